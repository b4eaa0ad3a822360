"""The paper's MPP study on Fashion-MNIST (sec. 4.6), as a resumable plan of real commands.

    python evals/study.py run      # every step without a result yet, in order (hours on 2 cores)
    python evals/study.py run --only mpp_e6/knn   # just these steps
    python evals/study.py status   # done, stale (its recipe changed since) or todo
    python evals/study.py report   # RESULTS.md from results/study/ (the committed results)

Run it in the background (`nohup python evals/study.py run > runs/study/study.log 2>&1 &`).
Each finished step leaves its result in results/study/<step>.json (the command, wall time,
machine, MLflow run and the JSON the step wrote; a training step's metric lines beside it):
those files are committed, so a new machine regenerates RESULTS.md and reruns only the steps
without a result. A step's checkpoints and exports stay in runs/study/ (never committed); a step
that needs another's export (a fine-tune needs its pretraining) reruns that one first when the
export is gone. A result whose recipe changed (the command, a config file's contents, or the
result of a step it reads) is stale: the step reruns, its old run directory moved aside. A
stopped pretraining or fine-tuning resumes from its own checkpoints.

The budget, the same for every method (equal total compute; every step here costs about the
same per image, 28 px, 16 tokens): pretraining PRETRAIN_EPOCHS epochs at batch 256, then
FINETUNE_EPOCHS epochs of fine-tuning at batch 128; from scratch gets the sum, trained with the
supervised preset's recipe (the stronger from-scratch baseline). A hashed 2% of the training
split is held out from every training run and makes every choice (lr, best evaluation).
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
STUDY = Path("runs/study")  # run directories, checkpoints, exports: never committed
RESULTS = Path("results/study")  # one JSON per finished step: committed
SHARDS = "shards/fashion-mnist"
HOLDOUT = 0.02  # the held-out part of the training split: chooses, never trains
PRETRAIN_EPOCHS = 6
SNAPSHOTS = (1, 2, 4, 6)  # pretraining epochs at which the frozen features are evaluated
FINETUNE_EPOCHS = 2
SCRATCH_EPOCHS = PRETRAIN_EPOCHS + FINETUNE_EPOCHS  # equal total compute
SEEDS = (0, 1, 2)  # fine-tuning (and from-scratch) seeds of the main comparison
FINETUNE_LRS = "0.003,0.01,0.03,0.06"  # the paper's grid (appendix B.1.1)
# The longer schedule (issue 13 item 2): one MPP pretraining LONG_PRETRAIN_EPOCHS long, its
# frozen features at LONG_SNAPSHOTS, a fine-tune of LONG_FINETUNE_EPOCHS (the 2-epoch fine-tune's
# loss was still falling) and from scratch for their sum; single seed, marked so.
LONG_PRETRAIN_EPOCHS = 16
LONG_SNAPSHOTS = (2, 4, 8, 16)
LONG_FINETUNE_EPOCHS = 4
LONG_SCRATCH_EPOCHS = LONG_PRETRAIN_EPOCHS + LONG_FINETUNE_EPOCHS
# The finer grid (issue 13 item 3): 4x4 patches, 7x7 = 49 tokens, about 3x the compute per image.
# It lost to 7x7 patches at 2 epochs from scratch (recipe_p4); this track asks whether it wins
# with a longer budget, MPP and from scratch at equal compute. Single seed; fine-tuned with the
# lr seed 0's 16-token sweep chose on held-out (a 4-value sweep costs 4 fine-tunes of this size).
P4 = ["model.patch_size=4"]
P4_PRETRAIN_EPOCHS = 8
P4_SNAPSHOTS = (2, 4, 8)
P4_FINETUNE_EPOCHS = 2
P4_SCRATCH_EPOCHS = P4_PRETRAIN_EPOCHS + P4_FINETUNE_EPOCHS
# Translation (issue 13 item 3, augmentation strength): a random shift of up to 2 px per axis
# (zero-filled) on top of the flips, in every training run of the track (pretraining,
# fine-tuning, from scratch). From scratch with flips only, the 20-epoch run ends at 95% train
# and 89.5% test accuracy: overfitting that a 28-px image's natural jitter may cure. Tried at
# the longer schedule, where the overfitting is, single seed.
SHIFT = ["data.translate=2"]
# The paper's hybrid (sec. 3.1, "R+ViT-Ti/S16" of timm) sized to the same 16 tokens: images
# resized to 32 px, the ResNet stem's 8x8 map cut into 2x2 patches. Each token then sees an
# 8-px cell through overlapping 7x7 convolutions: the locality a plain 7x7 projection lacks.
HYBRID = ["model.arch=vit_tiny_r_s16_p8_224", "model.img_size=32", "model.patch_size=2"]
RANDOM_HYBRID = ["--random-init", "vit_tiny_r_s16_p8_224", "--patch-size", "2", "--img-size", "32",
                 "--model-kwargs", '{"embed_dim": 128, "depth": 6, "num_heads": 4}']  # fmt: skip
# Frozen features read where they are best: `--layer auto` picks the block and pooling (mean or
# the 16 patch tokens concatenated) by kNN on the held-out 2% of train (issue 13, frozen goals).
READOUT = ["--layer", "auto"]
# The GPU track (issue 13, goals 1-2): the hybrid at 5x the main budget on a lent GPU
# (benchmarks/device_study.sh): MPP 40 epochs + fine-tuning 10 against from scratch for the sum,
# the same recipe and batches, eager (compiling costs a minute of a 10-minute lease). Single
# seed, marked so; the frozen evaluations of its export run on any machine.
GPU_PRETRAIN_EPOCHS = 40
GPU_SNAPSHOTS = (10, 20, 40)
GPU_FINETUNE_EPOCHS = 10
GPU_SCRATCH_EPOCHS = GPU_PRETRAIN_EPOCHS + GPU_FINETUNE_EPOCHS
EAGER = ["train.compile=false"]
FINETUNE = [  # 28 px: the pretraining resolution (16 tokens), for the budget
    "model.img_size=28", f"train.epochs={FINETUNE_EPOCHS}", "optim.warmup_steps=100",
    "run.eval_every=235",  # 4 held-out evaluations per run to choose among
]  # fmt: skip
BUDGET = (
    f"pretraining {PRETRAIN_EPOCHS} epochs at batch 256; fine-tuning {FINETUNE_EPOCHS} epochs at "
    f"batch 128 and 28 px (lr from {{{FINETUNE_LRS}}} on held-out, seed 0); from scratch "
    f"{SCRATCH_EPOCHS} epochs (the supervised preset's recipe, best evaluation on held-out); "
    f"{len(SEEDS)} seeds of each fine-tune (of one pretraining per method) and of from scratch"
)
CHECKPOINT_EVERY = 50  # a stop costs at most a minute of a run
MPP = "configs/fmnist_vit_tiny_mpp.yaml"
SUP = "configs/fmnist_vit_tiny_supervised.yaml"
FT = "configs/fmnist_finetune.yaml"
SMALL_VIT = '{"embed_dim": 128, "depth": 6, "num_heads": 4}'  # as in the presets
CASCADE = "configs/fmnist_cascade.yaml"  # Dynamic ViT: 2x2, 4x4, 7x7 tokens
MIXER = "configs/fmnist_mixer_mpp.yaml"  # an MLP-Mixer of about the ViT's compute
RANDOM = ["--random-init", "vit_tiny_patch16_224", "--patch-size", "7", "--img-size", "28",
          "--model-kwargs", SMALL_VIT]  # fmt: skip
RANDOM_P4 = [a if a != "7" else "4" for a in RANDOM]  # the finer grid's random init
COMMON = [f"data.root={SHARDS}", f"data.holdout_fraction={HOLDOUT}",
          f"run.checkpoint_every={CHECKPOINT_EVERY}", "monitor.knn_every=0"]  # fmt: skip


@dataclass
class Step:
    name: str
    argv: list[str] | Callable[[], list[str]]  # a callable when it reads an earlier result
    output: Path  # what the command writes last: the step ran when this exists
    needs: tuple[str, ...] = ()  # steps whose exports (in runs/) this one reads
    run_dir: Path | None = None  # a training step's run directory (metric lines, sweeps)
    figures: tuple[str, ...] = ()  # PNGs beside the output, committed with the result
    gpu: bool = False  # sized for a GPU: `run` takes it only when named by --only

    def args(self) -> list[str]:
        return self.argv() if callable(self.argv) else self.argv

    @property
    def result(self) -> Path:
        return RESULTS / f"{self.name}.json"


def _pretrain(
    name: str,
    config: str,
    script: str,
    *overrides: str,
    epochs: int = PRETRAIN_EPOCHS,
    snapshots: tuple[int, ...] = SNAPSHOTS,
) -> Step:
    run = STUDY / name
    exports = ",".join(map(str, snapshots))
    argv = [script, "--config", config, f"run.dir={run}", *COMMON,
            f"train.epochs={epochs}", f"run.export_epochs=[{exports}]", *overrides]  # fmt: skip
    return Step(name, lambda: [*argv, *chosen_augmentation()], run / "export" / "objective.json",
                run_dir=run)  # fmt: skip


def _evals(name: str, backbone: list[str], needs: tuple[str, ...] = ()) -> list[Step]:
    out = STUDY / "evals" / name
    common = [*backbone, "--data", SHARDS]
    return [
        Step(f"{name}/{kind}", [f"evals/{script}", *common, "--out", f"{out}/{kind}.json"],
             out / f"{kind}.json", needs)
        for kind, script in (("knn", "knn.py"), ("probe", "linear_probe.py"),
                             ("fewshot", "fewshot.py"))
    ]  # fmt: skip


def _snapshot_evals(pretrain: str, epochs: tuple[int, ...] = SNAPSHOTS) -> list[Step]:
    return [
        step
        for e in epochs
        for step in _evals(
            f"{pretrain}_e{e}",
            ["--backbone", str(STUDY / pretrain / f"export_epoch{e}")],
            (pretrain,),
        )
    ]


def chosen_lr(sweep_step: str) -> float:
    """The fine-tuning lr seed 0's sweep chose on held-out data (its committed result)."""
    res = json.loads((ROOT / RESULTS / f"{sweep_step}.json").read_text())["result"]
    return res["chosen"]["optim.lr"]


