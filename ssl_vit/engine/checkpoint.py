"""Atomic DeepSpeed checkpoints in a run directory, with a `latest` pointer and pruning.

    RUN/checkpoints/step00000500/   complete checkpoints (DeepSpeed's files + trainer_state.json)
    RUN/checkpoints/latest          the tag of the newest complete one, replaced atomically

DeepSpeed writes into `<tag>.partial/`; only when every rank has finished is it renamed to
`<tag>/` and `latest` replaced (temp file + rename). A kill at any moment therefore leaves
`latest` naming a complete checkpoint, and a leftover `.partial` folder is deleted on the next
save. Every rank must call `save` (DeepSpeed shards optimizer state across ranks), `find` and
`restore` (rank 0 decides which checkpoint and tells the others: no rank starts elsewhere).
The run directory must be on storage all ranks share: `check_shared` refuses to start otherwise.
"""

from __future__ import annotations

import json
import logging
import shutil
import socket
from pathlib import Path
from typing import Any

from ssl_vit.engine.distributed import all_gather_object, barrier, broadcast_object
from ssl_vit.io import atomic_write_text

STATE_NAME = "trainer_state.json"
log = logging.getLogger("ssl_vit.train")


class CheckpointError(RuntimeError):
    """The run directory's checkpoints cannot be resumed; the message says which and why."""


def tag_for(step: int) -> str:
    return f"step{step:08d}"


def latest_tag(ckpt_dir: Path) -> str | None:
    """The newest complete checkpoint's tag, or None for a fresh run."""
    pointer = ckpt_dir / "latest"
    if not pointer.is_file():
        return None
    tag = pointer.read_text().strip()
    if not tag or not (ckpt_dir / tag / STATE_NAME).is_file():
        raise CheckpointError(
            f"{pointer}: names {tag!r}, which is not a complete checkpoint; "
            "delete the pointer to restart from scratch or point it at a complete one"
        )
    return tag


def save(engine: Any, ckpt_dir: Path, step: int, state: dict, rank: int, keep: int) -> str:
    """Write a checkpoint for `step` on every rank; returns its tag."""
    tag = tag_for(step)
    partial = f"{tag}.partial"
    if rank == 0:
        ckpt_dir.mkdir(parents=True, exist_ok=True)
        for stale in ckpt_dir.glob("*.partial"):
            shutil.rmtree(stale, ignore_errors=True)
    barrier()
    engine.save_checkpoint(str(ckpt_dir), tag=partial, save_latest=False)
    barrier()
    if rank == 0:
        atomic_write_text(ckpt_dir / partial / STATE_NAME, json.dumps(state, indent=2))
        final = ckpt_dir / tag
        if final.exists():  # same step saved before (a rerun that ended here): replace it
            shutil.rmtree(final)
        (ckpt_dir / partial).rename(final)
        atomic_write_text(ckpt_dir / "latest", tag + "\n")
        _prune(ckpt_dir, keep)
    barrier()
    return tag


def _prune(ckpt_dir: Path, keep: int) -> None:
    tags = sorted(
        p for p in ckpt_dir.glob("step*") if p.is_dir() and not p.name.endswith(".partial")
    )
    for old in tags[: max(0, len(tags) - keep)]:
        shutil.rmtree(old, ignore_errors=True)


def _unreachable(path: Path, rank: int) -> str:
    """The ranks (with hosts) that cannot see `path`, as text; empty when every rank can."""
    seen = all_gather_object((rank, socket.gethostname(), path.is_file()))
    return ", ".join(f"rank {r} on {host}" for r, host, ok in seen if not ok)


def check_shared(run_dir: Path, rank: int) -> None:
    """Every rank sees the config rank 0 just wrote, or none starts (a collective).

    On node-local run directories each node would checkpoint and resume on its own."""
    missing = _unreachable(run_dir / "config.yaml", rank)
    if missing:
        raise CheckpointError(
            f"{run_dir}: {missing} cannot see the run directory that rank 0 wrote; put run.dir "
            "on storage that every node shares"
        )


def find(ckpt_dir: Path, rank: int) -> tuple[str, dict] | None:
    """(tag, trainer state) of the checkpoint to resume, the same on every rank, or None for a
    fresh run. Rank 0 decides; every rank must be able to read it (a collective)."""
    try:
        found: tuple = (latest_tag(ckpt_dir), None) if rank == 0 else (None, None)
    except CheckpointError as e:
        found = (None, str(e))
    tag, error = broadcast_object(found)  # type: ignore[misc]
    if error:
        raise CheckpointError(error)
    if tag is None:
        return None
    missing = _unreachable(ckpt_dir / tag / STATE_NAME, rank)
    if missing:
        raise CheckpointError(
            f"{ckpt_dir / tag}: {missing} cannot read this checkpoint; put run.dir on storage "
            "that every node shares"
        )
    return tag, json.loads((ckpt_dir / tag / STATE_NAME).read_text())


def restore(engine: Any, ckpt_dir: Path, tag: str) -> None:
    """Load model and optimizer state of checkpoint `tag` (every rank)."""
    path, _ = engine.load_checkpoint(str(ckpt_dir), tag=tag)
    if path is None:
        raise CheckpointError(f"{ckpt_dir / tag}: DeepSpeed could not load this checkpoint")


# What a checkpoint's step means depends on these; the trainer saves them in trainer_state.json.
LAUNCH_KEYS = {"world_size": "world size", "num_workers": "data.num_workers",
               "steps_per_epoch": "steps per epoch"}  # fmt: skip


def resume(engine: Any, ckpt_dir: Path, zero_stage: int, launch: dict[str, int]) -> dict:
    """Restore the checkpoint to resume and return its trainer state ({} for a fresh run),
    after checking that this launch (`LAUNCH_KEYS`) can continue it exactly.

    ZeRO >= 1 keeps optimizer partitions per rank; mid-epoch, the data position is per (rank,
    worker) stream and the shards read: a change to either would silently alter the run, so it
    is refused with one line before DeepSpeed loads anything."""
    found = find(ckpt_dir, engine.global_rank)
    if found is None:
        return {}
    tag, state = found
    step = int(state["step"])
    saved = {k: state.get(k, v) for k, v in launch.items()}
    changed = [k for k in LAUNCH_KEYS if saved[k] != launch[k]]
    mid_epoch = step % launch["steps_per_epoch"] != 0
    if (zero_stage and "world_size" in changed) or (changed and mid_epoch):
        what = ", ".join(f"{LAUNCH_KEYS[k]} {saved[k]} -> {launch[k]}" for k in changed)
        keep = ", ".join(f"{LAUNCH_KEYS[k]} {saved[k]}" for k in changed)
        raise CheckpointError(
            f"{ckpt_dir / tag}: cannot resume exactly ({what}); relaunch with the saved {keep}, "
            "or start a new run.dir with model.init_from pointing at this run"
        )
    restore(engine, ckpt_dir, tag)
    log.info("resumed from step %d (%s)", step, ckpt_dir / tag)
    return state
