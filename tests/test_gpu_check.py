"""benchmarks/gpu_check.py on the CPU at --quick sizes: the code a GPU machine runs, every
section end to end (the ZeRO-3 section kills and resumes a real pretraining run)."""

from __future__ import annotations

import json

import pytest
from conftest import run_cli

pytestmark = pytest.mark.slow


def test_gpu_check_runs_every_section_on_the_cpu(tmp_path) -> None:
    out = tmp_path / "check.json"
    proc = run_cli(["benchmarks/gpu_check.py", "--device", "cpu", "--quick", "--out", str(out),
                    "--work", str(tmp_path / "work")], timeout=900)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = json.loads(out.read_text())["rows"]
    by = {(r["section"], r["what"]): r for r in rows}
    assert by[("step", "eager")]["images_per_s"] > 0 and 0 < by[("step", "eager")]["mfu"] < 1
    for decode in ("cpu", "gpu"):  # the device path runs on the CPU here
        loader = by[("loader", f"decode={decode}")]
        assert loader["images_per_s"] > 0 and 0 <= loader["data_wait_share"] <= 1
    assert by[("knn", "faiss-cpu")]["queries_per_s"] > 0
    zero3 = by[("zero3", "kill at step 10, resume to 20")]
    assert zero3["ok"] and zero3["metric_steps"] == list(range(2, 21, 2))
    assert "| section | what | figures |" in proc.stdout
    # progress on the way, each section started and done, with the time since the start
    for section in ("step", "loader", "knn", "zero3"):
        assert f"] {section}: starting" in proc.stderr and f"] {section}: done" in proc.stderr
    assert "step (eager): 4/4 timed" in proc.stderr  # QUICK times 4 steps
