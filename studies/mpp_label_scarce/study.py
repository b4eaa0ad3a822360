"""The label-scarce study (PLAN.md beside this file) as a resumable plan of real commands.

    python studies/mpp_label_scarce/study.py run       # every runnable step without a result
    python studies/mpp_label_scarce/study.py run --only subsets pilot/random/lr=0.01,wd=0
    python studies/mpp_label_scarce/study.py status    # done, stale, todo or waiting
    python studies/mpp_label_scarce/study.py report    # REPORT.md from the committed results
    python studies/mpp_label_scarce/study.py chains    # what is left, as parallel chains (GPU)

Run it in the background from the repository root (`nohup python
studies/mpp_label_scarce/study.py run > runs/label_scarce/study.log 2>&1 &`). The Fashion-MNIST
study's runner does the work: a finished step leaves results/<step>.json (committed); a stopped
training resumes from its checkpoints; an export that is gone is rebuilt first. The evaluated
fine-tunes wait until every pilot step has a result: their lr and weight decay are the pilot's
choice (`steps.chosen_recipe`), read from those results.

A 40-epoch pretraining takes over two hours on 2 CPU cores, and its fine-tunes read its export:
where a machine does not outlive that, a GPU runs what is left side by side, each pretraining
with the steps that read it (`chains`; the GPU doses are among them):

    CHAINS="$(python studies/mpp_label_scarce/study.py chains)" \
    STUDY=studies/mpp_label_scarce/study.py RESULTS=studies/mpp_label_scarce/results \
        OUT=/tmp/device bash studies/mpp_fashion_mnist/gpu_track.sh
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root

from studies.mpp_fashion_mnist.steps import ROOT  # noqa: E402
from studies.mpp_label_scarce import steps  # noqa: E402


def pilot_scores(root: Path = ROOT) -> dict[tuple[str, str, str], float] | None:
    """(start, lr, wd) -> final-step held-out top-1 of every pilot run; None until all ran."""
    scores = {}
    for step in steps.pilot_steps():
        path = root / step.result
        if not path.is_file():
            return None
        _, start, grid = step.name.split("/")
        lr, wd = (kv.split("=")[1] for kv in grid.split(","))
        scores[(start, lr, wd)] = json.loads(path.read_text())["result"]["selection_final_top1"]
    return scores


def current_plan(root: Path = ROOT) -> tuple[list, tuple[str, str] | None]:
    """The steps that can run now, and the pilot's choice (None while the pilot runs)."""
    scores = pilot_scores(root)
    if scores is None:
        pending = {s.name for n, k in steps.evaluated_subsets()
                   for s in steps.evaluation_steps(n, k, "pending", "pending")}  # fmt: skip
        return [s for s in steps.plan() if s.name not in pending], None
    chosen = steps.chosen_recipe(scores)
    return steps.plan(*chosen), chosen


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("action", choices=("run", "status", "report", "chains"))
    p.add_argument("--only", nargs="+", metavar="STEP", help="run: just these steps (by name)")
    args = p.parse_args(argv)
    plan, chosen = current_plan()
    if args.action == "report":
        from studies.mpp_label_scarce.report import write_report

        print(f"wrote {write_report(ROOT).relative_to(ROOT)}")
        return 0
    from studies.mpp_fashion_mnist.run import run, state

    if args.action == "chains":
        if chosen is None:
            print("study.py chains: the pilot has not chosen the recipe yet", file=sys.stderr)
            return 2
        todo = [s for s in plan if state(s, ROOT) != "done"]
        print(";\n".join(" ".join(chain) for chain in steps.chains(todo)))
        return 0
    if args.action == "status":
        for step in plan:
            print(f"{state(step, ROOT):6}{step.name}")
        if chosen is None:
            n = len(steps.plan()) - len(plan)
            print(f"waiting: {n} evaluated steps, until every pilot step has a result")
        else:
            print(f"the pilot chose optim.lr={chosen[0]} optim.weight_decay={chosen[1]}")
        return 0
    return run(plan, ROOT, steps.RUNS, args.only)


if __name__ == "__main__":
    from ssl_vit import startup

    startup.begin(pause_gc=False)  # MLflow telemetry off by default (ssl_vit/startup.py)
    sys.exit(main())
