"""The label-scarce study's steps as data, in the order they run (PLAN.md says why each is so).

Every step is a command of the product run from the repository root, as in the Fashion-MNIST
study, whose `Step` record and runner this study reuses; its results land in results/ beside
this file, its run directories under runs/label_scarce/ (never committed). Flags the product
does not have yet are named in TO_BUILD: those steps cannot run before they exist.
"""

from __future__ import annotations

from pathlib import Path

from studies.mpp_fashion_mnist.steps import SMALL_VIT, Step

RUNS = Path("runs/label_scarce")
RESULTS = Path("studies/mpp_label_scarce/results")
SUBSETS = Path("studies/mpp_label_scarce/subsets")  # the drawn index files: committed
SHARDS = "shards/fashion-mnist"
HOLDOUT = 0.02  # the hashed held-out 2% of the training split: chooses, never trains

# Data: class-balanced labelled subsets, K per size, each drawn with its own seed; the pilot
# subset (its own seed, excluded from the others' pool) chooses the recipe and is never scored.
PER_CLASS = (10, 60)
SUBSET_SEEDS = (1, 2, 3, 4, 5)  # K = 5
PILOT = (60, 0)  # (images per class, seed)

# Pretraining: two seeds per pretrained arm; MPP's dose-response, each length its own schedule.
PRETRAIN_SEEDS = (0, 1)
MPP_EPOCHS = (10, 40)  # 0 epochs is random init itself
GPU_MPP_EPOCHS = (100, 300)  # on a GPU: the dose-response extended
CONTROL_EPOCHS = SUPERVISED_EPOCHS = 40
MPP_CFG = "configs/fmnist_vit_tiny_mpp.yaml"
SUP_CFG = "configs/fmnist_vit_tiny_supervised.yaml"
FT_CFG = "configs/fmnist_finetune.yaml"
# The positive control: masked image modelling with per-patch normalised pixel targets at a high
# mask ratio (MAE's 75%, all masked patches replaced by the [mask] embedding), same pipeline.
CONTROL = [
    "objective.target=pixels",
    "objective.normalize_pixels=true",
    "objective.corrupt_ratio=0.75",
    "objective.mask_prob=1.0",
    "objective.random_prob=0.0",
]

# One downstream recipe: SGD fine-tuning (appendix B.1.1) at 28 px for a fixed step count, the
# final step reported; lr x weight decay chosen once on the pilot subset.
FT_STEPS, FT_BATCH = 1500, 64
FT_LRS = ("0.003", "0.01", "0.03", "0.06")  # the paper's grid (B.1.1)
FT_WDS = ("0", "1e-4", "1e-3")
PLATEAU = 0.5  # points: random init's held-out rise over the last quarter that counts as flat
PROBE_FOLDS = 5  # the linear probe's L2 chosen by stratified 5-fold CV inside the subset
KNN_K = 20

# The baseline that stands: from scratch on all the labels (held-out excluded) to its plateau,
# at the lr the Fashion-MNIST study's own grid chose on held-out for all the labels.
BASELINE_EPOCHS, BASELINE_LR = 100, "2e-3"

TO_BUILD: dict[str, str] = {}  # flag -> what it does (PLAN.md, "To build"): all built

COMMON = [f"data.root={SHARDS}", f"data.holdout_fraction={HOLDOUT}", "monitor.knn_every=0"]
RANDOM_INIT = ["model.patch_size=7", f"model.kwargs={SMALL_VIT}"]


def subset_file(per_class: int, seed: int) -> Path:
    return SUBSETS / f"n{per_class}_seed{seed}.json"


def evaluated_subsets() -> list[tuple[int, int]]:
    """(images per class, seed) of every subset that is scored: never the pilot."""
    return [(n, s) for n in PER_CLASS for s in SUBSET_SEEDS]


