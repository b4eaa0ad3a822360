"""The paper's MPP study on Fashion-MNIST (sec. 4.6), as a resumable plan of real commands.

    python evals/study.py run      # every step not done yet, in order (hours on 2 CPU cores)
    python evals/study.py run --only inspect_mpp50   # just these steps
    python evals/study.py status   # what is done, what is left
    python evals/study.py report   # RESULTS.md from the step outputs and their MLflow run ids

Run it in the background (`nohup python evals/study.py run > runs/study/study.log 2>&1 &`);
after a stop, the same command carries on: each step is skipped once its output exists and a
pretraining step resumes from its own checkpoints. Every method gets the same budget:
PRETRAIN_STEPS optimizer steps of 256 images, then the same evaluations.
"""

from __future__ import annotations

import argparse
import json
import shlex
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import study_mlflow

ROOT = Path(__file__).resolve().parents[1]
STUDY = Path("runs/study")
SHARDS = "shards/fashion-mnist"
PRETRAIN_STEPS = 470  # 2 epochs of the 60k training images at batch 256
FINETUNE_STEPS = 470  # 1 epoch at batch 128, 42 px
FINETUNE_WARMUP = 50  # the preset's 200 warmup steps would be 40% of so short a run
# From scratch gets the pretrained runs' total steps (pretraining + fine-tuning): about their
# compute too, as a 42-px step costs about twice a 28-px one at half the batch.
SCRATCH_STEPS = PRETRAIN_STEPS + FINETUNE_STEPS
BUDGET = (
    f"every pretraining gets {PRETRAIN_STEPS} steps at batch 256 (2 epochs); fine-tuning "
    f"{FINETUNE_STEPS} steps at batch 128 and 42 px (1 epoch, {FINETUNE_WARMUP} warmup steps); "
    f"from scratch {SCRATCH_STEPS} steps at batch 128 and 42 px, the pretrained runs' total"
)
CHECKPOINT_EVERY = 50  # a stop costs at most a few minutes of a run
MPP = "configs/fmnist_vit_tiny_mpp.yaml"
SUP = "configs/fmnist_vit_tiny_supervised.yaml"
FT = "configs/fmnist_finetune.yaml"
SMALL_VIT = '{"embed_dim": 128, "depth": 6, "num_heads": 4}'  # as in the presets
MIXER = "configs/fmnist_mixer_mpp.yaml"  # an MLP-Mixer of about the ViT's compute
RANDOM = ["--random-init", "vit_tiny_patch16_224", "--patch-size", "7", "--img-size", "28",
          "--model-kwargs", SMALL_VIT]  # fmt: skip


@dataclass
class Step:
    name: str
    argv: list[str]
    output: Path  # the step is done when this exists

    @property
    def command(self) -> str:
        return shlex.join(["python", *self.argv])


def _pretrain(name: str, config: str, script: str, *overrides: str) -> Step:
    run = STUDY / name
    argv = [script, "--config", config, f"run.dir={run}", f"data.root={SHARDS}",
            "train.epochs=null", f"train.steps={PRETRAIN_STEPS}",
            f"run.checkpoint_every={CHECKPOINT_EVERY}", *overrides]  # fmt: skip
    return Step(name, argv, run / "export" / "objective.json")


def _evals(name: str, backbone: list[str]) -> list[Step]:
    out = STUDY / "evals" / name
    common = [*backbone, "--data", SHARDS]
    return [
        Step(f"{name}/probe", ["evals/linear_probe.py", *common, "--out", f"{out}/probe.json"],
             out / "probe.json"),
        Step(f"{name}/knn", ["evals/knn.py", *common, "--out", f"{out}/knn.json"],
             out / "knn.json"),
        Step(f"{name}/fewshot", ["evals/fewshot.py", *common, "--out", f"{out}/fewshot.json"],
             out / "fewshot.json"),
    ]  # fmt: skip


def _finetune(name: str, init: str | None, *overrides: str) -> Step:
    run = STUDY / name
    steps = FINETUNE_STEPS if init else SCRATCH_STEPS
    argv = ["evals/finetune.py", "--config", FT, f"run.dir={run}", f"data.root={SHARDS}",
            "train.epochs=null", f"train.steps={steps}", f"optim.warmup_steps={FINETUNE_WARMUP}",
            f"run.checkpoint_every={CHECKPOINT_EVERY}", *overrides]  # fmt: skip
    if init is None:  # the same ViT from scratch at 42 px, for SCRATCH_STEPS
        argv += ["model.init_from=null", "model.patch_size=7",
                 "model.kwargs={embed_dim: 128, depth: 6, num_heads: 4}"]  # fmt: skip
    else:
        argv += [f"model.init_from={init}"]
    return Step(name, argv, run / "results.json")


