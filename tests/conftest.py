"""Shared test fixtures: small real data sets written by the tests themselves."""

from __future__ import annotations

import gzip
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[1]
pytest_plugins = ["servers"]  # tests/servers.py: ShardHTTPServer, S3Server and their fixtures

# OpenMP threads that spin while they wait for work (libgomp's default) starve everything else
# on a small shared CPU: a tiny ViT's training step took ~1.3 s instead of ~0.08 s on 2 cores
# with MLflow's sender thread, a loader worker and other processes beside it. Passive waiting
# changes no arithmetic (the same losses to the last digit) and no thread count, only how idle
# threads wait. Set before torch loads here; every subprocess the tests start inherits it.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")


# The modules that take longest (each several real launches; seconds each took in a parallel
# run on 2 cores beside a training run), collected first: `make test` runs the suite on parallel
# workers one module per worker at a time (pytest-xdist --dist loadfile), and a long module that
# starts last finishes last.
LONGEST_FIRST = (
    "test_zero",  # 560 s
    "test_train_e2e",  # 442 s
    "test_faults",  # 356 s
    "test_dynamic_vit",  # 289 s
    "test_mlflow_native",  # 237 s
    "test_preemption",  # ~150 s (3 two-rank launches, each stopped by a signal)
    "test_remote_shards",  # ~130 s (2 trainings, a 2-rank launch, S3 and HTTP servers)
    "test_offline_kit",  # ~150 s (the kit installed in a fresh venv, 2 trainings in it)
    "test_elastic",  # ~60 s
    "test_checkpoint_failover",  # ~80 s (real launches: damaged, deleted, full-disk checkpoints)
    "test_non_square",  # ~100 s (pretraining, kNN, probe and fine-tune, two sets)
    "test_hostile_inputs",  # ~60 s (misbehaving servers, tampered sets)
    "test_bad_inputs",  # 130 s
    "test_compile",  # 102 s
    "test_launchers",  # ~40 s
    "test_gpu_check",  # ~35 s
    "test_tracking",  # 83 s
    "test_mixer_e2e",  # 74 s
    "test_startup",  # ~85 s (two ZeRO-3 trainings from S3 shards)
)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    # sort() is stable: tests keep their order within a module, other modules theirs after
    items.sort(key=lambda item: rank.get(item.module.__name__, len(rank)))


def write_idx(folder: Path, prefix: str, images: np.ndarray, labels: np.ndarray, gz: bool = True):
    """Write MNIST-format IDX files `{prefix}-images-idx3-ubyte[.gz]` and the labels beside."""
    folder.mkdir(parents=True, exist_ok=True)
    n, h, w = images.shape
    blobs = {
        f"{prefix}-images-idx3-ubyte": np.array([0x803, n, h, w], ">u4").tobytes()
        + images.astype(np.uint8).tobytes(),
        f"{prefix}-labels-idx1-ubyte": np.array([0x801, n], ">u4").tobytes()
        + labels.astype(np.uint8).tobytes(),
    }
    for name, data in blobs.items():
        if gz:
            (folder / f"{name}.gz").write_bytes(gzip.compress(data, mtime=0))
        else:
            (folder / name).write_bytes(data)


def toy_images(n: int, size: int, classes: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Gray noise with a centred square whose brightness is the class: learnable in a few
    dozen steps, with spatial structure for masked patch prediction to model."""
    rng = np.random.default_rng(seed)
    labels = rng.integers(0, classes, n)
    images = rng.integers(0, 40, (n, size, size))
    lo, hi = size // 4, size - size // 4
    for i, k in enumerate(labels):
        images[i, lo:hi, lo:hi] = 80 + (175 * int(k)) // max(1, classes - 1)
    return images.astype(np.uint8), labels.astype(np.uint8)


def run_cli(args: list[str], timeout: float = 600, **kw) -> subprocess.CompletedProcess:
    """Run a project entry script with this interpreter, from the repo root."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1", **kw.pop("env", {})}
    return subprocess.run(
        [sys.executable, *args], cwd=ROOT, env=env, capture_output=True, text=True,
        timeout=timeout, **kw,
    )  # fmt: skip


