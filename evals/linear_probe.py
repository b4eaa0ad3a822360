"""Linear probe: multinomial logistic regression on frozen features, top-1 / top-5.

The L2 strength (and the lr for --solver adamw) is chosen on a held-out part of the train split
(--val-fraction), or by stratified N-fold cross-validation over it (--cv-folds N: few labels),
then the probe is refit on all of it and scored on the test split. --mae uses MAE's recipe
(BatchNorm without affine + LARS) instead, for comparison with published numbers.

    python evals/linear_probe.py --backbone runs/quickstart --data shards/fashion-mnist \
        --out probe.json
    python evals/linear_probe.py --backbone runs/quickstart --data shards/fashion-mnist \
        --train-indices subsets/n10_seed1.json --cv-folds 5   # 10 labelled images per class
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
from ssl_vit.evaluation.options import DEFAULT_L2_GRID, DEFAULT_LR_GRID
from ssl_vit.logs import OneLineParser


def main(argv: list[str] | None = None) -> int:
    p = OneLineParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    add_common_args(p)
    add_train_indices_arg(p, "fit the probe (and choose its L2)")
    p.add_argument(
        "--solver",
        choices=("lbfgs", "adamw"),
        default="lbfgs",
        help="full-batch L-BFGS, or minibatch AdamW for very large feature sets",
    )
    p.add_argument(
        "--l2",
        type=float,
        nargs="+",
        default=list(DEFAULT_L2_GRID),
        help="L2 strengths tried (AdamW: weight decay)",
    )
    p.add_argument(
        "--lr",
        type=float,
        nargs="+",
        default=list(DEFAULT_LR_GRID),
        help="AdamW learning rates tried",
    )
    p.add_argument("--val-fraction", type=float, default=0.1, help="held-out share of train")
    p.add_argument(
        "--cv-folds",
        type=int,
        default=None,
        metavar="N",
        help="choose the L2 strength by stratified N-fold cross-validation on the fitting set "
        "(folds drawn with --probe-seed) instead of a --val-fraction split; every class needs "
        "N samples",
    )
    p.add_argument("--max-iter", type=int, default=300, help="L-BFGS iterations")
    p.add_argument(
        "--epochs", type=int, default=None, help="AdamW (default 30) or --mae (default 90) epochs"
    )
    p.add_argument(
        "--probe-batch-size",
        type=int,
        default=None,
        help="AdamW (default 1024) or --mae (default 4096) batch",
    )
    p.add_argument("--mae", action="store_true", help="MAE-style probe: BN(no affine) + LARS")
    p.add_argument(
        "--mae-base-lr",
        type=float,
        default=0.1,
        help="--mae: lr = base_lr * batch / 256 (MAE: 0.1; small sets may need more)",
    )
    p.add_argument("--probe-seed", type=int, default=0, help="split / init seed")
    args = p.parse_args(argv)
    if not 0 < args.val_fraction < 1:
        p.error("--val-fraction must be in (0, 1)")
    if args.cv_folds is not None and (args.cv_folds < 2 or args.mae):
        p.error("--cv-folds takes N >= 2, and not with --mae (which chooses nothing)")
    from ssl_vit.evaluation.linear_probe import linear_probe_eval, mae_probe_eval  # torch: now

    t0 = time.perf_counter()
    bb, train, test = features_from_args(args)
    data = (train.features, train.labels, test.features, test.labels)
    if args.mae:
        metrics = mae_probe_eval(
            *data,
            epochs=args.epochs or 90,
            batch_size=args.probe_batch_size or 4096,
            base_lr=args.mae_base_lr,
            seed=args.probe_seed,
            device=args.device,
        )
        options = {"probe": "mae", "mae_base_lr": args.mae_base_lr}
    else:
        metrics = linear_probe_eval(
            *data,
            solver=args.solver,
            l2_grid=tuple(args.l2),
            lr_grid=tuple(args.lr),
            val_fraction=args.val_fraction,
            cv_folds=args.cv_folds,
            max_iter=args.max_iter,
            epochs=args.epochs or 30,
            batch_size=args.probe_batch_size or 1024,
            seed=args.probe_seed,
            device=args.device,
        )
        options = {"probe": args.solver, "l2_grid": args.l2}
        if args.cv_folds is None:
            options["val_fraction"] = args.val_fraction
        else:
            options.update(cv_folds=args.cv_folds, probe_seed=args.probe_seed)
    report(args, "linear_probe", bb, metrics, options, time.perf_counter() - t0)
    return 0


if __name__ == "__main__":
    startup.begin()  # no GC passes over the modules it loads (ssl_vit/startup.py)
    sys.exit(run_main(main))
