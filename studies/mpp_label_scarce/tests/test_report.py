"""The report reads what the steps wrote: with no results it says what is missing, with a full
set it names the pilot's choice, the statistics and one verdict word."""

from __future__ import annotations

import json

import numpy as np

from studies.mpp_label_scarce import steps as S
from studies.mpp_label_scarce.report import _row, write_report

GAIN = {"random": 0.0, "mpp_e10": 1.0, "mpp_e40": 2.0, "pixels_e40": 6.0, "supervised_e40": 9.0}


def _write(root, name: str, result: dict) -> None:
    path = root / S.RESULTS / f"{name}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"step": name, "result": result}))


def _history(top: float) -> dict:
    rows = [[150 * (i + 1), top - 0.001 * (9 - i) ** 0.5, 0.0] for i in range(10)]
    return {"history_columns": ["step", "selection_top1", "report_top1"], "history": rows}


def test_an_empty_study_says_what_is_missing(tmp_path):
    text = write_report(tmp_path).read_text()
    assert f"Status: 0 of the {sum(not s.gpu for s in S.plan())} CPU steps" in text
    assert "Not chosen yet: 0 of 24 pilot runs" in text and "Not yet: the rule needs" in text


def _study(root, gain: dict[str, float], noise: float = 0.3) -> None:
    """The pilot, and every arm of `gain` on every subset and seed (accuracy 70 + n/10 + gain)."""
    rng = np.random.default_rng(0)
    for step in S.pilot_steps():
        lr = float(step.name.split("lr=")[1].split(",")[0])
        _write(root, step.name, {"selection_final_top1": 0.8 - abs(lr - 0.01), **_history(0.8)})
    for arm in gain:
        for n in S.PER_CLASS:
            for k in S.SUBSET_SEEDS:
                for s in S.PRETRAIN_SEEDS:
                    acc = (70 + n / 10 + gain[arm] + rng.normal(0, noise)) / 100
                    tag = f"{arm}/n{n}_k{k}_s{s}"
                    _write(root, f"ft/{tag}", {"final_top1": acc})
                    _write(
                        root,
                        f"probe/{tag}",
                        {"metrics": {"probe_top1": acc + 0.04 * (arm != "random")}},
                    )
                    _write(root, f"knn/{tag}", {"metrics": {"knn_top1@k=20": acc}})


def test_a_full_study_names_the_choice_the_statistics_and_one_verdict(tmp_path):
    _study(tmp_path, {arm: GAIN.get(arm, 0) for arm in S.arms()})
    text = write_report(tmp_path).read_text()
    assert (
        "**Chosen: optim.lr=0.01, optim.weight_decay=0.** On the grid's edge in weight decay 0"
        in text
    )
    assert "1500 steps stand" in text
    assert "**MPP (40 epochs) against random init: win.**" in text
    assert "| pixels_e40 |" in text and "bootstrap 95%" in text
    assert "## The baseline that stands\n\nNot run yet." in text


def test_a_bootstrap_that_disagrees_with_the_paired_t_is_said():
    """Every subset gains (the bootstrap's resampled means stay above 0) but one gains far
    more than the rest, so the t's interval with 4 df reaches below 0."""
    base = [[70.0, 70.0] for _ in range(5)]
    arm = [[70.0 + d, 70.0 + d] for d in (3.0, 0.2, 0.1, 0.3, 0.2)]
    _, p, note = _row("mpp_e40", arm, base)
    assert p.low < 0 and note is not None and "disagree on being above 0" in note
    _, p, note = _row("mpp_e40", [[72.0 + d, 72.0] for d in (0.1, 0.2, 0.3, 0.2, 0.1)], base)
    assert p.low > 0 and note is None


def test_a_baseline_below_the_public_figure_says_why_from_its_curve(tmp_path):
    name = S.baseline().name
    held = [0.80 + 0.002 * e for e in range(60)] + [0.92 - 0.001 * e for e in range(40)]
    rows = [[e + 1, h, 0.0] for e, h in enumerate(held)]
    result = {"final_top1": 0.885, "history_columns": ["step", "selection_top1", "report_top1"]}
    _write(tmp_path, name, {**result, "history": rows})
    lines = [{"step": i, "train/sup/acc": 0.97, "train/epoch": i / 10} for i in range(1, 1001)]
    metrics = tmp_path / S.RESULTS / f"{name}.metrics.jsonl"
    metrics.write_text("\n".join(json.dumps(x) for x in lines))
    text = write_report(tmp_path).read_text()
    assert "final test top-1 88.50% against the 92-93%" in text
    assert "It stays below 92%." in text
    assert "peaked at epoch 61 (92.00%) and ended at 88.10%: over-fitting" in text
    assert "train accuracy over its last epoch 97.00%" in text

    _write(tmp_path, name, {**result, "final_top1": 0.93, "history": rows})
    assert "It stays below" not in write_report(tmp_path).read_text()


def test_no_verdict_but_a_win_before_the_controls_ran(tmp_path):
    """MPP at 40 epochs within +-1 point of random init: a convincing null if a control shows a
    clear gain, so without the controls the report does not call it inconclusive yet."""
    _study(tmp_path, {"random": 0.0, "mpp_e10": 0.1, "mpp_e40": 0.0}, noise=0.05)
    text = write_report(tmp_path).read_text()
    assert "against random init: not decided yet" in text
    assert "- not run yet: pixels_e40, supervised_e40" in text
    _study(tmp_path, {"pixels_e40": 6.0, "supervised_e40": 9.0}, noise=0.05)
    assert "against random init: convincing null.**" in write_report(tmp_path).read_text()
