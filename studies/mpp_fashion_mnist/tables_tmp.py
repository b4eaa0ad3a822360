"""The tables of RESULTS.md beyond the main comparison: the longer schedules and the finer grid,
the small-image recipes, Dynamic ViT, the inspection figures and every step's command."""

from __future__ import annotations

import statistics
from pathlib import Path

from study_figures import figure_lines
from study_results import (
    Results,
    arm_scores,
    mean_std,
    mean_std_text,
    pct,
    sweep_choice,
    sweep_text,
)
from study_steps import (
    FEW_LABELS,
    FINETUNE_EPOCHS,
    FT_LONG_EPOCHS,
    GPU_SPLIT,
    PRETRAIN_EPOCHS,
    SCRATCH_EPOCHS,
    SEEDS,
    few_label_arms,
    few_label_budget,
    ft_long_arms,
)

LONG_ARMS = ("ft_mpp_long_s0", "scratch_long_s0")  # the longer schedule's two trainings (plan)
HIRES_ARM = "ft_mpp_long_42px"  # its MPP backbone fine-tuned at the higher resolution (plan)
P4_ARMS = ("ft_mpp_p4_s0", "scratch_p4_s0")  # the finer grid's two trainings (plan)
SHIFT_ARMS = ("ft_mpp_long_shift_s0", "scratch_long_shift_s0")  # the longer schedule, 2-px shifts
HYBRID_ARMS = ("ft_mpp_hybrid_s0", "scratch_hybrid_s0")  # the paper's hybrid, main budget
# the main pretraining, longer fine-tunes: (label, MPP fine-tune, from scratch) per length
FT_LONG = tuple((f"longer fine-tune ({PRETRAIN_EPOCHS} + {e} epochs)", *ft_long_arms(e))
                for e in FT_LONG_EPOCHS)  # fmt: skip
# the hybrid at the GPU budget, by seed (plan: evals/study.py gpu_track), and seed 0 of each
GPU_FT = tuple(f"ft_mpp_hybrid_gpu_s{s}" for s in (0, 1, 2))
GPU_SCRATCH = tuple(f"scratch_hybrid_gpu_s{s}" for s in (0, 1, 2))
GPU_ARMS = (GPU_FT[0], GPU_SCRATCH[0])
GPU_SPLIT_ARM = f"ft_mpp_hybrid_gpu_e{GPU_SPLIT[0]}_s0"  # a snapshot fine-tuned longer (plan)
GPU_SPLIT_LABEL = f"the paper's hybrid, GPU budget split {GPU_SPLIT[0]} + {GPU_SPLIT[1]}"
# the main pretraining fine-tuned on a share of the labels, and from scratch on it: by seed
FEW = tuple((f"{100 * f:g}% of the labels", *([few_label_arms(f, s)[i] for s in SEEDS]
                                              for i in (0, 1))) for f in FEW_LABELS)  # fmt: skip


def label_scarce(r: Results, full: tuple[list[str], list[str]]) -> list[str]:
    """Goal 2 in the paper's setting, pretraining on more images than fine-tuning has labels
    for: each share against all the labels (`full`: the main comparison's two arms)."""
    lines = ["", "## MPP vs from scratch with fewer labels (equal total compute)", "",
             f"The main MPP pretraining ({PRETRAIN_EPOCHS} epochs of every training image, no "
             "labels) fine-tuned on the labels of a hashed share of the training images "
             "(`data.train_fraction`), against from scratch on the same images for the same "
             "compute (they also get the pretraining's epochs, in epochs of the share). As in "
             "the paper, pretraining sees more images than fine-tuning has labels for (JFT, "
             "then ImageNet; sec. 4.6). Fine-tuning runs about as many steps as the main "
             "comparison's; the held-out 2% is the main comparison's, and each run on a share "
             "keeps the best of its 10 held-out evaluations.", "",
             "| labels | epochs: fine-tuning; from scratch | MPP, fine-tuned | from scratch | "
             "MPP minus from scratch (2 std) | MPP's lr (chosen on held-out) |",
             "|---|---|---|---|---|---|"]  # fmt: skip
    budgets = [("100% (the main comparison)",
                f"{PRETRAIN_EPOCHS} + {FINETUNE_EPOCHS}; {SCRATCH_EPOCHS}", *full)]  # fmt: skip
    for f, (label, ft, base) in zip(FEW_LABELS, FEW, strict=True):
        ft_epochs, scratch_epochs, _, _ = few_label_budget(f)
        budgets.append((label, f"{PRETRAIN_EPOCHS} + {ft_epochs}; {scratch_epochs}", ft, base))
    for label, epochs, ft, base in budgets:
        a, b = arm_scores(r, ft), arm_scores(r, base)
        cells = [mean_std_text(a), mean_std_text(b), "-"]
        if a and b:
            (m, sm), (s, ss) = mean_std(a), mean_std(b)
            spread = f"{200 * max(sm, ss):.2f}" if min(len(a), len(b)) > 1 else "one seed"
            cells[2] = f"{100 * (m - s):+.2f} ({spread})"
        lines.append(f"| {label} | {epochs} | {' | '.join(cells)} | {sweep_text(r, ft[0])} |")
    return lines + rebuilt_note(r, [s for _, _, ft, _ in budgets for s in ft])


