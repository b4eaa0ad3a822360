"""The tables of RESULTS.md: the main comparison per share of the labels, the longer schedules,
the GPU runs, the frozen features, the recipes, Dynamic ViT, the inspection figures and every
step.

Every row of a fine-tune or frozen evaluation names the pretraining it started from (its run and
the sha256 of its weights) and the code version and machine it ran on; results that started from
different pretrainings never share a row, and results that do not record their weights are in
no row (`records.shown`).
"""

from __future__ import annotations

import statistics
from pathlib import Path

from studies.mpp_fashion_mnist import steps as S
from studies.mpp_fashion_mnist.figures import figure_lines
from studies.mpp_fashion_mnist.records import (
    KNN,
    PROBE,
    Results,
    arm_scores,
    by_start,
    conditions,
    fewshot,
    mean_std_text,
    one_start,
    pct,
    readout_label,
    shown,
    start,
    sweep_choice,
    sweep_text,
    welch_text,
)
from studies.mpp_fashion_mnist.stats import welch

# The single-seed MPP fine-tunes (the provenance reruns of steps.provenance_reruns) and their
# from-scratch runs, which need no weights and keep their first runs.
LONG_ARMS = ("ft_mpp_long_seed0_s0", "scratch_long_s0")  # the longer schedule
HIRES_ARM = f"ft_mpp_long_seed0_{S.HIRES}px"  # its MPP backbone fine-tuned at the higher resolution
P4_ARMS = ("ft_mpp_p4_seed0_s0", "scratch_p4_s0")  # the finer grid
SHIFT_ARMS = ("ft_mpp_long_shift_seed0_s0", "scratch_long_shift_s0")  # longer, 2-px shifts
HYBRID_ARMS = ("ft_mpp_hybrid_seed0_s0", "scratch_hybrid_s0")  # the paper's hybrid, main budget
MIXER_ARM = "ft_mixer_seed0_s0"  # the MLP-Mixer pretrained with MPP, main budget
# the main pretraining's seed 0, longer fine-tunes: (label, MPP fine-tune, from scratch)
FT_LONG = tuple(
    (
        f"longer fine-tune ({S.PRETRAIN_EPOCHS} + {e} epochs)",
        S.ft_long_arms(e, "mpp_seed0")[0],
        S.ft_long_arms(e)[1],
    )
    for e in S.FT_LONG_EPOCHS
)
# the sweeps on the first pretrainings whose lr choices the reruns reuse
MPP_SWEEP, LONG_SWEEP, MIXER_SWEEP = "ft_mpp_s0", "ft_mpp_long_s0", "ft_mixer_s0"
# the GPU track's MPP: three pretrainings, each fine-tuned once
GPU_FT = [f"ft_mpp_hybrid_gpu_seed{s}_s{s}" for s in S.PRETRAIN_SEEDS]
GPU_SCRATCH = [f"scratch_hybrid_gpu_s{s}" for s in S.SEEDS]  # at the preset's lr
GPU_SPLIT_ARM = f"ft_mpp_hybrid_gpu_e{S.GPU_SPLIT[0]}_s0"
NOT_SWEPT = "1e-3 (the supervised preset's; not swept)"
# from scratch at the preset lr on each share (1.0: all the labels), by seed
UNTUNED_SCRATCH = {
    1.0: [f"scratch_s{s}" for s in S.SEEDS],
    **{f: [S.few_label_arms(f, s)[1] for s in S.SEEDS] for f in S.FEW_LABELS},
}


def arms() -> dict[str, list[str]]:
    """The main comparison's arms on all the labels: MPP and supervised pretraining, three
    pretrainings each fine-tuned once; from scratch at the preset's lr, three seeds."""
    return {
        "mpp": mpp_seed_arm(1.0),
        "supervised": [f"ft_supervised_seed{s}_s{s}" for s in S.PRETRAIN_SEEDS],
        "scratch": UNTUNED_SCRATCH[1.0],
    }


def arm_rows(r: Results, label: str, steps: list[str], lr: str) -> list[str]:
    """One row per pretraining the arm's seeds started from (none: one row); nothing for an
    arm without results."""
    rows = []
    for st, group in by_start(r, steps):
        vals = arm_scores(r, group)
        each = ", ".join(f"{100 * v:.2f}" for v in vals)
        origin = st.text() if st else "-"
        rows.append(
            f"| {label} | {origin} | {mean_std_text(vals)} | {each} | {lr} | "
            f"{conditions(r, group)} |"
        )
    return rows


ARM_HEADER = [
    "| method | started from | fine-tuned test top-1, mean ± std | per seed | lr (chosen on "
    "held-out) | code; machine |",
    "|---|---|---|---|---|---|",
]


def mpp_seed_arm(fraction: float) -> list[str]:
    """MPP on a share of the labels (1.0: all), one fine-tune per pretraining seed (0, 1, 2),
    the fine-tuning seed equal to the pretraining's."""
    tag = "" if fraction == 1.0 else f"_{S.share_tag(fraction)}"
    return [f"ft_mpp_seed{s}{tag}_s{s}" for s in S.PRETRAIN_SEEDS]


