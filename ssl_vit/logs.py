"""Logging set-up shared by every entry script: quiet start-up by default, `-v` shows it all.

At the default level a run prints its own progress and real warnings, not what the libraries
say while loading (FAISS's loader, torch's CUDA_HOME notice, MLflow creating its tables,
DeepSpeed's accelerator choice, matplotlib's font cache); `-v` (verbose, `wants_verbose`) shows
them again (DeepSpeed's loggers stay at WARNING). `setup_logging` sets the library loggers' levels
(QUIET_LEVELS) and filters the few known lines of DeepSpeed and torch; `quiet_prints` drops a
library's known start-up lines printed to stdout around a call. Our own warnings and errors
are never among them.

Call `setup_logging` before the libraries are imported where possible: MLflow reads
MLFLOW_LOGGING_LEVEL when it is imported. Each silenced line and how:
docs/training.md#start-up.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import logging
import os
import re
import sys
import warnings
from collections.abc import Iterator
from typing import NoReturn

__all__ = ["QUIET_LEVELS", "first_line", "quiet_prints", "setup_logging", "wants_verbose"]

# Library loggers and the level they get unless -v. Their INFO lines are start-up chatter.
QUIET_LEVELS: dict[str, int] = {
    "faiss": logging.WARNING,  # faiss.loader: "Loading faiss with AVX512 support" and so on
    "torch.utils.cpp_extension": logging.ERROR,  # "No CUDA runtime is found, using CUDA_HOME"
    "mlflow": logging.WARNING,  # "Creating initial MLflow database tables...", GPU metrics skip
    "alembic": logging.WARNING,
    "urllib3": logging.WARNING,
    "matplotlib": logging.WARNING,  # "generated new fontManager"
    "DeepSpeed": logging.WARNING,
    "deepspeed": logging.WARNING,
    "torch.distributed": logging.WARNING,
    # S3 reads: "Found credentials in environment variables.", "Found endpoint for s3 via: ..."
    "botocore": logging.WARNING,
    "aiobotocore": logging.WARNING,
    "boto3": logging.WARNING,
    "s3fs": logging.WARNING,
}
# WARNINGs DeepSpeed logs on every run: on every CPU run, and under any ZeRO stage with a torch
# optimizer (it only vouches for its own fused ones)
_DEEPSPEED_CHATTER = (
    "Setting accelerator to CPU",
    "**** You are using ZeRO with an untested optimizer",
)
# torch's FutureWarning for the collectives DeepSpeed's ZeRO stages call, once per collective
_TORCH_FUTURE = r"`torch\.distributed\.\w+` is deprecated"
# Lines libraries print to stdout while they start: DeepSpeed's CPU communication op, loaded
_PRINTED = re.compile(r"DeepSpeed \S+ built successfully")
_quiet = False  # setup_logging was called without -v: quiet_prints drops _PRINTED lines


class _DropChatter(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith(_DEEPSPEED_CHATTER)


def wants_verbose(argv: list[str] | None = None) -> bool:
    """True when the command line asks for -v/--verbose (read before argparse runs, so the
    libraries imported while parsing are already quiet or loud as asked)."""
    args = sys.argv[1:] if argv is None else argv
    return any(a in ("-v", "--verbose") or a.startswith("-vv") for a in args)


def setup_logging(
    verbose: bool = False,
    *,
    level: int = logging.INFO,
    fmt: str = "%(asctime)s %(name)s %(message)s",
    datefmt: str | None = "%H:%M:%S",
) -> None:
    """Root logging at `level` (our progress lines); library chatter off unless `verbose`."""
    global _quiet
    logging.basicConfig(level=level, format=fmt, datefmt=datefmt)
    _quiet = not verbose
    if verbose:
        # -v wins over a quiet level inherited from a parent process (which may have set it
        # up quiet itself); a user's own quiet choice stays below, via setdefault
        os.environ["MLFLOW_LOGGING_LEVEL"] = "INFO"
        os.environ["MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR"] = "true"
        for name in QUIET_LEVELS:  # DeepSpeed stays at WARNING: its INFO dumps whole configs
            keep = name in ("DeepSpeed", "deepspeed", "torch.distributed")
            logging.getLogger(name).setLevel(logging.WARNING if keep else logging.NOTSET)
        return
    # MLflow configures its logger from this variable when it is imported (mlflow.utils.
    # logging_utils); the explicit level below covers an MLflow that is already imported.
    os.environ.setdefault("MLFLOW_LOGGING_LEVEL", "WARNING")
    os.environ.setdefault("MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR", "false")
    for name, lvl in QUIET_LEVELS.items():
        logging.getLogger(name).setLevel(lvl)
    ds = logging.getLogger("DeepSpeed")
    if not any(isinstance(f, _DropChatter) for f in ds.filters):
        ds.addFilter(_DropChatter())
    if not sys.warnoptions:  # the user's own -W / PYTHONWARNINGS choice wins
        warnings.filterwarnings("ignore", _TORCH_FUTURE, FutureWarning)


@contextlib.contextmanager
def quiet_prints() -> Iterator[None]:
    """Inside, what is printed to stdout is held back and written out at the end without the
    known start-up lines of the libraries (`_PRINTED`), after `setup_logging` without -v; left
    alone otherwise (-v, or a program of the user's that never called `setup_logging`). For
    short calls only: their output comes out when they return."""
    if not _quiet:
        yield
        return
    held = io.StringIO()
    try:
        with contextlib.redirect_stdout(held):
            yield
    finally:
        lines = held.getvalue().splitlines(keepends=True)
        sys.stdout.write("".join(ln for ln in lines if not _PRINTED.fullmatch(ln.strip())))


def first_line(e: BaseException, limit: int = 300) -> str:
    """The first line of an error's message, cut at `limit` characters, for a one-line error;
    its type's name when the message is empty (`str(e)` of many OSErrors and timeouts)."""
    lines = str(e).strip().splitlines()
    return lines[0][:limit] if lines else type(e).__name__


class OneLineParser(argparse.ArgumentParser):
    """An entry script's argument parser whose usage errors are one line (`--help` for more),
    not the whole usage block above the one line that matters."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see --help)\n")
