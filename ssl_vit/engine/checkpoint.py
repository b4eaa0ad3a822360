"""Atomic, verified DeepSpeed checkpoints in a run directory, with a `latest` pointer and pruning.

    RUN/checkpoints/step00000500/             complete checkpoints (DeepSpeed's files,
                                              trainer_state.json and checksums.json)
    RUN/checkpoints/step00000500/universal/   the same in DeepSpeed's universal format, made
                                              by a launch of another world size
    RUN/checkpoints/latest                    the newest complete one's tag, replaced atomically
    RUN/checkpoints/step00000500.damaged/     one a resume found damaged, set aside

Every rank calls `save`, `find` and `restore` (rank 0 decides and tells the others); the run
directory must be on storage all ranks share (`check_shared`). How a save stays atomic, how a
damaged checkpoint is passed over, what the checksums cost and the free-space check:
docs/training.md, "Checkpoints". Resuming at another world size (`to_universal`, the data
position, `replayed_steps`): docs/multinode.md.
"""

from __future__ import annotations

import argparse
import contextlib
import errno
import io
import json
import logging
import os
import re
import shutil
import socket
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from ssl_vit.engine.distributed import all_gather_object, barrier, broadcast_object
from ssl_vit.io import atomic_write_text, sha256_file
from ssl_vit.logs import first_line

STATE_NAME = "trainer_state.json"
CHECKSUMS_NAME = "checksums.json"
DAMAGED = ".damaged"  # suffix of a checkpoint folder a resume set aside
UNIVERSAL = "universal"  # <tag>/universal: the checkpoint in DeepSpeed's universal format
log = logging.getLogger("ssl_vit.train")

_TAG = re.compile(r"step(\d+)")


class CheckpointError(RuntimeError):
    """The run directory's checkpoints cannot be resumed or written; the message says which
    and why, in one line."""


def tag_for(step: int) -> str:
    return f"step{step:08d}"


def _step_of(name: str) -> int | None:
    m = _TAG.fullmatch(name)
    return int(m.group(1)) if m else None


def _checkpoints(ckpt_dir: Path) -> list[Path]:
    """The complete-looking checkpoint folders (`step<N>`, not `.partial` or `.damaged`),
    oldest first by step."""
    if not ckpt_dir.is_dir():
        return []
    found = (p for p in ckpt_dir.iterdir() if _step_of(p.name) is not None and p.is_dir())
    return sorted(found, key=lambda p: _step_of(p.name) or 0)


def _size(n: float) -> str:
    for unit in ("B", "kB", "MB", "GB"):
        if n < 1000 or unit == "GB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    raise AssertionError("unreachable")


def _folder_bytes(folder: Path, universal: bool = True) -> int:
    """Bytes of the files under `folder`; without `universal`, leaving out the universal
    copy a conversion adds (not part of what a save writes)."""
    total = 0
    for p in folder.rglob("*"):
        if universal or not p.relative_to(folder).parts[0].startswith(UNIVERSAL):
            with contextlib.suppress(OSError):  # a file vanishing under us counts as nothing
                total += p.stat().st_size if p.is_file() else 0
    return total


# -- checksums -----------------------------------------------------------------------------


_RANK_FILE = re.compile(r"zero_pp_rank_(\d+)_")  # DeepSpeed's name of rank r's partition


def _assign(files: dict[str, int], world: int) -> dict[str, int]:
    """Which rank hashes each file (relative path -> bytes). A rank's ZeRO partition file goes
    to that rank, which wrote it (its pages are likely still cached there, and the reads are
    spread over the nodes); every other file, largest first, to the rank with the fewest bytes
    so far. Only the spread depends on DeepSpeed's file names, not the result."""
    load, out = [0] * world, {}
    for name, size in files.items():
        m = _RANK_FILE.search(Path(name).name)
        if m and int(m.group(1)) < world:
            out[name] = int(m.group(1))
            load[out[name]] += size
    for name, size in sorted(files.items(), key=lambda kv: (-kv[1], kv[0])):
        if name not in out:
            out[name] = min(range(world), key=lambda r: (load[r], r))
            load[out[name]] += size
    return out