@pytest.fixture(scope="session")
def tiny_shards(tmp_path_factory) -> Path:
    """A real shard set from data_prep: 512 train / 128 test gray 16x16 images, 4 classes."""
    base = tmp_path_factory.mktemp("tiny")
    src = base / "idx"
    for prefix, n, seed in (("train", 512, 0), ("t10k", 128, 1)):
        write_idx(src, prefix, *toy_images(n, 16, 4, seed))
    out = base / "shards"
    proc = run_cli(
        ["data_prep/make_shards.py", str(src), str(out), "--shard-size", "128",
         "--class-names", "a,b,c,d", "--workers", "1"]
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    return out


@pytest.fixture(scope="session")
def mlflow_template(tmp_path_factory) -> Path:
    """One MLflow SQLite store with its tables made: creating them takes seconds of migrations
    (about 2.5 s here), so a test that needs a fresh store copies this one (`mlflow_db`)."""
    from mlflow import MlflowClient

    path = tmp_path_factory.mktemp("mlflow_template") / "template.db"
    MlflowClient(f"sqlite:///{path}").search_experiments()
    return path


@pytest.fixture()
def mlflow_db(tmp_path: Path, mlflow_template: Path) -> Path:
    """A fresh, empty, migrated MLflow SQLite store at tmp_path/mlflow.db."""
    db = tmp_path / "mlflow.db"
    shutil.copyfile(mlflow_template, db)
    return db


def wait_until(cond: Callable[[], bool], timeout: float, what: str) -> None:
    """Poll `cond` (exceptions count as not yet) until true, or fail the test naming `what`."""
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        try:
            if cond():
                return
        except Exception:
            pass
        time.sleep(0.25)
    raise AssertionError(f"timed out after {timeout}s waiting for {what}")


# A watchdog beside each process group a test starts in its own session (servers, training
# launches): when the test process dies without its teardown (SIGKILL, an OOM kill, a CI
# timeout), the watchdog kills the group, so no server or rank outlives the run.
_WATCHDOG = """
import os, signal, sys, time
parent, group = int(sys.argv[1]), int(sys.argv[2])
def alive(pid):
    try:
        os.kill(pid, 0)
        return True
    except ProcessLookupError:
        return False
while alive(parent):
    time.sleep(1)
    try:
        os.killpg(group, 0)
    except ProcessLookupError:
        sys.exit(0)  # the group ended first: nothing to do
try:
    os.killpg(group, signal.SIGKILL)
except ProcessLookupError:
    pass
"""


def reap_with_this_process(proc: subprocess.Popen) -> subprocess.Popen:
    """Kill `proc`'s process group (started with start_new_session=True) when this test
    process dies, however it dies; returns proc."""
    subprocess.Popen(
        [sys.executable, "-c", _WATCHDOG, str(os.getpid()), str(proc.pid)],
        start_new_session=True,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    return proc


class MlflowServer:
    """A real `mlflow server` on 127.0.0.1 and a free port, killable and restartable there."""

    def __init__(self, root: Path, db: Path | None = None) -> None:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.root, self.db, self.proc = root, db or root / "server.db", None
        self.uri = f"http://127.0.0.1:{self.port}"

    def start(self, timeout: float = 180) -> MlflowServer:
        cmd = [
            sys.executable, "-m", "mlflow", "server", "--host", "127.0.0.1",
            "--port", str(self.port), "--backend-store-uri", f"sqlite:///{self.db}",
            "--artifacts-destination", str(self.root / "artifacts"), "--workers", "1",
        ]  # fmt: skip
        log = open(self.root / "server.log", "a")  # noqa: SIM115 (the server's lifetime)
        self.proc = reap_with_this_process(
            subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        )
        wait_until(
            lambda: urllib.request.urlopen(f"{self.uri}/health", timeout=1).status == 200,
            timeout, "mlflow server to start",
        )  # fmt: skip
        return self

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
