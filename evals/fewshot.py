"""Few-shot linear evaluation: closed-form ridge to {-1, 1}^K targets (ViT paper, sec. 4.1).

python evals/fewshot.py --backbone runs/quickstart --data shards/fashion-mnist --out fewshot.json
"""

from __future__ import annotations

import argparse
import sys
import time

from ssl_vit import startup
from ssl_vit.evaluation.cli import add_common_args, features_from_args, report, run_main
from ssl_vit.evaluation.options import DEFAULT_SHOTS
from ssl_vit.logs import OneLineParser


def main(argv: list[str] | None = None) -> int:
    p = OneLineParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    add_common_args(p)
    p.add_argument(
        "--shots",
        type=int,
        nargs="+",
        default=list(DEFAULT_SHOTS),
        help="examples per class (paper: 1 5 10 25)",
    )
    p.add_argument("--seeds", type=int, default=5, help="random draws per shot count")
    p.add_argument(
        "--l2",
        type=float,
        default=None,
        help="a fixed ridge strength (default: chosen per draw by leave-one-out on the shots)",
    )
    args = p.parse_args(argv)
    if min(args.shots) < 1 or args.seeds < 1 or (args.l2 is not None and args.l2 <= 0):
        p.error("--shots and --seeds must be >= 1 and --l2 > 0")
    from ssl_vit.evaluation.fewshot import fewshot_eval  # torch loads only now

    t0 = time.perf_counter()
    bb, train, test = features_from_args(args)
    metrics = fewshot_eval(
        train.features,
        train.labels,
        test.features,
        test.labels,
        shots=tuple(args.shots),
        seeds=args.seeds,
        l2=args.l2,
    )
    options = {"shots": args.shots, "seeds": args.seeds, "l2": args.l2 if args.l2 else "loo"}
    report(args, "fewshot", bb, metrics, options, time.perf_counter() - t0)
    return 0


if __name__ == "__main__":
    startup.begin()  # no GC passes over the modules it loads (ssl_vit/startup.py)
    sys.exit(run_main(main))
