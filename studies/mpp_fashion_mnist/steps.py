"""The study's steps and budgets (evals/study.py puts them in order): the constants every
step shares, the `Step` record, and one builder per kind of step (pretraining, fine-tuning,
from scratch, frozen evaluations, recipes, cascade, inspection)."""

from __future__ import annotations

import json
import math
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
# A longer fine-tune of the main pretraining (single seed): the 2-epoch fine-tune underfits
# (its loss still falls; layer decay and drop path, which slow or drop blocks, score lower on
# held-out), so does giving fine-tuning the epochs, at equal total compute, move MPP past
# from scratch? 6 + 6 against from scratch 12, the lr the 2-epoch sweep chose; then 6 + 12
# against 18, since 6 + 6 gave MPP +2.68 and from scratch +0.20 over 6 + 2 (-2.59 -> -0.11).
# 6 + 12 gave both about +1.1 more (-0.06): past the 2-epoch fine-tune's shortfall, a tie.
FT_LONG_EPOCHS = (6, 12)


def ft_long_arms(epochs: int) -> tuple[str, str]:
    """(MPP fine-tune, from scratch) step names of the longer fine-tune of `epochs` epochs; the
    first length keeps the names it ran under."""
    tag = "longft" if epochs == FT_LONG_EPOCHS[0] else f"longft{epochs}"
    return f"ft_mpp_{tag}_s0", f"scratch_{tag}_s0"


# Label-scarce fine-tuning (issue 13 goal 2), the paper's own setting: MPP pretrains on more
# images than fine-tuning has labels for (JFT, then ImageNet; sec. 4.6). The main pretraining
# (every training image, no labels) fine-tuned on the labels of a hashed share of them
# (data.train_fraction) against from scratch on the same share for the same total compute.
# Fine-tuning takes FEW_LABEL_FT_STEPS steps, the main 2-epoch fine-tune's count (10%: 5,861
# images, 20 epochs); from scratch also gets the pretraining's images (10%: 6 / 0.1 + 20 = 80
# epochs). Each run scores held-out 10 times (run.eval_every) and keeps the best. The shares run
# from most labels to fewest (the table's rows, the figure's line); 30% was added after 10% and
# 1% had won, to find where the lines cross between them and all the labels' -2.
FEW_LABELS = (0.3, 0.1, 0.01)
FEW_LABEL_FT_STEPS = 900
FMNIST_TRAIN = 60_000  # images in Fashion-MNIST's training split (the hash ranges over them)
FT_BATCH, SCRATCH_BATCH = 128, 256  # the fine-tuning and supervised presets' global batches


