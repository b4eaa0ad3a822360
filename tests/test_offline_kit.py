"""benchmarks/offline_kit.py and benchmarks/offline_install.sh: which packages travel to a GPU
node without internet, and (slow, building the kit from PyPI) the kit installed offline on a
simulated node, training from s3:// and http:// roots."""

from __future__ import annotations

import importlib.metadata as md
import importlib.util
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
from conftest import ROOT, run_cli
from packaging.requirements import Requirement
from test_train_e2e import overrides

spec = importlib.util.spec_from_file_location("offline_kit", ROOT / "benchmarks" / "offline_kit.py")
kit = importlib.util.module_from_spec(spec)
spec.loader.exec_module(kit)


def test_present_names_read_pip_freeze_or_plain_lists():
    freeze = "absl-py==2.1.0\nPyYAML==6.0.2\ntyping_extensions @ file:///wheels/te.whl\n# pinned\n"
    assert kit.present_names(freeze) == {"absl-py", "pyyaml", "typing-extensions"}
    assert kit.present_names("numpy\nTorch\n\nsafetensors\n") == {"numpy", "torch", "safetensors"}
    assert kit.present_names("zipp, numpy>=1.26, -e .\n") == {"zipp", "numpy"}


def test_needs_follow_the_nodes_markers():
    got = kit.needs([
        "Braceexpand",
        "tomli; python_version < '3.11'",  # the target runs 3.12
        "pywin32; sys_platform == 'win32'",
        "uvloop; sys_platform == 'linux'",
        "pytest; extra == 'test'",  # extras are never asked for
        "typing_extensions>=4.6; python_version < '3.13'",
    ])  # fmt: skip
    assert got == ["braceexpand", "uvloop", "typing-extensions"]


def test_closure_is_transitive_and_stops_at_what_the_machine_has():
    graph = {"mlflow-skinny": ["sqlparse", "numpy", "gitpython"], "gitpython": ["gitdb"],
             "gitdb": ["smmap", "gitpython"], "webdataset": ["braceexpand", "numpy"]}  # fmt: skip
    seen = []

    def requires(name):
        seen.append(name)
        return graph.get(name, [])

    levels = []
    got = kit.closure(["mlflow_skinny", "webdataset"], {"numpy"}, requires, levels.append)
    assert sorted(got) == ["braceexpand", "gitdb", "gitpython", "mlflow-skinny", "smmap",
                           "sqlparse", "webdataset"]  # fmt: skip
    assert len(seen) == len(set(seen)) == len(got)  # each wheel read once, the cycle ends
    # one download a level, before any package of it is read, not one a package
    assert levels == [["mlflow-skinny", "webdataset"],
                      ["sqlparse", "numpy", "gitpython", "braceexpand", "numpy"],
                      ["gitdb"], ["smmap", "gitpython"]]  # fmt: skip


def test_a_level_is_downloaded_in_one_pip_call_and_only_what_is_missing(tmp_path, monkeypatch):
    (tmp_path / "six-1.17.0-py2.py3-none-any.whl").write_bytes(b"")
    calls = []
    monkeypatch.setattr(kit, "_download", lambda pins, folder: calls.append(pins) or True)
    kit.fetch_level(["six", "numpy", "ssl-vit", "deepspeed", "zzz-not-installed", "packaging"],
                    tmp_path, present={"numpy"})  # fmt: skip
    assert calls == [["packaging==" + md.version("packaging"), "zzz-not-installed"]]
    kit.fetch_level(["six", "numpy"], tmp_path, present={"numpy"})
    assert len(calls) == 1  # nothing missing: no pip start


def test_extras_asked_of_a_requirement_are_followed():
    """torch asks for cuda-toolkit[cudart]: cuda-toolkit's `extra == 'cudart'` requirements
    travel; asked again with another extra, it is read again with both."""
    meta = {"cuda-toolkit": ["nvidia-cuda-runtime; extra == 'cudart'",
                             "nvidia-nvrtc; extra == 'nvrtc'"],
            "torch": ["cuda-toolkit[cudart]; sys_platform == 'linux'", "triton"],
            "triton": ["cuda-toolkit[nvrtc,cudart]"]}  # fmt: skip
    assert kit.needs(meta["torch"]) == ["cuda-toolkit[cudart]", "triton"]
    seen = []

    def requires(spec):
        seen.append(spec)
        req = kit.Requirement(spec)
        return kit.needs(meta.get(req.name, []), req.extras)

    got = kit.closure(["torch"], set(), requires)
    assert got == ["torch", "cuda-toolkit", "triton", "nvidia-cuda-runtime", "nvidia-nvrtc"]
    assert seen.count("cuda-toolkit[cudart]") == 1 and "cuda-toolkit[cudart,nvrtc]" in seen


