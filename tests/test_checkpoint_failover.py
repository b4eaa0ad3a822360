"""Checkpoints that fail over, a full disk, and waits that end (ssl_vit/engine/checkpoint.py).

Real launches (slow): a run saves checkpoints at steps 2 and 4; copies of it get the newest
truncated or deleted (the relaunch resumes from step 2 and finishes with the same losses), the
only one's trainer_state.json corrupted, or the newest one, saved by an older version without
checksums, truncated (each: one line, exit 2). A real DeepSpeed engine saves into a small
tmpfs (skipped where mounting is not allowed): the free-space check, a write that fills the
disk, and the saves after it; the run's metric line and config file on a full tmpfs. Unit
tests: every kind of damage `find` detects on hand-made checkpoints, the free-space planning,
write errors as torch and the OS raise them, and the heartbeat that bounds the wait for a
universal conversion.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import logging
import os
import shutil
import socket
import subprocess
import sys
import threading
import time
import types
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from conftest import ROOT, run_cli
from test_train_e2e import overrides

from ssl_vit.engine import checkpoint
from ssl_vit.engine.checkpoint import CheckpointError

PIPE = "pipelines/mpp_pretrain.py"
RESUMING = "resuming from the newest intact checkpoint"


# -- hand-made checkpoints (unit tests) ----------------------------------------------------


def _make(ckpt: Path, step: int, checksums: bool = True, size: int = 4096) -> Path:
    """A checkpoint folder as `save` leaves it: a payload file, trainer_state.json and
    checksums.json in the documented format; `latest` names it."""
    folder = ckpt / checkpoint.tag_for(step)
    folder.mkdir(parents=True)
    (folder / "mp_rank_00_model_states.pt").write_bytes(os.urandom(size))
    (folder / "trainer_state.json").write_text(json.dumps({"step": step, "epoch": 0}))
    if checksums:
        files = {
            p.name: {
                "bytes": p.stat().st_size,
                "sha256": hashlib.sha256(p.read_bytes()).hexdigest(),
            }
            for p in sorted(folder.iterdir())
        }
        (folder / "checksums.json").write_text(json.dumps({"files": files}))
    (ckpt / "latest").write_text(folder.name + "\n")
    return folder


def _flip_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))


MODEL, STATE = "mp_rank_00_model_states.pt", "trainer_state.json"
DAMAGE = {  # id: (what it does to RUN/checkpoints with step 2 and step 4, what the line says)
    "truncated": (
        lambda c: (c / "step00000004" / MODEL).write_bytes(b"x" * 100),
        f"step00000004: {MODEL} has 100 bytes, checksums.json says 4096",
    ),
    "same-size-bit-flip": (
        lambda c: _flip_byte(c / "step00000004" / MODEL),
        f"step00000004: {MODEL} does not match its sha256 in checksums.json",
    ),
    "file-deleted": (
        lambda c: (c / "step00000004" / MODEL).unlink(),
        f"step00000004: {MODEL} is missing",
    ),
    "state-not-json": (
        lambda c: (c / "step00000004" / STATE).write_text('{"step": 4, "ep'),
        f"step00000004: {STATE} is not valid JSON",
    ),
    "state-missing": (
        lambda c: (c / "step00000004" / STATE).unlink(),
        f"step00000004: {STATE} is missing",
    ),
    "state-other-step": (
        lambda c: (c / "step00000004" / STATE).write_text('{"step": 7}'),
        f"step00000004: {STATE} names step 7, not 4",
    ),
    "checksums-not-json": (
        lambda c: (c / "step00000004" / "checksums.json").write_text("{"),
        "step00000004: checksums.json cannot be read",
    ),
    "folder-deleted": (
        lambda c: shutil.rmtree(c / "step00000004"),
        "latest names 'step00000004', which does not exist",
    ),
    "pointer-garbage": (
        lambda c: (c / "latest").write_bytes(b"\xff\xfe\x00junk"),
        "latest cannot be read",
    ),
    "pointer-not-a-tag": (
        lambda c: (c / "latest").write_text("../../etc\n"),
        "latest names '../../etc', which is not a checkpoint tag",
    ),
    "pointer-missing": (lambda c: (c / "latest").unlink(), "latest is missing"),
}


@pytest.mark.parametrize("damage", list(DAMAGE))
def test_find_fails_over_to_the_newest_intact_checkpoint(tmp_path, caplog, damage):
    """Step 4 damaged: step 2 is resumed and step 4 set aside. `latest` damaged: step 4 (the
    newest intact one, by step) is resumed."""
    ckpt = tmp_path / "checkpoints"
    _make(ckpt, 2)
    _make(ckpt, 4)
    (ckpt / "step00000006.partial").mkdir()  # a save that was killed: never a candidate
    hurt, says = DAMAGE[damage]
    hurt(ckpt)
    pointer = damage.startswith("pointer")
    step = 4 if pointer else 2
    expected = checkpoint.tag_for(step)
    assert checkpoint.latest_tag(ckpt) in ("step00000002", "step00000004")  # no early error
    with caplog.at_level(logging.INFO, logger="ssl_vit.train"):
        tag, state = checkpoint.find(ckpt, rank=0)
    assert (tag, state["step"]) == (expected, step)
    lines = [r.getMessage() for r in caplog.records if RESUMING in r.getMessage()]
    assert len(lines) == 1, caplog.text
    assert says in lines[0] and f"{RESUMING}, {ckpt / expected} (step {step})" in lines[0]
    assert "\n" not in lines[0]
    assert (ckpt / "latest").read_text() == expected + "\n"  # a relaunch does not ask again
    assert not (ckpt / "step00000006.partial").exists()
    set_aside = not pointer and damage != "folder-deleted"
    assert (ckpt / "step00000004.damaged").is_dir() == set_aside
    assert ("set aside as step00000004.damaged (deleted by the next save)" in lines[0]) == set_aside
    assert (ckpt / "step00000004").is_dir() == pointer
    caplog.clear()  # the next launch takes the same one, without a word
    with caplog.at_level(logging.INFO, logger="ssl_vit.train"):
        assert checkpoint.find(ckpt, rank=0)[0] == expected
    assert RESUMING not in caplog.text


def test_no_intact_checkpoint_is_one_line_naming_what_was_found(tmp_path):
    ckpt = tmp_path / "checkpoints"
    _make(ckpt, 2)
    _flip_byte(ckpt / "step00000002" / MODEL)
    (ckpt / "step00000002" / STATE).write_text("[1, 2")
    for call in (lambda: checkpoint.latest_tag(ckpt), lambda: checkpoint.find(ckpt, rank=0)):
        with pytest.raises(CheckpointError) as e:
            call()
        text = str(e.value)
        assert "\n" not in text
        assert text.startswith(f"{ckpt}: no intact checkpoint to resume ")
        assert f"{ckpt / 'step00000002'}: {STATE} is not valid JSON" in text
        assert f"or delete {ckpt} to train this run.dir from step 0" in text
    assert sorted(p.name for p in ckpt.iterdir()) == ["latest", "step00000002"]  # untouched


def test_a_sha256_mismatch_in_every_checkpoint_is_one_line(tmp_path):
    """Damage only the hashes see: latest_tag (cheap) lets it pass, find (hashes) stops."""
    ckpt = tmp_path / "checkpoints"
    for step in (2, 4):
        _make(ckpt, step)
        _flip_byte(ckpt / checkpoint.tag_for(step) / MODEL)
    assert checkpoint.latest_tag(ckpt) == "step00000004"
    with pytest.raises(CheckpointError, match="no intact checkpoint to resume") as e:
        checkpoint.find(ckpt, rank=0)
    assert "step00000004: mp_rank_00_model_states.pt does not match its sha256" in str(e.value)
    assert "step00000002: mp_rank_00_model_states.pt does not match its sha256" in str(e.value)


def test_a_checkpoint_without_checksums_is_taken_with_a_log_line(tmp_path, caplog):
    ckpt = tmp_path / "checkpoints"
    _make(ckpt, 2)
    _make(ckpt, 4, checksums=False)
    _flip_byte(ckpt / "step00000004" / MODEL)  # not seen: only loading it can tell
    with caplog.at_level(logging.INFO, logger="ssl_vit.train"):
        assert checkpoint.find(ckpt, rank=0)[0] == "step00000004"
    assert f"{ckpt / 'step00000004'} has no checksums.json (saved by an older ssl-vit)" in (
        caplog.text
    )
    assert RESUMING not in caplog.text


def test_fresh_runs(tmp_path):
    ckpt = tmp_path / "checkpoints"
    assert checkpoint.find(ckpt, rank=0) is None  # no folder
    (ckpt / "step00000002.partial").mkdir(parents=True)
    assert checkpoint.latest_tag(ckpt) is None
    assert checkpoint.find(ckpt, rank=0) is None
    assert not (ckpt / "step00000002.partial").exists()  # the leftover's space is back


# -- free space ----------------------------------------------------------------------------


def _free(monkeypatch, n: int) -> None:
    monkeypatch.setattr(checkpoint, "free_bytes", lambda path: n)


def test_room_is_made_only_from_what_pruning_would_delete(tmp_path, monkeypatch):
    ckpt = tmp_path / "checkpoints"
    for step in (2, 4):
        _make(ckpt, step, size=10_000)
    need, basis = checkpoint.bytes_needed(ckpt, engine=None)
    one = checkpoint._folder_bytes(ckpt / "step00000004")
    assert basis == "the size of step00000004" and need == int(one * checkpoint.SPACE_MARGIN)

    _free(monkeypatch, need)  # enough: nothing goes
    checkpoint.make_room(ckpt, "step00000006", 2, need, basis)
    assert sorted(p.name for p in ckpt.glob("step*")) == ["step00000002", "step00000004"]

    _free(monkeypatch, need - one // 2)  # short, and step 2 would go after the save anyway
    checkpoint.make_room(ckpt, "step00000006", 2, need, basis)
    assert sorted(p.name for p in ckpt.glob("step*")) == ["step00000004"]

    # keep=2 with only the newest left: it is never deleted before the new one is complete
    with pytest.raises(CheckpointError) as e:
        checkpoint.make_room(ckpt, "step00000006", 2, need, basis)
    text = str(e.value)
    assert "\n" not in text and (ckpt / "step00000004").is_dir()
    assert text.startswith(f"{ckpt}: not enough free space for checkpoint step00000006: about ")
    assert "needed (the size of step00000004)" in text and "free; free space on that" in text
    assert "lower run.keep_checkpoints" not in text  # it would not help


def test_the_error_says_which_keep_would_make_the_room(tmp_path, monkeypatch):
    ckpt = tmp_path / "checkpoints"
    for step in (2, 4, 6):
        _make(ckpt, step, size=10_000)
    one = checkpoint._folder_bytes(ckpt / "step00000006")
    _free(monkeypatch, one + 100)  # keep=3 frees one folder: short; keep=2 frees two
    with pytest.raises(CheckpointError, match="or lower run.keep_checkpoints to 2, then"):
        checkpoint.make_room(ckpt, "step00000008", 3, 3 * one, "test")
    assert len(list(ckpt.glob("step*"))) == 3  # nothing deleted for a save that cannot fit


def test_first_save_estimates_from_the_parameter_count(tmp_path):
    engine = types.SimpleNamespace(module=torch.nn.Linear(100, 10))  # 1010 parameters
    need, basis = checkpoint.bytes_needed(tmp_path / "checkpoints", engine)
    assert need == int(1010 * 16 * checkpoint.SPACE_MARGIN)
    assert basis == "1010 parameters x 16 bytes"


def test_write_errors_as_torch_and_the_os_raise_them_become_one_line(tmp_path):
    partial = tmp_path / "checkpoints" / "step00000004.partial"
    partial.parent.mkdir()
    with pytest.raises(RuntimeError) as torch_error:  # torch's zip writer on a full device
        torch.save({"w": torch.zeros(100_000)}, "/dev/full")
    with pytest.raises(OSError) as os_error, open("/dev/full", "w") as f:
        f.write("x" * 100_000)
        f.flush()
    assert os_error.value.errno == errno.ENOSPC
    for e, why in ((torch_error.value, "torch's writer: RuntimeError: "),
                   (os_error.value, "No space left on device (a full disk or quota)")):  # fmt: skip
        line = checkpoint._write_failure(e, partial)
        assert line is not None and "\n" not in line, line
        assert line.startswith(f"{partial}: writing the checkpoint failed ({why}")
        assert "free there); the partial checkpoint is removed" in line
    assert checkpoint._write_failure(RuntimeError("CUDA error: out of memory"), partial) is None


# -- a real engine on a small file system ----------------------------------------------------

PROBE = r"""
import json, subprocess, sys
from pathlib import Path
sys.path.insert(0, "tests")
from engine_probe import engine_for, step
from ssl_vit.engine import checkpoint
from ssl_vit.engine.checkpoint import CheckpointError
from ssl_vit.engine.distributed import init_distributed

