"""Fault injection with real processes: SIGKILLed training and data_prep, bad shards at training
time, a non-finite loss, and an MLflow server that is down at start.

Each fault is a real event in a real process (kill -9 of the whole process group, bytes cut off a
shard file, a shard deleted, a learning rate that overflows the weights, a port with no server).
Faults injected and survived are printed (run with -s to see them).
"""

from __future__ import annotations

import json
import os
import random
import re
import signal
import subprocess
import sys
import tarfile
import time
from pathlib import Path

import pytest
from conftest import ROOT, MlflowServer, reap_with_this_process, run_cli
from mlflow.tracking import MlflowClient
from test_train_e2e import metric_steps, overrides

from ssl_vit.engine.optim import lr_lambda

pytestmark = pytest.mark.slow
PIPE = "pipelines/mpp_pretrain.py"


def _start(args: list[str], log: Path) -> subprocess.Popen:
    """Training in its own process group, so a kill takes its data workers too (a preemption)."""
    return reap_with_this_process(subprocess.Popen(
        [sys.executable, PIPE, *args], cwd=ROOT, stdout=subprocess.DEVNULL,
        stderr=open(log, "ab"), start_new_session=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    ))  # fmt: skip


def _kill(proc: subprocess.Popen) -> None:
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait(timeout=60)


def _assert_latest_complete(ckpt: Path) -> str | None:
    pointer = ckpt / "latest"
    if not pointer.is_file():
        return None
    tag = pointer.read_text().strip()
    assert (ckpt / tag / "trainer_state.json").is_file(), f"latest names incomplete {tag}"
    assert not tag.endswith(".partial")
    assert json.loads((ckpt / tag / "trainer_state.json").read_text())["step"] == int(tag[4:])
    return tag


def _wait_for(cond, proc: subprocess.Popen, timeout: float, poll: float = 0.002) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and proc.poll() is None:
        if cond():
            return True
        time.sleep(poll)
    return False


def _steps_logged(log: Path, offset: int) -> list[int]:
    """Steps this launch has logged: the `step N/T` lines written to `log` after `offset`."""
    text = log.read_bytes()[offset:].decode(errors="replace")
    return [int(m) for m in re.findall(r" step (\d+)/\d+ ", text)]


