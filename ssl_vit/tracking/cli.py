"""The `python -m ssl_vit.tracking replay SPOOL_DIR [--tracking-uri URI]` command.

Pushes every spool file in SPOOL_DIR (see `spool`) to its store, or to `--tracking-uri`.
Exit status 0 when all were sent, 1 when one failed, 2 on a usage error or a missing folder.
"""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

from ssl_vit.tracking.spool import replay_file
from ssl_vit.tracking.store import _Unreachable


def main(argv: list[str] | None = None) -> int:
    from ssl_vit import tracking

    parser = argparse.ArgumentParser(
        prog="python -m ssl_vit.tracking", description=tracking.__doc__.split("\n")[0]
    )
    sub = parser.add_subparsers(dest="cmd", required=True)
    rp = sub.add_parser(
        "replay", help="push spooled MLflow events (SPOOL_DIR/*.jsonl) to the store"
    )
    rp.add_argument("spool_dir", type=Path, help="the Tracker's spool_dir")
    rp.add_argument(
        "--tracking-uri", default=None, help="store to push to (default: the spooled one)"
    )
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(message)s")
    files = sorted(p for p in args.spool_dir.glob("*.jsonl") if p.name != "rejected.jsonl")
    if not args.spool_dir.is_dir():
        print(f"error: {args.spool_dir}: no such folder", file=sys.stderr)
        return 2
    failed = 0
    for path in files:
        try:
            run_id, n = replay_file(path, args.tracking_uri)
            print(f"{path}: {n} events -> run {run_id}")
        except (_Unreachable, ValueError) as e:
            print(f"error: {path}: {e}", file=sys.stderr)
            failed += 1
    if not files:
        print(f"{args.spool_dir}: nothing to replay")
    return 1 if failed else 0