def rebuilt_note(r: Results, steps: list[str]) -> list[str]:
    """A sentence naming the fine-tunes whose pretraining was rerun on a new machine (the same
    recipe, but weights that are a second sample of it), where there are any."""
    rebuilt = [s for s in steps if (r.get(s) or {}).get("rebuilt_needs")]
    if not rebuilt:
        return []
    return ["", f"{', '.join(rebuilt)} fine-tuned a rerun of the pretraining (a new machine had "
            "lost its export: the same recipe and seed, weights not bitwise the same on a CPU), "
            "so the spread over seeds also holds the pretraining's."]  # fmt: skip


def reused_lr(r: Results, arms: dict[str, list[str]]) -> str:
    """The lr of the fine-tunes that reuse the 16-token MPP sweep's choice instead of sweeping."""
    return f"{sweep_choice(r, arms['mpp'][0])}, the 16-token sweep's (not swept)"


def longer_schedule(r: Results, arms: dict[str, list[str]]) -> list[str]:
    """Issue 13 item 2: MPP pretrained and fine-tuned longer against from scratch for the same
    total epochs, beside the shorter budget's seed 0 (one seed each: no error bar)."""
    from study_steps import (
        FINETUNE_EPOCHS,
        HIRES,
        LONG_FINETUNE_EPOCHS,
        LONG_PRETRAIN_EPOCHS,
        LONG_SNAPSHOTS,
    )

    lines = ["", "## Longer schedules and the finer grid (single seed)", "",
             f"MPP pretrained {LONG_PRETRAIN_EPOCHS} epochs (frozen features at "
             f"{', '.join(map(str, LONG_SNAPSHOTS))} epochs, in the table below), fine-tuned "
             f"{LONG_FINETUNE_EPOCHS} epochs with lr from the paper's grid on held-out; from "
             f"scratch for the sum, {LONG_PRETRAIN_EPOCHS + LONG_FINETUNE_EPOCHS} epochs. Seed 0 "
             "only: read differences against the 3-seed std of the shorter budget above. The "
             "finer grid (4x4 patches) is the same presets with `model.patch_size=4`; the "
             "shifted runs add `data.translate=2` (a random shift of up to 2 px per axis, "
             "zero-filled) to the flips in pretraining, fine-tuning and from scratch alike.", "",
             "| budget (pretraining + fine-tuning epochs) | MPP, fine-tuned | from scratch, same "
             "total | MPP minus from scratch | MPP's lr (chosen on held-out) |",
             "|---|---|---|---|---|"]  # fmt: skip
    short = f"{PRETRAIN_EPOCHS} + {FINETUNE_EPOCHS} (seed 0)"
    reused = reused_lr(r, arms)
    long = f"{LONG_PRETRAIN_EPOCHS} + {LONG_FINETUNE_EPOCHS} (seed 0)"
    budgets = ((short, arms["mpp"][0], arms["scratch"][0]), (long, *LONG_ARMS))
    for label, ft, scratch in budgets:
        lines.append(f"| {label} | {_pair(r, ft, scratch)} | {sweep_text(r, ft)} |")
    from study_steps import P4_FINETUNE_EPOCHS, P4_PRETRAIN_EPOCHS, SHIFT

    lines.append(f"| {P4_PRETRAIN_EPOCHS} + {P4_FINETUNE_EPOCHS} (seed 0), 4x4 patches (7x7 "
                 f"tokens, ~3x the compute per image) | {_pair(r, *P4_ARMS)} | "
                 f"{reused} |")  # fmt: skip
    shift = " ".join(f"`{o}`" for o in SHIFT)
    lines.append(f"| {long}, random shifts of up to 2 px in every run ({shift}) | "
                 f"{_pair(r, *SHIFT_ARMS)} | {sweep_choice(r, LONG_ARMS[0])}, the flips-only "
                 f"{long} sweep's (not swept) |")  # fmt: skip
    lines.append(f"| {short}, the paper's hybrid (ResNet stem at 32 px, 2x2 patches of its "
                 f"8x8 map: 16 tokens, ~1.3x the compute per image) | {_pair(r, *HYBRID_ARMS)} | "
                 f"{reused} |")  # fmt: skip
    from study_steps import GPU_FINETUNE_EPOCHS, GPU_PRETRAIN_EPOCHS

    lines.append(f"| {GPU_PRETRAIN_EPOCHS} + {GPU_FINETUNE_EPOCHS} (seed 0), the paper's hybrid "
                 f"on one GPU ({_gpu_of(r, GPU_ARMS[1])}; `train.precision=auto`: bf16 from Ampere "
                 f"on) | {_pair(r, *GPU_ARMS)} | {reused} |")  # fmt: skip
    (pre, ft), total = GPU_SPLIT, sum(GPU_SPLIT)
    lines.append(f"| {pre} + {ft} (seed 0), the same GPU run's epoch-{pre} snapshot fine-tuned "
                 f"{ft} epochs (against the same from scratch {total}) | "
                 f"{_pair(r, GPU_SPLIT_ARM, GPU_ARMS[1])} | {reused} |")  # fmt: skip
    for e in FT_LONG_EPOCHS:
        ft, scratch = ft_long_arms(e)
        lines.append(f"| {PRETRAIN_EPOCHS} + {e} (seed 0), the main pretraining with a longer "
                     f"fine-tune | {_pair(r, ft, scratch)} | {reused} |")  # fmt: skip
    hires = r.output(HIRES_ARM)
    held = "pending" if hires is None else pct(hires["selection_best_top1"])
    lines.append(f"| {long}, fine-tuned at {HIRES} px (6x6 tokens, ~2.4x the fine-tuning "
                 f"compute; the paper's B.1.1) | {pct(r.selected(HIRES_ARM))} | - | - | the "
                 f"28 px sweep's (held-out top-1 {held}) |")  # fmt: skip
    return lines