def test_wheel_requires_reads_requires_dist(tmp_path):
    wheel = tmp_path / "demo-1.0-py3-none-any.whl"
    head = "Name: demo\nRequires-Dist: hjson\nRequires-Dist: x; extra == 'y'\n"
    body = "\nRequires-Dist: in the description, not a header\n"
    with zipfile.ZipFile(wheel, "w") as z:
        z.writestr("demo-1.0.dist-info/METADATA", head + body)
    assert kit.wheel_requires(wheel) == ["hjson", "x; extra == 'y'"]
    assert kit.wheel_of("demo", tmp_path) == wheel and kit.wheel_of("other", tmp_path) is None


# The node, simulated: the kit built for it, its Python and a fresh virtual environment on it.
# What is cached lives under .cache/ (ignored by git): a rerun reuses the kit's wheels and the
# node's Python, and makes the job's environment anew.
CACHE = ROOT / ".cache" / "offline-kit"
NODE_HAS = ("torch", "torchvision", "timm", "numpy", "pip")
# The kit's packages that the node does not have: not importable on the node before the install
NOT_ON_NODE = ("deepspeed", "webdataset", "mlflow", "s3fs", "aiohttp", "matplotlib", "faiss")


def _installed_closure(names) -> list[md.Distribution]:
    """The distributions installed here that `names` require, transitively, with the extras
    asked of them (this machine's markers): what `pip install torch ...` put on the node."""
    seen: dict[str, md.Distribution] = {}
    asked: dict[str, set[str]] = {}
    todo = [Requirement(n) for n in names]
    while todo:
        req = todo.pop()
        name, extras = kit.canonical(req.name), set(req.extras)
        if name in asked and extras <= asked[name]:
            continue
        asked[name] = asked.get(name, set()) | extras
        try:
            seen[name] = dist = md.distribution(name)
        except md.PackageNotFoundError:
            continue  # a requirement this platform does not install
        envs = [{"extra": e} for e in ("", *asked[name])]
        for spec in dist.requires or []:
            dep = Requirement(spec)
            if dep.marker is None or any(dep.marker.evaluate(env) for env in envs):
                todo.append(dep)
    return list(seen.values())


def _node_python() -> Path:
    """A Python with only NODE_HAS (pip among them) and what they require: a virtual
    environment (no system site packages) whose .pth exposes a folder of links to those
    packages' files in this environment's site-packages. Links, not copies: torch's CUDA build
    is gigabytes."""
    node = CACHE / "node"
    if (node / "ready").is_file():
        return node / "bin" / "python"
    shutil.rmtree(node, ignore_errors=True)
    base = getattr(sys, "_base_executable", sys.executable)
    # --without-pip: ensurepip would add its own setuptools, older than the one torch requires
    subprocess.run([base, "-m", "venv", "--without-pip", str(node)], check=True)
    site_dir = node / "site"
    site_dir.mkdir()
    for dist in _installed_closure(NODE_HAS):
        for top in {f.parts[0] for f in dist.files or []} - {"..", "__pycache__"}:
            src, dest = Path(dist.locate_file(top)), site_dir / top
            if src.exists() and not dest.exists():
                dest.symlink_to(src)
    (py,) = (node / "lib").glob("python3*/site-packages")
    (py / "node.pth").write_text(f"{site_dir}\n")
    (node / "ready").write_text("")
    return node / "bin" / "python"


