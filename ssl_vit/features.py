"""Frozen features of a backbone on a shard split, extracted in batches and cached on disk.

Every evaluator (kNN, few-shot ridge, linear probe) starts from the same (N, D) matrix of
features and (N,) labels. Extracting them is the slow part, so they are stored under a cache
directory keyed by what determines them: the backbone weights (file sha256, or arch + kwargs +
seed for a randomly initialised baseline), the shard set (manifest sha256), the split, the
pooling and the input size. A second eval of the same backbone reuses them.

Cache files are safetensors (never pickle), written atomically (`ssl_vit.io`).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import sys
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F
from safetensors.numpy import load_file, save
from tqdm.auto import tqdm

from ssl_vit import readout
from ssl_vit.data.manifest import load_manifest
from ssl_vit.feature_options import DEFAULT_CACHE_DIR
from ssl_vit.io import atomic_write_bytes, sha256_file
from ssl_vit.readout import POOLS, readout_name

log = logging.getLogger(__name__)

# Objectives whose loss reaches the [class] token. MPP's loss sits on the corrupted patch tokens
# only (paper sec. 4.6), so after MPP the [class] output is never trained and "auto" pools the
# patch tokens instead.
CLS_TRAINING_OBJECTIVES = ("supervised", "joint", "finetune", "cascade")
CACHE_FORMAT = 1


class FeatureError(ValueError):
    """Bad backbone/data combination; the message names the file and what to do."""


@dataclass
class EvalBackbone:
    """A frozen backbone ready for feature extraction."""

    model: nn.Module
    meta: dict[str, Any]  # backbone.json (or its equivalent for a random init)
    ident: str  # cache identity: weights sha256, or a hash of arch/kwargs/seed
    img_size: int
    in_chans: int
    source: str  # path or "random:ARCH"
    run_dir: Path | None = None  # the pretraining run directory, when known
    source_run_id: str | None = None  # the MLflow run the export came from (an MLflow URI)


@dataclass
class FeatureSet:
    features: np.ndarray  # (N, D) float32
    labels: np.ndarray  # (N,) int64, -1 when unlabelled
    cache_hit: bool = False
    seconds: float = 0.0


class RawPixels(nn.Module):
    """The baseline that learns nothing: its features are the normalised pixels, (B, C*H*W)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.flatten(1)


def raw_pixels_backbone(
    *, img_size: int, in_chans: int, mean: list[float], std: list[float]
) -> EvalBackbone:
    """Raw pixels as features: the floor that a pretrained backbone has to clear."""
    meta = {
        "arch": "raw-pixels",
        "kwargs": {"img_size": img_size, "in_chans": in_chans},
        "mean": mean,
        "std": std,
    }
    return EvalBackbone(
        RawPixels(), meta, f"pixels:{in_chans}x{img_size}", img_size, in_chans, "raw-pixels"
    )


def resolve_pool(backbone: EvalBackbone, pool: str) -> str:
    """The pooling that "auto" means for this backbone; other values pass through.

    [class] token when the pretraining objective trained it (supervised, joint, fine-tuned),
    otherwise the mean of the patch tokens (MPP, random init, backbones without [class]).
    """
    if isinstance(backbone.model, RawPixels):
        return "pixels"
    if pool != "auto":
        return pool
    has_cls = getattr(backbone.model, "cls_token", None) is not None
    trained = backbone.meta.get("objective") in CLS_TRAINING_OBJECTIVES
    return "cls" if has_cls and trained else "mean"


def _weights_file(path: Path) -> Path:
    for cand in (path / "backbone.safetensors", path / "export" / "backbone.safetensors"):
        if cand.is_file():
            return cand
    raise FeatureError(
        f"{path}: no backbone.safetensors here or under export/; pass an export folder or a run "
        "directory written by the trainer (or use --random-init ARCH for a baseline)"
    )


def _model_geometry(model: nn.Module) -> tuple[int, int]:
    """(img_size, in_chans) the model expects (square inputs)."""
    from ssl_vit.models import token_geometry

    geo = token_geometry(model)
    return int(geo.img_size[0]), int(geo.in_chans)


def load_eval_backbone(path: str | os.PathLike, *, img_size: int | None = None) -> EvalBackbone:
    """Load an export folder or a run directory (`ssl_vit.models.load_backbone`)."""
    path = Path(path)
    if not path.exists():
        raise FeatureError(f"{path}: no such backbone folder; pass an export folder or run dir")
    weights = _weights_file(path)
    from ssl_vit.models import load_backbone  # imported late: models pulls in timm (seconds)

    model, meta = load_backbone(path, img_size=img_size)
    size, chans = _model_geometry(model)
    run_dir = weights.parent.parent if weights.parent.name == "export" else None
    ident = "sha256:" + sha256_file(weights)
    return EvalBackbone(model.eval(), meta, ident, size, chans, str(path), run_dir)


