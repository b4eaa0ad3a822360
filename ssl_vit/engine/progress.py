"""Training metrics over a logging window, progress display, and the loss-curve plot."""

from __future__ import annotations

import json
import logging
import sys
import time
from pathlib import Path

import torch

from ssl_vit.engine.distributed import all_reduce_sum
from ssl_vit.io import atomic_write_text

log = logging.getLogger("ssl_vit.train")


class MetricWindow:
    """Sums step metrics as tensors (no host sync per step); `flush` averages over ranks."""

    def __init__(self, device: torch.device, global_batch: int) -> None:
        self.device = device
        self.global_batch = global_batch
        self._reset()

    def _reset(self) -> None:
        self.sums: dict[str, torch.Tensor] = {}
        self.count = 0
        self.steps = 0
        self.data_s = 0.0
        self.started = time.perf_counter()

    def add(self, loss: torch.Tensor, metrics: dict[str, torch.Tensor]) -> None:
        """One micro-batch's loss and metrics (scalar tensors)."""
        for key, value in {"loss": loss, **metrics}.items():
            value = value.detach().float()
            self.sums[key] = self.sums[key] + value if key in self.sums else value
        self.count += 1

    def end_step(self, data_wait_s: float) -> None:
        self.steps += 1
        self.data_s += data_wait_s

    def flush(
        self,
        extra: dict[str, float],
        flops_per_step: float,
        peak: float,
        world: int,
        measured_peak: float = 0.0,
    ) -> dict[str, float]:
        """Everything for one log line / MLflow point, identical on every rank. `peak` and
        `measured_peak` are one device's FLOP/s (ssl_vit.perf.mfu_denominator): model FLOP
        utilisation against each, over `world` devices."""
        elapsed = max(time.perf_counter() - self.started, 1e-9)
        keys = sorted(self.sums)
        count = torch.tensor(float(self.count), device=self.device)
        values = all_reduce_sum(torch.stack([self.sums[k] for k in keys] + [count])).tolist()
        row = {f"train/{k}": v / values[-1] for k, v in zip(keys, values[:-1], strict=True)}
        row["train/images_per_s"] = self.steps * self.global_batch / elapsed
        row["train/data_wait_share"] = self.data_s / elapsed
        if flops_per_step:
            row["train/model_flops_per_s"] = flops_per_step * self.steps / elapsed
            if peak:  # the published peak where known, else the measured one
                row["train/mfu"] = row["train/model_flops_per_s"] / (peak * world)
            if measured_peak:  # the matmul peak measured at start
                row["train/mfu_measured"] = row["train/model_flops_per_s"] / (measured_peak * world)
        row.update({f"train/{k}": float(v) for k, v in extra.items()})
        self._reset()
        return row

    @staticmethod
    def truncate_file(path: Path, step: int) -> None:
        """Keep only lines up to `step`: a resumed run re-logs the steps after its checkpoint."""
        if not path.is_file():
            return
        keep = [ln for ln in path.read_text().splitlines() if ln and json.loads(ln)["step"] <= step]
        atomic_write_text(path, "".join(ln + "\n" for ln in keep))


class TrainProgress:
    """tqdm on a terminal (rank 0); plain log lines at each logging step otherwise."""

    def __init__(self, total: int, start: int, enabled: bool) -> None:
        self.enabled = enabled
        self.bar = None
        if enabled and sys.stderr.isatty():
            from tqdm import tqdm

            self.bar = tqdm(total=total, initial=start, unit="step", dynamic_ncols=True)
        self.total = total

    def update(self, step: int, row: dict[str, float] | None) -> None:
        if not self.enabled:
            return
        if self.bar is not None:
            self.bar.n = step
            if row:
                self.bar.set_postfix(
                    loss=f"{row['train/loss']:.4f}", img_s=f"{row['train/images_per_s']:.0f}"
                )
            self.bar.refresh()
        elif row:
            shown = {k.removeprefix("train/"): v for k, v in row.items()}
            text = " ".join(
                f"{k}={v:.4g}" for k, v in shown.items() if k in _SHOWN or k.startswith("acc")
            )
            log.info("step %d/%d %s", step, self.total, text)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


_SHOWN = ("loss", "mpp/acc", "sup/acc", "lr", "grad_norm", "images_per_s", "data_wait_share", "mfu")


def write_loss_plot(metrics_file: Path, out: Path) -> Path | None:
    """Loss (and accuracy, when logged) against step, from the run's metrics.jsonl."""
    if not metrics_file.is_file():
        return None
    rows = [json.loads(ln) for ln in metrics_file.read_text().splitlines() if ln]
    if not rows:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    acc_keys = [k for k in rows[-1] if k.endswith("/acc") and k.startswith("train/")]
    fig, axes = plt.subplots(1, 1 + bool(acc_keys), figsize=(5 + 5 * bool(acc_keys), 3.6))
    axes = axes if acc_keys else [axes]
    steps = [r["step"] for r in rows]
    axes[0].plot(steps, [r["train/loss"] for r in rows])
    axes[0].set(xlabel="step", ylabel="training loss", title="Loss")
    axes[0].grid(alpha=0.3)
    for key in acc_keys:
        axes[1].plot(steps, [r.get(key, float("nan")) for r in rows], label=key[6:])
    if acc_keys:
        axes[1].set(xlabel="step", ylabel="accuracy", title="Training accuracy")
        axes[1].legend()
        axes[1].grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out