def _clean_env(**extra: str) -> dict[str, str]:
    """This environment without what points pip or Python elsewhere: no index, no find-links,
    no pip config files, no PYTHONPATH."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PIP_", "PYTHON"))}
    return {**env, "PIP_CONFIG_FILE": os.devnull, "PIP_NO_INDEX": "1", **extra}


def _build_kit(present: Path) -> Path:
    out = CACHE / "kit"
    py = f"{sys.version_info.major}.{sys.version_info.minor}"
    args = ["benchmarks/offline_kit.py", "--present", str(present), "--python", py]
    proc = run_cli([*args, "--out", str(out)], timeout=900)
    if proc.returncode != 0:
        probe = subprocess.run(
            [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--no-cache-dir",
             "-d", str(CACHE / "probe"), "braceexpand==0.1.7"],
            capture_output=True, text=True, timeout=300,
        )  # fmt: skip
        if probe.returncode != 0:
            last = (probe.stderr.strip().splitlines() or ["no output"])[-1]
            pytest.skip(f"PyPI is not reachable to build the kit (pip download: {last})")
        raise AssertionError(proc.stdout[-2000:] + proc.stderr[-4000:])
    return out


@pytest.mark.slow
def test_the_kit_installs_offline_and_trains_from_s3_and_http(
    tiny_shards, tmp_path, s3, serve_http, mlflow_db
):
    """The offline kit, end to end. The node is a Python that has torch, torchvision, timm and
    numpy (with what they require) and nothing else: a virtual environment without system
    site packages whose .pth file exposes links to exactly those packages of this environment
    (_node_python). Its package list (what `pip freeze` there says) is --present; the kit is
    built for its Python version; benchmarks/offline_install.sh makes a fresh virtual
    environment over it and installs the kit with the package index switched off (--no-index,
    PIP_NO_INDEX=1, no pip config file, no PIP_FIND_LINKS), so every other package can only
    come from the kit. That environment then trains a few steps from an s3:// root (moto's S3)
    and from an http:// root, exports, registers the model, and draws the loss plot."""
    CACHE.mkdir(parents=True, exist_ok=True)
    node = _node_python()
    listed = subprocess.run(
        [str(node), "-m", "pip", "list", "--format=freeze"],
        env=_clean_env(), capture_output=True, text=True, check=True,
    )  # fmt: skip
    present = tmp_path / "node-packages.txt"
    present.write_text(listed.stdout)
    assert {"torch", "timm", "numpy"} <= kit.present_names(listed.stdout)
    probe = f"import importlib.util as u; print([m for m in {NOT_ON_NODE!r} if u.find_spec(m)])"
    on_node = subprocess.run([str(node), "-c", probe], env=_clean_env(), capture_output=True,
                             text=True, check=True)  # fmt: skip
    assert on_node.stdout.strip() == "[]"

    wheels = _build_kit(present)
    names = {kit.canonical(w.name.split("-")[0]) for w in wheels.glob("*.whl")}
    assert {"ssl-vit", "deepspeed", "s3fs", "aiohttp", "matplotlib", "faiss-cpu"} <= names
    assert not names & {"torch", "timm", "numpy", "mlflow"}  # the node's, and the server's

    venv = tmp_path / "venv"
    install = subprocess.run(
        ["bash", "benchmarks/offline_install.sh", str(wheels), str(venv), "-q", "--no-compile"],
        cwd=ROOT, env=_clean_env(PY=str(node)), capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert install.returncode == 0, install.stdout[-3000:] + install.stderr[-3000:]
    assert f"ssl-vit in {venv}/lib/" in install.stdout, install.stdout

    s3.upload_folder(tiny_shards, "s3://bucket/tiny")
    server = serve_http(tiny_shards)
    for name, root in (("s3", "s3://bucket/tiny"), ("http", server.url)):
        run = tmp_path / name
        # 2 steps, no loader worker: each process start imports torch, deepspeed and mlflow
        args = overrides(root, run, mlflow_db, "train.steps=2", "run.log_every=1",  # type: ignore[arg-type]
                         "data.num_workers=0", "data.in_memory=false", "train.compile=false",
                         f"tracking.register_as=kit-{name}")  # fmt: skip
        proc = subprocess.run(
            [str(venv / "bin" / "python"), str(ROOT / "pipelines" / "mpp_pretrain.py"), *args],
            cwd=tmp_path, env=_clean_env(PYTHONUNBUFFERED="1"), capture_output=True, text=True,
            timeout=600,
        )  # fmt: skip
        assert proc.returncode == 0, proc.stderr[-4000:]
        assert (run / "export" / "backbone.json").is_file() and (run / "loss_curve.png").is_file()
        assert "not drawn" not in proc.stderr
    registered = subprocess.run(
        [str(venv / "bin" / "python"), "-c",
         "import sys; from mlflow import MlflowClient; c = MlflowClient(sys.argv[1]); "
         "print(sorted(v.name for v in c.search_model_versions()))", f"sqlite:///{mlflow_db}"],
        cwd=tmp_path, env=_clean_env(), capture_output=True, text=True, check=True,
    )  # fmt: skip
    assert registered.stdout.strip() == "['kit-http', 'kit-s3']"
    # The kit's environment built DeepSpeed's ops in a folder of its own: sharing this
    # environment's, each start of one after the other rebuilt them (over a minute).
    import torch

    from ssl_vit.engine.distributed import extensions_dir

    where = subprocess.run(
        [str(venv / "bin" / "python"), "-c",
         "from ssl_vit.engine.distributed import extensions_dir; print(extensions_dir())"],
        cwd=tmp_path, env=_clean_env(), capture_output=True, text=True, check=True,
    )  # fmt: skip
    kit_ops = Path(where.stdout.strip().splitlines()[-1])
    if "TORCH_EXTENSIONS_DIR" not in os.environ:  # else both use the folder chosen for them
        assert kit_ops != extensions_dir()
    if not torch.cuda.is_available():  # on a CPU every start loads DeepSpeed's comm op
        assert list(kit_ops.glob("deepspeed_shm_comm/*.so")), kit_ops
