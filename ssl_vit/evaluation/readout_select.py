"""Choose a frozen backbone's read-out (block and pooling) on held-out training data.

The last block is where a pretext task leaves its strongest mark: after MPP it specialises in
predicting patch colours (paper sec. 4.6), and masked-modelling features are often better read
some blocks earlier (BEiT's and MAE's linear probes found the same). `select_readout` scores
candidate read-outs, each block's output

- mean-pooled over the patch tokens (D dims),
- with the patch tokens concatenated in grid order (N*D dims: the spatial layout kept; offered
  while N*D <= `max_dim`, as every candidate of a split is held in memory at once),
- its [class] token, when the pretraining trained it,
by DINO's weighted kNN (k=20, T=0.07) of the held-out part of the *training* split (the hashed
2% every training run sets aside, `ssl_vit.data.holdout`) against the rest of it, and keeps the
best. The test split is never read. All candidates come from one pass over the split.
"""

from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ssl_vit.data.holdout import held_out_mask
from ssl_vit.data.manifest import load_manifest
from ssl_vit.features import (
    EvalBackbone,
    FeatureError,
    RawPixels,
    cache_key,
    default_device,
    eval_batches,
    extract_with,
    feature_fields,
)
from ssl_vit.io import atomic_write_bytes
from ssl_vit.knn import DEFAULT_T, knn_eval
from ssl_vit.readout import block_tokens, depth_of, pool_from_tokens, readout_name

__all__ = ["Readout", "readout_candidates", "select_readout", "SELECT_K", "SELECT_HOLDOUT"]

log = logging.getLogger(__name__)

SELECT_K = 20  # DINO's k; the held-out kNN top-1 at this k ranks the candidates
SELECT_HOLDOUT = 0.02  # the fine-tuning's own held-out share (appendix B.1.1)
MAX_DIM = 8192  # largest "tokens" read-out offered: 16 x 128 (our preset) is 2048


@dataclass(frozen=True)
class Readout:
    layer: int  # block, from 1
    pool: str  # "mean", "tokens" or "cls"

    @property
    def name(self) -> str:
        return readout_name(self.pool, self.layer)


def readout_candidates(bb: EvalBackbone, pools: tuple[str, ...], max_dim: int) -> list[Readout]:
    """Every block x pool worth scoring, last block first (ties keep the later block)."""
    model = bb.model
    depth = depth_of(model)
    if isinstance(model, RawPixels) or depth == 0:
        raise FeatureError(f"{bb.source}: has no blocks to choose among; drop --layer auto")
    prefix = int(getattr(model, "num_prefix_tokens", 0))
    from ssl_vit.models import token_geometry

    tokens_dim = token_geometry(model).num_patches * int(model.embed_dim)
    out = []
    for layer in range(depth, 0, -1):
        for pool in pools:
            if pool == "cls" and not prefix:
                continue  # no [class] token to read
            if pool == "tokens" and tokens_dim > max_dim:
                continue  # every token's features: too wide for this backbone
            out.append(Readout(layer, pool))
    if not out:
        raise FeatureError(
            f"{bb.source}: no read-out of pools {pools} fits (tokens: {tokens_dim} > {max_dim} "
            "dims); pick --pool mean"
        )
    return out


def select_readout(
    bb: EvalBackbone,
    data: str | os.PathLike,
    split: str,
    *,
    pools: tuple[str, ...] = ("mean", "tokens"),
    holdout_fraction: float = SELECT_HOLDOUT,
    k: int = SELECT_K,
    temperature: float = DEFAULT_T,
    max_dim: int = MAX_DIM,
    batch_size: int = 256,
    num_workers: int = 2,
    cache_dir: str | os.PathLike | None = None,
    device: torch.device | None = None,
    bf16: bool | None = None,
) -> dict[str, Any]:
    """Score the candidates on held-out training data; return the choice and every score.

    The result ({"layer", "pool", "name", "scores": {name: top-1}, "criterion", ...}) is cached
    beside the features. The candidates are scored from float16 copies; the evaluation that
    follows extracts the chosen read-out again in full precision.
    """
    cands = readout_candidates(bb, pools, max_dim)
    manifest = load_manifest(data)
    info = manifest.split(split)
    device = device or default_device()
    bf16 = (device.type == "cuda") if bf16 is None else bf16
    criterion = (
        f"kNN top-1 (k={k}, T={temperature}) of the held-out {holdout_fraction:.0%} of split "
        f"{split!r} against the rest of it; the test split is not read"
    )
    key = {
        **feature_fields(bb, str(manifest.source), split, pool="select", device=device, bf16=bf16),
        "candidates": [c.name for c in cands],
        "criterion": criterion,
    }
    path = Path(cache_dir) / f"readout-{cache_key(key)}.json" if cache_dir else None
    if path is not None and path.is_file():
        return json.loads(path.read_text())

    layers = sorted({c.layer for c in cands})
    prefix = int(getattr(bb.model, "num_prefix_tokens", 0))

    def read(model: torch.nn.Module, x: torch.Tensor) -> dict[str, torch.Tensor]:
        tokens = block_tokens(model, x, layers)
        return {c.name: pool_from_tokens(tokens[c.layer], c.pool, prefix) for c in cands}

    batches = eval_batches(str(manifest.source), split, batch_size, num_workers, bb.img_size)
    # float16 keeps every candidate of a 60k split in memory (1.5 GB for the preset); the
    # ranking is computed in float32 from it
    feats, labels = extract_with(
        bb,
        batches,
        read,
        device=device,
        bf16=bf16,
        total=info.num_samples,
        desc=f"{split} read-outs",
        dtype=np.float16,
    )
    if len(labels) != info.num_samples:
        raise FeatureError(
            f"{manifest.root}: split {split!r} lists {info.num_samples} samples but "
            f"{len(labels)} were readable, so the held-out samples cannot be told apart; "
            "run data_prep/verify_shards.py"
        )
    held = held_out_mask(np.arange(len(labels)), holdout_fraction)
    if held.sum() == 0 or (~held).sum() < k:
        raise FeatureError(
            f"{manifest.root}: split {split!r} of {len(labels)} samples is too small to hold "
            f"out {holdout_fraction:.0%} for choosing a read-out; pass --layer N"
        )
    scores = {}
    for c in cands:
        f = feats[c.name].astype(np.float32)
        scores[c.name] = knn_eval(
            f[~held],
            labels[~held],
            f[held],
            labels[held],
            ks=(k,),
            temperature=temperature,
            retrieval=False,
        )[f"knn_top1@k={k}"]
        log.info("read-out %s: held-out kNN top-1 %.4f", c.name, scores[c.name])
    best = max(cands, key=lambda c: scores[c.name])  # first of equals: later block, mean
    result = {
        "layer": best.layer,
        "pool": best.pool,
        "name": best.name,
        "scores": scores,
        "criterion": criterion,
        "num_held_out": int(held.sum()),
    }
    if path is not None:
        path.parent.mkdir(parents=True, exist_ok=True)
        atomic_write_bytes(path, json.dumps(result, indent=1).encode())
    return result
