"""Checks of a config against its shard set and model, run before any training state exists.

Kept free of DeepSpeed (and of torch until the model check) so `--check` and a bad config
answer in a moment, and so a run directory is never created for a run that cannot start.
"""

from __future__ import annotations

import difflib
import logging
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

from ssl_vit.config import KWARGS_SET_ELSEWHERE, Config, ConfigError, local_batch
from ssl_vit.data.manifest import Manifest, check_shards_exist, load_manifest
from ssl_vit.data.shards import ShardRef, select_shards
from ssl_vit.data.urls import join, probe_range
from ssl_vit.logs import first_line

if TYPE_CHECKING:
    import numpy as np

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class DataPlan:
    """What a config means on its shard set: what `--check` reports."""

    manifest: Manifest
    num_train: int  # samples trained on (held-out ones, and those train_fraction or
    # subset_file leave out)
    steps_per_epoch: int
    total_steps: int
    read_factor: float  # times an epoch reads the shard set (1.0: in RAM or resampled)
    ranged: bool | None = None  # the web server answers Range requests (None: not one)
    subset: np.ndarray | None = None  # the indices data.subset_file lists, checked
    shards: list[ShardRef] | None = None  # the split's shards, selected once for the loader

    @property
    def epochs(self) -> float:
        return self.total_steps / self.steps_per_epoch


def check_data(cfg: Config, world: int, probe_remote: bool = True) -> DataPlan:
    """Validate the config against the shard set and the model it names. `probe_remote`: ask
    a remote set for each shard once (check_remote_shards); one rank of a launch does."""
    local_batch(cfg, world)
    manifest = load_manifest(cfg.data.root)
    split = manifest.split(cfg.data.split)
    if cfg.data.missing_shards == "error":
        check_shards_exist(manifest, cfg.data.split)
    if probe_remote:
        check_remote_shards(manifest, cfg.data.split, cfg.data.missing_shards)
    if cfg.objective.kind != "mpp" and manifest.num_classes is None:
        raise ConfigError(
            f"objective.kind={cfg.objective.kind!r} needs labels, but {cfg.data.root} is "
            "unlabelled; use objective.kind=mpp or a labelled shard set"
        )
    in_chans = cfg.model.in_chans or manifest.channels
    if in_chans != manifest.channels and not cfg.model.init_from:
        raise ConfigError(
            f"model.in_chans={in_chans} but the shards in {cfg.data.root} have "
            f"{manifest.channels} channel(s); drop model.in_chans to follow the data"
        )
    num_train, fraction = split.num_samples, cfg.data.train_fraction
    subset_file, subset = cfg.data.subset_file, None
    if cfg.holdout_share > 0 or fraction < 1 or subset_file:  # imported late: numpy
        from ssl_vit.data.holdout import excluded_indices, held_out_indices

        if (
            cfg.holdout_share > 0
            and cfg.objective.kind != "mpp"
            and len(held_out_indices(split.num_samples, cfg.holdout_share)) == 0
        ):
            raise ConfigError(
                f"data.holdout_fraction={cfg.holdout_share} holds out no sample of the "
                f"{split.num_samples} in split {cfg.data.split!r}; raise it"
            )
        subset = read_subset(cfg, split.num_samples)
        num_train -= len(
            excluded_indices(split.num_samples, cfg.holdout_share, fraction, subset=subset)
        )
    steps_per_epoch = num_train // cfg.train.global_batch
    if steps_per_epoch == 0:
        raise ConfigError(
            f"train.global_batch={cfg.train.global_batch} exceeds the {num_train} training "
            f"samples of split {cfg.data.split!r}; lower the batch"
            + (f" or raise data.train_fraction={fraction}" if fraction < 1 else "")
            + (f" or list more in data.subset_file={subset_file}" if subset_file else "")
        )
    ranged = probe_range(join(str(manifest.root), split.shards[0].name)) if split.shards else None
    d = cfg.data
    shards = select_shards(manifest, d.split, d.missing_shards, d.verify)  # type: ignore[arg-type]
    factor = check_read_plan(cfg, manifest, world, shards)  # after the probe: reads depend on it
    check_model(cfg, in_chans)
    total_steps = cfg.train.steps or math.ceil(cfg.train.epochs * steps_per_epoch)
    return DataPlan(
        manifest, num_train, steps_per_epoch, total_steps, factor, ranged, subset, shards
    )