def _hash_files(folder: Path, files: dict[str, int], rank: int) -> dict[str, str]:
    """sha256 of each of `files` (relative path -> bytes) under `folder`, each read by one rank
    (`_assign`), on every rank (a collective: every rank passes the same `files`). A file that
    cannot be read maps to "unreadable (why)" instead of a digest."""
    world = dist.get_world_size() if dist.is_initialized() else 1
    share = [n for n, r in _assign(files, world).items() if r == rank]
    mine = {}
    for name in sorted(share):
        try:
            mine[name] = sha256_file(folder / name)  # 1 MiB reads: streams any size
        except OSError as e:
            mine[name] = f"unreadable ({e.strerror or e})"
    return {name: digest for part in all_gather_object(mine) for name, digest in part.items()}


def _list_files(folder: Path) -> dict[str, int]:
    """Every file under `folder` but checksums.json: relative path -> bytes."""
    return {
        p.relative_to(folder).as_posix(): p.stat().st_size
        for p in sorted(folder.rglob("*"))
        if p.is_file() and p.name != CHECKSUMS_NAME
    }


def _manifest_problem(folder: Path, manifest: dict[str, dict]) -> str | None:
    """What is wrong with `folder` by sizes alone (cheap: no file read), or None."""
    wrong = []
    for name, entry in manifest.items():
        try:
            size = (folder / name).stat().st_size
        except FileNotFoundError:
            wrong.append(f"{name} is missing")
        except OSError as e:
            wrong.append(f"{name} cannot be read ({e.strerror or e})")
        else:
            if size != entry["bytes"]:
                wrong.append(f"{name} has {size} bytes, {CHECKSUMS_NAME} says {entry['bytes']}")
    return _summary(wrong)


def _summary(wrong: list[str]) -> str | None:
    more = f" (and {len(wrong) - 1} more)" if len(wrong) > 1 else ""
    return wrong[0] + more if wrong else None


def _hash_problem(folder: Path, manifest: dict[str, dict], rank: int) -> str | None:
    """What the sha256 of `folder`'s files says is wrong, or None (a collective)."""
    digests = _hash_files(folder, {name: entry["bytes"] for name, entry in manifest.items()}, rank)
    wrong = []
    for name, entry in sorted(manifest.items()):
        got = digests[name]
        if got.startswith("unreadable"):
            wrong.append(f"{name} is {got}")
        elif got != entry["sha256"]:
            wrong.append(f"{name} does not match its sha256 in {CHECKSUMS_NAME}")
    return _summary(wrong)


# -- finding the checkpoint to resume ----------------------------------------------------


@dataclass
class _Candidate:
    """A checkpoint folder as rank 0 found it without reading its large files."""

    tag: str
    problem: str | None = None  # what is wrong, found cheaply (None: nothing so far)
    manifest: dict[str, dict] | None = None  # checksums.json's files; None: an older save
    state: dict = field(default_factory=dict)  # trainer_state.json


@dataclass
class _Survey:
    problems: list[str]  # what is wrong with `latest` (none: it names candidates[0])
    candidates: list[_Candidate]  # in the order to try: `latest`'s, then newest first


def _inspect(folder: Path) -> _Candidate:
    """The cheap checks of one checkpoint folder: trainer_state.json parses and names the
    folder's step, checksums.json parses, and every file it lists is there at its size."""
    tag = folder.name
    try:
        state = json.loads((folder / STATE_NAME).read_text())
    except FileNotFoundError:
        return _Candidate(
            tag, f"{STATE_NAME} is missing" if folder.is_dir() else "the folder is gone"
        )
    except OSError as e:
        return _Candidate(tag, f"{STATE_NAME} cannot be read ({e.strerror or e})")
    except ValueError as e:  # JSONDecodeError, UnicodeDecodeError
        return _Candidate(tag, f"{STATE_NAME} is not valid JSON ({e})")
    if not isinstance(state, dict) or state.get("step") != _step_of(tag):
        step = state.get("step") if isinstance(state, dict) else None
        return _Candidate(tag, f"{STATE_NAME} names step {step}, not {_step_of(tag)}")
    try:
        body = json.loads((folder / CHECKSUMS_NAME).read_text())
    except FileNotFoundError:  # saved before checksums.json existed: checked by loading it only
        return _Candidate(tag, state=state)
    except (OSError, ValueError) as e:
        return _Candidate(tag, f"{CHECKSUMS_NAME} cannot be read ({e})", state=state)
    files = body.get("files") if isinstance(body, dict) else None
    if not isinstance(files, dict) or not all(_entry_ok(n, v) for n, v in files.items()):
        bad = f"{CHECKSUMS_NAME} is not a list of this folder's files with bytes and sha256"
        return _Candidate(tag, bad, state=state)
    return _Candidate(tag, _manifest_problem(folder, files), files, state)


