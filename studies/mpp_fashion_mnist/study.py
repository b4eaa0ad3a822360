"""The paper's MPP study on Fashion-MNIST (sec. 4.6), as a resumable plan of real commands.

    python studies/mpp_fashion_mnist/study.py run      # every step without a result, in order
    python studies/mpp_fashion_mnist/study.py run --only mpp_e6/knn   # just these steps
    python studies/mpp_fashion_mnist/study.py status   # done, stale (recipe changed) or todo
    python studies/mpp_fashion_mnist/study.py report   # RESULTS.md from the committed results

Run it in the background from the repository root (`nohup python
studies/mpp_fashion_mnist/study.py run > runs/study/study.log 2>&1 &`; hours on 2 CPU cores).
Each finished step leaves its result in results/<step>.json beside this file (the command, wall
time, machine, code version, MLflow run, the weights it started from and the JSON the step
wrote; a training step's metric lines beside it): those files are committed, so a new machine
regenerates RESULTS.md and reruns only the steps without a result. A step's checkpoints and
exports stay in runs/study/ (never committed); a step that needs another's export (a fine-tune
needs its pretraining) reruns that one first when the export is gone. A result whose recipe
changed (the command, a config file's contents, or the result of a step it reads) is stale: the
step reruns, its old run directory moved aside. A stopped training resumes from its checkpoints.

The budget, the same for every method (equal total compute; every step here costs about the
same per image, 28 px, 16 tokens): pretraining 6 epochs at batch 256, then 2 epochs of
fine-tuning at batch 128; from scratch gets the sum, trained with the supervised preset's recipe.
A hashed 2% of the training split is held out from every training run and makes every choice.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root

from studies.mpp_fashion_mnist import steps  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("action", choices=("run", "status", "report"))
    p.add_argument("--only", nargs="+", metavar="STEP", help="run: just these steps (by name)")
    args = p.parse_args(argv)
    plan = steps.plan()
    if args.action == "report":
        from studies.mpp_fashion_mnist.report import write_report

        out = write_report(plan)
        print(f"wrote {out.relative_to(steps.ROOT)}")
        return 0
    from studies.mpp_fashion_mnist.run import run, state

    if args.action == "status":
        for step in plan:
            print(f"{state(step, steps.ROOT):6}{step.name}")
        return 0
    return run(plan, steps.ROOT, steps.STUDY, args.only)


if __name__ == "__main__":
    from ssl_vit import startup

    startup.begin(pause_gc=False)  # MLflow telemetry off by default (ssl_vit/startup.py)
    sys.exit(main())