def tuned_scratch(
    r: Results, share: float | str, stand_ins: list[str] | None = None
) -> tuple[str | None, list[str]]:
    """(the lr from scratch's seed-0 grid chose on held-out, its steps by seed: the grid's run at
    that lr, then seeds 1-2 as far as run); (None, []) while the grid is unfinished. A seed
    without a run at the chosen lr takes its `stand_ins` step (seeds 1-2, the same command but
    the lr) when that one trained at the chosen lr."""
    if any(r.get(S.scratch_lr_step(share, lr).name) is None for lr in S.SCRATCH_LRS):
        return None, []
    lr = S.chosen_scratch_lr(share, read=r.output)
    seeds = []
    for i, seed in enumerate(S.SEEDS[1:]):
        # a seed trained at an earlier choice (before the grid grew) is stale: it reruns, unread
        for step in (S.scratch_lr_seed(share, seed).name, *(stand_ins or [])[i : i + 1]):
            if r.get(step) is not None and trained_lr(r, step) == float(lr):
                seeds.append(step)
                break
    return lr, [S.scratch_lr_step(share, lr).name, *seeds]


def trained_lr(r: Results, step: str) -> float | None:
    """The optim.lr a training step's result was trained with (its resolved config)."""
    config = ((r.get(step) or {}).get("recipe") or {}).get("config") or {}
    lr = (config.get("optim") or {}).get("lr")
    return None if lr is None else float(lr)


def seed_row(
    r: Results,
    label: str,
    mpp: list[str],
    pretraining: str,
    tuned: tuple[str | None, list[str]],
    untuned: list[str],
) -> str | None:
    """A row of SEEDS_HEADER: MPP over its pretraining seeds (`pretraining`: seed 0's run, for
    the image passes) against from scratch at its own lr (`tuned`: tuned_scratch's answer) and
    at the preset's; None until every pretraining has its fine-tune."""
    lr, steps = tuned
    x, y, z = arm_scores(r, mpp), arm_scores(r, steps), arm_scores(r, untuned)
    if len(x) < len(mpp):  # a row is shown with all three pretrainings or not at all
        return None
    origins = ", ".join(st.text() if st else "-" for st in (start(r, s) for s in mpp))
    cells = [
        label,
        f"{mean_std_text(x)}: {', '.join(f'{100 * v:.2f}' for v in x)}",
        origins,
        f"{mean_std_text(y)} at lr {lr}" if y else "grid unfinished",
        welch_text(x, y) if len(y) > 1 else "-",
        mean_std_text(z) if z else "-",
        welch_text(x, z) if len(z) > 1 else "-",
        image_passes(r, [pretraining, mpp[0]], (steps or untuned)[0]),
        conditions(r, [*mpp, *steps, *untuned]),
    ]
    return f"| {' | '.join(cells)} |"


SEEDS_HEADER = [
    "| labels | MPP, three pretrainings: mean ± std: per seed | MPP started from | from scratch, "
    "own lr (chosen on held-out) | MPP minus from scratch, own lr [95% CI], Welch p | from "
    "scratch, preset lr 1e-3 | MPP minus from scratch, preset lr [95% CI], Welch p | image "
    "passes: MPP; from scratch | code; machine |",
    "|---|---|---|---|---|---|---|---|---|",
]


def seeds_table(r: Results, a: dict[str, list[str]]) -> list[str]:
    """Issue 38's comparison: MPP over three pretraining seeds against from scratch at the lr
    its own grid chose on held-out, per share of the labels; the untuned arm beside it."""
    rows = []
    for f in S.SCRATCH_SHARES:
        row = seed_row(
            r,
            f"{100 * f:g}%",
            mpp_seed_arm(f),
            "mpp_seed0",
            tuned_scratch(r, f),
            UNTUNED_SCRATCH[f],
        )
        rows += [row] if row else []
    if not rows:
        return []
    supervised = a["supervised"]
    sup, mpp = arm_scores(r, supervised), arm_scores(r, a["mpp"])
    if len(sup) == len(supervised) and len(mpp) == len(supervised):
        rows.append(
            f"\nSupervised pretraining on all the labels, three pretrainings (seeds 0-2, each "
            f"fine-tuned once at the lr its seed-0 sweep chose): {mean_std_text(sup)}; MPP minus "
            f"supervised pretraining: {welch_text(mpp, sup)} ({conditions(r, supervised)})."
        )
    return [
        "",
        "## MPP against from scratch tuned like it: three pretrainings (CPU, fp32)",
        "",
        "The study's main comparison, fixed in the study plan for issue 38 before its runs, per "
        f"share of the labels (100%: the main budget, {S.PRETRAIN_EPOCHS} + {S.FINETUNE_EPOCHS} "
        f"against {S.SCRATCH_EPOCHS} epochs). MPP: three "
        "pretrainings (seeds 0, 1, 2), each fine-tuned once (fine-tuning seed = pretraining "
        "seed) at the lr seed 0's sweep chose on held-out for that share, so the spread holds "
        "the pretraining's variance. From scratch: the lr its own seed-0 grid chose on held-out "
        "(next table), seeds 0-2 at that lr. Beside them, from scratch at the supervised "
        "preset's lr, untuned (the study's first runs). Each row names its code versions; MPP's "
        "and the tuned arm's runs ran on one machine in fp32 with the training data in RAM. The "
        "figure after the next table draws it. Differences: MPP minus from scratch in points, "
        "95% CI and Welch's p.",
        "",
        *SEEDS_HEADER,
        *rows,
    ]