def _entry_ok(name: str, entry: object) -> bool:
    """A checksums.json entry as `save` writes it: a path inside the folder (nothing outside it
    is ever read), its size and sha256."""
    return (
        not Path(name).is_absolute()
        and ".." not in Path(name).parts
        and isinstance(entry, dict)
        and isinstance(entry.get("bytes"), int)
        and isinstance(entry.get("sha256"), str)
    )


def _survey(ckpt_dir: Path) -> _Survey | None:
    """What is there to resume, without reading the large files; None for a fresh run."""
    pointer, folders = ckpt_dir / "latest", _checkpoints(ckpt_dir)
    named: str | None = None
    problem: str | None = None
    try:
        named = pointer.read_text().strip()
    except FileNotFoundError:
        if not folders:
            return None  # a fresh run
        problem = f"{pointer} is missing"
    except (OSError, ValueError) as e:  # ValueError: bytes that are not UTF-8
        problem = f"{pointer} cannot be read ({e})"
    first = ckpt_dir / named if named and _step_of(named) is not None else None
    if named is not None and not (first and first.is_dir()):
        what = "does not exist" if first else "is not a checkpoint tag"
        problem = f"{pointer} names {named!r}, which {what}"
        first = None
    order = ([first] if first else []) + [p for p in reversed(folders) if p != first]
    return _Survey([problem] if problem else [], [_inspect(p) for p in order])


def _none_intact(ckpt_dir: Path, problems: list[str]) -> CheckpointError:
    return CheckpointError(
        f"{ckpt_dir}: no intact checkpoint to resume ({'; '.join(problems)}); put back a "
        f"good copy of a checkpoint, or delete {ckpt_dir} to train this run.dir from step 0"
    )


def latest_tag(ckpt_dir: Path) -> str | None:
    """The tag of the checkpoint `find` will resume unless its sha256 disagrees, or None for a
    fresh run; a CheckpointError at once when checkpoints are there but none passes the cheap
    checks (`_inspect`: no large file is read, so every rank may call this, before the
    expensive set-up)."""
    survey = _survey(ckpt_dir)
    if survey is None:
        return None
    for c in survey.candidates:
        if c.problem is None:
            return c.tag
    raise _none_intact(
        ckpt_dir, survey.problems + [f"{ckpt_dir / c.tag}: {c.problem}" for c in survey.candidates]
    )


def _remove_leftovers(ckpt_dir: Path, damaged: bool) -> None:
    """Folders nobody will trust: interrupted saves (`*.partial`), interrupted conversions
    (`<tag>/universal.partial`, a dead converter's heartbeat) and, with `damaged`, the
    checkpoints a resume set aside (what they held is in that launch's log)."""
    stale = [*ckpt_dir.glob("*.partial"), *ckpt_dir.glob(f"step*/{UNIVERSAL}.partial")]
    if damaged:
        stale += ckpt_dir.glob(f"*{DAMAGED}")
    for p in stale:
        shutil.rmtree(p, ignore_errors=True)
    for beat in ckpt_dir.glob(f"step*/{UNIVERSAL}.heartbeat"):
        beat.unlink(missing_ok=True)