def _finetune(
    pretrain: str,
    seed: int,
    epochs: int = FINETUNE_EPOCHS,
    lr_from: str | None = None,
    *overrides: str,
) -> Step:
    """Fine-tuning of `pretrain`'s export; seed 0 sweeps the paper's lr grid on held-out unless
    `lr_from` names the fine-tuning step whose choice to reuse (as the other seeds do)."""
    name, run = f"ft_{pretrain}_s{seed}", STUDY / f"ft_{pretrain}_s{seed}"
    schedule = [f"train.epochs={epochs}" if a.startswith("train.epochs=") else a for a in FINETUNE]
    base = ["evals/finetune.py", "--config", FT, f"run.dir={run}", *COMMON, *schedule,
            f"model.init_from={STUDY / pretrain}", f"run.seed={seed}", *overrides]  # fmt: skip
    if seed == SEEDS[0] and lr_from is None:  # the lr sweep; the other seeds reuse its choice
        sweep = lambda: [*base, *chosen_augmentation(), "--sweep", f"optim.lr={FINETUNE_LRS}"]  # noqa: E731
        return Step(name, sweep, run / "results.json", (pretrain,), run)
    lr_step = lr_from or f"ft_{pretrain}_s{SEEDS[0]}"
    lr = lambda: f"optim.lr={chosen_lr(lr_step)}"  # noqa: E731
    return Step(name, lambda: [*base, *chosen_augmentation(), lr()], run / "results.json",
                (pretrain,), run)  # fmt: skip