def _shares(shares: list[str]) -> str:
    return ", ".join(shares) + " of the labels" if shares else "no share"


def longer_finetune_note(r: Results, gap: float) -> str:
    """What the 100% headline (MPP minus from scratch: `gap`) rests on: a fine-tune of the main
    budget's few epochs; and what the longer fine-tunes of seed 0's pretraining (one seed each)
    gave against from scratch for the same total."""
    note = (
        f" This row fine-tunes for {S.FINETUNE_EPOCHS} epochs only (the main budget, "
        f"{S.PRETRAIN_EPOCHS} + {S.FINETUNE_EPOCHS} against {S.SCRATCH_EPOCHS} from scratch)."
    )
    pairs, last = [], None
    for e, (_, ft, base) in zip(S.FT_LONG_EPOCHS, FT_LONG, strict=True):
        a, b = r.selected(ft), r.selected(base)
        if a is not None and b is not None and shown(r, ft):
            last = a - b
            pairs.append(
                f"{S.PRETRAIN_EPOCHS} + {e} against {S.PRETRAIN_EPOCHS + e}: MPP {100 * a:.2f}, "
                f"from scratch {100 * b:.2f} ({100 * last:+.2f})"
            )
    if last is None:
        return note
    trend = "narrows" if abs(last) < abs(gap) else "does not narrow"
    return note + (
        f" Fine-tuned longer, seed 0's pretraining {trend} the gap ({100 * gap:+.2f} here; one "
        f"seed each, no CI; from scratch at the preset's lr): {'; '.join(pairs)}."
    )


def headline(r: Results) -> list[str]:
    """The study's answer so far, per share of the labels: MPP over three pretrainings minus
    from scratch at its own lr (where that arm has 2+ seeds), with its 95% CI."""
    said, waiting, above, below, level = [], [], [], [], []
    for f in S.SCRATCH_SHARES:
        x = arm_scores(r, mpp_seed_arm(f))
        lr, tuned = tuned_scratch(r, f)
        y = arm_scores(r, tuned)
        if len(x) < len(S.PRETRAIN_SEEDS) or len(y) < 2:
            waiting.append(f"{100 * f:g}%")
            continue
        w = welch(x, y)
        verdict = "lies above 0" if w.low > 0 else ("lies below 0" if w.high < 0 else "includes 0")
        (above if w.low > 0 else below if w.high < 0 else level).append(f"{100 * f:g}%")
        said.append(
            f"- {100 * f:g}% of the labels: {100 * w.diff:+.2f} points [{100 * w.low:+.2f}, "
            f"{100 * w.high:+.2f}] (Welch p={w.p:.2g}; MPP {mean_std_text(x)}, from scratch at "
            f"lr {lr} {mean_std_text(y)}): the interval {verdict}."
            + (longer_finetune_note(r, w.diff) if f == 1.0 else "")
        )
    lines = ["", "## Headline", ""]
    if said:
        lines += [
            "MPP (three pretrainings, each fine-tuned once) minus from scratch tuned on held-out "
            "like MPP's fine-tuning, test top-1 with its 95% CI:",
            "",
            *said,
            "",
            f"MPP is ahead (the goal: the interval above 0) at {_shares(above)}; behind at "
            f"{_shares(below)}; not told apart at {_shares(level)}.",
        ]
    if waiting:
        lines += [
            *([""] if said else []),
            f"Not yet answered at {', '.join(waiting)} of the labels: the tuned from-scratch arm "
            "has fewer than 2 seeds there (the study plan below lists the steps to run).",
        ]
    return lines


