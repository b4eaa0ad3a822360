"""Atomic DeepSpeed checkpoints in a run directory, with a `latest` pointer and pruning.

    RUN/checkpoints/step00000500/             complete checkpoints (DeepSpeed's files +
                                              trainer_state.json)
    RUN/checkpoints/step00000500/universal/   the same in DeepSpeed's universal format, made
                                              by a launch of another world size
    RUN/checkpoints/latest                    the newest complete one's tag, replaced atomically

DeepSpeed writes into `<tag>.partial/`; only when every rank has finished is it renamed to
`<tag>/` and `latest` replaced (temp file + rename). A kill at any moment therefore leaves
`latest` naming a complete checkpoint, and a leftover `.partial` folder is deleted on the next
save. Every rank must call `save` (DeepSpeed shards optimizer state across ranks), `find` and
`restore` (rank 0 decides which checkpoint and tells the others: no rank starts elsewhere).
The run directory must be on storage all ranks share: `check_shared` refuses to start otherwise.

Another world size (a node lost, or added back). Under ZeRO >= 1 each rank saved only its
partition of the fp32 weights and optimizer state, which a different number of ranks cannot
load as it is. `resume` then has rank 0 convert the checkpoint once into DeepSpeed's universal
format (one folder per parameter holding its whole fp32 value, Adam moments and step), into
`<tag>/universal.partial/` renamed to `<tag>/universal/` when complete (`to_universal`), while
the other ranks watch for it; every rank then loads it with DeepSpeed's universal load, which
cuts each parameter into this world's partitions. Weights, moments and Adam's step count all
continue. A stage-0 checkpoint needs none of this: rank 0 saved the whole optimizer state in
one file, which any world size loads.

The data position does not carry over: each (rank, loader worker) stream reads its own part
of an epoch (ssl_vit.data.stream_plan), so "batch k of epoch E" means other samples at another
stream count. After a change of world size or data.num_workers in the middle of an epoch,
that epoch restarts from its first batch in the new world's order while the step count goes
on: the samples of its first k batches are seen twice, none is skipped, and later epochs are
exact again. `replayed_steps` in trainer_state.json counts the steps so replayed over the
run's life; the loader's position is `step - replayed_steps` batches.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import logging
import shutil
import socket
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

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


UNIVERSAL = "universal"  # <tag>/universal: the checkpoint in DeepSpeed's universal format


def restore(engine: Any, ckpt_dir: Path, tag: str, universal: bool = False) -> None:
    """Load model and optimizer state of checkpoint `tag` (every rank); `universal`: from
    `<tag>/universal` (`to_universal`), with DeepSpeed's universal load."""
    load_dir, load_tag = (ckpt_dir / tag, UNIVERSAL) if universal else (ckpt_dir, tag)
    groups = [{k: v for k, v in g.items() if k != "params"} for g in engine.optimizer.param_groups]
    with _universal_load(engine, universal):
        path, _ = engine.load_checkpoint(str(load_dir), tag=load_tag)
    if path is None:
        raise CheckpointError(f"{load_dir / load_tag}: DeepSpeed could not load this checkpoint")
    if universal:
        _repair_universal_load(engine.optimizer, groups)


def _repair_universal_load(optimizer: Any, groups: list[dict]) -> None:
    """Undo two faults of DeepSpeed's ZeRO-3 universal load (0.19.8, stage3.py,
    `load_hp_checkpoint_state_from_checkpoint_dir_stage3`), harmless elsewhere:

    - it copies the first parameter group's hyperparameters into every group, so the
      no-decay group (biases, norms, position embedding) would get weight decay: each group
      gets back its own, as this run's config made them (`groups`, taken before the load; the
      learning rate is set from the step right after anyway);
    - it gives every sub-group's Adam state the same `step` tensor, which Adam then increments
      in place once per sub-group, so the step count behind the bias correction would run
      ahead by a factor of the group count: each state gets its own copy."""
    for group, before in zip(optimizer.param_groups, groups, strict=True):
        group.update(before)
    seen: set[int] = set()
    for state in optimizer.state.values():
        step = state.get("step")
        if torch.is_tensor(step):
            if id(step) in seen:
                state["step"] = step.clone()
            seen.add(id(step))


@contextlib.contextmanager
def _universal_load(engine: Any, on: bool) -> Iterator[None]:
    """DeepSpeed's `checkpoint.load_universal` switched on for one load.

    The engine reads that config key only inside `load_checkpoint` (through
    `engine.load_universal_checkpoint()`), and whether a launch needs it is known only once its
    checkpoint is found, after the engine is built: so it is set on the engine's parsed config
    for this load and put back after, rather than in the JSON config of every launch."""
    if not on:
        yield
        return
    config = engine._config  # DeepSpeedConfig: what load_universal_checkpoint() reads
    before = config.load_universal_checkpoint
    config.load_universal_checkpoint = True
    try:
        if not engine.load_universal_checkpoint():
            raise CheckpointError(
                "this DeepSpeed's engine does not read checkpoint.load_universal where ssl-vit "
                "sets it; resume at the saved world size"
            )
        yield
    finally:
        config.load_universal_checkpoint = before