def _set_aside(ckpt_dir: Path, tags: list[str]) -> list[str]:
    """Rename damaged checkpoints to `<tag>.damaged` (a resume never trusts them, the next
    save deletes them); the new names."""
    moved = []
    for tag in tags:
        src, dst = ckpt_dir / tag, ckpt_dir / f"{tag}{DAMAGED}"
        if not src.is_dir():
            continue
        shutil.rmtree(dst, ignore_errors=True)
        try:
            src.rename(dst)
            moved.append(dst.name)
        except OSError as e:
            log.warning("%s: could not set it aside as %s (%s)", src, dst.name, e)
    return moved


def find(ckpt_dir: Path, rank: int) -> tuple[str, dict] | None:
    """(tag, trainer state) of the checkpoint to resume, the same on every rank, or None for a
    fresh run (a collective).

    Rank 0 surveys the folder (`_survey`: cheap checks of every checkpoint); then every rank
    helps hash the candidates' files, in order, until one matches its checksums.json. Rank 0
    sets the damaged ones aside, points `latest` at the one chosen and says so in one line."""
    plan: _Survey | str | None = None
    if rank == 0:
        try:
            _remove_leftovers(ckpt_dir, damaged=False)  # e.g. a save that ran out of space
            plan = _survey(ckpt_dir)
        except OSError as e:
            plan = f"{ckpt_dir}: cannot be read ({e}); check the run directory's file system"
    plan = broadcast_object(plan)  # type: ignore[assignment]
    if isinstance(plan, str):
        raise CheckpointError(plan)
    if plan is None:
        return None
    problems = plan.problems
    damaged = []
    for chosen in plan.candidates:
        if chosen.problem is None and chosen.manifest is not None:  # every rank hashes
            chosen.problem = _hash_problem(ckpt_dir / chosen.tag, chosen.manifest, rank)
        if chosen.problem is None:
            break
        problems.append(f"{ckpt_dir / chosen.tag}: {chosen.problem}")
        damaged.append(chosen.tag)
    else:  # none passed
        raise _none_intact(ckpt_dir, problems)
    where = ckpt_dir / chosen.tag
    if rank == 0:
        if problems:
            moved = _set_aside(ckpt_dir, damaged)
            with contextlib.suppress(OSError):  # else the next launch finds the same again
                atomic_write_text(ckpt_dir / "latest", chosen.tag + "\n")
            aside = f"; set aside as {', '.join(moved)} (deleted by the next save)" if moved else ""
            log.warning(
                "%s; resuming from the newest intact checkpoint, %s (step %d)%s",
                "; ".join(problems), where, chosen.state["step"], aside,
            )  # fmt: skip
        if chosen.manifest is None:
            log.info(
                "%s has no %s (saved by an older ssl-vit): it is checked only by loading it",
                where, CHECKSUMS_NAME,
            )  # fmt: skip
    check_shared(where / STATE_NAME, rank, "cannot read this checkpoint")
    return chosen.tag, chosen.state


# -- saving ------------------------------------------------------------------------------

# What a save needs when there is no previous checkpoint to measure: the fp32 weights (4
# bytes a parameter, 2 in bf16) plus AdamW's fp32 master copy and two moments (12), as
# DeepSpeed's files hold them at any ZeRO stage. 16 is the largest of these sums, so the
# estimate errs on the safe side (by a quarter for fp32 at stage 0, which keeps no master copy).
BYTES_PER_PARAMETER = 16
SPACE_MARGIN = 1.05  # a save is about the size of the one before; a little room for the rest


def free_bytes(path: Path) -> int:
    """Free space for this user on `path`'s file system (a quota the file system does not
    report through statvfs is not seen: a write then fails, and `_write_failure` says so)."""
    return shutil.disk_usage(path).free


def bytes_needed(ckpt_dir: Path, engine: Any) -> tuple[int, str]:
    """(bytes the next save needs, how that was estimated). The previous checkpoint's size when
    there is one (the same model and optimizer save the same tensors again), else the
    parameter count x BYTES_PER_PARAMETER: either is an estimate, with SPACE_MARGIN on top."""
    folders = _checkpoints(ckpt_dir)
    if folders:
        size = _folder_bytes(folders[-1], universal=False)
        if size:
            return int(size * SPACE_MARGIN), f"the size of {folders[-1].name}"
    params = sum(int(getattr(p, "ds_numel", p.numel())) for p in engine.module.parameters())
    return (
        int(params * BYTES_PER_PARAMETER * SPACE_MARGIN),
        f"{params} parameters x {BYTES_PER_PARAMETER} bytes",
    )