def grid_rows(r: Results, shares: tuple[float | str, ...]) -> tuple[list[str], list[str]]:
    """Rows of from scratch's lr grid per share (as far as run), and the shares whose choice
    sits on an edge of the grid."""
    rows, edges = [], []
    for f in shares:
        label = "100%" if f == S.GPU_SWEEP else f"{100 * f:g}%"
        held, tests = [], {}
        for lr in S.SCRATCH_LRS:
            out = r.output(S.scratch_lr_step(f, lr).name)
            held.append(f"{lr}: {100 * out['selection_best_top1']:.2f}" if out else f"{lr}: -")
            if out:
                tests[lr] = (out["selection_best_top1"], out["selected_top1"])
        if not tests:
            continue
        done = len(tests) == len(S.SCRATCH_LRS)
        best = max(tests, key=lambda lr: tests[lr][0])
        chosen = f"{best} (test top-1 {100 * tests[best][1]:.2f})" if done else "grid unfinished"
        if done and best in (S.SCRATCH_LRS[0], S.SCRATCH_LRS[-1]):
            edges.append(f"{label} ({best})")
        steps = [S.scratch_lr_step(f, lr).name for lr in tests]
        rows.append(f"| {label} | {', '.join(held)} | {chosen} | {conditions(r, steps)} |")
    return rows, edges


GRID_HEADER = [
    "| labels | held-out top-1 per lr | chosen lr | code; machine |",
    "|---|---|---|---|",
]


# Results replaced after the grid grew, quoted from the commit that holds the first one: (step,
# the lr it first ran at, the lr it runs at now, that commit, its first test top-1 in %).
REPLACED = (("scratch_sweep/labels1/chosen_s1", "5e-4", "4e-3", "1dac034", 71.26),)


def mpp_sweep_step(share: float) -> str:
    """The seed-0 MPP fine-tuning sweep whose lr the share's three pretrainings reuse."""
    return MPP_SWEEP if share == 1.0 else S.few_label_arms(share, S.SEEDS[0])[0]


def mpp_lr_rows(r: Results) -> tuple[list[str], list[str]]:
    """Rows of MPP's fine-tuning lr sweep per share (held-out top-1 per lr, the choice), and the
    shares whose choice sits on an edge of the grid ("1% (0.003, its lowest)")."""
    grid = S.FINETUNE_LRS.split(",")
    rows, edges = [], []
    for f in S.SCRATCH_SHARES:
        sweep = mpp_sweep_step(f)
        if r.output(sweep) is None:
            continue
        choice = sweep_choice(r, sweep)
        held = sweep_text(r, sweep).removeprefix(choice).strip(" ()")
        held = held.removeprefix("held-out top-1 ")
        if choice in (grid[0], grid[-1]):
            side = "lowest" if choice == grid[0] else "highest"
            edges.append(f"{100 * f:g}% ({choice}, its {side})")
        rows.append(f"| {100 * f:g}% | {held} | {choice} | {conditions(r, [sweep])} |")
    return rows, edges


def scratch_lr_grid(r: Results) -> list[str]:
    """From scratch's own lr grid per share (seed 0, chosen on held-out), as far as it has run:
    the tuning MPP's fine-tuning already had; then MPP's sweep per share beside it."""
    rows, edges = grid_rows(r, S.SCRATCH_SHARES)
    if not rows:
        return []
    text = (
        "The same budget per share as the table above, from scratch at each lr of the grid; the "
        "held-out 2% chooses; seeds 1-2 reuse the choice (the table above)."
    )
    if edges:
        text += (
            f" The choice is at an edge of the grid at {', '.join(edges)}: a wider grid might "
            "find a better lr there; the grid stays at the four values MPP's sweep has."
        )
    for step, first, now, commit, top1 in REPLACED:
        if r.get(step) is not None:
            text += (
                f" `{step}` first ran at lr {first}, the three-value grid's choice, and was run "
                f"again at {now} once the grown grid chose {now}; its first result (test top-1 "
                f"{top1:.2f}, commit {commit}) was replaced, not kept beside it."
            )
    return [
        "",
        "### The learning rates: from scratch's own grid and MPP's sweep (seed 0, held-out)",
        "",
        text,
        "",
        *GRID_HEADER,
        *rows,
        *mpp_lr_lines(r),
    ]


def mpp_lr_lines(r: Results) -> list[str]:
    """MPP's fine-tuning lr per share, chosen on held-out by seed 0's sweep of the paper's grid,
    and where that choice sits on an edge of a grid that, unlike from scratch's, never grew."""
    rows, edges = mpp_lr_rows(r)
    if not rows:
        return []
    grid = S.FINETUNE_LRS.replace(",", ", ")
    edge = (
        f" The choice is at an edge of the grid at {', '.join(edges)}, and MPP's grid was never "
        "widened there, while from scratch's was (4e-3 added when its 10% choice fell on the "
        "upper edge): a wider grid might find a better lr for MPP at those shares, so MPP's rows "
        "there may understate it. The comparison stands as run: the two arms had grids of four "
        "values each, not the same rule for widening them."
        if edges
        else ""
    )
    return [
        "",
        f"MPP's fine-tuning lr per share: seed 0's sweep of the paper's grid {{{grid}}} "
        "(appendix B.1.1) on the first 6-epoch pretraining, chosen on held-out; the three "
        "pretrainings of the table above reuse it." + edge,
        "",
        "| labels | held-out top-1 per lr | chosen lr | code; machine |",
        "|---|---|---|---|",
        *rows,
    ]


