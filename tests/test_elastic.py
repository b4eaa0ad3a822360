"""Elastic resume on real launches: a ZeRO-2 run on 2 ranks loses a "node" (SIGKILL) and goes on
with 1 rank, which loses it again, and the run ends on 2 ranks.

Each change of world size converts the latest checkpoint to DeepSpeed's universal format and
restarts the interrupted epoch from its first batch (ssl_vit/engine/checkpoint.py). An epoch is
16 steps (512 images, global batch 32); the kills land in epoch 0 (each restarting it), and the
last launch goes on into epoch 1 of the loader's plan.
"""

from __future__ import annotations

import json
import os
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from conftest import ROOT, reap_with_this_process
from test_train_e2e import free_port, overrides

from ssl_vit.engine.checkpoint import CheckpointError, to_universal

PIPE = "pipelines/mpp_pretrain.py"
STEPS, EPOCH = 40, 16  # steps_per_epoch of tiny_shards at global batch 32


def _cmd(ranks: int, args: list[str]) -> list[str]:
    if ranks == 1:  # a plain `python`: a world of one
        return [sys.executable, PIPE, *args]
    return [sys.executable, "-m", "deepspeed.launcher.runner", "--num_gpus", str(ranks),
            "--master_port", str(free_port()), PIPE, *args]  # fmt: skip


def _kill_after(cmd: list[str], ckpt: Path, at: int, log: Path) -> int:
    """Start `cmd`, SIGKILL its whole process group once `latest` reaches step `at`; returns
    the step of the checkpoint left to resume."""
    latest, deadline = ckpt / "latest", time.monotonic() + 300
    with open(log, "wb") as err:
        proc = reap_with_this_process(subprocess.Popen(
            cmd, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=err, start_new_session=True,
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
        ))  # fmt: skip
        while time.monotonic() < deadline and proc.poll() is None:
            if latest.is_file() and int(latest.read_text().strip()[4:]) >= at:
                break
            time.sleep(0.02)
        assert proc.poll() is None, f"ended before the kill: {log.read_text()[-3000:]}"
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=60)
    return int(latest.read_text().strip()[4:])


def _adam_steps(ckpt: Path, step: int) -> set[int]:
    """Adam's step count in every rank's ZeRO partition of checkpoint `step`."""
    found = set()
    for f in (ckpt / f"step{step:08d}").glob("*_optim_states.pt"):
        sd = torch.load(f, map_location="cpu", weights_only=False)["optimizer_state_dict"]
        found |= {int(s["step"]) for s in sd["base_optimizer_state"]["state"].values()}
    return found


def _restart_line(old: int, new: int, position: int) -> str:
    """The line a launch of `new` ranks logs on resuming `position` batches into the plan."""
    epoch, k = divmod(position, EPOCH)
    if k:
        where = f"restarts from its first batch ({k} batches of it are seen again)"
    else:
        where = "starts from its first batch, as planned"
    return f"world size {old} -> {new}: converted to a universal checkpoint; epoch {epoch} {where}"


@pytest.mark.slow
def test_zero2_resumes_on_fewer_then_more_ranks(tiny_shards, tmp_path, mlflow_db):
    run_dir = tmp_path / "run"
    ckpt = run_dir / "checkpoints"
    args = overrides(tiny_shards, run_dir, mlflow_db, f"train.steps={STEPS}",
                     "train.zero_stage=2", "run.checkpoint_every=4", "run.log_every=1",
                     "run.keep_checkpoints=20")  # fmt: skip

    # 2 ranks, killed after a checkpoint of epoch 0 (late enough for the loss to have left
    # its start: a resume with fresh weights would show).
    a = _kill_after(_cmd(2, args), ckpt, 8, tmp_path / "a.log")
    # 1 rank: converts, replays epoch 0 from its start (a steps replayed), killed again.
    b = _kill_after(_cmd(1, args), ckpt, a + 8, tmp_path / "b.log")
    said = (tmp_path / "b.log").read_text()
    assert _restart_line(2, 1, a) in said, said[-3000:]
    assert (ckpt / f"step{a:08d}" / "universal" / "zero").is_dir()
    assert not list(ckpt.glob("*/universal.partial"))
    # Adam's state came along: its step count is the run's, not the steps since the resume.
    assert _adam_steps(ckpt, b) == {b}
    # 2 ranks again, converting back, to the end.
    done = subprocess.run(_cmd(2, args), cwd=ROOT, capture_output=True, text=True, timeout=400)
    assert done.returncode == 0, done.stderr[-3000:]
    replayed = a % EPOCH  # the first restart's k
    assert _restart_line(1, 2, b - replayed) in done.stderr, done.stderr[-3000:]
    replayed += (b - replayed) % EPOCH  # and the second's
    state = json.loads((ckpt / f"step{STEPS:08d}" / "trainer_state.json").read_text())
    assert state["replayed_steps"] == replayed and state["world_size"] == 2
    assert _adam_steps(ckpt, STEPS) == {STEPS}
    assert (run_dir / "export" / "backbone.safetensors").is_file()

    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1))  # no gap, none twice
    loss = {r["step"]: r["train/loss"] for r in rows}
    noise = statistics.stdev(loss[s + 1] - loss[s] for s in range(1, STEPS))
    for at in (a, b):  # a resume with fresh weights would jump back to the first losses
        assert abs(loss[at + 1] - loss[at]) < 3 * noise, (at, loss, noise)


def test_a_failed_conversion_stops_in_one_line_and_leaves_nothing_to_trust(tmp_path):
    """The converter's error reaches every rank as one line; no `universal` folder is left for
    a later launch to load (one rank: no process group needed)."""
    tag = tmp_path / "step00000004"
    tag.mkdir()
    (tag / "mp_rank_00_model_states.pt").write_bytes(b"not a checkpoint")
    with pytest.raises(CheckpointError, match="conversion to a universal checkpoint failed"):
        to_universal(tmp_path, tag.name, rank=0)
    assert sorted(p.name for p in tag.iterdir()) == ["mp_rank_00_model_states.pt",
                                                      "universal.failed"]  # fmt: skip