def _pair(r: Results, finetune: str, scratch: str) -> str:
    """'MPP | from scratch | MPP minus from scratch' cells of one budget."""
    a, b = r.selected(finetune), r.selected(scratch)
    gap = "-" if a is None or b is None else f"{100 * (a - b):+.2f}"
    return f"{pct(a)} | {pct(b)} | {gap}"


def _gpu_of(r: Results, step: str) -> str:
    """The GPU a step's result was measured on, as its machine line names it."""
    res = r.get(step)
    return "pending" if res is None else res["machine"].split("; ")[3]


def dynamic(r: Results, root: Path, results: Path) -> list[str]:
    """Dynamic ViT: the operating point chosen on held-out, on test, against the finest stage."""
    lines = ["", "## Dynamic ViT (issue 15): 2x2, 4x4, 7x7 tokens, fine-tuned from MPP", "",
             "The operating point is the least compute whose held-out accuracy reaches the finest "
             "stage's (thresholds chosen on held-out, never on test). Goals: the finest stage's "
             "accuracy at <= 0.5x its GFLOPs, >= 1.5x its measured images/s (batched early exit).",
             "", "| cascade | finest stage top-1 | cascade top-1 | GFLOPs / finest | "
             "images/s / finest |", "|---|---|---|---|---|"]  # fmt: skip
    for label, name in (("feature + relationship reuse", "cascade"),
                        ("no feature reuse", "cascade_no_feature_reuse"),
                        ("no relationship reuse", "cascade_no_relation_reuse")):  # fmt: skip
        out = r.output(f"{name}/dynamic")
        if out is None:
            lines.append(f"| {label} | pending | - | - | - |")
            continue
        m = out["metrics"]
        if "matched_top1" not in m:
            lines.append(f"| {label} | {pct(m['finest_top1'])} | no threshold reached the "
                         "finest stage's held-out accuracy | - | - |")  # fmt: skip
            continue
        ratios = f"{m['matched_gflops_ratio']:.2f}x | {m['matched_speedup']:.2f}x"
        tops = f"{pct(m['finest_top1'])} | {pct(m['matched_top1'])}"
        lines.append(f"| {label} | {tops} | {ratios} |")
    fig = root / results / "cascade" / "dynamic.accuracy_vs_gflops.png"
    return lines + figure_lines(fig if fig.is_file() else None,
                           "Dynamic ViT: accuracy against mean GFLOPs per image", root)  # fmt: skip


