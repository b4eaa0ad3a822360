"""One rank's view of the training stream, run by tests/test_remote_shards.py under a real
launcher (`deepspeed --num_gpus 2`): no training, only the loader as the trainer builds it.

    python tests/stream_probe.py ROOT OUT_DIR [key=value ...]   -> OUT_DIR/rank{R}.json
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch

from ssl_vit.data.stream import make_train_loader
from ssl_vit.data.workers import IN_TRAINING_START


def main(root: str, out: str, *options: str) -> None:
    rank, world = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    kw = {"global_batch": 8, "num_workers": 2, "img_size": 8, "epochs": 2, "holdout": 0.0}
    for opt in options:
        key, value = opt.split("=", 1)
        kw[key] = type(kw[key])(value)
    loader = make_train_loader(
        root, "train", global_batch=kw["global_batch"], rank=rank, world_size=world,
        num_workers=kw["num_workers"], img_size=kw["img_size"], augment=False, timeout=120,
        multiprocessing_context=IN_TRAINING_START, holdout_fraction=kw["holdout"],
    )  # fmt: skip
    epochs = []
    for epoch in range(kw["epochs"]):
        loader.set_epoch(epoch)
        epochs.append(torch.cat([y for _, y in loader]).tolist())
    found = {
        "rank": rank,
        "world": world,
        "epochs": epochs,
        "samples_read": loader.counter.samples_read,
        "bytes_read": loader.counter.bytes_read,
        "read_factor": loader.read_factor,
    }
    Path(out).mkdir(parents=True, exist_ok=True)
    (Path(out) / f"rank{rank}.json").write_text(json.dumps(found))


if __name__ == "__main__":
    main(*[a for a in sys.argv[1:] if not a.startswith("--local_rank")])  # the launcher's