def to_universal(ckpt_dir: Path, tag: str, rank: int) -> None:
    """Convert checkpoint `tag` to DeepSpeed's universal format in `<tag>/universal/`, once: a
    later launch reuses it (every rank calls this; rank 0 converts).

    Rank 0 runs DeepSpeed's `ds_to_universal` (its `main`, serially: a process pool forked
    from a training process with threads and a process group is not safe) into
    `universal.partial/`, renamed when complete, so a kill mid-way leaves nothing a later
    launch would trust; a failure is written to `universal.failed` instead. The other ranks
    wait by watching for either on the shared run directory, not inside a collective: the
    conversion of a large model on a network file system can outlast the process group's
    timeout (DeepSpeed's 10 minutes by default), which would abort every rank. Our modules
    carry no universal-checkpoint metadata (tensor-parallel patterns; we have none), which the
    converter is told to add (`inject_missing_state`). Its progress output is kept out of the
    log unless it fails."""
    final = ckpt_dir / tag / UNIVERSAL
    failed = final.with_name(UNIVERSAL + ".failed")
    if rank == 0:
        failed.unlink(missing_ok=True)  # an earlier launch's: this one tries again
    barrier()
    if rank == 0 and not final.is_dir():
        partial = final.with_name(UNIVERSAL + ".partial")
        shutil.rmtree(partial, ignore_errors=True)
        output = io.StringIO()
        try:
            from deepspeed.checkpoint import ds_to_universal

            args = argparse.Namespace(
                input_folder=str(ckpt_dir / tag),
                output_folder=str(partial),
                num_extract_workers=1,
                num_merge_workers=1,
                keep_temp_folder=False,
                strict=True,
                inject_missing_state=True,
            )
            with contextlib.redirect_stdout(output), contextlib.redirect_stderr(output):
                ds_to_universal.main(args)
            # it also points `<tag>/latest_universal` at the folder it wrote; we load by name
            (ckpt_dir / tag / "latest_universal").unlink(missing_ok=True)
            partial.rename(final)
        except Exception as e:  # any failure of the converter: every rank must hear of it
            log.error("ds_to_universal output:\n%s", output.getvalue()[-5000:])
            shutil.rmtree(partial, ignore_errors=True)
            atomic_write_text(failed, f"{type(e).__name__}: {e}")
    while not (final.is_dir() or failed.is_file()):
        time.sleep(1.0)
    barrier()
    if failed.is_file():
        raise CheckpointError(
            f"{ckpt_dir / tag}: conversion to a universal checkpoint failed "
            f"({failed.read_text().strip()}); resume at the saved world size, or start a new "
            "run.dir with model.init_from pointing at this run"
        )


# What a checkpoint's step means depends on these; the trainer saves them in trainer_state.json.
LAUNCH_KEYS = {
    "world_size": "world size",
    "num_workers": "data.num_workers",
    "steps_per_epoch": "steps per epoch",
}


def resume(engine: Any, ckpt_dir: Path, launch: dict[str, int]) -> dict:
    """Restore the checkpoint to resume and return its trainer state ({} for a fresh run),
    after checking what this launch (`LAUNCH_KEYS`) changes.

    Another world size is converted to the universal format first when the engine partitions
    optimizer state (ZeRO >= 1, and DeepSpeed's bf16 optimizer at stage 0, which partitions
    like stage 1: hence the engine's stage, not the config's). Another world size or
    data.num_workers in the middle of an epoch restarts that epoch (module docstring): the
    returned state's `replayed_steps` then includes the k steps of it already run. Another
    steps-per-epoch (global batch, readable shards) mid-epoch has no such mapping and is
    refused with one line before DeepSpeed loads anything."""
    found = find(ckpt_dir, engine.global_rank)
    if found is None:
        return {}
    tag, state = found
    step, replayed = int(state["step"]), int(state.get("replayed_steps", 0))
    saved = {k: state.get(k, v) for k, v in launch.items()}
    changed = [k for k in LAUNCH_KEYS if saved[k] != launch[k]]
    epoch, k = divmod(step - replayed, launch["steps_per_epoch"])
    what = ", ".join(f"{LAUNCH_KEYS[c]} {saved[c]} -> {launch[c]}" for c in changed)
    if "steps_per_epoch" in changed and k:
        raise CheckpointError(
            f"{ckpt_dir / tag}: cannot resume exactly mid-epoch ({what}); relaunch with the "
            "saved train.global_batch and shards, or start a new run.dir with model.init_from "
            "pointing at this run"
        )
    universal = "world_size" in changed and engine.zero_optimization_stage() > 0
    if universal:
        to_universal(ckpt_dir, tag, engine.global_rank)
    restore(engine, ckpt_dir, tag, universal)
    log.info("resumed from step %d (%s)", step, ckpt_dir / tag)
    if {"world_size", "num_workers"} & set(changed):
        said = [what]
        if "world_size" in changed:
            said.append(
                "converted to a universal checkpoint"
                if universal
                else "ZeRO-0 saved the whole optimizer state, loaded as it is"
            )
        if k:
            state = {**state, "replayed_steps": replayed + k}
            said.append(
                f"epoch {epoch} restarts from its first batch ({k} batches of it are seen again)"
            )
        else:
            said.append(f"epoch {epoch} starts from its first batch, as planned")
        log.info("%s: %s", said[0], "; ".join(said[1:]))
    return state
