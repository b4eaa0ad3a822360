"""Export and load backbones: backbone.safetensors + backbone.json.

Weights are plain tensors in safetensors (never pickled); backbone.json names the timm
architecture and the `build_backbone` arguments, so loading needs no code from the training run.
Loading at another img_size interpolates the position embeddings (paper sec. 3.2).
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from safetensors.torch import load_file, save
from torch import nn

from ssl_vit.io import atomic_write_bytes, atomic_write_text, sha256_file
from ssl_vit.models.networks import build_backbone, token_geometry
from ssl_vit.models.pos_embed import adapt_pos_embed_state

__all__ = ["export_backbone", "load_backbone", "record_files", "FORMAT_VERSION"]

FORMAT_VERSION = 1
WEIGHTS = "backbone.safetensors"
META = "backbone.json"


def export_backbone(
    model: nn.Module,
    out_dir: str | os.PathLike,
    *,
    arch: str,
    kwargs: dict[str, Any],
    mean: Sequence[float],
    std: Sequence[float],
    extra: dict[str, Any] | None = None,
) -> Path:
    """Write out_dir/backbone.safetensors and out_dir/backbone.json; return out_dir.

    `kwargs` are the `build_backbone` keyword arguments (img_size, in_chans, patch_size, ...).
    Both files are written to temporary names, fsynced and renamed, weights first, so a reader
    never sees a JSON that points at half-written weights. backbone.json records the weights'
    sha256 under `files`, which a download from MLflow is checked against.
    """
    if "img_size" not in kwargs or "in_chans" not in kwargs:
        raise ValueError("export_backbone: kwargs must include img_size and in_chans")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tensors = {k: v.detach().to("cpu").contiguous() for k, v in model.state_dict().items()}
    atomic_write_bytes(out / WEIGHTS, save(tensors, metadata={"format": "pt", "arch": arch}))
    meta: dict[str, Any] = {
        "format_version": FORMAT_VERSION,
        "arch": arch,
        "kwargs": dict(kwargs),
        "mean": [float(m) for m in mean],
        "std": [float(s) for s in std],
        "token_grid": list(token_geometry(model).grid),
        "files": {WEIGHTS: sha256_file(out / WEIGHTS)},
    }
    meta.update(extra or {})
    atomic_write_text(out / META, json.dumps(meta, indent=2) + "\n")
    return out


def record_files(out_dir: str | os.PathLike, names: Sequence[str]) -> None:
    """Add the sha256 of more files of the export (e.g. the objective's) to backbone.json."""
    out = Path(out_dir)
    meta = json.loads((out / META).read_text(encoding="utf-8"))
    files = dict(meta.get("files") or {})
    files.update({name: sha256_file(out / name) for name in names})
    meta["files"] = files
    atomic_write_text(out / META, json.dumps(meta, indent=2) + "\n")


def find_export(path: Path) -> Path:
    """The export folder at `path`, its `export/` subfolder, or the folder of either file."""
    for cand in (path, path / "export"):
        if (cand / META).is_file():
            return cand
    if path.is_file() and path.name in (META, WEIGHTS):
        return path.parent
    raise FileNotFoundError(
        f"{path}: no {META} here or in {path / 'export'}; pass an export folder or a run directory"
    )


def load_backbone(
    path: str | os.PathLike, *, img_size: int | None = None, drop_path_rate: float = 0.0
) -> tuple[nn.Module, dict[str, Any]]:
    """Load an exported backbone (folder, run directory, or either file) -> (model, backbone.json).

    With `img_size` different from the exported one the position embeddings are 2-D
    interpolated; an MLP-Mixer cannot change size (its token-mixing MLPs are sized by N).
    `drop_path_rate` > 0 builds it with stochastic depth, for fine-tuning.
    """
    folder = find_export(Path(path))
    meta_path = folder / META
    try:
        meta = json.loads(meta_path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as e:
        raise ValueError(f"{meta_path}: not valid JSON ({e}); re-export the backbone") from e
    for key in ("format_version", "arch", "kwargs"):
        if key not in meta:
            raise ValueError(f"{meta_path}: missing key {key!r}; re-export the backbone")
    if meta["format_version"] != FORMAT_VERSION:
        raise ValueError(
            f"{meta_path}: format_version {meta['format_version']} is not {FORMAT_VERSION}; "
            "upgrade ssl-vit or re-export"
        )
    kwargs = dict(meta["kwargs"])
    kwargs.pop("drop_path_rate", None)  # a training setting, inert in eval: ours wins
    old_size = int(kwargs["img_size"])
    if img_size is not None:
        kwargs["img_size"] = int(img_size)
    model = build_backbone(meta["arch"], **kwargs, drop_path_rate=drop_path_rate)
    weights = folder / WEIGHTS
    if not weights.is_file():
        raise FileNotFoundError(f"{weights}: missing; the export in {folder} is incomplete")
    try:
        state = load_file(str(weights))
    except Exception as e:  # SafetensorError: a pickle or a truncated file under this name
        raise ValueError(
            f"{weights}: not a readable safetensors file ({type(e).__name__}: "
            f"{str(e)[:120]}); ssl-vit loads safetensors only, re-export the backbone"
        ) from None
    if kwargs["img_size"] != old_size:
        if getattr(model, "pos_embed", None) is None:
            raise ValueError(
                f"{meta_path}: arch {meta['arch']} has no position embeddings to interpolate; "
                f"load it at its exported img_size {old_size}"
            )
        grid = meta.get("token_grid")  # absent: a square grid is inferred from the table
        old_grid = tuple(grid) if grid else None
        state = adapt_pos_embed_state(state, model, old_grid)
    try:
        model.load_state_dict(state, strict=True)
    except RuntimeError as e:
        raise ValueError(f"{weights}: does not match {meta['arch']} {kwargs}: {e}") from e
    return model, meta
