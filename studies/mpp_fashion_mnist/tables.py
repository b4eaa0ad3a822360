"""The tables of RESULTS.md: the main comparison, fewer labels, the longer schedules, the GPU
runs, the frozen features, the recipes, Dynamic ViT, the inspection figures and every step.

Every row of a fine-tune or frozen evaluation names the pretraining it started from (run and
weights, where the result records them) and the code version and machine it ran on; results
that started from different pretrainings never share a row.
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
    by_start,
    conditions,
    fewshot,
    mean_std_text,
    one_start,
    pct,
    readout_label,
    start,
    sweep_choice,
    sweep_text,
    welch_text,
)
from studies.mpp_fashion_mnist.stats import welch

LONG_ARMS = ("ft_mpp_long_s0", "scratch_long_s0")  # the longer schedule's seed 0
HIRES_ARM = f"ft_mpp_long_{S.HIRES}px"  # its MPP backbone fine-tuned at the higher resolution
P4_ARMS = ("ft_mpp_p4_s0", "scratch_p4_s0")  # the finer grid
SHIFT_ARMS = ("ft_mpp_long_shift_s0", "scratch_long_shift_s0")  # the longer schedule, 2-px shifts
HYBRID_ARMS = ("ft_mpp_hybrid_s0", "scratch_hybrid_s0")  # the paper's hybrid, main budget
# the main pretraining, longer fine-tunes: (label, MPP fine-tune, from scratch) per length
FT_LONG = tuple(
    (f"longer fine-tune ({S.PRETRAIN_EPOCHS} + {e} epochs)", *S.ft_long_arms(e))
    for e in S.FT_LONG_EPOCHS
)
# the hybrid at the GPU budget, by seed, and the 20 + 30 split
# the GPU track's MPP: three pretrainings (mpp_hybrid_gpu is seed 0), each fine-tuned once
GPU_FT = [
    "ft_mpp_hybrid_gpu_s0",
    *(f"ft_mpp_hybrid_gpu_seed{s}_s{s}" for s in S.PRETRAIN_SEEDS[1:]),
]
GPU_SCRATCH = [f"scratch_hybrid_gpu_s{s}" for s in S.SEEDS]  # at the preset's lr
GPU_SPLIT_ARM = f"ft_mpp_hybrid_gpu_e{S.GPU_SPLIT[0]}_s0"
# the main pretraining fine-tuned on a share of the labels, and from scratch on it: by seed
FEW = tuple(
    (
        f"{100 * f:g}% of the labels",
        [S.few_label_arms(f, s)[0] for s in S.SEEDS],
        [S.few_label_arms(f, s)[1] for s in S.SEEDS],
    )
    for f in S.FEW_LABELS
)
NOT_SWEPT = "1e-3 (the supervised preset's; not swept)"
# from scratch at the preset lr on each share, by seed
UNTUNED_SCRATCH = {f: base for f, (_, _, base) in zip(S.FEW_LABELS, FEW, strict=True)}


def arms(seeds: tuple[int, ...] = S.SEEDS) -> dict[str, list[str]]:
    """The multi-seed arms by name: each a list of step names, one per seed."""
    return {
        "mpp": [f"ft_mpp_s{s}" for s in seeds],
        "supervised": [f"ft_supervised_s{s}" for s in seeds],
        "scratch": [f"scratch_s{s}" for s in seeds],
        "mpp_long": [f"ft_mpp_long_s{s}" for s in seeds],
        "scratch_long": [f"scratch_long_s{s}" for s in seeds],
    }


def scores(r: Results, steps: list[str]) -> list[float]:
    return [v for v in (r.selected(s) for s in steps) if v is not None]


def arm_rows(r: Results, label: str, steps: list[str], lr: str) -> list[str]:
    """One row per pretraining the arm's seeds started from (none: one row); nothing for an
    arm without results."""
    rows = []
    for st, group in by_start(r, steps):
        vals = scores(r, group)
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


def main_table(r: Results, a: dict[str, list[str]]) -> list[str]:
    """The main comparison and the longer schedule's seeds, all on CPU in fp32."""
    long_ft = f"{S.LONG_PRETRAIN_EPOCHS} + {S.LONG_FINETUNE_EPOCHS}"
    rows = [
        (
            "MPP (50% corrupted, 3-bit mean colour), fine-tuned",
            a["mpp"],
            sweep_text(r, a["mpp"][0]),
        ),
        ("supervised pretraining, fine-tuned", a["supervised"], sweep_text(r, a["supervised"][0])),
        ("from scratch (labels only, same total epochs)", a["scratch"], NOT_SWEPT),
        (
            "MLP-Mixer (D 128, 9 blocks), MPP, fine-tuned (1 seed)",
            ["ft_mixer_s0"],
            sweep_text(r, "ft_mixer_s0"),
        ),
        (
            f"longer schedule (post hoc): MPP {long_ft} epochs, fine-tuned",
            a["mpp_long"],
            sweep_text(r, a["mpp_long"][0]),
        ),
        (
            f"longer schedule (post hoc): from scratch, {S.LONG_SCRATCH_EPOCHS} epochs",
            a["scratch_long"],
            NOT_SWEPT,
        ),
    ]
    lines = [
        "",
        "### MPP vs supervised pretraining vs from scratch (equal total compute, CPU, fp32)",
        "",
        *ARM_HEADER,
    ]
    for label, steps, lr in rows:
        lines += arm_rows(r, label, steps, lr)
    return lines + rebuilt_note(r, [s for _, steps, _ in rows for s in steps])