def image_passes(r: Results, method: list[str], scratch: str) -> str:
    """Images trained on by the steps of `method` (pretraining, fine-tuning) and by `scratch`,
    from each run's last metric line, and how far from equal they are."""

    def seen(step: str) -> float | None:
        lines = r.metric_lines(step)
        return lines[-1].get("train/samples_seen") if lines else None

    ours, theirs = [seen(s) for s in method], seen(scratch)
    if None in ours or theirs is None:
        return "-"
    total = sum(ours)
    return f"{total / 1e3:.0f}k; {theirs / 1e3:.0f}k (MPP {total / theirs - 1:+.0%})"


def reused_lr(r: Results) -> str:
    """The lr of the fine-tunes that reuse the 16-token MPP sweep's choice instead of sweeping."""
    return f"{sweep_choice(r, MPP_SWEEP)}, the 16-token sweep's (not swept)"


def _origin(r: Results, step: str) -> str:
    st = start(r, step)
    return st.text() if st else "-"


def _pair(r: Results, finetune: str, scratch: str | None) -> str:
    """'MPP started from | MPP | from scratch | MPP minus from scratch' cells of one budget."""
    a, b = r.selected(finetune), r.selected(scratch) if scratch else None
    gap = "-" if a is None or b is None else f"{100 * (a - b):+.2f}"
    st = start(r, finetune)
    return f"{st.text() if st else '-'} | {pct(a)} | {pct(b)} | {gap}"


def first_sweep(r: Results, sweep: str) -> str:
    """The lr a rerun reuses: '0.03, its first run's sweep's (held-out top-1 ...)'."""
    choice = sweep_choice(r, sweep)
    return f"{choice}, its first run's sweep's{sweep_text(r, sweep).removeprefix(choice)}"


def longer_schedule(r: Results) -> list[str]:
    """MPP pretrained and fine-tuned longer, other models and grids, each against from scratch
    for the same total epochs, beside the main budget's seed 0 (one seed each: no error bar);
    all on CPU, fp32. A row shows once its MPP fine-tune has a result that records its weights."""
    long_total = S.LONG_PRETRAIN_EPOCHS + S.LONG_FINETUNE_EPOCHS
    lines = [
        "",
        "## Longer schedules, other models and the finer grid (single seed, CPU, fp32; post hoc)",
        "",
        f"MPP pretrained {S.LONG_PRETRAIN_EPOCHS} epochs, fine-tuned {S.LONG_FINETUNE_EPOCHS} "
        f"epochs; from scratch for the sum, {long_total} epochs. Seed 0 only: one seed has no "
        "confidence interval. The finer grid (4x4 patches) is the same presets with "
        "`model.patch_size=4`; the shifted runs add `data.translate=2` (a random shift of up to "
        "2 px per axis, zero-filled) to the flips in pretraining, fine-tuning and from scratch "
        "alike. The MPP rows fine-tune pretrainings run again at seed 0 (`<name>_seed0`, the "
        "main budget's `mpp_seed0`) that record their weights; each reuses the lr the first "
        "run's sweep chose on held-out. The frozen features of the first runs, which record "
        "theirs, are in the next tables. From scratch (no weights to record) keeps its first "
        "runs, at the supervised preset's lr.",
        "",
        "| budget (pretraining + fine-tuning epochs) | MPP started from | MPP, fine-tuned | from "
        "scratch, same total | MPP minus from scratch | MPP's lr (chosen on held-out) | code; "
        "machine |",
        "|---|---|---|---|---|---|---|",
    ]
    short = f"{S.PRETRAIN_EPOCHS} + {S.FINETUNE_EPOCHS} (seed 0)"
    long = f"{S.LONG_PRETRAIN_EPOCHS} + {S.LONG_FINETUNE_EPOCHS} (seed 0)"
    reused = reused_lr(r)
    shift = " ".join(f"`{o}`" for o in S.SHIFT)
    main_seed0 = mpp_seed_arm(1.0)[0]
    rows = [
        (short, main_seed0, UNTUNED_SCRATCH[1.0][0], first_sweep(r, MPP_SWEEP)),
        *(
            (
                f"{S.PRETRAIN_EPOCHS} + {e} (seed 0), the main pretraining with a longer fine-tune",
                ft,
                base,
                reused,
            )
            for e, (_, ft, base) in zip(S.FT_LONG_EPOCHS, FT_LONG, strict=True)
        ),
        (long, *LONG_ARMS, first_sweep(r, LONG_SWEEP)),
        (
            f"{short}, the paper's hybrid (ResNet stem at 32 px, 2x2 patches of its 8x8 map: 16 "
            "tokens, ~1.3x the compute per image)",
            *HYBRID_ARMS,
            reused,
        ),
        (
            f"{short}, an MLP-Mixer (D 128, 9 blocks) pretrained with MPP; from scratch: the ViT",
            MIXER_ARM,
            UNTUNED_SCRATCH[1.0][0],
            first_sweep(r, MIXER_SWEEP),
        ),
        (
            f"{long}, random shifts of up to 2 px in every run ({shift})",
            *SHIFT_ARMS,
            f"{sweep_choice(r, LONG_SWEEP)}, the flips-only {long} sweep's (not swept)",
        ),
        (
            f"{S.P4_PRETRAIN_EPOCHS} + {S.P4_FINETUNE_EPOCHS} (seed 0), 4x4 patches (7x7 tokens, "
            "~3x the compute per image)",
            *P4_ARMS,
            reused,
        ),
    ]
    for label, ft, base, lr in rows:
        if shown(r, ft):
            cells = f"{_pair(r, ft, base)} | {lr} | {conditions(r, [ft, base])}"
            lines.append(f"| {label} | {cells} |")
    hires = r.output(HIRES_ARM)
    if hires is not None and shown(r, HIRES_ARM):
        lines.append(
            f"| {long}, fine-tuned at {S.HIRES} px (6x6 tokens, ~2.4x the fine-tuning compute; "
            f"the paper's B.1.1) | {_origin(r, HIRES_ARM)} | {pct(r.selected(HIRES_ARM))} | "
            f"- | - | the 28 px sweep's (held-out top-1 {pct(hires['selection_best_top1'])}) | "
            f"{conditions(r, [HIRES_ARM])} |"
        )
    return lines