def recipes(r: Results) -> list[str]:
    """Issue 13 item 3: which small-image recipe wins on held-out data."""
    from study_steps import RECIPE_EPOCHS, RECIPES

    lines = ["", f"## Small-image recipe (from scratch with labels, {RECIPE_EPOCHS} epochs, "
             "single seed)", "", "Compared on held-out top-1 (the best of the run's "
             "evaluations); test is only reported. images/s: median of the run's logging "
             "windows, on the machine above.", "",
             "| recipe | overrides of the supervised preset | held-out top-1 | test top-1 | "
             "images/s |", "|---|---|---|---|---|"]  # fmt: skip
    scored = []
    for name, overrides in RECIPES.items():
        out = r.output(name)
        what = " ".join(f"`{o}`" for o in overrides) or "(the preset)"
        if out is None:
            lines.append(f"| {name} | {what} | pending | - | - |")
            continue
        rates = [row["train/images_per_s"] for row in r.metric_lines(name)
                 if "train/images_per_s" in row]  # fmt: skip
        ips = f"{statistics.median(rates):.0f}" if rates else "-"
        held = out["selection_best_top1"]
        scored.append((held, name))
        lines.append(f"| {name} | {what} | {pct(held)} | {pct(out['selected_top1'])} | {ips} |")
    if scored:
        lines += ["", f"Best on held-out so far: {max(scored)[1]}."]
    from study_steps import FINETUNE_RECIPES

    lines += ["", "MPP fine-tuning recipes (seed 0, same budget):", "",
              "| recipe | overrides of the fine-tuning preset | held-out top-1 | test top-1 |",
              "|---|---|---|---|"]  # fmt: skip
    sweep = r.output("ft_mpp_s0")
    if sweep is not None:
        lr, held = sweep["chosen"]["optim.lr"], pct(sweep.get("selection_best_top1"))
        lines.append(f"| SGD, the sweep's lr | `optim.lr={lr}` | {held} | "
                     f"{pct(sweep['selected_top1'])} |")  # fmt: skip
    for name, overrides in FINETUNE_RECIPES.items():
        out = r.output(name)
        args = " ".join(overrides).replace("--sweep ", "--sweep=").split(" ")  # one span each
        what = " ".join(f"`{a}`" for a in args)
        if not any(o.startswith("optim.lr=") for o in overrides) and sweep is not None:
            what += f" at the sweep's `optim.lr={sweep['chosen']['optim.lr']}`"
        held = "pending" if out is None else pct(out["selection_best_top1"])
        test = "-" if out is None else pct(out["selected_top1"])
        if out is not None and "sweep" in out:  # a sweep of its own: its choice, each value's
            what += f"; chose {sweep_text(r, name)}"
        lines.append(f"| {name} | {what} | {held} | {test} |")
    return lines


def inspect_figures(root: Path, results: Path) -> list[str]:
    from study_steps import INSPECT_FIGURES

    lines = []
    for name in INSPECT_FIGURES:
        fig = root / results / f"inspect_mpp.{name}"
        lines += figure_lines(fig if fig.is_file() else None, name.removesuffix(".png"), root)
    return ["", "## Inspecting the MPP backbone (paper sec. 4.5)", *lines] if lines else []


def steps_table(r: Results, plan: list) -> list[str]:
    lines = ["", "## Every step", "", "| step | command | MLflow run | wall time, notes |",
             "|---|---|---|---|"]  # fmt: skip
    for step in plan:
        res = r.get(step.name)
        if res is None:
            lines.append(f"| {step.name} | pending | - | - |")
            continue
        secs = res.get("seconds")
        wall = "-" if secs is None else f"{secs / 60:.1f} min"
        if res.get("resumed"):
            wall += " (its last leg: resumed from a checkpoint)"
        if rebuilt := res.get("rebuilt_needs"):
            wall += (
                f" (read a rebuild of {', '.join(sorted(rebuilt))}'s export: same recipe, new run)"
            )
        lines.append(f"| {step.name} | `{res['command']}` | {res.get('mlflow_run_id') or '-'} "
                     f"| {wall} |")  # fmt: skip
    return lines