def first_runs(r: Results, a: dict[str, list[str]]) -> list[str]:
    """The heading of the runs made before issue 38's plan, and why they are not its answer."""
    steps = [*a["mpp"], *a["supervised"], *a["scratch"]]
    steps += [s for _, ft, base in FEW for s in (*ft, *base)]
    commits = {(r.get(s) or {}).get("git_commit") for s in steps} - {None}
    return [
        "",
        "## The first runs (one pretraining per method, from scratch untuned)",
        "",
        "The runs made before issue 38's plan, kept as they ran. MPP's seeds fine-tune one "
        "pretraining, from scratch keeps the supervised preset's lr, and the rows of the next "
        f"two tables span {len(commits)} code versions and both loaders (streamed, then in "
        "RAM); some do not record the weights they started from. Where they overlap the "
        "comparison above, that one is the study's answer.",
    ]


def label_scarce(r: Results, a: dict[str, list[str]]) -> list[str]:
    """Goal 2 in the paper's setting, pretraining on more images than fine-tuning has labels
    for: each share against all the labels, MPP's seeds split by the pretraining they read."""
    lines = [
        "",
        "### MPP vs from scratch with fewer labels (equal total compute; post hoc)",
        "",
        f"The main MPP pretraining ({S.PRETRAIN_EPOCHS} epochs of every training image, no "
        "labels) fine-tuned on the labels of a hashed share of the training images "
        "(`data.train_fraction`), against from scratch on the same images for the same compute "
        "(they also get the pretraining's epochs, in epochs of the share). As in the paper, "
        "pretraining sees more images than fine-tuning has labels for (JFT, then ImageNet; "
        "sec. 4.6). Fine-tuning runs about as many steps as the main comparison's; the held-out "
        "2% is the main comparison's, and each run on a share keeps the best of its 10 held-out "
        "evaluations. MPP minus from scratch: the difference of the means in points, its 95% "
        "confidence interval and the two-sided p of Welch's t-test (Welch-Satterthwaite degrees "
        "of freedom). Where MPP's seeds read different pretrainings, each gets its own row "
        "against the same from-scratch seeds. From scratch here keeps the supervised preset's lr "
        "(1e-3) and weight decay, not tuned as MPP's fine-tuning lr is: its own grid follows "
        "the table. Compute: image passes (every one 16 tokens of the "
        "same model), MPP's pretraining plus fine-tuning against from scratch, from the runs' "
        "own step counts.",
        "",
        "| labels | epochs: fine-tuning; from scratch | image passes: MPP; from scratch | "
        "MPP started from | MPP, fine-tuned | from scratch | MPP minus from scratch [95% CI], "
        "Welch p | MPP's lr (chosen on held-out) | code; machine |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    budgets = [
        (
            "100% (the main comparison)",
            f"{S.PRETRAIN_EPOCHS} + {S.FINETUNE_EPOCHS}; {S.SCRATCH_EPOCHS}",
            a["mpp"],
            a["scratch"],
        )
    ]
    for f, (label, ft, base) in zip(S.FEW_LABELS, FEW, strict=True):
        ft_epochs, scratch_epochs, _, _ = S.few_label_budget(f)
        budgets.append((label, f"{S.PRETRAIN_EPOCHS} + {ft_epochs}; {scratch_epochs}", ft, base))
    for label, epochs, ft, base in budgets:
        b = scores(r, base)
        for st, group in by_start(r, ft):
            a_ = scores(r, group)
            cells = [
                image_passes(r, ["mpp", group[0]], base[0]),
                st.text() if st else "-",
                mean_std_text(a_),
                mean_std_text(b),
                welch_text(a_, b) if b else "-",
                sweep_text(r, ft[0]),
                conditions(r, [*group, *base]),
            ]
            lines.append(f"| {label} | {epochs} | {' | '.join(cells)} |")
    return lines + rebuilt_note(r, [s for _, _, ft, _ in budgets for s in ft])