def gpu_tables(r: Results) -> list[str]:
    """The runs on one GPU in bf16: apart from the CPU's fp32 rows (another device, precision
    and code version), the frozen evaluations of their exports with them."""
    reused = reused_lr(r)
    tuned = tuned_scratch(r, S.GPU_SWEEP, stand_ins=GPU_SCRATCH[1:])
    seeds = seed_row(r, "100%", GPU_FT, "mpp_hybrid_gpu_seed0", tuned, GPU_SCRATCH)
    rows = [
        # until all three pretrainings have their fine-tunes: a row per pretraining run so far
        *(
            []
            if seeds
            else [
                (
                    f"MPP {S.GPU_PRETRAIN_EPOCHS} + {S.GPU_FINETUNE_EPOCHS} epochs, fine-tuned",
                    GPU_FT,
                    reused,
                )
            ]
        ),
        (f"from scratch, {S.GPU_SCRATCH_EPOCHS} epochs, preset lr", GPU_SCRATCH, NOT_SWEPT),
        (
            f"MPP: the epoch-{S.GPU_SPLIT[0]} snapshot fine-tuned {S.GPU_SPLIT[1]} epochs (the "
            "same 50 epochs split)",
            [GPU_SPLIT_ARM],
            reused,
        ),
    ]
    body = [row for label, steps, lr in rows for row in arm_rows(r, label, steps, lr)]
    frozen = [
        (
            f"MPP after {e} epochs, read-out chosen on held-out: "
            f"{readout_label(r, f'mpp_hybrid_gpu_readout_e{e}')}",
            f"mpp_hybrid_gpu_readout_e{e}",
        )
        for e in S.GPU_SNAPSHOTS
    ]
    frozen_rows = frozen_lines(r, frozen)
    if not body and not frozen_rows:
        return []
    lines = [
        "",
        "## The paper's hybrid on one GPU (bf16; post hoc)",
        "",
        "Trained on one GPU with `train.precision=auto` (bf16), at other code versions than "
        "the CPU runs: compare these rows with each other, not with the CPU tables. MPP "
        f"pretrains {S.GPU_PRETRAIN_EPOCHS} epochs and fine-tunes {S.GPU_FINETUNE_EPOCHS} at lr "
        f"{reused}; from scratch trains {S.GPU_SCRATCH_EPOCHS}. The frozen "
        "evaluations of the first pretraining's snapshots ran on a CPU.",
    ]
    if seeds:
        lines += [
            "",
            "Issue 38's rules on this budget: MPP over three pretrainings, each fine-tuned "
            "once, against from scratch at the lr its own seed-0 grid "
            f"chose on held-out ({', '.join(S.SCRATCH_LRS)}), seeds 1-2 at that lr. A preset-lr "
            "seed stands in for a seed of the tuned arm when the grid chose the preset's lr.",
            "",
            *SEEDS_HEADER,
            seeds,
        ]
    grid, edges = grid_rows(r, (S.GPU_SWEEP,))
    if grid:
        edge = f" The choice is at an edge of the grid ({edges[0]})." if edges else ""
        lines += ["", f"From scratch's lr grid on this budget (seed 0).{edge}", "", *GRID_HEADER]
        lines += grid
    lines += ["", *ARM_HEADER, *body]
    if frozen_rows:
        lines += ["", *FROZEN_HEADER, *frozen_rows]
    return lines


FROZEN_HEADER = [
    "| features | started from | kNN (k=20) | linear probe | few-shot 1/5/10/25 (ridge, l2 by "
    "LOO) | code; machine |",
    "|---|---|---|---|---|---|",
]