def read_subset(cfg: Config, num_samples: int) -> np.ndarray | None:
    """The indices `data.subset_file` lists, checked against a split of `num_samples` (None
    without one); a bad file is a ConfigError naming it."""
    if cfg.data.subset_file is None:
        return None
    from ssl_vit.data.holdout import read_subset_file

    try:
        return read_subset_file(cfg.data.subset_file, num_samples, cfg.holdout_share)
    except ValueError as e:
        raise ConfigError(f"data.subset_file: {e}") from None


def check_remote_shards(manifest: Manifest, split: str, missing: str) -> None:
    """Every shard of a remote set asked for once at start (a listing for object storage, a
    HEAD each on a web server): one missing, or of another size than the manifest says, stops
    the start in one line naming it, rather than a minute or a day into training; with
    data.missing_shards=skip the missing ones are named in one warning. A pipe cannot be asked."""
    from ssl_vit.data.urls import join, reason, remote_sizes

    root = str(manifest.root)
    infos = {join(root, i.name): i for i in manifest.split(split).shards}
    try:
        sizes = remote_sizes(list(infos))
    except Exception as e:  # a listing or HEAD that failed after its retries
        raise ConfigError(
            f"{root}: its {split} shards could not be listed ({reason(e)}); check the URL, the "
            "server and the credentials"
        ) from None
    gone = sorted(u.rsplit("/", 1)[-1] for u, size in sizes.items() if size is None)
    wrong = [(u, n) for u, n in sizes.items() if n is not None and n != infos[u].bytes]
    if wrong and missing == "error":
        url, n = wrong[0]
        raise ConfigError(
            f"{url}: {n} bytes, the manifest says {infos[url].bytes} ({len(wrong)} of "
            f"{len(infos)} {split} shards differ); restore the set or re-create its manifest"
        )
    if not gone:
        return
    listed = ", ".join(gone[:3]) + (", ..." if len(gone) > 3 else "")
    if missing == "error":
        raise ConfigError(
            f"{root}: {len(gone)} of {len(infos)} {split} shards missing ({listed}); restore "
            "them, or set data.missing_shards=skip to train on without them"
        )
    log.warning(
        "%s: %d of %d %s shards missing, skipped: %s", root, len(gone), len(infos), split, listed
    )


def check_read_plan(cfg: Config, manifest: Manifest, world: int, shards: list[ShardRef]) -> float:
    """Refuse a streamed epoch that would read the shard set more than MAX_READ_FACTOR times:
    streams that must read shard heads to drop them (a pipe, or remote shards without the
    offset index) when there are not many more shards than streams (ssl_vit.data.stream).
    Returns the factor (1.0 for a split held in RAM or resampled epochs)."""
    from ssl_vit.data.holdout import excluded_indices  # imported late: numpy, torch
    from ssl_vit.data.memory import resolve_in_memory
    from ssl_vit.data.stream import (
        MAX_READ_FACTOR,
        Exclusions,
        exact_pieces,
        read_factor,
        stream_quota,
    )

    d = cfg.data
    if d.resampled or resolve_in_memory(d.in_memory, manifest, d.split)[0]:
        return 1.0
    total = sum(r.num_samples for r in shards)
    subset = read_subset(cfg, total)
    exclusions = Exclusions(excluded_indices(total, cfg.holdout_share, d.train_fraction, subset))
    steps = (total - len(exclusions.sorted)) // cfg.train.global_batch  # missing shards left out
    workers = max(1, d.num_workers)
    batch = cfg.train.global_batch // world
    quotas = [stream_quota(steps, batch, workers, role) for role in range(workers)] * world
    plans = exact_pieces(shards, quotas, exclusions, seed=cfg.run.seed, epoch=0)
    factor = read_factor(shards, plans)
    if factor > MAX_READ_FACTOR:
        if read_factor(shards, plans, assume_ranged=True) > MAX_READ_FACTOR:
            streams = world * workers
            raise ConfigError(
                f"{d.root}: each epoch would read the shard set {factor:.2f} times: {streams} "
                f"loader streams ({world} ranks x {workers} workers) start inside {len(shards)} "
                "shards that cannot be entered without reading their heads (a pipe, or no offset "
                f"index); re-shard with data_prep/make_shards.py --num-shards {20 * streams} "
                "(which also writes the index), or set data.resampled=true"
            )
        # only a web server without Range support costs the extra reads: it trains, warned
        log.warning(
            "%s: the server ignores Range requests, so each epoch reads the shard set %.2f "
            "times; more shards than loader streams (make_shards.py --num-shards) or "
            "data.resampled=true bring it to 1",
            d.root,
            factor,
        )
    return factor