def _doomed(ckpt_dir: Path, tag: str, keep: int) -> list[Path]:
    """The checkpoints pruning (in `_finish`) would delete once `tag` is saved, less the newest
    one and the one `latest` names: these may go before the save, which never leaves the run
    without an intact checkpoint if it fails."""
    folders = [p for p in _checkpoints(ckpt_dir) if p.name != tag]
    after = sorted([*(p.name for p in folders), tag], key=lambda t: _step_of(t) or 0)
    pruned = set(after[: max(0, len(after) - keep)])
    with contextlib.suppress(OSError, ValueError):
        pruned.discard((ckpt_dir / "latest").read_text().strip())
    return [p for p in folders[:-1] if p.name in pruned]


def make_room(ckpt_dir: Path, tag: str, keep: int, need: int, basis: str) -> None:
    """Enough free space for a save of `need` bytes, deleting early what pruning would delete
    after it (`_doomed`) if that is what it takes; else a CheckpointError naming the folder,
    the bytes needed and free, and what to do."""
    free = free_bytes(ckpt_dir)
    if free >= need:
        return
    doomed = _doomed(ckpt_dir, tag, keep)
    if doomed and free + sum(_folder_bytes(p) for p in doomed) >= need:
        log.info(
            "%s: %s free, about %s needed for %s: deleting %s before the save rather than after "
            "(run.keep_checkpoints=%d)",
            ckpt_dir, _size(free), _size(need), tag, ", ".join(p.name for p in doomed), keep,
        )  # fmt: skip
        for p in doomed:
            shutil.rmtree(p, ignore_errors=True)
        return
    k = next(  # the largest keep that would make the room
        (k for k in range(keep - 1, 0, -1)
         if free + sum(_folder_bytes(p) for p in _doomed(ckpt_dir, tag, k)) >= need),
        None,
    )  # fmt: skip
    lower = f", or lower run.keep_checkpoints to {k}" if k else ""
    raise CheckpointError(
        f"{ckpt_dir}: not enough free space for checkpoint {tag}: about {_size(need)} needed "
        f"({basis}), {_size(free)} free; free space on that file system{lower}, then relaunch "
        "(the run resumes from its last complete checkpoint)"
    )


# torch's zip writer reports a failed write in its own words (a full disk gave "unexpected pos
# N vs M" from inline_container.cc with torch 2.14, "basic_ios::clear" or "file write failed"
# with others), not as an OSError.
_TORCH_WRITE_ERRORS = ("basic_ios", "No space", "file write failed", "inline_container",
                       "PytorchStreamWriter")  # fmt: skip


def _write_failure(e: BaseException, partial: Path) -> str | None:
    """One line for an exception of a checkpoint write that is the file system's doing (an
    OSError, or torch's writer failing), naming the folder and the free space; else None."""
    if isinstance(e, OSError):
        why = e.strerror or str(e)
        if e.errno in (errno.ENOSPC, errno.EDQUOT):
            why += " (a full disk or quota)"
    elif isinstance(e, RuntimeError) and any(m in str(e) for m in _TORCH_WRITE_ERRORS):
        why = f"torch's writer: {type(e).__name__}: {first_line(e)}"
    else:
        return None
    try:
        free = f"{_size(free_bytes(partial.parent))} free there"
    except OSError:
        free = "free space unknown"
    return (
        f"{partial}: writing the checkpoint failed ({why}; {free}); the partial checkpoint is "
        "removed and the last complete one kept: free space (or lower run.keep_checkpoints), "
        "then relaunch"
    )


def _check(error: str | None) -> None:
    """Raise on every rank the error one rank found (its argument, after a broadcast)."""
    if error:
        raise CheckpointError(error)