def _scratch(
    seed: int, epochs: int = SCRATCH_EPOCHS, name: str = "scratch", *overrides: str
) -> Step:
    run = STUDY / f"{name}_s{seed}"
    argv = ["pipelines/supervised_pretrain.py", "--config", SUP, f"run.dir={run}", *COMMON,
            f"train.epochs={epochs}", f"run.seed={seed}", *overrides]  # fmt: skip
    return Step(run.name, lambda: [*argv, *chosen_augmentation()], run / "results.json",
                run_dir=run)  # fmt: skip


HIRES = 42  # px: the fine-tuning preset's resolution (6x6 tokens), as the paper fine-tunes (B.1.1)


def _finetune_hires(pretrain: str, epochs: int) -> Step:
    """Fine-tuning at the higher resolution of the paper's recipe (appendix B.1.1: the patch
    size kept, the position embeddings 2-D interpolated), with the lr the pretraining's 28 px
    sweep chose on held-out; about 2.4x the compute per image of 28 px (36 tokens, not 16)."""
    name = f"ft_{pretrain}_{HIRES}px"
    run = STUDY / name
    schedule = [f"model.img_size={HIRES}" if a.startswith("model.img_size=") else
                f"train.epochs={epochs}" if a.startswith("train.epochs=") else a
                for a in FINETUNE]  # fmt: skip
    argv = ["evals/finetune.py", "--config", FT, f"run.dir={run}", *COMMON, *schedule,
            f"model.init_from={STUDY / pretrain}", f"run.seed={SEEDS[0]}"]  # fmt: skip
    lr = lambda: f"optim.lr={chosen_lr(f'ft_{pretrain}_s{SEEDS[0]}')}"  # noqa: E731
    return Step(name, lambda: [*argv, *chosen_augmentation(), lr()], run / "results.json",
                (pretrain,), run)  # fmt: skip


