"""Backbones in MLflow, the model registry and run artifacts: `resolve_export` turns
`runs:/RUN_ID/export`, `models:/NAME/VERSION`, `models:/NAME@ALIAS` or `models:/NAME/latest`
into a local, verified export folder (a plain path comes back as given); `register_export`
(ssl_vit.tracking.tracker) makes a run's export a registered model version.

Downloads are cached under $SSL_VIT_MLFLOW_CACHE (else ~/.cache/ssl-vit/mlflow), keyed by the
sha256 of the export's backbone.json, fetched first, which lists every file's sha256: `runs:/`
and `models:/` share an entry, and a run exported again gets a new one. A download is checked
(each listed sha256; each .safetensors parses) in a temporary folder before it is renamed into
place, and pickled weights are refused: loading them can run code. Every problem is an
`ArtifactError` of one line naming the URI.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ssl_vit.io import sha256_file
from ssl_vit.tracking.tracker import client_for, register_export, resolve_uri

# Registering a run's export is MLflow tracking, so it lives in ssl_vit.tracking (whose command
# `register` calls it); it is named here too, beside the resolution of what it registers.
__all__ = ["ArtifactError", "ResolvedExport", "register_export", "resolve_export", "verify_export"]

log = logging.getLogger("ssl_vit.tracking")
MLFLOW_SCHEMES = ("runs:/", "models:/")  # a --backbone or model.init_from that MLflow resolves
PICKLES = (".pt", ".pth", ".bin", ".pkl", ".pickle", ".ckpt")
_RUNS = re.compile(r"^runs:/([0-9A-Za-z_-]+)(?:/(.*))?$")
_MODELS = re.compile(r"^models:/([^/@]+)(?:/([^/]+)|@([^/]+))$")


class ArtifactError(ValueError):
    """A URI that does not lead to a usable export; the message is one line."""


@dataclass(frozen=True)
class ResolvedExport:
    path: Path  # local export folder (or the path given, when it was not a URI)
    uri: str | None = None  # the MLflow URI given
    run_id: str | None = None  # the run whose artifact it is
    model_version: str | None = None  # "NAME/VERSION" for a registry URI


def cache_root() -> Path:
    return Path(os.environ.get("SSL_VIT_MLFLOW_CACHE") or Path.home() / ".cache/ssl-vit/mlflow")


def resolve_export(source: str | os.PathLike, *, tracking_uri: str | None = None) -> ResolvedExport:
    """A local export folder for `source`: a path as given, or an MLflow URI downloaded once."""
    if not (isinstance(source, str) and source.startswith(MLFLOW_SCHEMES)):
        return ResolvedExport(Path(source))  # a local folder: no MLflow to load (seconds)
    import mlflow

    uri, store, label = source, resolve_uri(tracking_uri), None
    client = client_for(store)
    if m := _MODELS.match(uri):
        mv = _model_version(client, uri, store, *m.groups())
        label = f"{mv.name}/{mv.version}"
        with _reading(uri, store):
            src = client.get_model_version_download_uri(mv.name, str(mv.version))
        if not (m := _RUNS.match(src or "")):  # a version that is not a run's artifact
            key = hashlib.sha256(f"source:{src}".encode()).hexdigest()[:32]
            folder = _download(uri, key, {"artifact_uri": src, "tracking_uri": store})
            return ResolvedExport(folder, uri, mv.run_id or None, label)
    elif not (m := _RUNS.match(uri)):
        raise ArtifactError(
            f"{uri}: not an MLflow URI this tool reads; use runs:/RUN_ID/export, "
            "models:/NAME/VERSION or models:/NAME@ALIAS"
        )
    run_id, path = m.group(1), (m.group(2) or "export").strip("/")
    hint = "check the id (and --tracking-uri or tracking.uri)"
    with _reading(uri, store, missing=f"no run {run_id} in MLflow store {store}; {hint}"):
        client.get_run(run_id)
    with _reading(uri, store):
        if not (listed := client.list_artifacts(run_id, path)):
            top = sorted(a.path for a in client.list_artifacts(run_id))
            raise ArtifactError(
                f"{uri}: run {run_id} has no artifact {path!r} (it has {top}); was the run "
                "exported, and its record replayed?"
            )
        _check_names(uri, {Path(a.path).name for a in listed if not a.is_dir})
        what = {"run_id": run_id, "artifact_path": path, "tracking_uri": store}
        with tempfile.TemporaryDirectory() as tmp:  # backbone.json alone first: the cache key
            meta_uri = {**what, "artifact_path": f"{path}/backbone.json"}
            meta = Path(mlflow.artifacts.download_artifacts(**meta_uri, dst_path=tmp)).read_bytes()
    folder = _download(uri, hashlib.sha256(meta).hexdigest()[:32], what, meta)
    return ResolvedExport(folder, uri, run_id, label)


@contextmanager
def _reading(uri: str, store: str, missing: str | None = None) -> Iterator[None]:
    """A failure reading the store becomes an ArtifactError: `missing` when the store says the
    thing does not exist, else that the store could not be read."""
    try:
        yield
    except ArtifactError:
        raise
    except Exception as e:
        code = getattr(e, "error_code", "")
        if missing and code in ("RESOURCE_DOES_NOT_EXIST", "INVALID_PARAMETER_VALUE", "NOT_FOUND"):
            raise ArtifactError(f"{uri}: {missing}") from None
        first = (str(e).splitlines() or [type(e).__name__])[0][:200]
        raise ArtifactError(f"{uri}: cannot read from MLflow store {store} ({first})") from None


def _model_version(client: Any, uri: str, store: str, name: str, version: str, alias: str) -> Any:
    with _reading(uri, store):
        versions = client.search_model_versions(f"name='{name}'")
    if not versions:
        hint = "check the name (register one with tracking.register_as)"
        with _reading(uri, store, missing=f"no registered model {name!r} in {store}; {hint}"):
            client.get_registered_model(name)
        raise ArtifactError(
            f"{uri}: registered model {name!r} has no versions in {store}; register one "
            "(tracking.register_as=NAME or `python -m ssl_vit.tracking register`)"
        )
    have = sorted(int(v.version) for v in versions)
    if alias is not None:
        no_alias = f"registered model {name!r} has no alias {alias!r}; versions {have}"
        with _reading(uri, store, missing=no_alias):
            return client.get_model_version_by_alias(name, alias)
    if version == "latest":
        return max(versions, key=lambda v: int(v.version))
    for v in versions:
        if str(v.version) == version:
            return v
    raise ArtifactError(f"{uri}: registered model {name!r} has no version {version}; it has {have}")


def _check_names(uri: str, names: set[str]) -> None:
    pickles = sorted(n for n in names if n.endswith(PICKLES))
    if "backbone.safetensors" not in names and pickles:
        raise ArtifactError(
            f"{uri}: holds {pickles[0]} (pickled weights) and no backbone.safetensors; ssl-vit "
            "loads safetensors only: export the backbone with ssl_vit.models.export_backbone"
        )
    if missing := [n for n in ("backbone.json", "backbone.safetensors") if n not in names]:
        raise ArtifactError(
            f"{uri}: no {missing[0]} in this artifact (it has {sorted(names)}); point at a run's "
            "export/ artifact"
        )


def _download(uri: str, key: str, what: dict, meta: bytes | None = None) -> Path:
    """Download into a temporary folder, check it, rename it to cache/key; returns cache/key."""
    import mlflow

    root = cache_root()
    folder = root / key
    if (folder / "backbone.json").is_file():  # complete and checked: it was renamed in
        log.info("%s: cached in %s", uri, folder)
        return folder
    root.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{key}.", dir=root))
    try:
        log.info("%s: downloading to %s", uri, folder)
        with _reading(uri, what["tracking_uri"]):
            got = Path(mlflow.artifacts.download_artifacts(**what, dst_path=str(tmp)))
        got = got.parent if got.is_file() else got
        _check_names(uri, {p.name for p in got.iterdir() if p.is_file()})
        if meta is not None and (got / "backbone.json").read_bytes() != meta:
            raise ArtifactError(f"{uri}: the export changed while it was downloaded; retry")
        verify_export(got, uri)
        (got / "source.json").write_text(json.dumps({"uri": uri, **what}, indent=2) + "\n")
        try:
            os.replace(got, folder)  # atomic; a folder another process put there first stays
        except OSError:
            if not (folder / "backbone.json").is_file():
                raise
        return folder
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def verify_export(folder: Path, label: str) -> None:
    """Each file backbone.json lists under `files` has its sha256; each .safetensors parses."""
    from safetensors import safe_open

    try:
        files = json.loads((folder / "backbone.json").read_text(encoding="utf-8")).get("files")
    except (OSError, json.JSONDecodeError) as e:
        raise ArtifactError(f"{label}: backbone.json is not readable JSON ({e})") from None
    if not isinstance(files, dict) or not files:
        log.warning("%s: backbone.json records no sha256 (an older export); not verified", label)
    for name, want in (files or {}).items():
        if not (folder / name).is_file():
            raise ArtifactError(f"{label}: {name} is listed in backbone.json but missing")
        if (got := sha256_file(folder / name)) != want:
            raise ArtifactError(
                f"{label}: {name} has sha256 {got[:16]}..., backbone.json says {want[:16]}...; "
                "the download is corrupt or the export was changed after it was written"
            )
    for path in sorted(folder.glob("*.safetensors")):
        try:
            with safe_open(str(path), framework="pt") as f:
                f.keys()
        except Exception as e:
            raise ArtifactError(
                f"{label}: {path.name} is not a safetensors file "
                f"({type(e).__name__}); ssl-vit loads safetensors only"
            ) from None
