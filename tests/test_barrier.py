"""Our barriers between ranks are bounded and name the ranks they waited for."""

from __future__ import annotations

import os
import time

import torch.distributed as dist
import torch.multiprocessing as tmp
from test_train_e2e import free_port

from ssl_vit.engine.distributed import BarrierTimeout, barrier


def _rank(rank: int, port: int, out: str) -> None:
    os.environ["SSL_VIT_BARRIER_TIMEOUT_S"] = "3"
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=3)
    barrier("the start")  # all three arrive
    if rank == 2:  # hangs, as a rank stuck in I/O would
        time.sleep(8)
        return
    start = time.monotonic()
    try:
        barrier("the checkpoint")
        said = "passed"
    except BarrierTimeout as e:
        said = f"{time.monotonic() - start:.1f}|{e}"
    with open(f"{out}.{rank}", "w") as f:
        f.write(said)


def test_a_rank_that_never_comes_is_named_after_the_timeout(tmp_path):
    out = str(tmp_path / "said")
    tmp.start_processes(_rank, args=(free_port(), out), nprocs=3, join=True, start_method="spawn")
    said = open(f"{out}.0").read()
    waited, _, line = said.partition("|")
    assert 2.5 < float(waited) < 10, said
    assert "rank(s) 2 did not reach the checkpoint within 3 s" in line and "\n" not in line