RECIPES = {  # name -> overrides of the supervised preset; compared on held-out accuracy
    # 7x7 patches, 4x4 tokens, D 128, lr 1e-3 (the presets), with the presets' earlier crop
    "recipe_p7": ["data.crop_scale=[0.35,1.0]"],
    "recipe_p7_flip": ["data.crop_scale=[1.0,1.0]"],  # no crop, flips only: the presets' now
    "recipe_p7_crop0.7": ["data.crop_scale=[0.7,1.0]"],
    "recipe_p4": ["model.patch_size=4"],  # 7x7 tokens: about 3x the compute per image
    "recipe_p7_lr2e-3": ["optim.lr=2e-3"],
    "recipe_p7_d192": ["model.kwargs={embed_dim: 192, depth: 6, num_heads: 4}"],
    "recipe_p7_lr5e-4": ["optim.lr=5e-4"],
    "recipe_p7_shift2": SHIFT,
    # The paper's hybrid (sec. 3.1): timm's ResNet stem (7x7 conv, stride 2, max-pool, stride
    # 2) at 32 px gives an 8x8 map, 2x2 "patches" of it the same 4x4 grid of 16 tokens
    "recipe_hybrid32": HYBRID,
}
RECIPE_EPOCHS = 2
AUGMENTATIONS = ("recipe_p7", "recipe_p7_flip", "recipe_p7_crop0.7")  # the crop, compared


def chosen_augmentation() -> list[str]:
    """The crop every training step of the study uses: that of the augmentation recipe with
    the best held-out top-1; the presets' own until those recipes have results."""
    scored = []
    for name in AUGMENTATIONS:
        path = ROOT / RESULTS / f"{name}.json"
        if not path.is_file():
            return []
        scored.append((json.loads(path.read_text())["result"]["selection_best_top1"], name))
    return RECIPES[max(scored)[1]]


def _recipe(name: str) -> Step:
    """Item 3 of issue 13: a small-image recipe chosen on held-out accuracy, from scratch with
    labels (the cheapest signal of what the architecture and augmentation can learn)."""
    run = STUDY / name
    argv = ["pipelines/supervised_pretrain.py", "--config", SUP, f"run.dir={run}", *COMMON,
            f"train.epochs={RECIPE_EPOCHS}", "run.eval_every=115", *RECIPES[name]]  # fmt: skip
    if name in AUGMENTATIONS:  # these choose the crop; the others vary one thing beside it
        return Step(name, argv, run / "results.json", run_dir=run)
    return Step(name, lambda: [*argv, *chosen_augmentation()], run / "results.json", run_dir=run)


