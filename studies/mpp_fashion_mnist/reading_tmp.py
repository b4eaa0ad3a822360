"""What the study's curves say about its goals: computed from results/study/, never typed.

Issue 13 asks, where a goal is missed, by how much and what the curves say would close it.
This reads the curves the results hold: whether each training's loss had flattened and its
held-out accuracy was still rising at its end, and how fast the frozen features were still
improving between the last pretraining snapshots.
"""

from __future__ import annotations

import math
from statistics import mean

KNN, PROBE = "knn_top1@k=20", "probe_top1"
FLAT = 0.05  # a loss that fell less than 5% from the third to the last quarter counts as flat


def held_out_history(r, step: str) -> list[tuple[int, float]]:
    """(step, held-out top-1) of a run's evaluations; a sweep's: those of the value it chose."""
    out = r.output(step)
    if out is None:
        return []
    if "runs" in out:
        chosen = out.get("chosen_run_dir")
        out = next((x for x in out["runs"] if x.get("run_dir") == chosen), {})
    return [(h[0], h[1]) for h in out.get("history", [])]


def loss_fall(rows: list[dict]) -> float | None:
    """How much lower the mean training loss was over the last quarter of the run than over the
    quarter before it, as a fraction (quarters, not the last steps alone: a cosine schedule
    flattens any loss at its very end); None for a run with too few logged steps."""
    losses = [row["train/loss"] for row in rows if "train/loss" in row]
    n = len(losses) // 4
    if n < 1:
        return None
    before, last = mean(losses[-2 * n : -n]), mean(losses[-n:])
    return (before - last) / before


def _training_line(r, label: str, step: str) -> str | None:
    """Whether a training's loss had flattened and its held-out accuracy was still rising."""
    hist, fall = held_out_history(r, step), loss_fall(r.metric_lines(step))
    if len(hist) < 2 or fall is None:
        return None
    (_, a), (_, b) = hist[-2], hist[-1]
    loss = "flat" if fall < FLAT else "still falling"
    acc = "still rising" if b > a else "no longer rising"
    way = "lower" if fall >= 0 else "higher"
    return (f"- {label}: training loss {loss} ({100 * abs(fall):.1f}% {way} over the "
            f"last quarter of the run than the quarter before); held-out top-1 {100 * a:.1f} -> "
            f"{100 * b:.1f} over its last two evaluations ({acc}).")  # fmt: skip


def _feature_line(r, what: str, kind: str, key: str, goal: float, pretraining) -> str | None:
    """How fast a pretraining run's frozen features still improved between its snapshots."""
    run_label, run, epochs = pretraining
    pts = [(e, r.metric(f"{run}_e{e}", kind, key)) for e in epochs]
    pts = [(e, 100 * v) for e, v in pts if v is not None]
    if len(pts) < 3 or pts[-1][1] >= goal:
        return None
    (e0, v0), (e1, v1), (e2, v2) = pts[-3:]
    rate, before = (v2 - v1) / (e2 - e1), (v1 - v0) / (e1 - e0)
    short = goal - v2
    if rate <= 0:
        need = "not by more epochs of this recipe"
    else:
        need = f"{math.ceil(short / rate)} more epochs at the latest rate"
    # The snapshots are of one run: its cosine schedule takes the lr towards 0 in the last
    # epochs, so the latest rate also says the schedule ended, not only that features saturate.
    return (
        f"- MPP frozen {what} ({run_label}): {before:+.2f} points per epoch from {e0} to {e1} "
        f"epochs, {rate:+.2f} from {e1} to {e2}; {short:.1f} short of {goal:.0f}: {need} (the "
        "snapshots are of one run, whose cosine lr nears 0 by its end: a longer schedule, not "
        "these epochs continued, is the test)."
    )


def _schedule_line(r, what: str, kind: str, key: str, pretrainings) -> str | None:
    """The frozen features at the end of each pretraining run: what a longer schedule gave."""
    ends = [(label, eps[-1], r.metric(f"{run}_e{eps[-1]}", kind, key))
            for label, run, eps in pretrainings]  # fmt: skip
    ends = [(label, e, 100 * v) for label, e, v in ends if v is not None]
    if len(ends) < 2:
        return None
    (_, e0, v0), (_, e1, v1) = ends[0], ends[-1]
    return (f"- MPP frozen {what} at the end of each run: {v0:.1f} after {e0} epochs, {v1:.1f} "
            f"after {e1} ({v1 - v0:+.1f} points for {e1 / e0:.1f}x the pretraining).")  # fmt: skip


def reading(r, arms: dict[str, list[str]], pretrainings: list,
            trainings: list[tuple[str, str]], one_recipe: list) -> list[str]:  # fmt: skip
    """Markdown lines: the section, or nothing before the curves exist. `pretrainings`:
    (label, step, snapshot epochs) of each MPP pretraining; `trainings`: (label, step) of the
    single-seed fine-tunes and from-scratch runs beside the main arms; `one_recipe`: the
    pretrainings that differ only in length (what a longer schedule gave)."""
    found = [
        _training_line(r, "MPP, fine-tuned (seed 0)", arms["mpp"][0]),
        _training_line(r, "supervised, fine-tuned (seed 0)", arms["supervised"][0]),
        _training_line(r, "from scratch (seed 0)", arms["scratch"][0]),
        *(_training_line(r, label, step) for label, step in trainings),
    ]
    for pretraining in pretrainings:
        found += [_feature_line(r, "kNN (k=20)", "knn", KNN, 87.0, pretraining),
                  _feature_line(r, "linear probe", "probe", PROBE, 88.0, pretraining)]  # fmt: skip
    found += [_schedule_line(r, "kNN (k=20)", "knn", KNN, one_recipe),
              _schedule_line(r, "linear probe", "probe", PROBE, one_recipe)]  # fmt: skip
    found = [line for line in found if line]
    if not found:
        return []
    return ["", "## What the curves say", "",
            "Read from the results above (a loss counts as flat below a 5% fall from the third "
            "to the last quarter of a run):", "", *found]  # fmt: skip
