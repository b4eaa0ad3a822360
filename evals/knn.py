"""Weighted kNN classification and retrieval on frozen features (DINO protocol, FAISS).

python evals/knn.py --backbone runs/quickstart --data shards/fashion-mnist --out knn.json
python evals/knn.py --random-init vit_tiny_patch16_224 --patch-size 4 --data shards/fashion-mnist
python evals/knn.py --backbone runs:/RUN_ID/export --data shards/fashion-mnist   # from MLflow
python evals/knn.py --backbone runs/quickstart --data shards/fashion-mnist \
    --train-indices subsets/n10_seed1.json --k 20   # a gallery of 10 labelled images per class
"""

from __future__ import annotations

import argparse
import sys
import time

from ssl_vit import startup
from ssl_vit.evaluation.cli import (
    add_common_args,
    add_train_indices_arg,
    features_from_args,
    report,
    run_main,
)
from ssl_vit.evaluation.options import DEFAULT_KS, DEFAULT_T, INDEX_KINDS
from ssl_vit.logs import OneLineParser


def main(argv: list[str] | None = None) -> int:
    p = OneLineParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    add_common_args(p)
    add_train_indices_arg(p, "build the gallery")
    p.add_argument(
        "--k",
        type=int,
        nargs="+",
        default=list(DEFAULT_KS),
        help="neighbour counts (DINO: 10 20 100 200)",
    )
    p.add_argument("--temperature", type=float, default=DEFAULT_T, help="vote weight exp(sim/T)")
    p.add_argument(
        "--index",
        choices=INDEX_KINDS,
        default="flat",
        help="flat = exact; ivf/hnsw for big galleries (recall vs exact reported)",
    )
    p.add_argument("--nprobe", type=int, default=16, help="IVF lists searched")
    p.add_argument("--ef-search", type=int, default=256, help="HNSW search breadth")
    p.add_argument("--no-retrieval", action="store_true", help="skip recall@k and mAP@R")
    args = p.parse_args(argv)
    if min(args.k) < 1 or args.temperature <= 0:
        p.error("--k values must be >= 1 and --temperature > 0")
    from ssl_vit.knn import knn_eval  # torch and FAISS load only now

    t0 = time.perf_counter()
    bb, train, test = features_from_args(args)
    metrics = knn_eval(
        train.features,
        train.labels,
        test.features,
        test.labels,
        ks=tuple(args.k),
        temperature=args.temperature,
        index=args.index,
        nprobe=args.nprobe,
        ef_search=args.ef_search,
        retrieval=not args.no_retrieval,
    )
    options = {"k": args.k, "temperature": args.temperature, "index": args.index}
    report(args, "knn", bb, metrics, options, time.perf_counter() - t0)
    return 0


if __name__ == "__main__":
    startup.begin()  # no GC passes over the modules it loads (ssl_vit/startup.py)
    sys.exit(run_main(main))