FINETUNE_RECIPES = {  # MPP fine-tuning (seed 0) beside the sweep's SGD: name -> overrides
    "ft_recipe_adamw": ["optim.name=adamw", "optim.lr=1e-3", "optim.weight_decay=0.05"],
}


def _finetune_recipe(name: str) -> Step:
    run = STUDY / name
    argv = ["evals/finetune.py", "--config", FT, f"run.dir={run}", *COMMON, *FINETUNE,
            f"model.init_from={STUDY / 'mpp'}", "run.seed=0", *FINETUNE_RECIPES[name]]  # fmt: skip
    return Step(name, lambda: [*argv, *chosen_augmentation()], run / "results.json", ("mpp",),
                run)  # fmt: skip


def _cascade(name: str, *overrides: str) -> list[Step]:
    """A Dynamic ViT fine-tuned from the MPP export (lr: seed 0's choice for MPP fine-tuning),
    then its exit thresholds chosen on held-out and measured on test."""
    run, out = STUDY / name, STUDY / "evals" / name
    base = ["evals/finetune.py", "--config", CASCADE, f"run.dir={run}", *COMMON,
            f"train.epochs={FINETUNE_EPOCHS}", "optim.warmup_steps=100", "run.eval_every=235",
            f"model.init_from={STUDY / 'mpp'}", *overrides]  # fmt: skip
    lr = lambda: f"optim.lr={chosen_lr(f'ft_mpp_s{SEEDS[0]}')}"  # noqa: E731
    argv = lambda: [*base, *chosen_augmentation(), lr()]  # noqa: E731
    dynamic = ["evals/dynamic_vit.py", "--backbone", str(run), "--data", SHARDS, "--out", str(out)]
    return [
        Step(name, argv, run / "results.json", ("mpp",), run),
        Step(f"{name}/dynamic", dynamic, out / "results.json", (name,),
             figures=("accuracy_vs_gflops.png",)),
    ]  # fmt: skip


INSPECT_FIGURES = ("mpp_predictions.png", "position_similarity.png", "attention_distance.png",
                   "embedding_filters.png", "attention_rollout.png")  # fmt: skip


def _inspect(pretrain: str) -> Step:
    out = STUDY / f"inspect_{pretrain}"
    argv = ["evals/inspect_vit.py", "--backbone", str(STUDY / pretrain), "--data", SHARDS,
            "--out", str(out)]  # fmt: skip
    return Step(f"inspect_{pretrain}", argv, out / "inspect.json", (pretrain,),
                figures=INSPECT_FIGURES)  # fmt: skip


