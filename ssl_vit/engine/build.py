"""From a config to an objective, and from a trained objective back to files (the export)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import deepspeed
import torch
from deepspeed.utils import safe_get_full_fp32_param
from torch import nn

from ssl_vit.config import Config, ConfigError
from ssl_vit.data.manifest import Manifest
from ssl_vit.models import build_backbone, export_backbone, load_backbone
from ssl_vit.models.export import record_files
from ssl_vit.objectives import build_objective, options_from_config
from ssl_vit.objectives.export import META as OBJECTIVE_META
from ssl_vit.objectives.export import WEIGHTS as OBJECTIVE_WEIGHTS
from ssl_vit.objectives.export import save_objective
from ssl_vit.registry import resolve_export


@dataclass
class ModelSpec:
    """What an export must record to rebuild the backbone (`build_backbone` arguments)."""

    arch: str
    kwargs: dict[str, Any]
    in_chans: int
    mean: list[float]
    std: list[float]
    source_run_id: str | None = None  # `init_from`: the MLflow run that produced the export


def build_from_config(cfg: Config, manifest: Manifest) -> tuple[nn.Module, dict, ModelSpec]:
    """(objective with its backbone, the objective's options, the backbone's spec).

    With `model.init_from` the backbone is the exported one (its arch, kwargs and input
    normalisation win), its position embeddings resampled to `model.img_size`.
    """
    m, o = cfg.model, cfg.objective
    if m.init_from:
        try:  # a path, or an MLflow URI (downloaded once, by preflight, into the cache)
            source = resolve_export(m.init_from, tracking_uri=cfg.tracking.uri)
            backbone, meta = load_backbone(
                source.path, img_size=m.img_size, drop_path_rate=m.drop_path_rate
            )
        except (ValueError, FileNotFoundError) as e:
            raise ConfigError(f"model.init_from: {e}") from None
        kwargs = {**meta["kwargs"], "img_size": m.img_size}
        source_run = source.run_id or meta.get("mlflow_run_id")  # lineage of what it started from
        spec = ModelSpec(
            meta["arch"],
            kwargs,
            kwargs["in_chans"],
            meta["mean"],
            meta["std"],
            source_run_id=source_run,
        )
    else:
        in_chans = m.in_chans or manifest.channels
        kwargs = m.backbone_kwargs(in_chans)
        try:  # the drop-path rate trains this run only: not in the export's kwargs
            backbone = build_backbone(m.arch, **kwargs, drop_path_rate=m.drop_path_rate)
        except (ValueError, TypeError) as e:  # unknown arch, kwargs timm does not take
            raise ConfigError(f"model.arch={m.arch!r} with model.kwargs={m.kwargs}: {e}") from None
        spec = ModelSpec(m.arch, kwargs, in_chans, manifest.mean, manifest.std)
    num_classes = manifest.num_classes
    options = options_from_config(o, in_chans=spec.in_chans, num_classes=num_classes)
    objective = build_objective(o.kind, backbone, mean=spec.mean, std=spec.std, **options)
    return objective, options, spec


def classifier_of(objective: nn.Module) -> nn.Module | None:
    """The part of an objective that predicts classes (`.logits`), if any."""
    for candidate in (objective, getattr(objective, "supervised", None)):
        if candidate is not None and hasattr(candidate, "logits"):
            return candidate
    return None


@contextlib.contextmanager
def _master_weights(objective: nn.Module) -> Iterator[None]:
    """Inside: every parameter holds its whole fp32 master value (collective under ZeRO).

    Half-precision engines keep fp32 masters in the optimizer; exporting the bf16/fp16 working
    copy would round every weight the run learned. Under ZeRO-3 the working copies are also
    partitioned, hence the gather first."""
    params = list(objective.parameters())
    with deepspeed.zero.GatheredParameters(params, modifier_rank=None):
        saved = []
        for p in params:
            master = safe_get_full_fp32_param(p)  # None without a DeepSpeed master copy
            if master is not None:
                saved.append((p, p.data))
                p.data = master.detach().to(p.device, torch.float32).view(p.shape)
        try:
            yield
        finally:
            for p, data in saved:
                p.data = data


def export_run(
    objective: nn.Module,
    spec: ModelSpec,
    kind: str,
    options: dict,
    out_dir: Path,
    extra: dict[str, Any],
    rank: int,
) -> None:
    """Backbone (safetensors + backbone.json) and the objective's own weights, by rank 0, in
    fp32 from the optimizer's master weights where the engine keeps them.

    Every rank must call this: under ZeRO the parameters are gathered from all of them.
    """
    with _master_weights(objective):
        if rank == 0:
            export_backbone(
                objective.backbone,
                out_dir,
                arch=spec.arch,
                kwargs=spec.kwargs,
                mean=spec.mean,
                std=spec.std,
                extra=extra,
            )
            save_objective(objective, out_dir, kind, options)
            record_files(out_dir, [OBJECTIVE_WEIGHTS, OBJECTIVE_META])