def frozen_lines(r: Results, rows: list[tuple[str, str]]) -> list[str]:
    """A row per set of frozen features (label, evals name); a set whose weights (sha256) an
    earlier row already showed is not repeated: that row names both."""
    kinds = ("knn", "probe", "fewshot")
    seen: dict[tuple, int] = {}  # (sha256, numbers) -> index in `out`
    out: list[list[str]] = []
    for label, ev in rows:
        steps = [f"{ev}/{k}" for k in kinds if r.get(f"{ev}/{k}") is not None]
        if not steps or not all(shown(r, s) for s in steps):
            continue
        st = one_start(label, [start(r, s) for s in steps])
        cells = [
            label,
            st.text() if st else "-",
            pct(r.metric(ev, "knn", KNN)),
            pct(r.metric(ev, "probe", PROBE)),
            fewshot(r, ev),
            conditions(r, steps),
        ]
        key = (st.sha256, *cells[2:5]) if st is not None and st.sha256 else None
        if key in seen:  # the same weights measured the same way: one row, both names
            out[seen[key]][0] += f"; the same weights: {label}"
            continue
        if key is not None:
            seen[key] = len(out)
        out.append(cells)
    return ["| " + " | ".join(c) + " |" for c in out]


def frozen_table(r: Results, pretrainings: list, random_rows: list, readouts: tuple) -> list[str]:
    rows = list(random_rows)
    for run_label, run, eps in pretrainings:
        rows += [(f"MPP after {e} epoch{'s' * (e > 1)} ({run_label})", f"{run}_e{e}") for e in eps]
    rows.append(
        (f"supervised after {S.PRETRAIN_EPOCHS} epochs", f"supervised_e{S.PRETRAIN_EPOCHS}")
    )
    for label, ev, rand in readouts:
        rows += [
            (
                f"MPP after 6 epochs ({label}), read-out chosen on held-out: "
                f"{readout_label(r, ev)}",
                ev,
            ),
            (f"its random init, read-out chosen the same way: {readout_label(r, rand)}", rand),
        ]
    return ["", "## Frozen features (CPU, fp32)", "", *FROZEN_HEADER, *frozen_lines(r, rows)]


def ablations(r: Results) -> list[str]:
    rows = [
        ("MPP 15% corrupted (BERT's rate)", "mpp15_e6"),
        ("target: 4x4 downsized patch, 3-bit", "mpp_downsized_e6"),
        ("target: L2 on pixels", "mpp_pixels_e6"),
        (
            "MPP 50%, read at the [class] token (the mpp recipe retrained: its first run "
            "directory was lost)",
            "mpp_cls",
        ),
        ("MLP-Mixer (D 128, 9 blocks), MPP 50%", "mixer_e6"),
    ]
    return [
        "",
        "## Ablations (single seed; paper sec. 4.6 / appendix B.1.2)",
        "",
        *FROZEN_HEADER,
        *frozen_lines(r, rows),
    ]


DYNAMIC_FROM = "mpp_seed0"  # the pretraining the cascades and fine-tuning recipes start from
RERUN_PENDING = (
    "Not rerun yet from a pretraining that records its weights (the study plan's provenance "
    "reruns): its first results are in no table."
)


def dynamic(r: Results, root: Path, results: Path) -> list[str]:
    """Dynamic ViT: the operating point chosen on held-out, on test, against the finest stage."""
    lines = [
        "",
        "## Dynamic ViT (issue 15): 2x2, 4x4, 7x7 tokens, fine-tuned from MPP",
        "",
        "The operating point is the least compute whose held-out accuracy reaches the finest "
        "stage's (thresholds chosen on held-out, never on test). Goals: the finest stage's "
        "accuracy at <= 0.5x its GFLOPs, >= 1.5x its measured images/s (batched early exit).",
        "",
        "| cascade | started from | finest stage top-1 | cascade top-1 | GFLOPs / "
        "finest | images/s / finest |",
        "|---|---|---|---|---|---|",
    ]
    labels = ("feature + relationship reuse", "no feature reuse", "no relationship reuse")
    for label, (cascade, *_) in zip(labels, S.CASCADES, strict=True):
        name = f"{cascade}_{DYNAMIC_FROM}"
        out = r.output(f"{name}/dynamic")
        if out is None or not shown(r, name):
            continue
        m = out["metrics"]
        if "matched_top1" not in m:
            lines.append(
                f"| {label} | {_origin(r, name)} | {pct(m['finest_top1'])} | no "
                "threshold reached the finest stage's held-out accuracy | - | - |"
            )
            continue
        ratios = f"{m['matched_gflops_ratio']:.2f}x | {m['matched_speedup']:.2f}x"
        tops = f"{pct(m['finest_top1'])} | {pct(m['matched_top1'])}"
        lines.append(f"| {label} | {_origin(r, name)} | {tops} | {ratios} |")
    if lines[-1] == "|---|---|---|---|---|---|":  # the header alone
        lines = [*lines[:-2], RERUN_PENDING]
    fig = root / results / f"cascade_{DYNAMIC_FROM}" / "dynamic.accuracy_vs_gflops.png"
    return lines + figure_lines(
        fig if fig.is_file() else None, "Dynamic ViT: accuracy against mean GFLOPs per image", root
    )