def plan() -> list[Step]:
    """In order of what matters most, so a partial study still answers the main questions."""
    py, sup_py = "pipelines/mpp_pretrain.py", "pipelines/supervised_pretrain.py"
    main_comparison = [
        step
        for seed in SEEDS
        for step in (_finetune("mpp", seed), _finetune("supervised", seed), _scratch(seed))
    ]
    return [
        # The crop augmentation every training step uses, chosen on held-out (issue 13 item 3).
        *(_recipe(n) for n in AUGMENTATIONS),
        _pretrain("mpp", MPP, py),
        *_snapshot_evals("mpp", (PRETRAIN_EPOCHS,)),
        *_evals("random", RANDOM),
        *_evals("pixels", ["--raw-pixels"]),
        main_comparison[0],  # MPP's fine-tuning lr sweep
        *(_finetune_recipe(name) for name in FINETUNE_RECIPES),
        _pretrain("supervised", SUP, sup_py),
        *main_comparison[1:3],  # seed 0 of supervised and from scratch
        *_snapshot_evals("mpp", SNAPSHOTS[:-1]),  # the curve against pretraining length
        _recipe("recipe_p4"),  # 7x7 tokens: the finer grid item 3 asks for first
        *_snapshot_evals("supervised", (PRETRAIN_EPOCHS,)),
        # Pipeline vs a plain timm loop, images/s side by side (item 4); run between steps, so
        # nothing of the study runs beside it.
        Step(
            "speed",
            [
                "benchmarks/train_throughput.py",
                "--steps",
                "100",
                "--rounds",
                "3",
                "--out",
                str(STUDY / "speed" / "train_throughput.json"),
            ],
            STUDY / "speed" / "train_throughput.json",
        ),  # fmt: skip
        *main_comparison[3:],  # seeds 1 and 2: the error bars
        *(_recipe(n) for n in RECIPES if n not in (*AUGMENTATIONS, "recipe_p4")),  # lr, width
        # Dynamic ViT (issue 15): the cascade, then each reuse switched off alone.
        *_cascade("cascade"),
        *_cascade("cascade_no_feature_reuse", "objective.feature_reuse=false"),
        *_cascade("cascade_no_relation_reuse", "objective.relation_reuse=false"),
        # An MLP-Mixer beside the ViT under the same recipe (issue 15, single seed).
        _pretrain("mixer", MIXER, py),
        *_snapshot_evals("mixer", (PRETRAIN_EPOCHS,)),
        _finetune("mixer", SEEDS[0]),
        _inspect("mpp"),
        _inspect("mixer"),
        # The longer schedule (single seed): does pretraining longer keep paying, and does a
        # longer fine-tune close the gap to from scratch at equal compute?
        _pretrain("mpp_long", MPP, py, epochs=LONG_PRETRAIN_EPOCHS, snapshots=LONG_SNAPSHOTS),
        _finetune("mpp_long", SEEDS[0], LONG_FINETUNE_EPOCHS),
        *_snapshot_evals("mpp_long", LONG_SNAPSHOTS),
        _scratch(SEEDS[0], LONG_SCRATCH_EPOCHS, "scratch_long"),
        _finetune_hires("mpp_long", LONG_FINETUNE_EPOCHS),  # the paper's higher resolution
        # The finer grid, 49 tokens (single seed): MPP pretraining and its fine-tune against
        # from scratch for the sum, then the frozen features along the pretraining.
        _scratch(SEEDS[0], P4_SCRATCH_EPOCHS, "scratch_p4", *P4),
        _pretrain("mpp_p4", MPP, py, *P4, epochs=P4_PRETRAIN_EPOCHS, snapshots=P4_SNAPSHOTS),
        _finetune("mpp_p4", SEEDS[0], P4_FINETUNE_EPOCHS, lr_from=f"ft_mpp_s{SEEDS[0]}"),
        *_snapshot_evals("mpp_p4", P4_SNAPSHOTS),
        *_evals("random_p4", RANDOM_P4),
        # Ablations (single seed): the corruption rate and the target (sec. 4.6, B.1.2), and
        # the [class] token read-out.
        _pretrain("mpp15", MPP, py, "objective.corrupt_ratio=0.15"),
        *_snapshot_evals("mpp15", (PRETRAIN_EPOCHS,)),
        _pretrain("mpp_downsized", MPP, py, "objective.target=downsized_color"),
        *_snapshot_evals("mpp_downsized", (PRETRAIN_EPOCHS,)),
        _pretrain("mpp_pixels", MPP, py, "objective.target=pixels"),
        *_snapshot_evals("mpp_pixels", (PRETRAIN_EPOCHS,)),
        *_evals("mpp_cls", ["--backbone", str(STUDY / "mpp"), "--pool", "cls"], ("mpp",)),
        # Translation at the longer schedule (single seed): from scratch first (does the shift
        # raise what the architecture reaches?), then MPP and its fine-tune with the lr the
        # flips-only long sweep chose on held-out, then the frozen features.
        _scratch(SEEDS[0], LONG_SCRATCH_EPOCHS, "scratch_long_shift", *SHIFT),
        _pretrain(
            "mpp_long_shift", MPP, py, *SHIFT, epochs=LONG_PRETRAIN_EPOCHS, snapshots=LONG_SNAPSHOTS
        ),  # fmt: skip
        _finetune("mpp_long_shift", SEEDS[0], LONG_FINETUNE_EPOCHS, "ft_mpp_long_s0", *SHIFT),
        *_snapshot_evals("mpp_long_shift", LONG_SNAPSHOTS[-1:]),
        # Error bars for the longer schedule: seeds 1 and 2 of its fine-tune (the lr seed 0's
        # sweep chose) and of from scratch, a pair at a time.
        *(
            step
            for seed in SEEDS[1:]
            for step in (
                _finetune("mpp_long", seed, LONG_FINETUNE_EPOCHS),
                _scratch(seed, LONG_SCRATCH_EPOCHS, "scratch_long"),
            )
        ),  # fmt: skip
        # The paper's hybrid at the main budget (6 + 2 against 8 from scratch), seed 0 first:
        # it led the 16-token ViT by 4 points held-out at 2 epochs (recipe_hybrid32). Fine-tuned
        # with the lr the 16-token sweep chose (a sweep is 4 fine-tunes).
        _scratch(SEEDS[0], SCRATCH_EPOCHS, "scratch_hybrid", *HYBRID),
        _pretrain("mpp_hybrid", MPP, py, *HYBRID, snapshots=(2, 4, 6)),
        _finetune("mpp_hybrid", SEEDS[0], FINETUNE_EPOCHS, f"ft_mpp_s{SEEDS[0]}", HYBRID[1]),
        *_snapshot_evals("mpp_hybrid", (PRETRAIN_EPOCHS,)),
        *_evals("random_hybrid", RANDOM_HYBRID),
        # Frozen features with the read-out chosen on held-out, beside the last block's: the
        # hybrid's first (its export is fresh), then the ViT's (6-epoch MPP) and random inits.
        *_evals(
            "mpp_hybrid_e6_readout",
            ["--backbone", str(STUDY / "mpp_hybrid" / "export_epoch6"), *READOUT],
            ("mpp_hybrid",),
        ),  # fmt: skip
        *_evals("random_hybrid_readout", [*RANDOM_HYBRID, *READOUT]),
        *_evals(
            "mpp_e6_readout",
            ["--backbone", str(STUDY / "mpp" / "export_epoch6"), *READOUT],
            ("mpp",),
        ),  # fmt: skip
        *_evals("random_readout", [*RANDOM, *READOUT]),
        *gpu_track(py),
    ]