def check_model(cfg: Config, in_chans: int) -> None:
    """The backbone to start from exists: an export for `model.init_from`, else a timm name
    that builds with `model.kwargs` (on the meta device: no memory, no weights)."""
    m = cfg.model
    if m.init_from:
        from ssl_vit.models.export import WEIGHTS, find_export  # imported late: torch, timm
        from ssl_vit.registry import resolve_export

        try:  # an MLflow URI is downloaded (verified) into the cache here, once
            folder = find_export(resolve_export(m.init_from, tracking_uri=cfg.tracking.uri).path)
        except (FileNotFoundError, ValueError) as e:
            raise ConfigError(f"model.init_from: {e}") from None
        if not (folder / WEIGHTS).is_file():
            raise ConfigError(
                f"model.init_from: {folder / WEIGHTS} is missing; the export is incomplete, "
                "export the run again or point at another one"
            )
        return
    check_backbone(cfg, in_chans)


# One family's name for an option that the other family calls otherwise (too far apart for
# difflib): ViT blocks are `depth`, MLP-Mixer blocks `num_blocks`.
_ACROSS_FAMILIES = {"depth": "num_blocks", "num_blocks": "depth"}


def check_backbone(cfg: Config, in_chans: int) -> None:
    """`model.arch` is a timm model whose class takes every key of `model.kwargs`, and it builds
    with them (on the meta device: no memory, no weights). timm would pass a key it does not
    know on to the class (a TypeError deep in timm) or, if its value is null, drop it silently
    and build the architecture's default size, so every key is checked first, by name."""
    m = cfg.model
    import timm

    if not timm.is_model(m.arch):
        raise ConfigError(
            f"model.arch={m.arch!r} is not a timm model; pick one of timm.list_models('vit_*')"
        )
    import torch

    from ssl_vit.models import build_backbone
    from ssl_vit.models.networks import constructor_kwargs

    cls, taken = constructor_kwargs(m.arch)
    if taken is not None:
        allowed = sorted(taken - set(KWARGS_SET_ELSEWHERE))  # the rest are refused by validate
        for key in [k for k in m.kwargs if k not in taken]:
            other = _ACROSS_FAMILIES.get(key)
            close = [other] if other in allowed else difflib.get_close_matches(key, allowed, n=1)
            hint = f"did you mean {close[0]!r}?" if close else f"it takes {', '.join(allowed)}"
            raise ConfigError(f"model.kwargs.{key}: {m.arch} (timm {cls}) takes no {key!r}; {hint}")
    try:
        with torch.device("meta"):
            build_backbone(m.arch, **m.backbone_kwargs(in_chans))
    except (ValueError, TypeError, AssertionError) as e:
        raise ConfigError(
            f"model.arch={m.arch!r} does not build with model.kwargs={m.kwargs}: {first_line(e)}; "
            "fix model.kwargs"
        ) from None
