"""Backbones by MLflow URI, the model registry switch, study nesting, quiet start-up.

The fast tests use a real MLflow SQLite store in-process with small hand-made exports; the slow
one starts a real `mlflow server` on 127.0.0.1, pretrains, deletes the run directory and
evaluates and fine-tunes from the server alone, in another folder.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import ROOT, MlflowServer
from mlflow.tracking import MlflowClient
from safetensors.torch import save_file

from ssl_vit.registry import ArtifactError, resolve_export


def _sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _export(folder: Path, *, wrong_sha: bool = False) -> Path:
    """backbone.safetensors + backbone.json listing its sha256, as export_backbone writes."""
    folder.mkdir(parents=True)
    save_file({"w": torch.arange(6.0).reshape(2, 3)}, str(folder / "backbone.safetensors"))
    sha = "0" * 64 if wrong_sha else _sha(folder / "backbone.safetensors")
    meta = {"format_version": 1, "arch": "x", "kwargs": {}, "files": {"backbone.safetensors": sha}}
    (folder / "backbone.json").write_text(json.dumps(meta))
    return folder


@pytest.fixture()
def store(mlflow_db, tmp_path, monkeypatch):
    """A real SQLite store with its artifact folder, and a tmp download cache."""
    monkeypatch.setenv("SSL_VIT_MLFLOW_CACHE", str(tmp_path / "cache"))
    uri = f"sqlite:///{mlflow_db}"
    client = MlflowClient(uri)
    exp = client.create_experiment("t", artifact_location=str(tmp_path / "artifacts"))
    return uri, client, exp


def _run_with(client: MlflowClient, exp: str, folder: Path | None) -> str:
    rid = client.create_run(exp).info.run_id
    if folder is not None:
        client.log_artifacts(rid, str(folder), "export")
    return rid


def test_runs_uri_downloads_once_verified_and_models_uri_shares_it(store, tmp_path):
    uri, client, exp = store
    rid = _run_with(client, exp, _export(tmp_path / "src"))
    got = resolve_export(f"runs:/{rid}/export", tracking_uri=uri)
    assert got.run_id == rid and got.path.parent == tmp_path / "cache"
    assert _sha(got.path / "backbone.safetensors") == _sha(tmp_path / "src/backbone.safetensors")
    assert json.loads((got.path / "source.json").read_text())["run_id"] == rid

    client.create_registered_model("m")
    client.create_model_version("m", f"runs:/{rid}/export", run_id=rid)
    client.set_registered_model_alias("m", "best", "1")
    for u in ("models:/m/1", "models:/m@best", "models:/m/latest"):
        r = resolve_export(u, tracking_uri=uri)
        assert (r.path, r.run_id, r.model_version) == (got.path, rid, "m/1")

    # A second resolve fetches backbone.json only: the weights in the store are now garbage,
    # which a new download would refuse (sha256), and the cached copy is served.
    weights = next((tmp_path / "artifacts").rglob("backbone.safetensors"))
    weights.write_bytes(b"garbage")
    assert resolve_export(f"runs:/{rid}/export", tracking_uri=uri).path == got.path
    assert [p.name for p in (tmp_path / "cache").iterdir()] == [got.path.name]  # no temp left

    # The run's export replaced (a resumed run exports again): a new entry, not the stale one.
    shutil.rmtree(tmp_path / "src")
    src = _export(tmp_path / "src")
    save_file({"w": torch.ones(2, 3)}, str(src / "backbone.safetensors"))
    meta = json.loads((src / "backbone.json").read_text())
    meta["files"]["backbone.safetensors"] = _sha(src / "backbone.safetensors")
    (src / "backbone.json").write_text(json.dumps(meta))
    client.log_artifacts(rid, str(src), "export")
    new = resolve_export(f"runs:/{rid}/export", tracking_uri=uri)
    assert new.path != got.path
    assert _sha(new.path / "backbone.safetensors") == _sha(src / "backbone.safetensors")


@pytest.mark.parametrize(
    "case,message",
    [
        ("unknown-run", "no run 0123456789abcdef0123456789abcdef in MLflow store"),
        ("missing-artifact", "has no artifact 'export'"),
        ("no-versions", "registered model 'empty' has no versions"),
        ("unknown-model", "no registered model 'nosuch'"),
        ("unknown-version", "registered model 'm' has no version 7; it has [1]"),
        ("pickle", "holds backbone.pt (pickled weights) and no backbone.safetensors"),
        ("sha-mismatch", "backbone.safetensors has sha256"),
        ("not-safetensors", "backbone.safetensors is not a safetensors file"),
    ],
)
def test_bad_uri_is_one_line_error(store, tmp_path, case, message):
    uri, client, exp = store
    target = {"unknown-run": "runs:/0123456789abcdef0123456789abcdef/export"}
    if case == "missing-artifact":
        target[case] = f"runs:/{_run_with(client, exp, None)}/export"
    elif case == "no-versions":
        client.create_registered_model("empty")
        target[case] = "models:/empty/1"
    elif case == "unknown-model":
        target[case] = "models:/nosuch@best"
    elif case == "unknown-version":
        rid = _run_with(client, exp, _export(tmp_path / "src"))
        client.create_registered_model("m")
        client.create_model_version("m", f"runs:/{rid}/export", run_id=rid)
        target[case] = "models:/m/7"
    elif case == "pickle":
        src = _export(tmp_path / "src")
        torch.save({"w": torch.zeros(2)}, src / "backbone.pt")
        (src / "backbone.safetensors").unlink()
        target[case] = f"runs:/{_run_with(client, exp, src)}/export"
    elif case == "sha-mismatch":
        target[case] = f"runs:/{_run_with(client, exp, _export(tmp_path / 's', wrong_sha=True))}"
    elif case == "not-safetensors":  # a pickle under the safetensors name, sha recorded for it
        src = _export(tmp_path / "src")
        torch.save({"w": torch.zeros(2)}, src / "backbone.safetensors")
        meta = json.loads((src / "backbone.json").read_text())
        meta["files"] = {"backbone.safetensors": _sha(src / "backbone.safetensors")}
        (src / "backbone.json").write_text(json.dumps(meta))
        target[case] = f"runs:/{_run_with(client, exp, src)}/export"
    with pytest.raises(ArtifactError) as err:
        resolve_export(target[case], tracking_uri=uri)
    text = str(err.value)
    assert "\n" not in text and text.startswith(target[case]) and message in text, text
    cache = tmp_path / "cache"
    assert not cache.exists() or not any(cache.iterdir())  # nothing unverified kept


TINY = [
    "model.img_size=16", "model.patch_size=4",
    "model.kwargs={depth: 2, embed_dim: 32, num_heads: 2}",
    "data.num_workers=1", "train.global_batch=32", "train.epochs=null", "train.precision=fp32",
    "optim.warmup_steps=2", "run.log_every=2",
]  # fmt: skip
NOISE = ("faiss.loader", "CUDA_HOME", "Creating initial MLflow database tables")


def _py(args: list[str], cwd: Path, env: dict[str, str]) -> subprocess.CompletedProcess:
    path = os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])
    full = {**os.environ, "PYTHONUNBUFFERED": "1", "PYTHONPATH": path, **env}
    proc = subprocess.run([sys.executable, *args], cwd=cwd, env=full, capture_output=True,
                          text=True, timeout=600)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc


@pytest.mark.slow
def test_server_uris_give_the_local_results(tiny_shards, tmp_path):
    """Pretrain against a real server (named by `tracking.uri`), delete the run directory, then
    kNN by `runs:/` and fine-tune by `models:/` from another folder, the server named by
    MLFLOW_TRACKING_URI: the same numbers as from the local export."""
    server = MlflowServer(tmp_path).start()
    a, b = tmp_path / "a", tmp_path / "b"
    a.mkdir(), b.mkdir()
    cache = {"SSL_VIT_MLFLOW_CACHE": str(tmp_path / "cache")}
    env = {**cache, "MLFLOW_TRACKING_URI": server.uri}
    knn = [str(ROOT / "evals/knn.py"), "--data", str(tiny_shards), "--no-cache"]
    ft = [str(ROOT / "evals/finetune.py"), "--config", str(ROOT / "configs/fmnist_finetune.yaml"),
          f"data.root={tiny_shards}", *TINY, "model.img_size=24",
          "train.steps=6", "optim.lr=0.05"]  # fmt: skip
    try:
        pretrain = [str(ROOT / "pipelines/mpp_pretrain.py"), f"data.root={tiny_shards}", *TINY,
                    "run.dir=run", "train.steps=4", "tracking.register_as=tiny",
                    f"tracking.uri={server.uri}"]  # fmt: skip
        pre = _py(pretrain, a, cache)
        assert not [n for n in NOISE if n in pre.stderr], pre.stderr  # quiet start-up
        rid = (a / "run" / "mlflow_run_id").read_text().strip()
        client = MlflowClient(server.uri)
        run = client.get_run(rid)
        assert run.info.status == "FINISHED" and run.data.params["train.global_batch"] == "32"
        assert [m.step for m in client.get_metric_history(rid, "train/loss")] == [2, 4]
        assert "export" in {f.path for f in client.list_artifacts(rid)}
        _py([*knn, "--backbone", "run", "--out", "knn.json"], a, env)
        _py([*ft, "model.init_from=run", "run.dir=ft"], a, env)
        shutil.rmtree(a / "run")

        got = _py([*knn, "--backbone", f"runs:/{rid}/export", "--out", "knn.json"], b, env)
        _py([*ft, "model.init_from=models:/tiny/1", "run.dir=ft"], b, env)
        assert not [n for n in NOISE if n in got.stderr], got.stderr
        version = client.get_model_version("tiny", "1")
        assert version.run_id == rid and float(version.tags["train/loss"]) > 0
        remote = json.loads((b / "knn.json").read_text())
        assert client.get_run(remote["mlflow_run_id"]).data.tags["pretrain_run_id"] == rid
        ft_run = (b / "ft" / "mlflow_run_id").read_text().strip()
        assert client.get_run(ft_run).data.tags["pretrain_run_id"] == rid  # lineage
    finally:
        server.kill()
    local, remote = (json.loads((d / "knn.json").read_text()) for d in (a, b))
    drop = {"search_seconds"}
    assert {k: v for k, v in remote["metrics"].items() if k not in drop} == {
        k: v for k, v in local["metrics"].items() if k not in drop
    }
    assert (
        remote["pretrain_run_id"] == rid and remote["params"]["backbone"] == f"runs:/{rid}/export"
    )
    ft_local, ft_remote = (json.loads((d / "ft" / "results.json").read_text()) for d in (a, b))
    assert ft_remote["history"] == ft_local["history"] and len(ft_remote["history"]) == 1
    cached = list((tmp_path / "cache").iterdir())  # runs:/ and models:/ share one download
    assert len(cached) == 1 and (cached[0] / "backbone.safetensors").is_file()


@pytest.mark.slow
def test_start_up_is_quiet_unless_verbose(tiny_shards, tmp_path):
    """A fresh SQLite store and FAISS: their loading lines only with -v."""
    argv = [str(ROOT / "evals/knn.py"), "--random-init", "vit_tiny_patch16_224", "--patch-size",
            "4", "--model-kwargs", '{"depth": 1, "embed_dim": 32, "num_heads": 2}', "--data",
            str(tiny_shards), "--no-cache", "--k", "5"]  # fmt: skip
    for verbose in (False, True):
        db = f"sqlite:///{tmp_path / f'v{verbose}.db'}"
        proc = _py([*argv, "--tracking-uri", db, *(["-v"] if verbose else [])], tmp_path, {})
        shown = {n for n in ("faiss.loader", "Creating initial MLflow database tables")
                 if n in proc.stderr}  # fmt: skip
        assert len(shown) == (2 if verbose else 0), (verbose, proc.stderr)


def test_register_with_the_store_down_is_a_warning(tmp_path, caplog):
    import socket

    from ssl_vit.registry import register_export

    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    assert register_export(f"http://127.0.0.1:{port}", "tiny", "abc") is None
    assert "python -m ssl_vit.tracking register abc tiny" in caplog.text


def test_register_command_makes_a_version_that_resolves(store, tmp_path, capsys):
    from ssl_vit.tracking import main

    uri, client, exp = store
    rid = _run_with(client, exp, _export(tmp_path / "src"))
    assert main(["register", rid, "later", "--tracking-uri", uri]) == 0
    assert capsys.readouterr().out.strip() == "models:/later/1"
    assert client.get_run(rid).data.tags["ssl_vit.registered_as"] == "models:/later/1"
    assert resolve_export("models:/later/1", tracking_uri=uri).run_id == rid
    empty = client.create_run(exp).info.run_id  # no export logged: nothing to register
    assert main(["register", empty, "later", "--tracking-uri", uri]) == 1
    assert len(client.search_model_versions("name='later'")) == 1