def mpp_seed_arm(r: Results, fraction: float) -> list[str]:
    """MPP on a share of the labels (1.0: all), one fine-tune per pretraining seed (0, 1, 2),
    the fine-tuning seed equal to the pretraining's. Until seed 0's second pretraining
    (mpp_seed0) is fine-tuned, the first one's seed-0 fine-tune stands for it."""
    tag = "" if fraction == 1.0 else f"_{S.share_tag(fraction)}"
    names = [f"ft_mpp_seed{s}{tag}_s{s}" for s in S.PRETRAIN_SEEDS]
    if r.get(names[0]) is None:
        names[0] = "ft_mpp_s0" if fraction == 1.0 else S.few_label_arms(fraction, 0)[0]
    return names


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
    x, y, z = scores(r, mpp), scores(r, steps), scores(r, untuned)
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
        mpp = mpp_seed_arm(r, f)
        untuned = a["scratch"] if f == 1.0 else UNTUNED_SCRATCH[f]
        pretraining = "mpp_seed0" if mpp[0].startswith("ft_mpp_seed0") else "mpp"  # seed 0's
        row = seed_row(r, f"{100 * f:g}%", mpp, pretraining, tuned_scratch(r, f), untuned)
        rows += [row] if row else []
    if not rows:
        return []
    supervised = [f"ft_supervised_seed{s}_s{s}" for s in S.PRETRAIN_SEEDS]
    sup, mpp = scores(r, supervised), scores(r, mpp_seed_arm(r, 1.0))
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
        "share of the labels (100%: the budget of the first runs' main comparison). MPP: three "
        "pretrainings (seeds 0, 1, 2), each fine-tuned once (fine-tuning seed = pretraining "
        "seed) at the lr seed 0's sweep chose on held-out for that share, so the spread holds "
        "the pretraining's variance. From scratch: the lr its own seed-0 grid chose on held-out "
        "(next table), seeds 0-2 at that lr as far as run. Beside them, from scratch at the "
        "supervised preset's lr (the first runs' arm). Each row names its code versions; "
        + (
            "MPP's and the tuned arm's runs ran on one machine in fp32 with the training data "
            "in RAM. "
            if r.get("ft_mpp_seed0_s0")
            else "the tuned arm and MPP's seeds 1-2 ran on one machine in fp32 with the training "
            "data in RAM; MPP's seed 0 is the first pretraining (`mpp`, its data streamed, at an "
            "older commit) until its second one, `mpp_seed0`, has run. "
        )
        + "The figure after the next table draws it. Differences: MPP minus from scratch in "
        "points, 95% CI and Welch's p.",
        "",
        *SEEDS_HEADER,
        *rows,
    ]