def random_backbone(
    arch: str,
    *,
    img_size: int,
    in_chans: int,
    patch_size: int | None,
    mean: list[float],
    std: list[float],
    seed: int = 0,
    **timm_kwargs: Any,
) -> EvalBackbone:
    """A randomly initialised backbone, the baseline every pretraining should beat."""
    from ssl_vit.models import build_backbone

    with torch.random.fork_rng(devices=[]):  # seeded weights without touching the global RNG
        torch.manual_seed(seed)
        model = build_backbone(
            arch, img_size=img_size, in_chans=in_chans, patch_size=patch_size, **timm_kwargs
        )
    kwargs = {"img_size": img_size, "in_chans": in_chans, "patch_size": patch_size, **timm_kwargs}
    meta = {"arch": arch, "kwargs": kwargs, "mean": list(mean), "std": list(std), "seed": seed}
    blob = json.dumps({"arch": arch, "kwargs": kwargs, "seed": seed}, sort_keys=True)
    ident = "random:" + hashlib.sha256(blob.encode()).hexdigest()
    size, chans = _model_geometry(model)
    return EvalBackbone(model.eval(), meta, ident, size, chans, f"random:{arch}")


def pool_tokens(
    model: nn.Module, x: torch.Tensor, pool: str, n_last: int = 4, layer: int | None = None
) -> torch.Tensor:
    """Features (B, D') of normalised images x (B, C, H, W); see `ssl_vit.readout`."""
    if isinstance(model, RawPixels):
        return model(x)
    try:
        return readout.pool_tokens(model, x, pool, n_last, layer)
    except ValueError as e:
        raise FeatureError(str(e)) from None


def default_device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def extract_features(
    backbone: EvalBackbone,
    batches: Iterable[tuple[torch.Tensor, torch.Tensor]],
    *,
    pool: str = "auto",
    n_last: int = 4,
    layer: int | None = None,
    device: torch.device | None = None,
    bf16: bool | None = None,
    total: int | None = None,
    desc: str = "features",
) -> tuple[np.ndarray, np.ndarray]:
    """Run uint8 image batches (B, C, H, W) through the frozen backbone: (N, D') features.

    `layer` reads block `layer` (from 1) instead of the last (`ssl_vit.readout`); the input
    handling is `extract_with`'s.
    """
    pool = resolve_pool(backbone, pool)

    def read(m: nn.Module, x: torch.Tensor) -> dict[str, torch.Tensor]:
        return {"f": pool_tokens(m, x, pool, n_last, layer)}

    out, labels = extract_with(
        backbone, batches, read, device=device, bf16=bf16, total=total, desc=desc
    )
    return out["f"], labels


@torch.no_grad()
def extract_with(
    backbone: EvalBackbone,
    batches: Iterable[tuple[torch.Tensor, torch.Tensor]],
    read: Callable[[nn.Module, torch.Tensor], dict[str, torch.Tensor]],
    *,
    device: torch.device | None = None,
    bf16: bool | None = None,
    total: int | None = None,
    desc: str = "features",
    dtype: type = np.float32,
) -> tuple[dict[str, np.ndarray], np.ndarray]:
    """Run uint8 image batches through the frozen backbone; `read(model, x)` names features.

    Images are scaled to [0, 1], resized to the backbone's input size when they differ,
    grey images are repeated to 3 channels for an RGB backbone, then normalised with the
    backbone's mean/std from backbone.json. bf16 autocast defaults to on for CUDA and off for
    CPU, where it is emulated and several times slower without AVX512-BF16/AMX (pass bf16=True
    on CPUs that have them). One pass can read
    several features (every block's, to choose a read-out); `dtype` is what they are kept in.
    """
    device = device or default_device()
    bf16 = (device.type == "cuda") if bf16 is None else bf16
    model = backbone.model.to(device).eval()
    mean = torch.tensor(backbone.meta["mean"], dtype=torch.float32, device=device)
    std = torch.tensor(backbone.meta["std"], dtype=torch.float32, device=device)
    if mean.numel() != backbone.in_chans and mean.numel() == 1:
        mean, std = mean.expand(backbone.in_chans), std.expand(backbone.in_chans)
    feats: dict[str, list[np.ndarray]] = {}
    labels: list[np.ndarray] = []
    bar = tqdm(total=total, desc=desc, unit="img", disable=None, mininterval=2.0)
    last_log = time.monotonic()
    done = 0
    for images, y in batches:
        x = images.to(device, non_blocking=True).float().div_(255.0)  # (B, C, H, W)
        if x.shape[1] == 1 and backbone.in_chans == 3:
            x = x.expand(-1, 3, -1, -1)
        elif x.shape[1] != backbone.in_chans:
            raise FeatureError(
                f"{backbone.source}: backbone takes {backbone.in_chans} channels, the "
                f"shards have {x.shape[1]}; use a backbone trained on this kind of image"
            )
        if x.shape[-2:] != (backbone.img_size, backbone.img_size):
            size = (backbone.img_size, backbone.img_size)
            x = F.interpolate(x, size=size, mode="bilinear", antialias=True, align_corners=False)
        x = (x - mean[:, None, None]) / std[:, None, None]
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=bf16):
            out = read(model, x)  # name -> (B, D')
        for name, f in out.items():
            feats.setdefault(name, []).append(f.float().cpu().numpy().astype(dtype, copy=False))
        labels.append(y.to(torch.int64).cpu().numpy())
        done += len(y)
        bar.update(len(y))
        if bar.disable and time.monotonic() - last_log > 30:  # no TTY: periodic log lines
            log.info("%s: %d/%s images", desc, done, total if total is not None else "?")
            last_log = time.monotonic()
    bar.close()
    if not labels:
        raise FeatureError(f"{desc}: the split yielded no images; check the shard set")
    return {k: np.concatenate(v) for k, v in feats.items()}, np.concatenate(labels)