def save(engine: Any, ckpt_dir: Path, step: int, state: dict, rank: int, keep: int) -> str:
    """Write a checkpoint for `step` on every rank; returns its tag. Stops with a
    CheckpointError (one line) when there is no room for it, leaving no partial folder."""
    tag = tag_for(step)
    partial = ckpt_dir / f"{tag}.partial"
    error = None
    if rank == 0:
        try:
            ckpt_dir.mkdir(parents=True, exist_ok=True)
            _remove_leftovers(ckpt_dir, damaged=True)
            make_room(ckpt_dir, tag, keep, *bytes_needed(ckpt_dir, engine))
        except CheckpointError as e:
            error = str(e)
        except OSError as e:
            error = f"{ckpt_dir}: cannot prepare the checkpoint folder ({e}); check its storage"
    _check(broadcast_object(error))  # type: ignore[arg-type]
    try:
        engine.save_checkpoint(str(ckpt_dir), tag=partial.name, save_latest=False)
    except (OSError, RuntimeError) as e:
        # This rank stops; DeepSpeed's ranks that wrote their part wait in its last barrier
        # until the launcher, seeing this one exit, ends them (or the process group times out).
        line = _write_failure(e, partial)
        if line is None:
            raise
        shutil.rmtree(partial, ignore_errors=True)
        raise CheckpointError(line) from e
    barrier()
    files, error = None, None
    if rank == 0:
        try:
            atomic_write_text(partial / STATE_NAME, json.dumps(state, indent=2))
            files = _list_files(partial)
        except OSError as e:
            error = _write_failure(e, partial)
            shutil.rmtree(partial, ignore_errors=True)
    files, error = broadcast_object((files, error))  # type: ignore[misc]
    _check(error)
    digests = _hash_files(partial, files, rank)  # every rank reads its share back
    if rank == 0:
        error = _finish(ckpt_dir, partial, tag, files, digests, keep)
    _check(broadcast_object(error))  # type: ignore[arg-type]
    return tag


def _finish(
    ckpt_dir: Path, partial: Path, tag: str, files: dict, digests: dict, keep: int
) -> str | None:
    """Rank 0: checksums.json, then the rename, `latest` and pruning; an error line or None.
    checksums.json is written before the rename, so every complete checkpoint has one."""
    try:
        unreadable = [f"{n} is {d}" for n, d in sorted(digests.items()) if d.startswith("unread")]
        if unreadable:
            shutil.rmtree(partial, ignore_errors=True)
            return (
                f"{partial}: the checkpoint just written cannot be read back "
                f"({_summary(unreadable)}); check the run directory's storage, then relaunch"
            )
        body = {n: {"bytes": files[n], "sha256": digests[n]} for n in sorted(files)}
        atomic_write_text(partial / CHECKSUMS_NAME, json.dumps({"files": body}, indent=1))
        final = ckpt_dir / tag
        if final.exists():  # same step saved before (a rerun that ended here): replace it
            shutil.rmtree(final)
        partial.rename(final)
        atomic_write_text(ckpt_dir / "latest", tag + "\n")
    except OSError as e:
        line = _write_failure(e, partial)
        shutil.rmtree(partial, ignore_errors=True)
        return line
    folders = _checkpoints(ckpt_dir)  # pruned to the newest `keep`
    for old in folders[: max(0, len(folders) - keep)]:
        shutil.rmtree(old, ignore_errors=True)
    return None


def check_shared(
    path: Path, rank: int, what: str = "cannot see the run directory that rank 0 wrote"
) -> None:
    """Every rank sees the file `path` (by default RUN/config.yaml, which rank 0 just wrote), or
    none goes on: a CheckpointError naming the ranks that do not (a collective).

    On node-local run directories each node would checkpoint and resume on its own."""
    seen = all_gather_object((rank, socket.gethostname(), path.is_file()))
    missing = ", ".join(f"rank {r} on {host}" for r, host, ok in seen if not ok)
    if missing:
        raise CheckpointError(
            f"{path.parent}: {missing} {what}; put run.dir on storage that every node shares"
        )


# -- loading -----------------------------------------------------------------------------