def plan() -> list[Step]:
    """In order of what matters most, so a partial study still answers the main question."""
    py = "pipelines/mpp_pretrain.py"
    return [
        _pretrain("mpp50", MPP, py),
        *_evals("mpp50", ["--backbone", str(STUDY / "mpp50")]),
        # The paper's "inspecting ViT" figures (sec. 4.5) for the MPP backbone.
        Step(
            "inspect_mpp50",
            [
                "evals/inspect_vit.py",
                "--backbone",
                str(STUDY / "mpp50"),
                "--data",
                SHARDS,
                "--out",
                str(STUDY / "inspect_mpp50"),
            ],
            STUDY / "inspect_mpp50" / "inspect.json",
        ),
        *_evals("pixels", ["--raw-pixels"]),
        *_evals("random", RANDOM),
        _pretrain("supervised", SUP, "pipelines/supervised_pretrain.py"),
        _finetune("ft_mpp50", str(STUDY / "mpp50")),
        _finetune("ft_scratch", None),
        *_evals("supervised", ["--backbone", str(STUDY / "supervised")]),
        _pretrain("mpp15", MPP, py, "objective.corrupt_ratio=0.15"),
        *_evals("mpp15", ["--backbone", str(STUDY / "mpp15")]),
        _finetune("ft_supervised", str(STUDY / "supervised")),
        _pretrain("mpp_downsized", MPP, py, "objective.target=downsized_color"),
        *_evals("mpp_downsized", ["--backbone", str(STUDY / "mpp_downsized")]),
        _pretrain("mpp_pixels", MPP, py, "objective.target=pixels"),
        *_evals("mpp_pixels", ["--backbone", str(STUDY / "mpp_pixels")]),
        # Why the evals pool patch tokens after MPP: the same backbone read at its [class] token.
        *_evals("mpp50_cls", ["--backbone", str(STUDY / "mpp50"), "--pool", "cls"]),
        # MLP-Mixer beside ViT: same MPP recipe and budget; fine-tuned at 28 px (a Mixer's
        # token-mixing MLPs fix its token count), so the ViT is also fine-tuned at 28 px.
        _pretrain("mixer_mpp50", MIXER, py),
        *_evals("mixer_mpp50", ["--backbone", str(STUDY / "mixer_mpp50")]),
        _finetune("ft_mixer_mpp50", str(STUDY / "mixer_mpp50"), "model.img_size=28"),
        _finetune("ft_mpp50_28px", str(STUDY / "mpp50"), "model.img_size=28"),
        Step(
            "inspect_mixer_mpp50",
            [
                "evals/inspect_vit.py",
                "--backbone",
                str(STUDY / "mixer_mpp50"),
                "--data",
                SHARDS,
                "--out",
                str(STUDY / "inspect_mixer_mpp50"),
            ],
            STUDY / "inspect_mixer_mpp50" / "inspect.json",
        ),  # fmt: skip
    ]


def _timings() -> dict[str, float]:
    path = STUDY / "steps.jsonl"
    if not path.is_file():
        return {}
    rows = [json.loads(ln) for ln in path.read_text().splitlines() if ln]
    return {r["name"]: r["seconds"] for r in rows if r["returncode"] == 0}


def run(only: list[str] | None = None) -> int:
    steps = plan()
    unknown = set(only or ()) - {s.name for s in steps}
    if unknown:
        print(f"study.py: no step named {sorted(unknown)}; see `study.py status`", file=sys.stderr)
        return 2
    STUDY.mkdir(parents=True, exist_ok=True)
    (STUDY / "logs").mkdir(exist_ok=True)
    parents = study_mlflow.parents(STUDY, ROOT)  # one MLflow parent run per method
    for step in steps:
        if step.output.exists() or (only and step.name not in only):
            continue
        log = STUDY / "logs" / f"{step.name.replace('/', '-')}.log"
        print(f"[study] {step.name}: {step.command}  (log: {log})", flush=True)
        t0 = time.time()
        with open(log, "a") as f:
            env = study_mlflow.parent_env(parents, step.name)  # the step's run nests under it
            rc = subprocess.call(
                [sys.executable, *step.argv], cwd=ROOT, stdout=f, stderr=f, env=env
            )
        seconds = time.time() - t0
        with open(STUDY / "steps.jsonl", "a") as f:
            f.write(json.dumps({"name": step.name, "returncode": rc, "seconds": seconds}) + "\n")
        if rc != 0:
            print(f"[study] {step.name} failed (exit {rc}); see {log}", flush=True)
            return rc
        study_mlflow.log_step(parents, step.name, step.output)
    done = "the steps asked for" if only else "all steps"
    print(f"[study] {done} done; python evals/study.py report", flush=True)
    return 0


def status() -> int:
    for step in plan():
        print(("done " if step.output.exists() else "todo ") + step.name)
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("action", choices=("run", "status", "report"))
    p.add_argument("--only", nargs="+", metavar="STEP", help="run: just these steps (by name)")
    args = p.parse_args(argv)
    if args.action == "report":
        from study_report import write_report

        write_report(plan(), _timings(), STUDY, ROOT / "RESULTS.md", BUDGET)
        print("wrote RESULTS.md")
        return 0
    return run(args.only) if args.action == "run" else status()


if __name__ == "__main__":
    sys.exit(main())