def pretrained_arms() -> dict[str, list[str]]:
    """Arm name -> pretraining command, less its run directory and seed."""
    mpp = ["pipelines/mpp_pretrain.py", "--config", MPP_CFG, *COMMON]
    arms = {f"mpp_e{e}": [*mpp, f"train.epochs={e}"] for e in (*MPP_EPOCHS, *GPU_MPP_EPOCHS)}
    arms[f"pixels_e{CONTROL_EPOCHS}"] = [*mpp, f"train.epochs={CONTROL_EPOCHS}", *CONTROL]
    sup = ["pipelines/supervised_pretrain.py", "--config", SUP_CFG, *COMMON]
    arms[f"supervised_e{SUPERVISED_EPOCHS}"] = [*sup, f"train.epochs={SUPERVISED_EPOCHS}"]
    return arms


def is_gpu(arm: str) -> bool:
    return any(arm == f"mpp_e{e}" for e in GPU_MPP_EPOCHS)


def pretrain(arm: str, seed: int) -> Step:
    run = RUNS / f"{arm}_seed{seed}"
    argv = [*pretrained_arms()[arm], f"run.dir={run}", f"run.seed={seed}"]
    step = Step(f"{arm}_seed{seed}", argv, run / "export" / "objective.json", run_dir=run)
    step.results, step.gpu = RESULTS, is_gpu(arm)
    return step


def start(arm: str, seed: int) -> list[str]:
    """The fine-tune's starting weights: an arm's pretraining, or random init (seed: run.seed)."""
    if arm == "random":
        return ["model.init_from=null", *RANDOM_INIT]
    return [f"model.init_from={RUNS / f'{arm}_seed{seed}'}"]


def finetune(name: str, arm: str, seed: int, subset: Path, lr: str, wd: str) -> Step:
    """The one downstream recipe; every arm and subset differs only in its start and data."""
    run = RUNS / name
    argv = [
        "evals/finetune.py", "--config", FT_CFG, f"run.dir={run}", *COMMON,
        "model.img_size=28", f"train.steps={FT_STEPS}", "train.epochs=null",
        f"train.global_batch={FT_BATCH}", f"optim.lr={lr}", f"optim.weight_decay={wd}",
        f"run.eval_every={FT_STEPS // 10}", f"data.subset_file={subset}",
        *start(arm, seed), f"run.seed={seed}",
    ]  # fmt: skip
    needs = () if arm == "random" else (f"{arm}_seed{seed}",)
    step = Step(name, argv, run / "results.json", needs, run)
    step.results, step.gpu = RESULTS, is_gpu(arm)
    return step


def pilot_steps() -> list[Step]:
    """The lr x weight-decay grid on the pilot subset, from random init and from MPP (40
    epochs, seed 0): the only steps that choose anything, on held-out."""
    pilot = subset_file(*PILOT)
    return [
        finetune(f"pilot/{arm}/lr={lr},wd={wd}", arm, 0, pilot, lr, wd)
        for arm in ("random", f"mpp_e{MPP_EPOCHS[-1]}")
        for lr in FT_LRS
        for wd in FT_WDS
    ]


def chosen_recipe(held_out: dict[tuple[str, str, str], float]) -> tuple[str, str]:
    """(lr, wd) of the grid whose final-step held-out top-1, averaged over the two starts
    (random init, MPP), is highest; ties: the smaller lr, then the smaller weight decay.
    `held_out`: (start, lr, wd) -> selection_final_top1 of the pilot's runs."""
    starts = sorted({k[0] for k in held_out})
    score = {
        (lr, wd): sum(held_out[(s, lr, wd)] for s in starts) / len(starts)
        for lr in FT_LRS
        for wd in FT_WDS
    }
    return max(score, key=lambda k: (score[k], -float(k[0]), -float(k[1])))


def arms() -> list[str]:
    """Every arm fine-tuned on the evaluated subsets: random init first, GPU arms last."""
    return [
        "random",
        *(a for a in pretrained_arms() if not is_gpu(a)),
        *(a for a in pretrained_arms() if is_gpu(a)),
    ]


