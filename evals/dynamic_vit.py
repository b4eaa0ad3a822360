"""Dynamic ViT adaptive inference: exit thresholds per compute budget, accuracy vs GFLOPs.

python evals/dynamic_vit.py --backbone runs/fmnist-cascade --data shards/fashion-mnist \
    --out runs/fmnist-cascade/dynamic
python evals/dynamic_vit.py --backbone runs:/RUN_ID/export --data shards/fashion-mnist --out D

--backbone is the export of a `cascade` fine-tune (configs/fmnist_cascade.yaml). Thresholds
are chosen on the held-out part of the training split (the fine-tune's hashed 2%, never
trained on), never on test; test gives accuracy, mean GFLOPs, exit shares, and measured
images/s of batched early exit against the finest stage alone. Writes OUT/results.json and
OUT/accuracy_vs_gflops.png and logs both to MLflow.
"""

from __future__ import annotations

import argparse
import os
import sys

from ssl_vit import startup
from ssl_vit.evaluation.cli import add_verbose_arg, backbone_source, run_main
from ssl_vit.logs import OneLineParser


def main(argv: list[str] | None = None) -> int:
    p = OneLineParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument(
        "--backbone",
        required=True,
        type=backbone_source,
        help="cascade export, run dir or MLflow URI",
    )
    p.add_argument("--data", required=True, help="shard set: a folder or URL holding manifest.json")
    p.add_argument("--out", required=True, help="folder for results.json and the plot")
    p.add_argument("--train-split", default="train", help="split whose held-out part chooses")
    p.add_argument("--test-split", default=None, help="split reported on (default: test, else val)")
    p.add_argument(
        "--holdout-fraction",
        type=float,
        default=0.02,
        help="held-out share of --train-split (the fine-tune's data.holdout_fraction)",
    )
    p.add_argument("--num-budgets", type=int, default=12, help="compute budgets on the curve")
    p.add_argument("--grid", type=int, default=33, help="threshold candidates per exit")
    p.add_argument("--batch-size", type=int, default=256, help="inference batch")
    p.add_argument("--speed-images", type=int, default=2048, help="test images timed")
    p.add_argument("--repeats", type=int, default=3, help="timed passes (median)")
    p.add_argument("--max-test", type=int, default=None, help="first N test images only")
    p.add_argument(
        "--workers",
        type=int,
        default=min(8, os.cpu_count() or 1),
        help="data loader workers (default: the cores, at most 8)",
    )
    p.add_argument("--device", default="cpu", help="cpu or cuda")
    p.add_argument("--no-mlflow", action="store_true", help="do not log to MLflow")
    p.add_argument(
        "--tracking-uri",
        default=None,
        help="MLflow URI (default: $MLFLOW_TRACKING_URI or sqlite:///mlflow.db)",
    )
    add_verbose_arg(p)
    args = p.parse_args(argv)
    if not 0 < args.holdout_fraction < 0.5 or args.num_budgets < 2 or args.grid < 2:
        p.error("--holdout-fraction must be in (0, 0.5), --num-budgets and --grid >= 2")
    from ssl_vit.evaluation.dynamic_run import evaluate, report  # torch loads only now

    report(args, evaluate(args))
    return 0


if __name__ == "__main__":
    startup.begin()  # no GC passes over the modules it loads (ssl_vit/startup.py)
    sys.exit(run_main(main))
