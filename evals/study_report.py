"""RESULTS.md from the study's outputs (result JSONs, run directories, MLflow run ids, timings).

Every number in the file is read from a file a step wrote; nothing is typed in by hand except
the reference accuracies, quoted with their source.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

from ssl_vit.perf import describe_machine

REFERENCES = [  # Fashion-MNIST README (zalandoresearch/fashion-mnist)
    ("human", 83.5), ("MLP", 88.3), ("2-conv CNN", 91.6), ("HOG + SVM", 92.6),
    ("ResNet18", 94.9), ("WRN-40-4", 96.7),
]  # fmt: skip


def _json(path: Path) -> dict[str, Any] | None:
    return json.loads(path.read_text()) if path.is_file() else None


def _pct(x: float | None) -> str:
    return "pending" if x is None else f"{100 * x:.1f}"


def _eval(study: Path, name: str, kind: str, key: str) -> float | None:
    res = _json(study / "evals" / name / f"{kind}.json")
    return None if res is None else res["metrics"].get(key)


def _fewshot(study: Path, name: str) -> str:
    res = _json(study / "evals" / name / "fewshot.json")
    if res is None:
        return "pending"
    m = res["metrics"]
    return " / ".join(
        f"{100 * m[f'fewshot_{n}shot_mean']:.1f}" for n in (1, 5, 10, 25)
        if f"fewshot_{n}shot_mean" in m
    )  # fmt: skip


def _finetuned(study: Path, run: str) -> str:
    res = _json(study / run / "results.json")
    if res is None:
        return "pending"
    if "selected_top1" not in res:  # older runs chose their best epoch on test: say so
        return f"{100 * res['final_top1']:.1f} (best on test {100 * res['best_top1']:.1f})"
    sel = res["selected_top1"]
    return f"{100 * res['final_top1']:.1f} (chosen {'-' if sel is None else f'{100 * sel:.1f}'})"


def _run_id(study: Path, step_name: str) -> str:
    top = step_name.split("/")[0]
    if "/" in step_name:
        kind = step_name.split("/")[1]
        res = _json(study / "evals" / top / f"{kind}.json")
        return (res or {}).get("mlflow_run_id") or "-"
    path = study / top / "mlflow_run_id"
    return path.read_text().strip() if path.is_file() else "-"


FIGURES = [  # (file written by evals/inspect_vit.py, what it shows)
    ("mpp_predictions.png", "MPP at work: corrupted inputs, predicted and true 3-bit colours"),
    ("position_similarity.png", "cosine similarity of the learned position embeddings"),
    ("attention_distance.png", "mean attention distance per head and layer"),
    ("embedding_filters.png", "principal components of the patch-embedding filters"),
    ("attention_rollout.png", "attention rollout from the output token to the input"),
]


def _figures(study: Path, root: Path) -> list[str]:
    """Copy the MPP backbone's inspection figures next to RESULTS.md and link them."""
    src = study / "inspect_mpp50"
    if not (src / "inspect.json").is_file():
        return []
    dst = root / "docs" / "results"
    dst.mkdir(parents=True, exist_ok=True)
    lines = ["", "## Inspecting the MPP backbone (paper sec. 4.5)", ""]
    for name, caption in FIGURES:
        if (src / name).is_file():
            shutil.copyfile(src / name, dst / name)
            lines += [f"![{caption}](docs/results/{name})", f"*{caption}*", ""]
    return lines


GOALS = [  # issue 7's targets for the MPP backbone: (what, reader, goal %)
    ("linear probe", lambda st: _eval(st, "mpp50", "probe", "probe_top1"), 88.0),
    ("kNN (k=20)", lambda st: _eval(st, "mpp50", "knn", "knn_top1@k=20"), 87.0),
    ("fine-tuned", lambda st: (_json(st / "ft_mpp50" / "results.json") or {}).get("final_top1"),
     93.0),
]  # fmt: skip


def _goals(study: Path) -> list[str]:
    lines = ["", "## Goals for the MPP backbone", "", "| eval | goal | got | met |",
             "|---|---|---|---|"]  # fmt: skip
    for what, read, goal in GOALS:
        got = read(study)
        met = "pending" if got is None else ("yes" if 100 * got >= goal else "no")
        lines.append(f"| {what} | {goal:.0f} | {_pct(got)} | {met} |")
    return lines


def _mlflow(study: Path) -> list[str]:
    """The parent run of each method (see study_mlflow), linked to its page in `mlflow ui`."""
    from study_mlflow import EXPERIMENT, PARENTS_FILE

    from ssl_vit.tracking.nesting import run_link

    parents = _json(study / PARENTS_FILE) or {}
    if not parents:
        return []
    uri = os.environ.get("MLFLOW_TRACKING_URI") or "sqlite:///mlflow.db"
    lines = ["", "## In MLflow", "",
             f"Each method is a parent run in experiment `{EXPERIMENT}` with its pretraining, "
             "evaluations and fine-tuning nested under it, and its headline numbers logged on "
             f"it: `mlflow ui --backend-store-uri {uri}`, select the parents, Compare.", "",
             "| method | parent run |", "|---|---|"]  # fmt: skip
    for method, p in parents.items():
        link = run_link(uri, p["experiment_id"], p["run_id"])
        lines.append(f"| {method} | [{p['run_id']}]({link}) |")
    return lines


