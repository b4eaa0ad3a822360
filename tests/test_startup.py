"""ssl_vit.startup: the collector is paused only in an entry script's process, and resumed."""

from __future__ import annotations

import os
import subprocess
import sys

from conftest import ROOT

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


# Each evaluator's script with an argument it refuses, and the words of the refusal.
BAD_ARGS = {
    "knn.py": (["--raw-pixels", "--k", "0"], "--k values must be >= 1"),
    "fewshot.py": (["--raw-pixels", "--shots", "0"], "--shots and --seeds must be >= 1"),
    "linear_probe.py": (["--raw-pixels", "--val-fraction", "2"], "--val-fraction must be in"),
    "dynamic_vit.py": (["--backbone", "b", "--out", "o", "--grid", "1"], "--grid >= 2"),
    "inspect_vit.py": (["--random-init", "vit_tiny_patch16_224", "--out", "o"], "manifest.json"),
}


def test_eval_scripts_answer_bad_arguments_before_torch_loads(tmp_path):
    """An evaluator's usage error (or a missing shard set) is reported before torch, timm,
    FAISS or MLflow load: at once, not after seconds of imports."""
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
    for script, (args, words) in BAD_ARGS.items():
        cmd = [sys.executable, "-c", probe, f"evals/{script}", "--data", str(tmp_path), *args]
        proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
        assert proc.stdout.strip() == "2 []", (script, proc.stdout, proc.stderr)
        assert words in proc.stderr, (script, proc.stderr)


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