def test_training_survives_random_sigkills(tiny_shards, tmp_path, mlflow_db):
    """3 SIGKILLs (two at seeded random steps plus a random fraction of a step, one the instant a
    `.partial` checkpoint folder appears), then the same command: planned steps reached, `latest`
    always complete, the partial folder never trusted, MLflow metric steps exact. Kill points are
    steps, not seconds, so a faster loader or machine cannot outrun them. Checkpoints every 5
    steps, logging every 2: a resume from an odd step still logs each even step once."""
    rng = random.Random(8)
    run_dir, db = tmp_path / "run", mlflow_db
    ckpt, log = run_dir / "checkpoints", tmp_path / "train.log"
    total = 24
    args = overrides(tiny_shards, run_dir, db, f"train.steps={total}", "run.checkpoint_every=5")
    injected, report = 0, []
    for kind in ("random", "partial", "random"):
        offset = log.stat().st_size if log.exists() else 0
        proc = _start(args, log)
        started = _wait_for(lambda o=offset: bool(_steps_logged(log, o)), proc, 300, poll=0.01)
        if not started and proc.wait(timeout=60) == 0:
            break  # it resumed next to the end and finished first: nothing left to kill
        assert started, log.read_text()[-3000:]
        if kind == "random":
            first = _steps_logged(log, offset)[0]
            target = rng.randrange(first, total - 2, 2) if first < total - 2 else first
            _wait_for(lambda o=offset, t=target: max(_steps_logged(log, o)) >= t, proc, 300)
            time.sleep(rng.uniform(0.0, 0.1))  # land somewhere inside a step
            partial_seen = bool(list(ckpt.glob("*.partial")))
        else:
            partial_seen = _wait_for(lambda: bool(list(ckpt.glob("*.partial"))), proc, 120)
        if proc.poll() is not None:
            break  # it finished first: nothing left to kill
        _kill(proc)
        injected += 1
        tag = _assert_latest_complete(ckpt)
        report.append((kind, partial_seen, tag, metric_steps(run_dir)[-1]))
    assert injected >= 2, report
    assert any(p for _, p, _, _ in report), f"no kill hit a checkpoint write: {report}"

    expected_resume = _assert_latest_complete(ckpt)
    done = run_cli([PIPE, *args], timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    if expected_resume:
        assert f"resumed from step {int(expected_resume[4:])}" in done.stderr
    assert _assert_latest_complete(ckpt) == f"step{total:08d}"
    assert not list(ckpt.glob("*.partial")), "a partial checkpoint was left behind"
    assert metric_steps(run_dir) == list(range(2, total + 1, 2))
    client = MlflowClient(tracking_uri=f"sqlite:///{db}")
    run_id = (run_dir / "mlflow_run_id").read_text().strip()
    exp = client.get_experiment_by_name("ssl-vit")
    assert [r.info.run_id for r in client.search_runs([exp.experiment_id])] == [run_id]
    steps = [m.step for m in client.get_metric_history(run_id, "train/loss")]
    assert sorted(steps) == list(range(2, total + 1, 2)), steps  # none missing, none twice
    assert client.get_run(run_id).info.status == "FINISHED"
    print(f"\nfaults injected {injected}, survived {injected}: {report}")


def _corpus(root: Path, n: int) -> Path:
    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(0)
    for i in range(n):
        path = root / f"class{i % 3}" / f"{i:04d}.png"
        path.parent.mkdir(parents=True, exist_ok=True)
        Image.fromarray(rng.integers(0, 256, (24, 24, 3), dtype=np.uint8)).save(path)
    return root


def _snapshot(out: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(out.iterdir()) if p.is_file()}


def test_data_prep_killed_repeatedly_is_byte_identical(tmp_path):
    """data_prep SIGKILLed 4 times at seeded random points of its progress, then rerun: the shard
    set equals an uninterrupted run's byte for byte (no sample missing or twice)."""
    rng = random.Random(3)
    src = _corpus(tmp_path / "src", 600)
    args = ["--shard-size", "10", "--workers", "1", "--format", "png", "--val-fraction", "0.1"]
    out, log = tmp_path / "killed", tmp_path / "prep.log"
    make = [sys.executable, "data_prep/make_shards.py", str(src), str(out), *args]
    kills, done_groups = 0, []
    for _ in range(4):
        proc = subprocess.Popen(make, cwd=ROOT, stdout=subprocess.DEVNULL,
                                stderr=open(log, "ab"), start_new_session=True)  # fmt: skip
        have = len(list((out / ".work").glob("*-g*.json"))) if (out / ".work").exists() else 0
        want = have + rng.randint(1, 6)
        _wait_for(lambda w=want: len(list((out / ".work").glob("*-g*.json"))) >= w, proc, 120)
        if proc.poll() is not None:
            break
        _kill(proc)
        kills += 1
        done_groups.append(len(list((out / ".work").glob("*-g*.json"))))
        assert not (out / "manifest.json").exists()
    assert kills >= 3, (kills, log.read_text()[-2000:])
    rerun = run_cli(["data_prep/make_shards.py", str(src), str(out), *args], timeout=300)
    assert rerun.returncode == 0, rerun.stderr
    clean = run_cli(["data_prep/make_shards.py", str(src), str(tmp_path / "clean"), *args])
    assert clean.returncode == 0, clean.stderr
    assert _snapshot(out) == _snapshot(tmp_path / "clean")
    manifest = json.loads((out / "manifest.json").read_text())
    assert sum(s["num_samples"] for s in manifest["splits"].values()) == 600
    print(f"\ndata_prep: {kills} SIGKILLs survived (groups done at each kill: {done_groups})")


def _damage(shards: Path, tmp: Path) -> Path:
    """A copy of the shard set with train shard 0 truncated, shard 1 holding a corrupt image
    and shard 3 deleted after the manifest was written."""
    bad = tmp / "bad_shards"
    bad.mkdir()
    for p in shards.iterdir():
        if p.is_file():
            (bad / p.name).write_bytes(p.read_bytes())
    t0 = bad / "train-000000.tar"
    t0.write_bytes(t0.read_bytes()[: t0.stat().st_size // 2 + 100])  # cut mid-member
    t1 = bad / "train-000001.tar"
    with tarfile.open(shards / "train-000001.tar") as src, tarfile.open(t1, "w") as dst:
        for i, m in enumerate(src.getmembers()):
            data = src.extractfile(m).read()
            if m.name.endswith(".png") and i < 12:  # the first 4 images: PNG header kept, body junk
                data = data[:16] + b"\x00junk" * 20
            m.size = len(data)
            import io

            dst.addfile(m, io.BytesIO(data))
    (bad / "train-000003.tar").unlink()
    return bad


@pytest.mark.parametrize("in_memory", ["true", "false"])
def test_bad_shards_at_training_time(tiny_shards, tmp_path, mlflow_db, in_memory):
    """Streamed (read while training) and held in RAM (read at start): the same policy."""
    bad = _damage(tiny_shards, tmp_path)
    ram = f"data.in_memory={in_memory}"
    # Missing shard, default policy: a clear one-line error at start, no traceback.
    args = overrides(bad, tmp_path / "r1", mlflow_db, "train.steps=6", ram)
    t = time.monotonic()
    proc = run_cli([PIPE, *args], timeout=300)
    assert proc.returncode == 2, proc.stderr[-2000:]
    last = proc.stderr.strip().splitlines()[-1]
    assert "train-000003.tar" in last and "Traceback" not in proc.stderr, last
    print(f"\nmissing shard refused at start in {time.monotonic() - t:.1f}s: {last}")

    # Asked to skip: trains to the end on what is readable, corrupt samples skipped and counted.
    run_dir = tmp_path / "r2"
    args = overrides(bad, run_dir, mlflow_db, "train.steps=12", "data.missing_shards=skip",
                     ram)  # fmt: skip
    t = time.monotonic()
    proc = run_cli([PIPE, *args], timeout=400)
    took = time.monotonic() - t
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [2, 4, 6, 8, 10, 12]
    skipped = rows[-1]["train/skipped_samples"]
    assert skipped >= 4, rows[-1]  # 4 corrupt images at least, plus the truncated tail
    assert "train-000003.tar" in proc.stderr  # the skip is said, not silent
    print(f"bad shards skipped: {skipped} samples counted, run took {took:.1f}s")


def test_nonfinite_loss_skips_then_stops_keeping_last_good_checkpoint(
    tiny_shards, tmp_path, mlflow_db
):
    """A real overflow: lr=1e30 after a normal start blows the weights up, the loss turns
    non-finite; those steps are skipped and counted, and after K=3 in a row the run stops."""
    run_dir = tmp_path / "run"
    # Warmup of 3 steps keeps the first steps finite (lr ramps from ~0), then the weights explode.
    args = overrides(tiny_shards, run_dir, mlflow_db, "train.steps=40",
                     "run.checkpoint_every=1", "run.log_every=1", "optim.lr=1e30",
                     "optim.warmup_steps=3", "run.max_nonfinite_steps=3",
                     "train.zero_stage=2")  # ZeRO-2 steps the optimizer group by group  # fmt: skip
    proc = run_cli([PIPE, *args], timeout=400)
    assert proc.returncode == 3, proc.stderr[-3000:]
    last = proc.stderr.strip().splitlines()[-1]
    assert "3 steps in a row had a non-finite loss" in last and "Traceback" not in proc.stderr
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    counts = [r["train/nonfinite_steps"] for r in rows]
    assert counts == sorted(counts) and counts[-1] >= 1, counts
    assert [r["train/skipped_steps"] for r in rows] == counts  # fp32: skips are the NaN steps
    for r in rows:  # skipped steps still advance the schedule: lr is a function of the step
        assert r["train/lr"] == pytest.approx(1e30 * lr_lambda(r["step"], 3, 40, "cosine", 0.0))
    ckpt = run_dir / "checkpoints"
    tag = _assert_latest_complete(ckpt)
    state = json.loads((ckpt / tag / "trainer_state.json").read_text())
    assert state["nonfinite_in_row"] < 3  # the kept checkpoint is from before the stop
    stop_step = int(last.split("(at step ")[1].split(")")[0])
    assert state["step"] < stop_step
    print(f"\nnon-finite: stopped at step {stop_step}, counts {counts}, kept {tag}")


def test_mlflow_down_at_start_then_replayed(tiny_shards, tmp_path):
    """Training against a server that is not there: it finishes without stalling, metrics are
    spooled in RUN/mlflow_spool, and `python -m ssl_vit.tracking replay` pushes them all once
    the server is up."""
    server = MlflowServer(tmp_path)  # its port, with nothing listening yet
    uri = server.uri
    run_dir = tmp_path / "run"
    args = [a for a in overrides(tiny_shards, run_dir, tmp_path / "x.db", "train.steps=8")
            if not a.startswith("tracking.uri")]  # fmt: skip
    t = time.monotonic()
    proc = run_cli([PIPE, *args, f"tracking.uri={uri}"], timeout=400)
    took = time.monotonic() - t
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert metric_steps(run_dir) == [2, 4, 6, 8]
    spool = run_dir / "mlflow_spool"
    assert spool.is_dir() and any(spool.rglob("*")), "nothing was kept for replay"

    try:
        server.start()
        rep = subprocess.run(
            [sys.executable, "-m", "ssl_vit.tracking", "replay", str(spool), "--tracking-uri",
             uri], cwd=ROOT, capture_output=True, text=True, timeout=300,
        )  # fmt: skip
        assert rep.returncode == 0, rep.stdout + rep.stderr
        client = MlflowClient(tracking_uri=uri)
        runs = client.search_runs([client.get_experiment_by_name("ssl-vit").experiment_id])
        assert len(runs) == 1
        steps = [m.step for m in client.get_metric_history(runs[0].info.run_id, "train/loss")]
        assert sorted(steps) == [2, 4, 6, 8], steps
        assert runs[0].data.params["train.global_batch"] == "32"
    finally:
        server.kill()
    print(f"\nMLflow down at start: training took {took:.1f}s; replay pushed steps {sorted(steps)}")


def test_resume_position_counts_the_shards_actually_read(tiny_shards, tmp_path, mlflow_db):
    """With a shard gone and data.missing_shards=skip an epoch is 12 steps, not the manifest's
    16: a resume at step 14 is epoch 1, batch 2 (the manifest's count would say epoch 0, batch
    14, past the end of what is readable)."""
    short = tmp_path / "short"
    short.mkdir()
    for p in tiny_shards.iterdir():
        if p.is_file() and p.name != "train-000003.tar":
            (short / p.name).write_bytes(p.read_bytes())
    run_dir = tmp_path / "run"
    common = ["data.missing_shards=skip", "run.checkpoint_every=7"]
    first = run_cli([PIPE, *overrides(short, run_dir, mlflow_db, "train.steps=14", *common)])
    assert first.returncode == 0, first.stderr[-3000:]
    state = json.loads(
        (run_dir / "checkpoints" / "step00000014" / "trainer_state.json").read_text()
    )
    assert state["steps_per_epoch"] == 12  # 384 readable samples / 32
    more = run_cli([PIPE, *overrides(short, run_dir, mlflow_db, "train.steps=20", *common)])
    assert more.returncode == 0, more.stderr[-3000:]
    assert "resumed from step 14" in more.stderr
    assert metric_steps(run_dir) == list(range(2, 21, 2))