def frozen(kind: str, arm: str, seed: int, per_class: int, k: int) -> Step:
    """kNN or linear probe of an arm's frozen features, fitted on one subset only."""
    name = f"{kind}/{arm}/n{per_class}_k{k}_s{seed}"
    out = RUNS / "evals" / f"{name}.json"
    if arm == "random":
        backbone = ["--random-init", "vit_tiny_patch16_224", "--patch-size", "7", "--img-size"]
        backbone += ["28", "--model-kwargs", SMALL_VIT, "--seed", str(seed)]
    else:
        backbone = ["--backbone", str(RUNS / f"{arm}_seed{seed}")]
    extra = ["--k", str(KNN_K)] if kind == "knn" else ["--cv-folds", str(PROBE_FOLDS)]
    script = "evals/knn.py" if kind == "knn" else "evals/linear_probe.py"
    argv = [script, *backbone, "--data", SHARDS, "--train-indices",
            str(subset_file(per_class, k)), *extra, "--out", str(out)]  # fmt: skip
    needs = () if arm == "random" else (f"{arm}_seed{seed}",)
    step = Step(name, argv, out, needs)
    step.results, step.gpu = RESULTS, is_gpu(arm)
    return step


def evaluation_steps(per_class: int, k: int, lr: str, wd: str) -> list[Step]:
    """Every arm on one evaluated subset: fine-tuned with the one recipe, probed and kNN."""
    subset = subset_file(per_class, k)
    return [
        step
        for arm in arms()
        for seed in PRETRAIN_SEEDS
        for step in (
            finetune(f"ft/{arm}/n{per_class}_k{k}_s{seed}", arm, seed, subset, lr, wd),
            frozen("probe", arm, seed, per_class, k),
            frozen("knn", arm, seed, per_class, k),
        )
    ]


def baseline() -> Step:
    """From scratch on all the labels to its plateau, the final epoch reported."""
    run = RUNS / "baseline_scratch_all_labels"
    argv = ["pipelines/supervised_pretrain.py", "--config", SUP_CFG, f"run.dir={run}", *COMMON]
    argv += [f"train.epochs={BASELINE_EPOCHS}", f"optim.lr={BASELINE_LR}", "run.eval_every=0"]
    step = Step("baseline_scratch_all_labels", argv, run / "results.json", run_dir=run)
    step.results = RESULTS
    return step


def subsets_step() -> Step:
    argv = ["studies/mpp_label_scarce/subsets.py", "--data", SHARDS, "--out", str(SUBSETS)]
    step = Step("subsets", argv, SUBSETS / "subsets.json")
    step.results = RESULTS
    return step


def plan(lr: str = "pending", wd: str = "pending") -> list[Step]:
    """The whole study: subsets, pretrainings, the pilot grid, then every evaluated subset at
    the recipe the pilot chose (`lr`, `wd`; "pending" until it has), then the baseline."""
    return [
        subsets_step(),
        *(pretrain(arm, s) for arm in pretrained_arms() for s in PRETRAIN_SEEDS),
        *pilot_steps(),
        *(step for n, k in evaluated_subsets() for step in evaluation_steps(n, k, lr, wd)),
        baseline(),
    ]


def chains(todo: list[Step], parts: int = 4) -> list[list[str]]:
    """`todo` as chains of step names that can run side by side (one GPU, several processes):
    a chain per pretraining with every step that reads its export, so that no two chains
    train or rebuild the same export; the steps that read none (random init, the baseline)
    dealt round-robin into `parts` chains. A chain's steps keep the plan's order."""
    by_need: dict[str, list[str]] = {}
    free: list[str] = []
    pretrainings = pretrained_names()
    for step in todo:
        if step.needs:
            by_need.setdefault(step.needs[0], []).append(step.name)
        elif step.name in pretrainings:
            by_need.setdefault(step.name, []).insert(0, step.name)
        else:
            free.append(step.name)
    dealt = [free[i::parts] for i in range(parts)]
    return [c for c in [*by_need.values(), *dealt] if c]


def pretrained_names() -> set[str]:
    return {f"{arm}_seed{s}" for arm in pretrained_arms() for s in PRETRAIN_SEEDS}