def restore(engine: Any, ckpt_dir: Path, tag: str, universal: bool = False) -> None:
    """Load model and optimizer state of checkpoint `tag` (every rank); `universal`: from
    `<tag>/universal` (`to_universal`), with DeepSpeed's universal load. Whatever DeepSpeed
    raises while loading becomes one line naming the checkpoint."""
    load_dir, load_tag = (ckpt_dir / tag, UNIVERSAL) if universal else (ckpt_dir, tag)
    groups = [{k: v for k, v in g.items() if k != "params"} for g in engine.optimizer.param_groups]
    what_to_do = (
        "delete that folder to convert again, or resume at the saved world size"
        if universal
        else f"rename it to {tag}{DAMAGED} to resume from the checkpoint before it, or delete "
        f"{ckpt_dir} to train this run.dir from step 0"
    )
    try:
        with _universal_load(engine) if universal else contextlib.nullcontext():
            path, _ = engine.load_checkpoint(str(load_dir), tag=load_tag)
    except (CheckpointError, torch.cuda.OutOfMemoryError):  # not the checkpoint's fault
        raise
    except Exception as e:  # torch's unpickler, DeepSpeed's asserts: a damaged or odd file
        raise CheckpointError(
            f"{load_dir / load_tag}: DeepSpeed could not load this checkpoint "
            f"({type(e).__name__}: {first_line(e)}); {what_to_do}"
        ) from e
    if path is None:
        raise CheckpointError(
            f"{load_dir / load_tag}: DeepSpeed could not load this checkpoint; {what_to_do}"
        )
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
def _universal_load(engine: Any) -> Iterator[None]:
    """DeepSpeed's `checkpoint.load_universal` switched on for one load.

    The engine reads that config key only inside `load_checkpoint` (through
    `engine.load_universal_checkpoint()`), and whether a launch needs it is known only once its
    checkpoint is found, after the engine is built: so it is set on the engine's parsed config
    for this load and put back after, rather than in the JSON config of every launch."""
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


# Rank 0 rewrites a heartbeat file while it converts; a waiting rank gives up when it has not
# changed for HEARTBEAT_LIMIT_S (the environment variable overrides it): a dead rank 0 stops
# the others in bounded time, while a slow conversion that is alive may take as long as it
# needs. The limit is far above the beat's period and a network file system's attribute
# caching (up to a minute), so a live converter is never taken for a dead one.
HEARTBEAT_EVERY_S = 5.0
HEARTBEAT_LIMIT_S = 600.0
HEARTBEAT_LIMIT_ENV = "SSL_VIT_HEARTBEAT_LIMIT_S"


def heartbeat_limit() -> float:
    """HEARTBEAT_LIMIT_S, or the number of seconds in $SSL_VIT_HEARTBEAT_LIMIT_S."""
    text = os.environ.get(HEARTBEAT_LIMIT_ENV, "").strip()
    with contextlib.suppress(ValueError):  # not a number: the error below
        limit = float(text or HEARTBEAT_LIMIT_S)
        if limit > 0:
            return limit
    raise CheckpointError(
        f"{HEARTBEAT_LIMIT_ENV}={text!r}: give a positive number of seconds, or unset it"
    )


