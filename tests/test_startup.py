"""ssl_vit.startup: the collector is paused only in an entry script's process, and resumed;
ssl_vit.logs: the libraries' start-up lines are left out unless -v."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from conftest import ROOT, run_cli

CHECK = """
import gc, weakref
from ssl_vit import startup

startup.ready()  # a library user's process: left as it was
assert gc.isenabled() and gc.get_freeze_count() == 0

startup.begin()  # an entry script's __main__
assert not gc.isenabled()
import json, email.parser  # noqa: F401  (what "loading" stands for here)
startup.ready()
assert gc.isenabled() and gc.get_freeze_count() > 0, "loaded objects are frozen"

class Node:
    pass

a, b = Node(), Node()
a.other, b.other = b, a  # a reference cycle made after start-up
alive = weakref.ref(a)
del a, b
gc.collect()
assert alive() is None, "cycles made after ready() are still collected"
startup.begin()  # once resumed, never paused again by a second call
print("ok", gc.isenabled())
"""


def test_collector_paused_for_start_up_then_resumed():
    proc = subprocess.run([sys.executable, "-c", CHECK], cwd=ROOT, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == ["ok", "True"]


# Each evaluator's script with an argument it refuses, and the words of the refusal ({T}: a
# folder that exists).
BAD_ARGS = [
    ("knn.py", ["--raw-pixels", "--k", "0"], "--k values must be >= 1"),
    ("knn.py", ["--backbone", "{T}/nope"], "nope: no such backbone folder"),
    ("fewshot.py", ["--raw-pixels", "--shots", "0"], "--shots and --seeds must be >= 1"),
    ("linear_probe.py", ["--raw-pixels", "--val-fraction", "2"], "--val-fraction must be in"),
    ("dynamic_vit.py", ["--backbone", "{T}", "--out", "o", "--grid", "1"], "--grid >= 2"),
    ("dynamic_vit.py", ["--backbone", "{T}/nope", "--out", "o"], "no such backbone folder"),
    ("inspect_vit.py", ["--random-init", "vit_tiny_patch16_224", "--out", "o"], "manifest.json"),
    ("inspect_vit.py", ["--backbone", "{T}/nope", "--out", "o"], "no such backbone folder"),
]


def test_eval_scripts_answer_bad_arguments_before_torch_loads(tmp_path):
    """An evaluator's usage error (or a missing shard set) is reported before torch, timm,
    FAISS or MLflow load: at once, not after seconds of imports, and in one line."""
    probe = (
        "import runpy, sys\n"
        "sys.argv = sys.argv[1:]\n"
        "try:\n"
        "    runpy.run_path(sys.argv[0], run_name='__main__')\n"
        "except SystemExit as e:\n"
        "    code = e.code\n"
        "heavy = ('torch', 'timm', 'faiss', 'mlflow', 'numpy')\n"
        "print(code, sorted(m for m in heavy if m in sys.modules))\n"
    )
    for script, args, words in BAD_ARGS:
        args = [a.replace("{T}", str(tmp_path)) for a in args]
        cmd = [sys.executable, "-c", probe, f"evals/{script}", "--data", str(tmp_path), *args]
        proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
        assert proc.stdout.strip() == "2 []", (script, proc.stdout, proc.stderr)
        assert words in proc.stderr, (script, proc.stderr)
        assert len(proc.stderr.strip().splitlines()) == 1, (script, proc.stderr)


def test_mlflow_telemetry_is_off_unless_the_user_turns_it_on():
    """MLflow 3 sends usage events to its makers by default; our entry scripts switch that off
    before MLflow loads, and leave a user's own MLFLOW_DISABLE_TELEMETRY alone."""
    probe = (
        "from ssl_vit import startup\n"
        "startup.begin(pause_gc=False)\n"
        "import mlflow\n"
        "from mlflow.telemetry.client import get_telemetry_client\n"
        "print(get_telemetry_client() is not None)\n"
    )
    # MLflow stays quiet on its own under a test runner or CI (PYTEST_CURRENT_TEST, CI,
    # GITHUB_ACTIONS, ...): the probe runs with a bare environment, as a user's shell would be
    env = {k: os.environ[k] for k in ("PATH", "HOME", "LANG") if k in os.environ}
    for opt_in, want in ((None, "False"), ("false", "True")):
        if opt_in is not None:
            env["MLFLOW_DISABLE_TELEMETRY"] = opt_in
        proc = subprocess.run([sys.executable, "-c", probe], cwd=ROOT, env=env,
                              capture_output=True, text=True, timeout=120)  # fmt: skip
        assert proc.returncode == 0, proc.stderr[-2000:]
        assert proc.stdout.strip() == want, (opt_in, proc.stdout)