def write_report(
    plan: list, timings: dict[str, float], study: Path, out: Path, budget: str
) -> None:
    rows = [
        ("raw pixels (probe = logistic regression)", "pixels", None),
        ("random-init ViT (frozen)", "random", None),
        ("MPP, 50% corrupted, 3-bit mean colour", "mpp50", "ft_mpp50"),
        ("supervised pretraining on the labels", "supervised", "ft_supervised"),
        ("no pretraining (fine-tuned from scratch)", None, "ft_scratch"),
        ("MPP ViT, fine-tuned at 28 px (the Mixer's resolution)", None, "ft_mpp50_28px"),
        (
            "MPP MLP-Mixer (D 128, 9 blocks, about the ViT's FLOPs), 28 px",
            "mixer_mpp50",
            "ft_mixer_mpp50",
        ),
    ]
    ablations = [
        ("MPP 50% (paper)", "mpp50"),
        ("MPP 15% (BERT's rate)", "mpp15"),
        ("target: 4x4 downsized patch, 3-bit", "mpp_downsized"),
        ("target: L2 on pixels", "mpp_pixels"),
        ("MPP 50%, read at the [class] token", "mpp50_cls"),
    ]
    lines = [
        "# Results: the ViT paper's MPP study on Fashion-MNIST",
        "",
        "Generated by `python evals/study.py report` from the outputs of `python evals/study.py "
        "run`; do not edit by hand. Test accuracy (%) on the 10k test images after pretraining on "
        "the 60k training images. Model: a small ViT (D 128, 6 blocks, 4 heads), 7x7 patches "
        f"at 28 px (configs/fmnist_vit_tiny_mpp.yaml); {budget} (configs/fmnist_finetune.yaml). "
        "Frozen features are pooled with `--pool auto`: the [class] token after supervised "
        "pretraining, the mean of the patch tokens after MPP and for the random init (MPP's "
        "loss never reaches the [class] token; the last ablation row shows the difference).",
        f"Machine: {describe_machine()}.",
        "",
        "## Methods",
        "",
        "| method | linear probe | kNN (k=20) | few-shot 1/5/10/25 | fine-tuned |",
        "|---|---|---|---|---|",
    ]
    for label, ev, ft in rows:
        probe = _pct(_eval(study, ev, "probe", "probe_top1")) if ev else "-"
        knn = _pct(_eval(study, ev, "knn", "knn_top1@k=20")) if ev else "-"
        few = _fewshot(study, ev) if ev else "-"
        fine = _finetuned(study, ft) if ft else "-"
        lines.append(f"| {label} | {probe} | {knn} | {few} | {fine} |")
    lines += [
        "",
        "Fine-tuned: test accuracy at the end of the run (and, chosen, that of the epoch with "
        "the best accuracy on a held-out 2% of the training split, which never trains; the "
        "test split chooses nothing). The Mixer has no [class] token (features: the mean of "
        "its tokens), no position embeddings and no attention (its inspection says the "
        "attention plots are not applicable); MPP corrupts its patch embeddings after the stem "
        "as for the ViT (configs/fmnist_mixer_mpp.yaml). It cannot change resolution, so it "
        "and the ViT beside it are fine-tuned at 28 px.",
        "",
        "## Ablations (paper sec. 4.6 / appendix B.1.2)",
        "",
        "| MPP variant | linear probe | kNN (k=20) | few-shot 1/5/10/25 |",
        "|---|---|---|---|",
    ]
    for label, ev in ablations:
        lines.append(
            f"| {label} | {_pct(_eval(study, ev, 'probe', 'probe_top1'))} | "
            f"{_pct(_eval(study, ev, 'knn', 'knn_top1@k=20'))} | {_fewshot(study, ev)} |"
        )
    lines += ["", "## Reference points (Fashion-MNIST README)", "", "| model | test accuracy |",
              "|---|---|"]  # fmt: skip
    lines += [f"| {name} | {acc} |" for name, acc in REFERENCES]
    lines += ["", "The paper's MPP result (ImageNet, ViT-B/16; ViT paper sec. 4.6): 79.9% top-1 "
              "fine-tuned after MPP, about +2% over training from scratch (77.9%) and about -4% "
              "from supervised JFT pretraining (84.2%)."]  # fmt: skip
    lines += _goals(study)
    lines += _figures(study, out.parent)
    lines += _mlflow(study)
    lines += ["", "## Every step", "", "| step | command | MLflow run | wall time |",
              "|---|---|---|---|"]  # fmt: skip
    for step in plan:
        secs = timings.get(step.name)
        wall = "pending" if secs is None else f"{secs / 60:.1f} min"
        lines.append(f"| {step.name} | `{step.command}` | {_run_id(study, step.name)} | {wall} |")
    out.write_text("\n".join(lines) + "\n")