def gpu_track(py: str) -> list[Step]:
    """The hybrid at the GPU budget: from scratch and MPP + fine-tune run side by side on one
    GPU (benchmarks/device_study.sh), the exported features evaluated anywhere."""
    mpp = "mpp_hybrid_gpu"
    steps = [
        _scratch(SEEDS[0], GPU_SCRATCH_EPOCHS, "scratch_hybrid_gpu", *HYBRID, *EAGER),
        _pretrain(
            mpp, MPP, py, *HYBRID, *EAGER, epochs=GPU_PRETRAIN_EPOCHS, snapshots=GPU_SNAPSHOTS
        ),  # fmt: skip
        _finetune(mpp, SEEDS[0], GPU_FINETUNE_EPOCHS, f"ft_mpp_s{SEEDS[0]}", HYBRID[1], *EAGER),
    ]
    for step in steps:
        step.gpu = True
    return [
        *steps,
        *_evals(
            f"{mpp}_e{GPU_PRETRAIN_EPOCHS}_readout",
            ["--backbone", str(STUDY / mpp / f"export_epoch{GPU_PRETRAIN_EPOCHS}"), *READOUT],
            (mpp,),
        ),  # fmt: skip
    ]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("action", choices=("run", "status", "report"))
    p.add_argument("--only", nargs="+", metavar="STEP", help="run: just these steps (by name)")
    args = p.parse_args(argv)
    steps = plan()
    if args.action == "report":
        from study_report import write_report

        write_report(steps, RESULTS, ROOT / "RESULTS.md", BUDGET, STUDY, SNAPSHOTS, SEEDS)
        print("wrote RESULTS.md")
        return 0
    from study_run import run, state

    if args.action == "status":
        for step in steps:
            print(f"{state(step, ROOT):6}{step.name}")
        return 0

    return run(steps, ROOT, STUDY, args.only)


if __name__ == "__main__":
    sys.exit(main())