# What ssl_vit.logs silences by default, one of each kind (printed, logged at INFO, a DeepSpeed
# WARNING, a torch FutureWarning), beside lines of the same kinds it must leave alone.
CHATTER_PROBE = """
import logging, sys, warnings
from ssl_vit.logs import quiet_prints, setup_logging

setup_logging(sys.argv[1] == "-v")
with quiet_prints():
    print("DeepSpeed deepspeed.ops.comm.deepspeed_shm_comm_op built successfully")
    print("a line of ours")
warnings.warn("`torch.distributed.all_gather_into_tensor` is deprecated. Use ...", FutureWarning)
warnings.warn("another FutureWarning", FutureWarning)
ds = logging.getLogger("DeepSpeed")
ds.warning("**** You are using ZeRO with an untested optimizer, proceed with caution *****")
ds.warning("a real DeepSpeed warning")
logging.getLogger("botocore.credentials").info("Found credentials in environment variables.")
logging.getLogger("ssl_vit.train").warning("a warning of ours")
"""
CHATTER = (
    "deepspeed_shm_comm_op built successfully",
    "torch.distributed.all_gather_into_tensor",
    "You are using ZeRO with an untested optimizer",
    "Found credentials in environment variables",
)
KEPT = ("a line of ours", "another FutureWarning", "a real DeepSpeed warning", "a warning of ours")


def test_known_library_lines_are_dropped_and_nothing_else():
    """Each way a library line is silenced drops that line only: the same kind of line that is
    not on the list (a print of ours, another FutureWarning, another DeepSpeed warning, our own
    warning) still shows; with -v everything shows."""
    for flag in ("", "-v"):
        proc = subprocess.run([sys.executable, "-c", CHATTER_PROBE, flag], cwd=ROOT,
                              capture_output=True, text=True, timeout=120)  # fmt: skip
        assert proc.returncode == 0, proc.stderr
        out = proc.stdout + proc.stderr
        assert all(line in out for line in KEPT), (flag, out)
        shown = [line for line in CHATTER if line in out]
        assert shown == (list(CHATTER) if flag else []), (flag, out)


def _chatter_here() -> dict[str, bool]:
    """Each third-party start-up line a run used to print, and whether this machine prints it
    at all (with -v) in a ZeRO-3 run reading its shards from S3."""
    import torch

    cpu = not torch.cuda.is_available()
    deprecated = hasattr(torch.distributed.all_gather_into_tensor, "__deprecated__")
    return {
        "deepspeed_shm_comm_op built successfully": cpu,  # DeepSpeed's CPU communication op
        "Setting accelerator to CPU": cpu,
        "You are using ZeRO with an untested optimizer": True,
        "Found credentials in environment variables": True,  # botocore, S3 credentials
        "FutureWarning: `torch.distributed.": deprecated,  # ZeRO's collectives
    }


@pytest.mark.slow
def test_a_training_run_is_quiet_by_default_and_shows_all_with_v(
    tiny_shards, s3, tmp_path, mlflow_db
):
    """A tiny ZeRO-3 training from S3 shards prints none of the libraries' known start-up
    lines by default, and each of those this machine prints with -v."""
    s3.upload_folder(tiny_shards, "s3://bucket/tiny")
    common = [
        "pipelines/mpp_pretrain.py", "data.root=s3://bucket/tiny",
        f"tracking.uri=sqlite:///{mlflow_db}", "model.img_size=16", "model.patch_size=4",
        "model.kwargs={depth: 1, embed_dim: 32, num_heads: 2}", "data.num_workers=1",
        "train.global_batch=32", "train.epochs=null", "train.steps=2", "train.precision=fp32",
        "train.zero_stage=3", "run.log_every=2",
    ]  # fmt: skip
    known = _chatter_here()
    for verbose in (False, True):
        run_dir = tmp_path / ("loud" if verbose else "quiet")
        proc = run_cli([*common, f"run.dir={run_dir}", *(["-v"] if verbose else [])])
        assert proc.returncode == 0, proc.stderr[-3000:]
        out = proc.stdout + proc.stderr
        assert "ssl_vit.train done: 2 steps" in out  # our own lines stay
        if verbose:
            missing = [line for line, here in known.items() if here and line not in out]
            assert not missing, (missing, out[-4000:])
        else:
            shown = [line for line in known if line in out]
            assert not shown, (shown, out[-4000:])


def test_first_line_of_an_error_is_one_line_even_when_the_message_is_empty():
    from ssl_vit.logs import first_line

    assert first_line(ValueError("  bad key\n  at line 3\n")) == "bad key"
    assert first_line(TimeoutError()) == "TimeoutError"  # str() is ""; no IndexError
    assert first_line(OSError("x" * 400)) == "x" * 300


def test_a_loader_worker_imports_neither_torchvision_nor_dynamo():
    """What each rank's loader fork server imports (ssl_vit.data.stream, workers.py) leaves
    torchvision's package and torch._dynamo out, and still has torchvision's PNG and JPEG
    decoders: that import costs over a second of CPU in every fork server."""
    check = (
        "import sys\n"
        "from ssl_vit.data import augment, stream  # noqa: F401\n"
        "print(sorted(m for m in ('torchvision', 'torch._dynamo', 'timm') if m in sys.modules),"
        " augment._DECODE_PNG is not None, augment._DECODE_JPEG is not None)\n"
    )
    proc = subprocess.run([sys.executable, "-c", check], cwd=ROOT, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == ["[]", "True", "True"]
