"""The study's figures, drawn from its results (never from typed numbers) into that folder."""

from __future__ import annotations

from pathlib import Path

from studies.mpp_fashion_mnist.records import KNN, PROBE

# (label, xs, ys) or (label, xs, ys, matplotlib line style): one line of a plot
Series = tuple


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _save(fig, out: Path) -> Path:
    fig.savefig(out, dpi=110, bbox_inches="tight")  # the legends sit outside the axes
    fig.clf()
    return out


def line_plot(
    out: Path, series: list[Series], xlabel: str, ylabel: str, title: str, log_y: bool = False
) -> Path | None:
    """One PNG of labelled lines, the legend beside the axes; None when there is nothing to
    draw. Lines without a colour of their own take 20 distinct ones, not 10 that repeat."""
    series = [s for s in series if len(s[1]) > 1]
    if not series:
        return None
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7.5, 4.2))
    palette = plt.get_cmap("tab20" if len(series) > 10 else "tab10").colors
    for i, (label, xs, ys, *style) in enumerate(series):
        ax.plot(
            xs,
            ys,
            label=label,
            **{
                "marker": "o" if len(xs) < 12 else None,
                "color": palette[i % len(palette)],
                **(style or [{}])[0],
            },
        )
    ax.set(xlabel=xlabel, ylabel=ylabel, title=title, yscale="log" if log_y else "linear")
    ax.grid(alpha=0.3)
    ax.legend(fontsize="small", loc="upper left", bbox_to_anchor=(1.01, 1.0))
    out = _save(fig, out)
    plt.close(fig)
    return out


FEATURE_MEASURES = (
    ("kNN (k=20)", "knn", KNN),
    ("linear probe", "probe", PROBE),
    ("10-shot ridge", "fewshot", "fewshot_10shot_mean"),
)


def curve_figure(
    r, out: Path, runs: list[tuple[str, str, tuple[int, ...]]], random_of: dict[str, str]
) -> Path | None:
    """Frozen-feature accuracy against MPP pretraining epochs: one panel per measure, one
    colour per pretraining run (label, the run's step name, its snapshot epochs), each run
    starting at 0 from its own random init (`random_of`: run -> that init's evals, else
    "random"); raw pixels as a grey line. A run's snapshots share one cosine schedule, so each
    run is drawn on its own."""
    lines = []  # (panel, run index, label, xs, ys)
    for i, (run_label, run, epochs) in enumerate(runs):
        for panel, (_, kind, key) in enumerate(FEATURE_MEASURES):
            pts = [(0, r.metric(random_of.get(run, "random"), kind, key))]
            pts += [(e, r.metric(f"{run}_e{e}", kind, key)) for e in epochs]
            pts = [(e, 100 * v) for e, v in pts if v is not None]
            if len(pts) > 1:
                lines.append((panel, i, run_label, [e for e, _ in pts], [v for _, v in pts]))
    if not lines:
        return None
    plt = _pyplot()
    fig, axes = plt.subplots(1, len(FEATURE_MEASURES), figsize=(13, 4.2), sharex=True)
    colours = plt.get_cmap("tab10").colors
    last = max(e for *_, xs, _ in lines for e in xs)
    for panel, i, label, xs, ys in lines:
        axes[panel].plot(xs, ys, marker="o", color=colours[i % 10], label=label)
    for ax, (title, kind, key) in zip(axes, FEATURE_MEASURES, strict=True):
        if (pixels := r.metric("pixels", kind, key)) is not None:  # what the features must beat
            ax.axhline(100 * pixels, color="grey", linestyle=":", label="raw pixels")
        ax.set(title=title, xlabel="MPP pretraining epochs (0: random init)", xlim=(-1, last + 1))
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("test top-1 (%)")
    handles, labels = {}, []
    for ax in axes:  # each run once, from whichever panel drew it
        for h, lab in zip(*ax.get_legend_handles_labels(), strict=True):
            if lab not in handles:
                handles[lab] = h
                labels.append(lab)
    fig.legend(
        [handles[lab] for lab in labels],
        labels,
        loc="upper center",
        ncol=2,
        fontsize="small",
        bbox_to_anchor=(0.5, 0.0),
    )
    fig.suptitle("Frozen MPP features against pretraining length")
    out = _save(fig, out)
    plt.close(fig)
    return out


def loss_figure(r, out: Path, runs: list[tuple[str, str]]) -> Path | None:
    """Training loss against epoch of the fine-tuning (and from-scratch) runs: one colour per
    budget (what follows the method in a label, "MPP, fine-tuned, 4x4 patches" -> "4x4
    patches"), one line style per method, so each MPP run sits beside its from-scratch run."""
    budgets: list[str] = []
    series = []
    for label, step in runs:
        _, tuned, rest = label.partition(", fine-tuned")
        budget = (rest if tuned else label.removeprefix("from scratch")).lstrip(", ")
        budgets += [budget] if budget not in budgets else []
        dash = "--" if label.startswith("from scratch") else ":" if "supervised" in label else "-"
        style = {"color": f"C{budgets.index(budget) % 10}", "linestyle": dash}
        rows = [row for row in r.metric_lines(step) if "train/loss" in row]
        series.append(
            (
                label,
                [row["train/epoch"] for row in rows],
                [row["train/loss"] for row in rows],
                style,
            )
        )
    return line_plot(
        out,
        series,
        "epoch",
        "training loss",
        "Fine-tuning (seed 0, chosen lr) and from scratch",
        log_y=True,
    )


def label_figure(r, out: Path, shares: list[tuple[float, list[str], list[str]]]) -> Path | None:
    """Fine-tuned test top-1 against the share of labels, MPP and from scratch at equal
    compute: (share, MPP fine-tune steps, from-scratch steps) per point, mean and std of seeds."""
    from studies.mpp_fashion_mnist.records import arm_scores, mean_std

    lines = {"MPP, three pretrainings": [], "from scratch, lr chosen on held-out": []}
    for share, *arms in shares:
        for pts, steps in zip(lines.values(), arms, strict=True):
            if scores := arm_scores(r, steps):
                m, sd = mean_std(scores)
                pts.append((100 * share, 100 * m, 100 * sd))
    if not all(len(pts) > 1 for pts in lines.values()):
        return None
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(6.5, 4.2))
    for (label, pts), style in zip(lines.items(), ("-", "--"), strict=True):
        xs, ys, sds = zip(*pts, strict=True)
        ax.errorbar(xs, ys, yerr=sds, marker="o", capsize=3, linestyle=style, label=label)
    ticks = sorted({x for pts in lines.values() for x, _, _ in pts})
    ax.set(
        xscale="log",
        xlabel="labelled share of the training images (log scale)",
        ylabel="test top-1 (%), mean ± std of seeds",
        title="MPP vs from scratch against labels (equal compute)",
    )
    ax.set_xticks(ticks, [f"{x:g}%" for x in ticks])
    ax.minorticks_off()
    ax.grid(alpha=0.3)
    ax.legend(fontsize="small")
    out = _save(fig, out)
    plt.close(fig)
    return out


def figure_lines(path: Path | None, caption: str, root: Path) -> list[str]:
    """Markdown for a figure (nothing when it was not drawn)."""
    if path is None:
        return []
    return ["", f"![{caption}]({path.relative_to(root)})", f"*{caption}*"]
