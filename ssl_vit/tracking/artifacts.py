"""A backbone by its MLflow URI: `runs:/RUN_ID/export`, `models:/NAME/VERSION` or `@ALIAS`.

    resolved = resolve_export("runs:/0a1b.../export", tracking_uri="http://127.0.0.1:5000")
    model, meta = load_backbone(resolved.path)      # a local export folder, verified
    resolved.run_id                                  # the run that logged it (lineage)

The one place every `--backbone`, `model.init_from` and `--check` turns a URI into a local
export folder; a plain path comes back as it is. The trainer logs RUN/export as the run's
`export` artifact, so a run seen in the MLflow UI is enough: no access to the run directory.

Artifacts are downloaded once into a cache keyed by their content: the sha256 of the export's
backbone.json (fetched first, a few hundred bytes), which records every file's sha256; a
registry version resolves to its run's artifact, so `runs:/` and `models:/` share an entry, and
a run whose export was replaced gets a new one. $SSL_VIT_MLFLOW_CACHE, else
~/.cache/ssl-vit/mlflow. A download lands in a temporary
folder, every file backbone.json lists under `files` is checked against its sha256, every
`.safetensors` file must parse as safetensors, and only then is the folder renamed into place,
so the cache never holds a half-written or unverified export. Pickled weights (`.pt`, `.pth`,
`.bin`, `.pkl`, `.ckpt`) are refused: loading them can run code. Every problem is an
`ArtifactError` whose one line names the URI and what is missing.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

from ssl_vit.io import sha256_file
from ssl_vit.tracking.store import open_client

log = logging.getLogger("ssl_vit.tracking")

__all__ = ["ArtifactError", "ResolvedExport", "cache_root", "is_mlflow_uri", "resolve_export"]

CACHE_ENV = "SSL_VIT_MLFLOW_CACHE"
SCHEMES = ("runs:/", "models:/")
PICKLE_SUFFIXES = (".pt", ".pth", ".bin", ".pkl", ".pickle", ".ckpt")
SOURCE_FILE = "source.json"  # beside the downloaded files: where they came from
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


def is_mlflow_uri(source: object) -> bool:
    return isinstance(source, str) and source.startswith(SCHEMES)


def cache_root() -> Path:
    env = os.environ.get(CACHE_ENV)
    return Path(env) if env else Path.home() / ".cache" / "ssl-vit" / "mlflow"


def resolve_export(source: str | os.PathLike, *, tracking_uri: str | None = None) -> ResolvedExport:
    """A local export folder for `source`: a path as given, or an MLflow URI downloaded once."""
    if not is_mlflow_uri(source):
        return ResolvedExport(Path(source))
    uri = str(source)
    store = tracking_uri or os.environ.get("MLFLOW_TRACKING_URI") or "sqlite:///mlflow.db"
    m = _RUNS.match(uri)
    if m:
        run_id, path = m.group(1), (m.group(2) or "export").strip("/")
        return _fetch_run_artifact(uri, store, run_id, path, model_version=None)
    m = _MODELS.match(uri)
    if not m:
        raise ArtifactError(
            f"{uri}: not an MLflow URI this tool reads; use runs:/RUN_ID/export, "
            "models:/NAME/VERSION or models:/NAME@ALIAS"
        )
    name, version, alias = m.groups()
    return _fetch_model_version(uri, store, name, version, alias)


def client_for(store: str):
    """An MlflowClient that gives up on a dead server within seconds (not minutes of retries)."""
    if store.startswith(("http://", "https://")):  # a dead server answers within seconds
        os.environ.setdefault("MLFLOW_HTTP_REQUEST_TIMEOUT", "10")
        os.environ.setdefault("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "1")
    return open_client(store)


def _missing(e: Exception) -> bool:
    code = getattr(e, "error_code", "")
    return code in ("RESOURCE_DOES_NOT_EXIST", "INVALID_PARAMETER_VALUE", "NOT_FOUND")


def _unreachable(uri: str, store: str, e: Exception) -> ArtifactError:
    first = (str(e).splitlines() or [type(e).__name__])[0][:200]
    return ArtifactError(f"{uri}: cannot read from MLflow store {store} ({first})")


def _fetch_model_version(
    uri: str, store: str, name: str, version: str | None, alias: str | None
) -> ResolvedExport:
    client = client_for(store)
    try:
        versions = client.search_model_versions(f"name='{name}'")
    except Exception as e:
        raise _unreachable(uri, store, e) from None
    if not versions:
        try:
            client.get_registered_model(name)
        except Exception as e:
            if _missing(e):
                raise ArtifactError(
                    f"{uri}: no registered model {name!r} in {store}; check the name "
                    "(register one with tracking.register_as=NAME)"
                ) from None
            raise _unreachable(uri, store, e) from None
        raise ArtifactError(
            f"{uri}: registered model {name!r} has no versions in {store}; register one "
            "(tracking.register_as=NAME or `python -m ssl_vit.tracking register`)"
        )
    have = sorted(int(v.version) for v in versions)
    if alias is not None:
        try:
            mv = client.get_model_version_by_alias(name, alias)
        except Exception as e:
            if _missing(e):
                raise ArtifactError(
                    f"{uri}: registered model {name!r} has no alias {alias!r}; versions {have}"
                ) from None
            raise _unreachable(uri, store, e) from None
    elif version == "latest":
        mv = max(versions, key=lambda v: int(v.version))
    else:
        mv = next((v for v in versions if str(v.version) == version), None)
        if mv is None:
            raise ArtifactError(
                f"{uri}: registered model {name!r} has no version {version}; it has {have}"
            )
    label = f"{name}/{mv.version}"
    try:
        src = client.get_model_version_download_uri(name, str(mv.version))
    except Exception as e:
        raise _unreachable(uri, store, e) from None
    m = _RUNS.match(src or "")
    if m:  # the usual case (tracking.register_as): the version points at its run's artifact
        path = (m.group(2) or "export").strip("/")
        return _fetch_run_artifact(uri, store, m.group(1), path, model_version=label)
    key = hashlib.sha256(f"source:{src}".encode()).hexdigest()[:32]
    folder = _download(uri, store, key, dict(artifact_uri=src), mv.run_id, src)
    return ResolvedExport(folder, uri, mv.run_id or None, label)


def _fetch_run_artifact(
    uri: str, store: str, run_id: str, path: str, model_version: str | None
) -> ResolvedExport:
    client = client_for(store)
    try:
        client.get_run(run_id)
    except Exception as e:
        if _missing(e):
            raise ArtifactError(
                f"{uri}: no run {run_id} in MLflow store {store}; check the id "
                "(and --tracking-uri / tracking.uri)"
            ) from None
        raise _unreachable(uri, store, e) from None
    try:
        listed = client.list_artifacts(run_id, path)
    except Exception as e:
        raise _unreachable(uri, store, e) from None
    names = {Path(a.path).name for a in listed if not a.is_dir}
    if not listed:
        top = sorted(a.path for a in client.list_artifacts(run_id))
        raise ArtifactError(
            f"{uri}: run {run_id} has no artifact {path!r} (it has {top}); was the run "
            "exported, or its spool replayed?"
        )
    _check_listing(uri, names)
    # Keyed by content: backbone.json holds every file's sha256, so a run whose export was
    # replaced (a resumed run exports again) gets a new entry, never the stale one.
    meta = _fetch_meta(uri, store, run_id, path)
    key = hashlib.sha256(meta).hexdigest()[:32]
    what = dict(run_id=run_id, artifact_path=path)
    folder = _download(uri, store, key, what, run_id, f"runs:/{run_id}/{path}", meta)
    return ResolvedExport(folder, uri, run_id, model_version)


def _fetch_meta(uri: str, store: str, run_id: str, path: str) -> bytes:
    """backbone.json alone (small): the cache key, fetched before any weights."""
    import mlflow

    with tempfile.TemporaryDirectory() as tmp:
        try:
            got = mlflow.artifacts.download_artifacts(
                run_id=run_id, artifact_path=f"{path}/backbone.json", dst_path=tmp,
                tracking_uri=store,
            )  # fmt: skip
            return Path(got).read_bytes()
        except Exception as e:
            raise _unreachable(uri, store, e) from None


def _check_listing(uri: str, names: set[str]) -> None:
    pickles = sorted(n for n in names if n.endswith(PICKLE_SUFFIXES))
    if "backbone.safetensors" not in names and pickles:
        raise ArtifactError(
            f"{uri}: holds {pickles[0]} (pickled weights) and no backbone.safetensors; ssl-vit "
            "loads safetensors only: export the backbone with ssl_vit.models.export_backbone"
        )
    for need in ("backbone.json", "backbone.safetensors"):
        if need not in names:
            raise ArtifactError(
                f"{uri}: no {need} in this artifact (it has {sorted(names)}); point at a run's "
                "export/ artifact"
            )


def _download(
    uri: str,
    store: str,
    key: str,
    what: dict,
    run_id: str | None,
    resolved: str,
    meta: bytes | None = None,
) -> Path:
    """Download into a temporary folder, verify, rename to cache/key; returns cache/key."""
    import mlflow

    root = cache_root()
    folder = root / key
    if (folder / "backbone.json").is_file():  # complete and verified: it was renamed in
        log.info("%s: cached in %s", uri, folder)
        return folder
    root.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{key}.", dir=root))
    try:
        log.info("%s: downloading to %s", uri, folder)
        try:
            got = Path(
                mlflow.artifacts.download_artifacts(**what, dst_path=str(tmp), tracking_uri=store)
            )
        except Exception as e:
            raise _unreachable(uri, store, e) from None
        if got.is_file():  # an artifact path naming one file: use its folder
            got = got.parent
        _check_listing(uri, {p.name for p in got.iterdir() if p.is_file()})
        if meta is not None and (got / "backbone.json").read_bytes() != meta:
            raise ArtifactError(f"{uri}: the export changed while it was downloaded; retry")
        verify_export(got, uri)
        source = {"uri": uri, "resolved": resolved, "run_id": run_id, "tracking_uri": store}
        (got / SOURCE_FILE).write_text(json.dumps(source, indent=2) + "\n")
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
        meta = json.loads((folder / "backbone.json").read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as e:
        raise ArtifactError(f"{label}: backbone.json is not readable JSON ({e})") from None
    files = meta.get("files")
    if not isinstance(files, dict) or not files:
        log.warning("%s: backbone.json records no sha256 (an older export); not verified", label)
        files = {}
    for name, want in files.items():
        path = folder / name
        if not path.is_file():
            raise ArtifactError(f"{label}: {name} is listed in backbone.json but missing")
        got = sha256_file(path)
        if got != want:
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
                f"{label}: {path.name} is not a safetensors file ({type(e).__name__}); "
                "ssl-vit loads safetensors only"
            ) from None