init_distributed()  # a world of one
ckpt = Path(sys.argv[1])
engine, optimizer, _, _ = engine_for(0, "fp32", 4, 4)
step(engine, optimizer, skip=False)
out = {}

def attempt(step_, keep):
    try:
        checkpoint.save(engine, ckpt, step_, {"step": step_}, rank=0, keep=keep)
        return "saved"
    except CheckpointError as e:
        return str(e)

def listing():
    return sorted(p.name for p in ckpt.iterdir())

out["first"] = attempt(1, 1)
out["size"] = checkpoint._folder_bytes(ckpt / "step00000001")
# keep=1: step 1 may go only once step 2 is complete, and both do not fit
out["refused"], out["after_refused"] = attempt(2, 1), listing()
# past the check (as if the estimate were wrong): the disk fills during DeepSpeed's write
estimate = checkpoint.bytes_needed
checkpoint.bytes_needed = lambda ckpt_dir, engine: (0, "nothing")
out["filled"], out["after_filled"] = attempt(2, 1), listing()
checkpoint.bytes_needed = estimate
out["intact"] = checkpoint.find(ckpt, 0)[0]
subprocess.run(["mount", "-o", "remount,size=4m", str(ckpt)], check=True)
out["later"], out["after_later"] = attempt(2, 1), listing()
out["resumes"] = checkpoint.find(ckpt, 0)[0]
print(json.dumps(out))
"""


@contextlib.contextmanager
def small_disk(folder: Path, size: str) -> Iterator[None]:
    """A tmpfs of `size` mounted on a new `folder` for the block (the test is skipped where
    mounting is not allowed)."""
    folder.mkdir()
    mount = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(folder)],
                           capture_output=True, text=True)  # fmt: skip
    if mount.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {mount.stderr.strip()}")
    try:
        yield
    finally:
        subprocess.run(["umount", "-l", str(folder)], check=False)


@pytest.mark.slow
def test_full_disk_on_a_real_engine(tmp_path):
    """A DeepSpeed engine saves into a tmpfs a little larger than one checkpoint: the second
    save is refused before writing (keep=1 needs two copies for a moment); let past that
    check, its write fills the disk and becomes one line with the partial folder removed;
    with more space the same save goes through."""
    ckpt = tmp_path / "checkpoints"
    with small_disk(ckpt, "640k"):
        proc = subprocess.run([sys.executable, "-c", PROBE, str(ckpt)], cwd=ROOT,
                              capture_output=True, text=True, timeout=300)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["first"] == "saved" and 300_000 < out["size"] < 640_000, out
    refused = out["refused"]
    assert refused.startswith(f"{ckpt}: not enough free space for checkpoint step00000002"), out
    assert "needed (the size of step00000001)" in refused
    assert out["after_refused"] == ["latest", "step00000001"]
    filled = out["filled"]
    assert filled.startswith(f"{ckpt / 'step00000002.partial'}: writing the checkpoint failed")
    assert "the partial checkpoint is removed" in filled and "\n" not in filled
    assert " kB free there)" in filled or " B free there)" in filled  # the disk is full
    assert out["after_filled"] == ["latest", "step00000001"]  # no partial left taking the space
    assert out["intact"] == "step00000001"  # its checksums still match
    assert out["later"] == "saved" and out["after_later"] == ["latest", "step00000002"]
    assert out["resumes"] == "step00000002"
    print(f"\nrefused: {refused}\nfilled: {filled}")


def test_a_full_disk_leaves_no_half_metric_line_and_names_the_file(tmp_path):
    """The run's other files on a full tmpfs: a metric line that does not fit is cut back off
    (a resumed run parses every line), and each failed write names its file."""
    from ssl_vit.io import append_text, atomic_write_text

    disk = tmp_path / "run"
    with small_disk(disk, "16k"):
        metrics = disk / "metrics.jsonl"
        append_text(metrics, '{"step": 2}\n')
        with pytest.raises(OSError) as caught:  # a 32 kB line on a 16 kB disk
            append_text(metrics, json.dumps({"step": 4, "pad": "x" * 32_000}) + "\n")
        assert caught.value.errno == errno.ENOSPC and caught.value.filename == str(metrics)
        assert metrics.read_text() == '{"step": 2}\n'
        with pytest.raises(OSError) as caught:
            atomic_write_text(disk / "ds_config.json", "x" * 32_000)
        assert caught.value.errno == errno.ENOSPC
        assert caught.value.filename == str(disk / "ds_config.json")
        assert sorted(f.name for f in disk.iterdir()) == ["metrics.jsonl"]  # no temporary left


def test_a_resume_drops_damaged_metric_lines_and_the_steps_after_its_checkpoint(tmp_path, caplog):
    from ssl_vit.engine.trainer import truncate_metrics

    metrics = tmp_path / "metrics.jsonl"
    metrics.write_bytes(b'{"step": 2}\n{"st\xff\n[4]\n{"step": 4}\n\n{"step": 6}\n{"step": 8, "tra')
    with caplog.at_level(logging.WARNING):
        truncate_metrics(metrics, 4)
    assert metrics.read_text() == '{"step": 2}\n{"step": 4}\n'
    assert f"{metrics}: 3 damaged line(s) dropped on resume" in caplog.text


# -- the bounded wait for a universal conversion ----------------------------------------------


def test_a_dead_converter_stops_the_waiting_ranks_in_one_line(tmp_path, monkeypatch):
    """Rank 0 died mid-conversion: its heartbeat file stays as it was, and a waiting rank
    stops after the limit (1 s here, through the environment) naming rank 0 and its host."""
    monkeypatch.setenv(checkpoint.HEARTBEAT_LIMIT_ENV, "1")
    tag = tmp_path / "step00000004"
    tag.mkdir()
    (tag / "universal.heartbeat").write_text("rank 0 on elsewhere, pid 1: beat 7\n")
    (tag / "universal.partial").mkdir()  # what the dead converter left
    t = time.monotonic()
    with pytest.raises(CheckpointError) as e:
        checkpoint.to_universal(tmp_path, tag.name, rank=1)  # no process group: one rank
    took = time.monotonic() - t
    text = str(e.value)
    assert 1.0 <= took < 10, took
    assert "\n" not in text
    assert f"rank 0 on {socket.gethostname()} gave no sign of life for 1 s while converting" in (
        text
    )
    assert text.startswith(str(tag / "universal.heartbeat")) and "relaunch the run" in text


def test_a_live_converter_is_waited_for_past_the_limit(tmp_path):
    """The limit bounds the silence, not the conversion: rank 0 beating every 0.1 s for 2.5 s
    (2.5 limits) is waited for to the end."""
    beat, final = tmp_path / "universal.heartbeat", tmp_path / "universal"

    def convert() -> None:
        with checkpoint.heartbeat(beat, every=0.1):
            time.sleep(2.5)
        final.mkdir()

    thread = threading.Thread(target=convert)
    t = time.monotonic()
    thread.start()
    checkpoint.wait_for_rank0(final.is_dir, beat, "here", "converting", limit=1.0)
    thread.join()
    assert time.monotonic() - t >= 2.5 and not beat.exists()  # the heartbeat cleans up


def test_the_heartbeat_limit_from_the_environment(monkeypatch):
    monkeypatch.delenv(checkpoint.HEARTBEAT_LIMIT_ENV, raising=False)
    assert checkpoint.heartbeat_limit() == checkpoint.HEARTBEAT_LIMIT_S == 600
    monkeypatch.setenv(checkpoint.HEARTBEAT_LIMIT_ENV, "2.5")
    assert checkpoint.heartbeat_limit() == 2.5
    monkeypatch.setenv(checkpoint.HEARTBEAT_LIMIT_ENV, "ten")
    with pytest.raises(CheckpointError, match="SSL_VIT_HEARTBEAT_LIMIT_S='ten': give a positive"):
        checkpoint.heartbeat_limit()


# -- real launches --------------------------------------------------------------------------

STEPS = ["train.steps=4", "run.checkpoint_every=2"]


@pytest.fixture(scope="module")
def trained(tiny_shards, tmp_path_factory, mlflow_template) -> Path:
    """A finished 4-step run with checkpoints at steps 2 and 4 (and its MLflow store)."""
    base = tmp_path_factory.mktemp("trained")
    shutil.copyfile(mlflow_template, base / "mlflow.db")
    proc = run_cli([PIPE, *overrides(tiny_shards, base / "run", base / "mlflow.db", *STEPS)])
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert sorted(p.name for p in (base / "run" / "checkpoints").iterdir()) == [
        "latest", "step00000002", "step00000004"]  # fmt: skip
    return base


def _copy(trained: Path, tmp_path: Path) -> tuple[Path, Path]:
    shutil.copytree(trained / "run", tmp_path / "run")
    shutil.copyfile(trained / "mlflow.db", tmp_path / "mlflow.db")
    return tmp_path / "run", tmp_path / "mlflow.db"


def _rows(run_dir: Path) -> dict[int, dict]:
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return {r["step"]: r for r in map(json.loads, lines)}


@pytest.mark.slow
@pytest.mark.parametrize("damage", ["truncate", "delete"])
def test_relaunch_resumes_from_the_checkpoint_before_a_damaged_one(
    tiny_shards, trained, tmp_path, damage
):
    """The newest checkpoint truncated (a file cut short by a crash or a copy) or deleted:
    one line says so, the run resumes from step 2 and ends as the undamaged run did."""
    run_dir, db = _copy(trained, tmp_path)
    ckpt = run_dir / "checkpoints"
    newest = ckpt / "step00000004"
    if damage == "truncate":
        model = newest / MODEL
        model.write_bytes(model.read_bytes()[: model.stat().st_size // 2])
        says = f"{newest}: {MODEL} has "
    else:
        shutil.rmtree(newest)
        says = f"{ckpt / 'latest'} names 'step00000004', which does not exist"
    t = time.monotonic()
    proc = run_cli([PIPE, *overrides(tiny_shards, run_dir, db, *STEPS)], timeout=300)
    took = time.monotonic() - t
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr
    lines = [ln for ln in proc.stderr.splitlines() if RESUMING in ln]
    assert len(lines) == 1, proc.stderr[-3000:]
    assert says in lines[0] and f"{RESUMING}, {ckpt / 'step00000002'} (step 2)" in lines[0]
    assert "resumed from step 2" in proc.stderr
    # it trained steps 3-4 again from step 2's state: the same losses as the first run
    before, after = _rows(trained / "run"), _rows(run_dir)
    assert sorted(after) == [2, 4]
    assert after[4]["train/loss"] == pytest.approx(before[4]["train/loss"], rel=1e-6)
    assert checkpoint.latest_tag(ckpt) == "step00000004"
    assert checkpoint.find(ckpt, rank=0)[0] == "step00000004"  # saved again, checksums match
    assert sorted(p.name for p in ckpt.iterdir()) == ["latest", "step00000002", "step00000004"]
    print(f"\n{damage}: resumed and finished in {took:.1f}s; {lines[0].split(' ', 2)[2]}")


@pytest.mark.slow
def test_the_only_checkpoint_damaged_is_one_line(tiny_shards, trained, tmp_path):
    run_dir, db = _copy(trained, tmp_path)
    ckpt = run_dir / "checkpoints"
    shutil.rmtree(ckpt / "step00000002")
    (ckpt / "step00000004" / STATE).write_text('{"step": 4, "samples_se')
    proc = run_cli([PIPE, *overrides(tiny_shards, run_dir, db, *STEPS)], timeout=300)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith(f"error: {ckpt}: no intact checkpoint to resume "), last
    assert f"{ckpt / 'step00000004'}: {STATE} is not valid JSON" in last, last


@pytest.mark.slow
def test_an_older_checkpoint_deepspeed_cannot_load_is_one_line(tiny_shards, trained, tmp_path):
    """A checkpoint without checksums.json (an older version's) is taken on trust; when
    DeepSpeed then fails to load it, one line names it and says what to do."""
    run_dir, db = _copy(trained, tmp_path)
    newest = run_dir / "checkpoints" / "step00000004"
    (newest / "checksums.json").unlink()
    model = newest / MODEL
    model.write_bytes(model.read_bytes()[:5000])
    proc = run_cli([PIPE, *overrides(tiny_shards, run_dir, db, *STEPS)], timeout=300)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr
    assert f"{newest} has no checksums.json (saved by an older ssl-vit)" in proc.stderr
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith(f"error: {newest}: DeepSpeed could not load this checkpoint ("), last
    assert "rename it to step00000004.damaged to resume from the checkpoint before it" in last