def recipes(r: Results) -> list[str]:
    """Issue 13 item 3: which small-image recipe wins on held-out data."""
    RECIPE_EPOCHS, RECIPES = S.RECIPE_EPOCHS, S.RECIPES
    lines = [
        "",
        f"## Small-image recipe (from scratch with labels, {RECIPE_EPOCHS} epochs, single seed)",
        "",
        "Compared on held-out top-1 (the best of the run's "
        "evaluations); test is only reported. images/s: median of the run's logging "
        "windows, on the machine above.",
        "",
        "| recipe | overrides of the supervised preset | held-out top-1 | test top-1 | images/s |",
        "|---|---|---|---|---|",
    ]
    scored = []
    for name, overrides in RECIPES.items():
        out = r.output(name)
        what = " ".join(f"`{o}`" for o in overrides) or "(the preset)"
        if out is None:
            continue
        rates = [
            row["train/images_per_s"] for row in r.metric_lines(name) if "train/images_per_s" in row
        ]
        ips = f"{statistics.median(rates):.0f}" if rates else "-"
        held = out["selection_best_top1"]
        scored.append((held, name))
        lines.append(f"| {name} | {what} | {pct(held)} | {pct(out['selected_top1'])} | {ips} |")
    if scored:
        lines += ["", f"Best on held-out so far: {max(scored)[1]}."]
    FINETUNE_RECIPES = S.FINETUNE_RECIPES
    lines += [
        "",
        f"MPP fine-tuning recipes (seed 0, same budget, of `{DYNAMIC_FROM}`; the lr seed 0's "
        "SGD sweep chose on held-out):",
        "",
        "| recipe | overrides of the fine-tuning preset | started from | held-out top-1 | "
        "test top-1 |",
        "|---|---|---|---|---|",
    ]
    sweep, base = r.output(MPP_SWEEP), mpp_seed_arm(1.0)[0]
    if sweep is not None and (sgd := r.output(base)) is not None and shown(r, base):
        lines.append(
            f"| SGD, the sweep's lr | `optim.lr={sweep['chosen']['optim.lr']}` | "
            f"{_origin(r, base)} | {pct(sgd.get('selection_best_top1'))} | "
            f"{pct(sgd['selected_top1'])} |"
        )
    for recipe, overrides in FINETUNE_RECIPES.items():
        name = f"{recipe}_{DYNAMIC_FROM}"
        out = r.output(name) if shown(r, name) else None
        args = " ".join(overrides).replace("--sweep ", "--sweep=").split(" ")  # one span each
        what = " ".join(f"`{a}`" for a in args)
        if not any(o.startswith("optim.lr=") for o in overrides) and sweep is not None:
            what += f" at the sweep's `optim.lr={sweep['chosen']['optim.lr']}`"
        if out is None:
            continue
        held = pct(out["selection_best_top1"])
        test = pct(out["selected_top1"])
        if "sweep" in out:  # a sweep of its own: its choice, each value's
            what += f"; chose {sweep_text(r, name)}"
        lines.append(f"| {name} | {what} | {_origin(r, name)} | {held} | {test} |")
    if not lines[-1].startswith("| ft_recipe"):
        lines.append(f"\n{RERUN_PENDING}")
    return lines


def inspect_figures(root: Path, results: Path) -> list[str]:
    INSPECT_FIGURES = S.INSPECT_FIGURES
    lines = []
    for name in INSPECT_FIGURES:
        fig = root / results / f"inspect_{DYNAMIC_FROM}.{name}"
        lines += figure_lines(fig if fig.is_file() else None, name.removesuffix(".png"), root)
    return ["", "## Inspecting the MPP backbone (paper sec. 4.5)", *lines] if lines else []


def steps_table(r: Results, plan: list) -> list[str]:
    lines = [
        "",
        "## Every step",
        "",
        "| step | command | MLflow run | wall time, notes |",
        "|---|---|---|---|",
    ]
    for step in plan:
        res = r.get(step.name)
        if res is None:
            lines.append(f"| {step.name} | not run yet | - | - |")
            continue
        secs = res.get("seconds")
        wall = "-" if secs is None else f"{secs / 60:.1f} min"
        if res.get("resumed"):
            wall += " (its last leg: resumed from a checkpoint)"
        if rebuilt := res.get("rebuilt_needs"):
            wall += (
                f" (read a rebuild of {', '.join(sorted(rebuilt))}'s export: same recipe, new run)"
            )
        lines.append(
            f"| {step.name} | `{res['command']}` | {res.get('mlflow_run_id') or '-'} | {wall} |"
        )
    return lines