@contextlib.contextmanager
def heartbeat(path: Path, every: float = HEARTBEAT_EVERY_S) -> Iterator[None]:
    """Rewrite `path` every `every` seconds from a thread while the body runs (each time with a
    new count, so a reader sees a change whatever the clocks of the nodes say); removed after."""
    stop = threading.Event()

    def beat() -> None:
        n = 0
        while True:
            n += 1
            with contextlib.suppress(OSError):  # e.g. a full disk: the waiters' limit tells
                atomic_write_text(
                    path, f"rank 0 on {socket.gethostname()}, pid {os.getpid()}: beat {n}\n"
                )
            if stop.wait(every):
                return

    thread = threading.Thread(target=beat, name="checkpoint-heartbeat", daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join()
        path.unlink(missing_ok=True)


def wait_for_rank0(
    done: Callable[[], bool], beat: Path, host: str, what: str, limit: float | None = None
) -> None:
    """Poll `done` until true, or raise a CheckpointError naming rank 0 and its `host` once
    `beat` (rank 0's `heartbeat`) has not changed for `limit` seconds of this rank's clock."""
    limit = heartbeat_limit() if limit is None else limit
    last: str | None = None
    since = time.monotonic()
    while not done():
        try:
            seen: str | None = beat.read_text()
        except (OSError, ValueError):
            seen = None  # not written yet, or between two beats
        now = time.monotonic()
        if seen is not None and seen != last:
            last, since = seen, now
        elif now - since > limit:
            raise CheckpointError(
                f"{beat}: rank 0 on {host} gave no sign of life for {limit:.0f} s while "
                f"{what}; it has probably died: relaunch the run (to wait longer, set "
                f"{HEARTBEAT_LIMIT_ENV})"
            )
        time.sleep(min(1.0, limit / 4))


def to_universal(ckpt_dir: Path, tag: str, rank: int) -> None:
    """Convert checkpoint `tag` to DeepSpeed's universal format in `<tag>/universal/`, once: a
    later launch reuses it (every rank calls this; rank 0 converts).

    Rank 0 runs DeepSpeed's `ds_to_universal` (its `main`, serially: a process pool forked
    from a training process with threads and a process group is not safe) into
    `universal.partial/`, renamed when complete, so a kill mid-way leaves nothing a later
    launch would trust; a failure is written to `universal.failed` instead. The other ranks
    wait by watching for either on the shared run directory, not inside a collective: the
    conversion of a large model on a network file system can outlast the process group's
    timeout (DeepSpeed's 10 minutes by default), which would abort every rank. They watch
    rank 0's heartbeat too (`<tag>/universal.heartbeat`), and stop with one line when it
    stops (`wait_for_rank0`). Our modules carry no universal-checkpoint metadata
    (tensor-parallel patterns; we have none), which the converter is told to add
    (`inject_missing_state`). Its progress output is kept out of the log unless it fails."""
    final = ckpt_dir / tag / UNIVERSAL
    failed = final.with_name(UNIVERSAL + ".failed")
    beat = final.with_name(UNIVERSAL + ".heartbeat")
    if rank == 0:
        failed.unlink(missing_ok=True)  # an earlier launch's: this one tries again
        beat.unlink(missing_ok=True)
    host = str(broadcast_object(socket.gethostname()))  # rank 0's, for the waiters' error
    error, told = None, True
    if rank == 0 and not final.is_dir():
        partial = final.with_name(UNIVERSAL + ".partial")
        output = io.StringIO()
        try:
            with heartbeat(beat):  # from the start: deleting a large leftover takes time too
                shutil.rmtree(partial, ignore_errors=True)
                from deepspeed.checkpoint import ds_to_universal

                with contextlib.redirect_stdout(output), contextlib.redirect_stderr(output):
                    ds_to_universal.main(
                        argparse.Namespace(
                            input_folder=str(ckpt_dir / tag),
                            output_folder=str(partial),
                            num_extract_workers=1,
                            num_merge_workers=1,
                            keep_temp_folder=False,
                            strict=True,
                            inject_missing_state=True,
                        )
                    )
                # it also points `<tag>/latest_universal` at the folder it wrote; we load by name
                (ckpt_dir / tag / "latest_universal").unlink(missing_ok=True)
                partial.rename(final)
        except Exception as e:  # any failure of the converter: every rank must hear of it
            log.error("ds_to_universal output:\n%s", output.getvalue()[-5000:])
            shutil.rmtree(partial, ignore_errors=True)
            error = f"{type(e).__name__}: {e}"
            try:
                atomic_write_text(failed, error)
            except OSError:  # e.g. a full disk: the others stop when the heartbeat does
                told = False
    if rank != 0:
        converting = f"converting {ckpt_dir / tag} to a universal checkpoint"
        wait_for_rank0(lambda: final.is_dir() or failed.is_file(), beat, host, converting)
        if failed.is_file():
            error = failed.read_text().strip()
    if told:  # else the others wait for a file that will not come: stop now, the launcher ends them
        barrier()
    if error:
        raise CheckpointError(
            f"{ckpt_dir / tag}: conversion to a universal checkpoint failed "
            f"({error}); resume at the saved world size, or start a new "
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
            if k
            else f"epoch {epoch} starts from its first batch, as planned"
        )
        log.info("%s: %s", said[0], "; ".join(said[1:]))
    return state