def _shares(shares: list[str]) -> str:
    return ", ".join(shares) + " of the labels" if shares else "no share"


def headline(r: Results) -> list[str]:
    """The study's answer so far, per share of the labels: MPP over three pretrainings minus
    from scratch at its own lr (where that arm has 2+ seeds), with its 95% CI."""
    said, waiting, above, below, level = [], [], [], [], []
    for f in S.SCRATCH_SHARES:
        x = scores(r, mpp_seed_arm(r, f))
        lr, tuned = tuned_scratch(r, f)
        y = scores(r, tuned)
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
            "has fewer than 2 seeds there (the study plan below lists the steps to run). The "
            "tables further down hold the first runs, against the untuned from scratch.",
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


def scratch_lr_grid(r: Results) -> list[str]:
    """From scratch's own lr grid per share (seed 0, chosen on held-out), as far as it has run:
    the tuning MPP's fine-tuning already had."""
    rows, edges = grid_rows(r, S.SCRATCH_SHARES)
    if not rows:
        return []
    return [
        "",
        "### From scratch's own learning rate (seed 0, chosen on held-out)",
        "",
        "The same budget per share as the table above, from scratch at each lr of the grid; the "
        "held-out 2% chooses; seeds 1-2 reuse the choice (the table above)."
        + (
            f" The choice is at an edge of the grid at {', '.join(edges)}: a wider grid might "
            "find a better lr there; the grid stays at the four values MPP's sweep has."
            if edges
            else ""
        ),
        "",
        *GRID_HEADER,
        *rows,
    ]


