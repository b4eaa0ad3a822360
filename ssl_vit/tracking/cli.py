"""`python -m ssl_vit.tracking replay SPOOL_DIR` and `... register RUN_ID NAME`.

replay pushes every spool file in SPOOL_DIR (see `spool`) to its store, or to `--tracking-uri`.
register makes the run's `export` artifact a new version of registered model NAME (see
`registry`), e.g. after a replay when the store was down at the end of training.
Exit status 0 when all was sent, 1 when something failed, 2 on a usage error or a missing folder.
"""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

from ssl_vit.tracking.spool import replay_file
from ssl_vit.tracking.store import Unreachable, resolve_uri


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
    rg = sub.add_parser("register", help="register RUN_ID's export as a new version of NAME")
    rg.add_argument("run_id", help="the MLflow run that logged the export")
    rg.add_argument("name", help="registered model name (created if new)")
    rg.add_argument("--artifact-path", default="export", help="the export's artifact path")
    rg.add_argument("--tracking-uri", default=None, help="default: $MLFLOW_TRACKING_URI")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(message)s")
    if args.cmd == "register":
        from ssl_vit.tracking.registry import register_export

        uri = resolve_uri(args.tracking_uri)
        version = register_export(uri, args.name, args.run_id, artifact_path=args.artifact_path)
        if version is None:
            return 1
        print(f"models:/{args.name}/{version}")
        return 0
    files = sorted(p for p in args.spool_dir.glob("*.jsonl") if p.name != "rejected.jsonl")
    if not args.spool_dir.is_dir():
        print(f"error: {args.spool_dir}: no such folder", file=sys.stderr)
        return 2
    failed = 0
    for path in files:
        try:
            run_id, n = replay_file(path, args.tracking_uri)
            print(f"{path}: {n} events -> run {run_id}")
        except (Unreachable, ValueError) as e:
            print(f"error: {path}: {e}", file=sys.stderr)
            failed += 1
    if not files:
        print(f"{args.spool_dir}: nothing to replay")
    return 1 if failed else 0