def cache_key(fields: dict[str, Any]) -> str:
    blob = json.dumps({"cache_format": CACHE_FORMAT, **fields}, sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()[:32]


def cached(
    cache_dir: str | os.PathLike | None,
    fields: dict[str, Any],
    compute: Callable[[], tuple[np.ndarray, np.ndarray]],
) -> FeatureSet:
    """Return features for `fields` from the cache, or compute and store them."""
    t0 = time.perf_counter()
    path = Path(cache_dir) / f"{cache_key(fields)}.safetensors" if cache_dir else None
    if path is not None and path.is_file():
        try:
            d = load_file(path)
            return FeatureSet(d["features"], d["labels"], True, time.perf_counter() - t0)
        except Exception as e:  # a corrupt cache entry is recomputed, not fatal
            log.warning("%s: unreadable feature cache (%s); recomputing", path, e)
    feats, labels = compute()
    feats = np.ascontiguousarray(feats, dtype=np.float32)
    labels = np.ascontiguousarray(labels, dtype=np.int64)
    if path is not None:
        path.parent.mkdir(parents=True, exist_ok=True)
        meta = {k: json.dumps(v) for k, v in fields.items()}
        atomic_write_bytes(path, save({"features": feats, "labels": labels}, metadata=meta))
    return FeatureSet(feats, labels, False, time.perf_counter() - t0)


def eval_batches(
    data: str | os.PathLike, split: str, batch_size: int, num_workers: int, img_size: int
) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """Each sample of the split once, in order, as uint8 (B, C, img_size, img_size)."""
    from ssl_vit.data.stream import make_eval_loader

    yield from make_eval_loader(
        data, split, batch_size=batch_size, img_size=img_size, num_workers=num_workers
    )


def feature_fields(
    backbone: EvalBackbone,
    manifest_root: str | os.PathLike,
    split: str,
    *,
    pool: str,
    n_last: int = 4,
    layer: int | None = None,
    device: torch.device,
    bf16: bool,
) -> dict[str, Any]:
    """What determines a split's features: their cache key (`cached`)."""
    return {
        "backbone": backbone.ident,
        "manifest_sha256": load_manifest(manifest_root).sha256,
        "split": split,
        # the last block's keys are those of before layers
        "pool": readout_name(pool if pool != "lastn" else f"lastn{n_last}", layer),
        "img_size": backbone.img_size,
        # bf16 features differ in the last bits, and GPU kernels from CPU ones: a cached
        # file answers only for the arithmetic that made it
        "device": device.type,
        "precision": "bf16" if bf16 else "fp32",
    }


def split_features(
    backbone: EvalBackbone,
    data: str | os.PathLike,
    split: str,
    *,
    pool: str = "auto",
    n_last: int = 4,
    layer: int | None = None,
    batch_size: int = 256,
    num_workers: int = 2,
    cache_dir: str | os.PathLike | None = DEFAULT_CACHE_DIR,
    device: torch.device | None = None,
    bf16: bool | None = None,
) -> FeatureSet:
    """Frozen features and labels of one split of a shard set, cached."""
    pool = resolve_pool(backbone, pool)
    if pool not in (*POOLS, "pixels"):
        raise FeatureError(f"unknown pool {pool!r}; choose one of {POOLS}")
    if layer is not None and isinstance(backbone.model, RawPixels):
        raise FeatureError("raw pixels have no blocks; drop --layer")
    manifest = load_manifest(data)
    info = manifest.split(split)  # raises naming the manifest and the splits it has
    device = device or default_device()
    bf16 = (device.type == "cuda") if bf16 is None else bf16
    how = dict(pool=pool, n_last=n_last, layer=layer, device=device, bf16=bf16)
    fields = feature_fields(backbone, str(manifest.source), split, **how)

    def compute() -> tuple[np.ndarray, np.ndarray]:
        batches = eval_batches(
            str(manifest.source), split, batch_size, num_workers, backbone.img_size
        )
        f, y = extract_features(
            backbone, batches, **how, total=info.num_samples, desc=f"{split} features"
        )
        if len(y) != info.num_samples:  # the loader skips (and reports) corrupt samples
            log.warning(
                "%s: split %r lists %d samples but %d were readable; results cover those only "
                "(run data_prep/verify_shards.py)",
                manifest.where,
                split,
                info.num_samples,
                len(y),
            )
        return f, y

    fs = cached(cache_dir, fields, compute)
    where = "cache" if fs.cache_hit else "backbone"
    print(
        f"{split}: {fs.features.shape} features from {where} in {fs.seconds:.1f}s", file=sys.stderr
    )
    return fs
