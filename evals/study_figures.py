"""The study's figures, drawn from results/study/ (never from typed numbers) into that folder."""

from __future__ import annotations

from pathlib import Path

from study_reading import KNN, PROBE

# (label, xs, ys) or (label, xs, ys, matplotlib line style): one line of a plot
Series = tuple


def line_plot(out: Path, series: list[Series], xlabel: str, ylabel: str, title: str,
              log_y: bool = False) -> Path | None:  # fmt: skip
    """One PNG of labelled lines; None when there is nothing to draw."""
    series = [s for s in series if len(s[1]) > 1]
    if not series:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.5, 4.2))
    for label, xs, ys, *style in series:
        ax.plot(xs, ys, label=label, **{"marker": "o" if len(xs) < 12 else None,
                                        **(style or [{}])[0]})  # fmt: skip
    ax.set(xlabel=xlabel, ylabel=ylabel, title=title, yscale="log" if log_y else "linear")
    ax.grid(alpha=0.3)
    ax.legend(fontsize="small")
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


FEATURE_MEASURES = (("kNN (k=20)", "knn", KNN, "C0"), ("linear probe", "probe", PROBE, "C1"),
                    ("10-shot ridge", "fewshot", "fewshot_10shot_mean", "C2"))  # fmt: skip


def curve_figure(r, out: Path, runs: list[tuple[str, str, tuple[int, ...]]]) -> Path | None:
    """Frozen-feature accuracy against MPP pretraining epochs, random init at 0: one line per
    measure and pretraining run (label, the run's step name, its snapshot epochs). A run's
    snapshots share one cosine schedule, so each run is drawn on its own."""
    series = []
    for i, (run_label, run, epochs) in enumerate(runs):
        for label, kind, key, colour in FEATURE_MEASURES:
            pts = [(0, r.metric("random", kind, key))]
            pts += [(e, r.metric(f"{run}_e{e}", kind, key)) for e in epochs]
            pts = [(e, 100 * v) for e, v in pts if v is not None]
            style = {"color": colour, "linestyle": ("-", "--", ":")[i % 3]}
            name = f"{label}, {run_label}" if len(runs) > 1 else label
            series.append((name, [e for e, _ in pts], [v for _, v in pts], style))
    last = max((e for _, _, eps in runs for e in eps), default=0)
    for label, kind, key, colour in FEATURE_MEASURES:  # what the features must beat
        if (pixels := r.metric("pixels", kind, key)) is not None:
            style = {"color": colour, "linestyle": ":", "marker": None, "alpha": 0.6}
            series.append((f"{label}, raw pixels", [0, last], [100 * pixels] * 2, style))
    return line_plot(out, series, "MPP pretraining epochs (0: random init)", "test top-1 (%)",
                     "Frozen MPP features against pretraining length")  # fmt: skip


def loss_figure(r, out: Path, runs: list[tuple[str, str]]) -> Path | None:
    """Training loss against epoch of the fine-tuning (and from-scratch) runs."""
    series = []
    for label, step in runs:
        rows = [row for row in r.metric_lines(step) if "train/loss" in row]
        series.append((label, [row["train/epoch"] for row in rows],
                       [row["train/loss"] for row in rows]))  # fmt: skip
    return line_plot(out, series, "epoch", "training loss",
                     "Fine-tuning (seed 0, chosen lr) and from scratch", log_y=True)  # fmt: skip


def figure_lines(path: Path | None, caption: str, root: Path) -> list[str]:
    """Markdown for a figure (nothing when it was not drawn)."""
    if path is None:
        return []
    return ["", f"![{caption}]({path.relative_to(root)})", f"*{caption}*"]
