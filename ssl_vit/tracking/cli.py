"""`python -m ssl_vit.tracking replay DIR` pushes the records a Tracker left in DIR (its
spool_dir) to their store, oldest first, each into its run (found by id, else by run key, else
created); `register RUN_ID NAME` makes a run's export a registered model version. Exit status 0
when all went through, 1 when something failed, 2 on a usage error."""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

from ssl_vit.logs import first_line
from ssl_vit.tracking.tracker import Store, read_record, records, register_export, resolve_uri


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m ssl_vit.tracking", description=__doc__)
    sub = parser.add_subparsers(dest="cmd", required=True)
    rp = sub.add_parser("replay", help="push the records in DIR to their MLflow store")
    rp.add_argument("dir", type=Path, help="the Tracker's spool_dir, e.g. RUN/mlflow_spool")
    rp.add_argument("--tracking-uri", help="store to push to (default: the recorded one)")
    rg = sub.add_parser("register", help="register RUN_ID's export as a new version of NAME")
    rg.add_argument("run_id", help="the MLflow run that logged the export")
    rg.add_argument("name", help="registered model name (created if new)")
    rg.add_argument("--artifact-path", default="export", help="the export's artifact path")
    rg.add_argument("--tracking-uri", help="default: $MLFLOW_TRACKING_URI, else sqlite")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(message)s")
    if args.cmd == "register":
        uri = resolve_uri(args.tracking_uri)
        version = register_export(uri, args.name, args.run_id, artifact_path=args.artifact_path)
        if version is None:
            return 1
        print(f"models:/{args.name}/{version}")
        return 0
    if not args.dir.is_dir():
        print(f"error: {args.dir}: no such folder (give the Tracker's spool_dir)", file=sys.stderr)
        return 2
    failed = 0
    for path in records(args.dir):
        try:
            run_id = Store(args.tracking_uri or read_record(path)[0]["tracking_uri"]).sync(path)
            path.unlink()
            print(f"{path}: sent to run {run_id}")
        except Exception as e:
            print(f"error: {path}: {first_line(e)}", file=sys.stderr)
            failed += 1
    return 1 if failed else 0