def few_label_budget(fraction: float) -> tuple[int, int, list[str], list[str]]:
    """(fine-tuning epochs, from-scratch epochs, their overrides) on `fraction` of the labels."""
    from ssl_vit.data.holdout import excluded_indices

    n = FMNIST_TRAIN - len(excluded_indices(FMNIST_TRAIN, HOLDOUT, fraction))
    ft_epochs = math.ceil(FEW_LABEL_FT_STEPS / (n // FT_BATCH))
    scratch_epochs = round(PRETRAIN_EPOCHS / fraction) + ft_epochs
    share = f"data.train_fraction={fraction}"
    return (ft_epochs, scratch_epochs,
            [share, f"run.eval_every={ft_epochs * (n // FT_BATCH) // 10}"],
            [share, f"run.eval_every={scratch_epochs * (n // SCRATCH_BATCH) // 10}"])  # fmt: skip


def few_label_arms(fraction: float, seed: int) -> tuple[str, str]:
    """(MPP fine-tune, from scratch) step names on `fraction` of the labels, `seed`."""
    tag = f"labels{100 * fraction:g}"
    return f"ft_mpp_{tag}_s{seed}", f"scratch_{tag}_s{seed}"


# The GPU track (issue 13, goals 1-2): the hybrid at 5x the main budget on a lent GPU
# (benchmarks/device_study.sh): MPP 40 epochs + fine-tuning 10 against from scratch for the sum,
# the same recipe and batches, eager (compiling costs a minute of a 10-minute lease). Single
# seed, marked so; the frozen evaluations of its export run on any machine.
GPU_PRETRAIN_EPOCHS = 40
GPU_SNAPSHOTS = (10, 20, 40)
GPU_FINETUNE_EPOCHS = 10
GPU_SCRATCH_EPOCHS = GPU_PRETRAIN_EPOCHS + GPU_FINETUNE_EPOCHS
# The same 50 epochs split toward fine-tuning (the CPU's 6 + 6 closed most of 6 + 2's gap, and
# the 40 + 10 fine-tune's loss was still falling): the run's epoch-20 snapshot fine-tuned 30,
# against the from-scratch 50 already run. (A snapshot of a 40-epoch schedule, its lr not yet
# annealed: 20 epochs of compute, not a 20-epoch run's best.)
GPU_SPLIT = (20, GPU_SCRATCH_EPOCHS - 20)
EAGER = ["train.compile=false"]
# On a GPU a step takes ~20 ms: a checkpoint every 50 steps (sized for a 2-core CPU, where 50
# steps are a minute) would save one a second, and a lent machine's files go with it anyway.
GPU_RUN = [*EAGER, "run.checkpoint_every=2000", "run.log_every=50"]
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


def pretrain(
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


def evals(name: str, backbone: list[str], needs: tuple[str, ...] = ()) -> list[Step]:
    out = STUDY / "evals" / name
    common = [*backbone, "--data", SHARDS]
    return [
        Step(f"{name}/{kind}", [f"evals/{script}", *common, "--out", f"{out}/{kind}.json"],
             out / f"{kind}.json", needs)
        for kind, script in (("knn", "knn.py"), ("probe", "linear_probe.py"),
                             ("fewshot", "fewshot.py"))
    ]  # fmt: skip


def snapshot_evals(pretrain: str, epochs: tuple[int, ...] = SNAPSHOTS) -> list[Step]:
    return [
        step
        for e in epochs
        for step in evals(
            f"{pretrain}_e{e}",
            ["--backbone", str(STUDY / pretrain / f"export_epoch{e}")],
            (pretrain,),
        )
    ]


def chosen_lr(sweep_step: str) -> float:
    """The fine-tuning lr seed 0's sweep chose on held-out data (its committed result)."""
    res = json.loads((ROOT / RESULTS / f"{sweep_step}.json").read_text())["result"]
    return res["chosen"]["optim.lr"]


def finetune(
    pretrain: str,
    seed: int,
    epochs: int = FINETUNE_EPOCHS,
    lr_from: str | None = None,
    *overrides: str,
    name: str | None = None,
    snapshot: int | None = None,
) -> Step:
    """Fine-tuning of `pretrain`'s export (or its `snapshot` epoch's) as step `name`, by default
    ft_<pretrain>_s<seed>; seed 0 sweeps the paper's lr grid on held-out unless `lr_from` names
    the fine-tuning step whose choice to reuse (as the other seeds do)."""
    name = name or f"ft_{pretrain}_s{seed}"
    run = STUDY / name
    source = STUDY / pretrain / (f"export_epoch{snapshot}" if snapshot else "")
    schedule = [f"train.epochs={epochs}" if a.startswith("train.epochs=") else a for a in FINETUNE]
    base = ["evals/finetune.py", "--config", FT, f"run.dir={run}", *COMMON, *schedule,
            f"model.init_from={source}", f"run.seed={seed}", *overrides]  # fmt: skip
    if seed == SEEDS[0] and lr_from is None:  # the lr sweep; the other seeds reuse its choice
        sweep = lambda: [*base, *chosen_augmentation(), "--sweep", f"optim.lr={FINETUNE_LRS}"]  # noqa: E731
        return Step(name, sweep, run / "results.json", (pretrain,), run)
    lr_step = lr_from or f"ft_{pretrain}_s{SEEDS[0]}"
    lr = lambda: f"optim.lr={chosen_lr(lr_step)}"  # noqa: E731
    return Step(name, lambda: [*base, *chosen_augmentation(), lr()], run / "results.json",
                (pretrain,), run)  # fmt: skip


def scratch(
    seed: int, epochs: int = SCRATCH_EPOCHS, name: str = "scratch", *overrides: str
) -> Step:
    run = STUDY / f"{name}_s{seed}"
    argv = ["pipelines/supervised_pretrain.py", "--config", SUP, f"run.dir={run}", *COMMON,
            f"train.epochs={epochs}", f"run.seed={seed}", *overrides]  # fmt: skip
    return Step(run.name, lambda: [*argv, *chosen_augmentation()], run / "results.json",
                run_dir=run)  # fmt: skip


HIRES = 42  # px: the fine-tuning preset's resolution (6x6 tokens), as the paper fine-tunes (B.1.1)


def finetune_hires(pretrain: str, epochs: int) -> Step:
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


def recipe(name: str) -> Step:
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
    # Layer-wise lr decay (BEiT's and MAE's fine-tuning, not the ViT paper's): the head and the
    # last block at the full lr, each block below one factor `decay` less, the patch embedding
    # decay^6: the pretrained lower blocks move least. Chosen on held-out at the SGD sweep's lr.
    "ft_recipe_layer_decay": ["--sweep", "optim.layer_decay=0.65,0.75,0.85"],
    # Stochastic depth (MAE fine-tunes with it): each block's residual branch dropped per
    # sample, up to the rate at the last block. Chosen on held-out at the SGD sweep's lr.
    "ft_recipe_drop_path": ["--sweep", "model.drop_path_rate=0.1,0.2"],
}


def finetune_recipe(name: str) -> Step:
    """A fine-tuning recipe of the 6-epoch MPP export, seed 0; without an lr of its own, the
    lr seed 0's SGD sweep chose on held-out."""
    run, overrides = STUDY / name, FINETUNE_RECIPES[name]
    argv = ["evals/finetune.py", "--config", FT, f"run.dir={run}", *COMMON, *FINETUNE,
            f"model.init_from={STUDY / 'mpp'}", "run.seed=0", *overrides]  # fmt: skip
    own_lr = any(o.startswith("optim.lr=") for o in overrides)
    lr = lambda: [] if own_lr else [f"optim.lr={chosen_lr(f'ft_mpp_s{SEEDS[0]}')}"]  # noqa: E731
    return Step(name, lambda: [*argv, *chosen_augmentation(), *lr()], run / "results.json",
                ("mpp",), run)  # fmt: skip


def cascade(name: str, *overrides: str) -> list[Step]:
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


def inspection(pretrain: str) -> Step:
    out = STUDY / f"inspect_{pretrain}"
    argv = ["evals/inspect_vit.py", "--backbone", str(STUDY / pretrain), "--data", SHARDS,
            "--out", str(out)]  # fmt: skip
    return Step(f"inspect_{pretrain}", argv, out / "inspect.json", (pretrain,),
                figures=INSPECT_FIGURES)  # fmt: skip
