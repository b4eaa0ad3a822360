"""Logging set-up shared by every entry script: quiet start-up by default, `-v` shows it all.

At the default level a run prints its own progress and real warnings, not what the libraries
say while loading: FAISS's loader trying each instruction set, torch's "No CUDA runtime is
found, using CUDA_HOME" on CPU machines, MLflow creating its SQLite tables, DeepSpeed choosing
the CPU accelerator, matplotlib building its font cache. `-v` (verbose) leaves every library at
its own level and shows these lines again.

Call `setup_logging` before the libraries are imported where possible: MLflow reads
MLFLOW_LOGGING_LEVEL when it is imported, and loggers set here keep their level after.
"""

from __future__ import annotations

import logging
import os
import sys

__all__ = ["QUIET_LEVELS", "setup_logging", "wants_verbose"]

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
}
_DEEPSPEED_CHATTER = ("Setting accelerator to CPU",)  # a WARNING DeepSpeed prints on every CPU run


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
    logging.basicConfig(level=level, format=fmt, datefmt=datefmt)
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