def pretraining_seeds(r: Results) -> list[str]:
    """MPP fine-tuned from each pretraining seed (pretraining seed = fine-tuning seed), per
    share of the labels, as far as run: the spread the tables above leave out."""
    shares = [(1.0, "ft_mpp_s0", "ft_mpp_seed{s}_s{s}")]
    shares += [
        (f, S.few_label_arms(f, 0)[0], f"ft_mpp_seed{{s}}_{S.share_tag(f)}_s{{s}}")
        for f in S.FEW_LABELS
    ]
    rows, widest = [], (0.0, 0.0)  # (range over the pretraining seeds, share)
    for f, first, pattern in shares:
        names = [first, *(pattern.format(s=s) for s in S.PRETRAIN_SEEDS)]
        top1 = [r.selected(n) for n in names]
        got = [t for t in top1 if t is not None]
        widest = max(widest, (100 * (max(got) - min(got)), f)) if got else widest
        if all(t is None for t in top1[1:]):
            continue
        cells = [f"{100 * t:.2f}" if t is not None else "-" for t in top1]
        done = [n for n, t in zip(names, top1, strict=True) if t is not None]
        rows.append(f"| {100 * f:g}% | {' | '.join(cells)} | {conditions(r, done)} |")
    if not rows:
        return []
    spread = (
        f"The widest range over pretraining seeds so far is {widest[0]:.2f} points, at "
        f"{100 * widest[1]:g}% of the labels: the spreads above, one pretraining per method, "
        "leave it out."
    )
    seeds = " | ".join(f"pretraining seed {s}" for s in S.PRETRAIN_SEEDS)
    return [
        "",
        "### MPP across pretraining seeds (fine-tuned test top-1)",
        "",
        "Each pretraining seed fine-tuned once, with the fine-tuning seed equal to it and the lr "
        "seed 0's sweep chose on held-out for that share. The first column is the seed-0 "
        "fine-tune of the tables above, with the pretraining it read there (at 30% of the "
        "labels a rerun of it); seed 0's column is the same recipe and seed pretrained again "
        f"with seeds 1-2's code and loader (mpp_seed0). {spread}",
        "",
        f"| labels | `mpp` (seed 0, first run) | {seeds} | code; machine |",
        "|---|---|" + "---|" * len(S.PRETRAIN_SEEDS) + "---|",
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


def label_welch(r: Results, a: dict[str, list[str]]) -> list[tuple]:
    """(share label, pretraining, MPP scores, from-scratch scores) per row of the label table."""
    shares = [("100% of the labels", a["mpp"], a["scratch"]), *FEW]
    return [
        (label, st, scores(r, group), scores(r, base))
        for label, ft, base in shares
        for st, group in by_start(r, ft)
    ]


def rebuilt_note(r: Results, steps: list[str]) -> list[str]:
    """A sentence naming the fine-tunes whose pretraining was rerun on a new machine (the same
    recipe, but weights that are a second sample of it), where there are any."""
    rebuilt = [s for s in steps if (r.get(s) or {}).get("rebuilt_needs")]
    if not rebuilt:
        return []
    return [
        "",
        f"{', '.join(rebuilt)} fine-tuned a rerun of the pretraining (a new machine had lost "
        "its export: the same recipe and seed, weights not bitwise the same on a CPU): their "
        "rows are apart from those of the first run's weights.",
    ]


def reused_lr(r: Results, a: dict[str, list[str]]) -> str:
    """The lr of the fine-tunes that reuse the 16-token MPP sweep's choice instead of sweeping."""
    return f"{sweep_choice(r, a['mpp'][0])}, the 16-token sweep's (not swept)"


def _origin(r: Results, step: str) -> str:
    st = start(r, step)
    return st.text() if st else "-"


def _pair(r: Results, finetune: str, scratch: str) -> str:
    """'MPP started from | MPP | from scratch | MPP minus from scratch' cells of one budget."""
    a, b = r.selected(finetune), r.selected(scratch)
    gap = "-" if a is None or b is None else f"{100 * (a - b):+.2f}"
    st = start(r, finetune)
    return f"{st.text() if st else '-'} | {pct(a)} | {pct(b)} | {gap}"


def longer_schedule(r: Results, a: dict[str, list[str]]) -> list[str]:
    """MPP pretrained and fine-tuned longer against from scratch for the same total epochs,
    beside the shorter budget's seed 0 (one seed each: no error bar); all on CPU, fp32."""
    long_total = S.LONG_PRETRAIN_EPOCHS + S.LONG_FINETUNE_EPOCHS
    lines = [
        "",
        "## Longer schedules and the finer grid (single seed, CPU, fp32; post hoc)",
        "",
        f"MPP pretrained {S.LONG_PRETRAIN_EPOCHS} epochs (frozen features at "
        f"{', '.join(map(str, S.LONG_SNAPSHOTS))} epochs, in the table below), fine-tuned "
        f"{S.LONG_FINETUNE_EPOCHS} epochs with lr from the paper's grid on held-out; from "
        f"scratch for the sum, {long_total} epochs. Seed 0 only: one seed has no confidence "
        "interval. The finer grid (4x4 patches) is the same presets with `model.patch_size=4`; "
        "the shifted runs add `data.translate=2` (a random shift of up to 2 px per axis, "
        "zero-filled) to the flips in pretraining, fine-tuning and from scratch alike.",
        "",
        "| budget (pretraining + fine-tuning epochs) | MPP started from | MPP, fine-tuned | from "
        "scratch, same total | MPP minus from scratch | MPP's lr (chosen on held-out) | code; "
        "machine |",
        "|---|---|---|---|---|---|---|",
    ]
    short = f"{S.PRETRAIN_EPOCHS} + {S.FINETUNE_EPOCHS} (seed 0)"
    long = f"{S.LONG_PRETRAIN_EPOCHS} + {S.LONG_FINETUNE_EPOCHS} (seed 0)"
    reused = reused_lr(r, a)
    shift = " ".join(f"`{o}`" for o in S.SHIFT)
    rows = [
        (short, a["mpp"][0], a["scratch"][0], sweep_text(r, a["mpp"][0])),
        (long, *LONG_ARMS, sweep_text(r, LONG_ARMS[0])),
        (
            f"{S.P4_PRETRAIN_EPOCHS} + {S.P4_FINETUNE_EPOCHS} (seed 0), 4x4 patches (7x7 tokens, "
            "~3x the compute per image)",
            *P4_ARMS,
            reused,
        ),
        (
            f"{long}, random shifts of up to 2 px in every run ({shift})",
            *SHIFT_ARMS,
            f"{sweep_choice(r, LONG_ARMS[0])}, the flips-only {long} sweep's (not swept)",
        ),
        (
            f"{short}, the paper's hybrid (ResNet stem at 32 px, 2x2 patches of its 8x8 map: 16 "
            "tokens, ~1.3x the compute per image)",
            *HYBRID_ARMS,
            reused,
        ),
        *(
            (
                f"{S.PRETRAIN_EPOCHS} + {e} (seed 0), the main pretraining with a longer fine-tune",
                *S.ft_long_arms(e),
                reused,
            )
            for e in S.FT_LONG_EPOCHS
        ),
    ]
    for label, ft, base, lr in rows:
        if r.get(ft) is None and r.get(base) is None:
            continue
        lines.append(f"| {label} | {_pair(r, ft, base)} | {lr} | {conditions(r, [ft, base])} |")
    hires = r.output(HIRES_ARM)
    if hires is not None:
        st = start(r, HIRES_ARM)
        lines.append(
            f"| {long}, fine-tuned at {S.HIRES} px (6x6 tokens, ~2.4x the fine-tuning compute; "
            f"the paper's B.1.1) | {st.text() if st else '-'} | {pct(r.selected(HIRES_ARM))} | "
            f"- | - | the 28 px sweep's (held-out top-1 {pct(hires['selection_best_top1'])}) | "
            f"{conditions(r, [HIRES_ARM])} |"
        )
    return lines


def gpu_tables(r: Results, a: dict[str, list[str]]) -> list[str]:
    """The runs on one GPU in bf16: apart from the CPU's fp32 rows (another device, precision
    and code version), the frozen evaluations of their exports with them."""
    reused = reused_lr(r, a)
    tuned = tuned_scratch(r, S.GPU_SWEEP, stand_ins=GPU_SCRATCH[1:])
    seeds = seed_row(r, "100%", GPU_FT, "mpp_hybrid_gpu", tuned, GPU_SCRATCH)
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
            "Issue 38's rules on this budget: MPP over three pretrainings (seed 0 is the first "
            "run), each fine-tuned once, against from scratch at the lr its own seed-0 grid "
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
    shown: dict[tuple, int] = {}  # (sha256, numbers) -> index in `out`
    out: list[list[str]] = []
    for label, ev in rows:
        steps = [f"{ev}/{k}" for k in kinds if r.get(f"{ev}/{k}") is not None]
        if not steps:
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
        if key in shown:  # the same weights measured the same way: one row, both names
            out[shown[key]][0] += f"; the same weights: {label}"
            continue
        if key is not None:
            shown[key] = len(out)
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
    for label, name in (
        ("feature + relationship reuse", "cascade"),
        ("no feature reuse", "cascade_no_feature_reuse"),
        ("no relationship reuse", "cascade_no_relation_reuse"),
    ):
        out = r.output(f"{name}/dynamic")
        if out is None:
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
    fig = root / results / "cascade" / "dynamic.accuracy_vs_gflops.png"
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
        "MPP fine-tuning recipes (seed 0, same budget):",
        "",
        "| recipe | overrides of the fine-tuning preset | started from | held-out top-1 | "
        "test top-1 |",
        "|---|---|---|---|---|",
    ]
    sweep = r.output("ft_mpp_s0")
    if sweep is not None:
        lr, held = sweep["chosen"]["optim.lr"], pct(sweep.get("selection_best_top1"))
        origin = _origin(r, "ft_mpp_s0")
        lines.append(
            f"| SGD, the sweep's lr | `optim.lr={lr}` | {origin} | {held} | "
            f"{pct(sweep['selected_top1'])} |"
        )
    for name, overrides in FINETUNE_RECIPES.items():
        out = r.output(name)
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
    return lines


def inspect_figures(root: Path, results: Path) -> list[str]:
    INSPECT_FIGURES = S.INSPECT_FIGURES
    lines = []
    for name in INSPECT_FIGURES:
        fig = root / results / f"inspect_mpp.{name}"
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
