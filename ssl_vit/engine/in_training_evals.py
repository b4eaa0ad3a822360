"""Evaluations run inside training: classifier accuracy (fine-tuning, supervised) and the
online kNN monitor that shows a self-supervised representation improving as it trains."""

from __future__ import annotations

import itertools
import json
import logging
from collections.abc import Callable, Iterable
from pathlib import Path

import torch
from torch import nn

from ssl_vit.config import Config, MonitorConfig
from ssl_vit.data.holdout import HOLDOUT_SPLIT
from ssl_vit.data.manifest import Manifest
from ssl_vit.data.stream import make_eval_loader
from ssl_vit.data.workers import IN_PROCESS_SAMPLES, IN_TRAINING_START
from ssl_vit.engine import zero
from ssl_vit.engine.build import ModelSpec, classifier_of
from ssl_vit.engine.distributed import all_reduce_sum, barrier
from ssl_vit.features import EvalBackbone, extract_features
from ssl_vit.io import atomic_write_text

log = logging.getLogger("ssl_vit.train")


EVAL_CACHE_BUDGET = 512 << 20  # bytes of decoded images per rank kept between evaluations


@torch.no_grad()
def classifier_accuracy(
    objective: nn.Module,
    batches: Iterable[tuple[torch.Tensor, torch.Tensor]],
    *,
    channels: int,
    img_size: int,
    autocast: bool,
) -> float:
    """Top-1 of `objective.logits` over `batches` (uint8 (B, C, H, W) images, labels): the
    rank's part of a split, the counts summed over ranks."""
    device = next(objective.parameters()).device
    was_training = objective.training
    objective.eval()
    counts = torch.zeros(2, device=device)  # (correct, seen)
    tagged: Iterable = ((b, True) for b in batches)
    if zero.is_zero3(objective):  # each forward is a collective: as many on every rank
        placeholder = (
            torch.zeros(1, channels, img_size, img_size, dtype=torch.uint8),
            torch.zeros(1),
        )
        tagged = zero.even_batches(batches, placeholder, device)
    with zero.gathered_loose(objective):
        for (images, labels), real in tagged:
            x = images.to(device).float().div_(255)
            with torch.autocast("cpu", torch.bfloat16, enabled=autocast):
                pred = objective.logits(x).argmax(-1)
            if real:  # counted on the device: no host sync per batch
                counts[0] += (pred == labels.to(device)).sum()
                counts[1] += len(labels)
    objective.train(was_training)
    correct, seen = all_reduce_sum(counts).tolist()
    return correct / max(seen, 1)


class EvalSplits:
    """The rank's part of each evaluation split, decoded once and kept (on the training device)
    when it fits EVAL_CACHE_BUDGET, else streamed every time: in-training evaluations would
    otherwise repeat the same deterministic decode each time (on a fast GPU, as long as an
    epoch of a small model's training; docs/training.md). Read from the manifest the trainer
    loaded."""

    def __init__(
        self,
        manifest: Manifest,
        img_size: int,
        rank: int,
        world: int,
        num_workers: int,
        device: torch.device,
    ) -> None:
        self.manifest, self.img_size = manifest, img_size
        self.rank, self.world, self.num_workers, self.device = rank, world, num_workers, device
        self.kept: dict[tuple[str, float | None], list] = {}

    def batches(self, split: str, holdout: float | None) -> Iterable:
        key = (split, holdout)
        if key in self.kept:
            return self.kept[key]
        # ssl_vit.data.workers: a small split in-process, a larger one with workers from a fork
        # server (IN_TRAINING_START), never forked from this threaded process.
        n = self.manifest.split(split).num_samples
        loader = make_eval_loader(
            self.manifest,
            split,
            batch_size=256,
            img_size=self.img_size,
            rank=self.rank,
            num_workers=0 if n <= IN_PROCESS_SAMPLES else self.num_workers,
            world_size=self.world,
            holdout_fraction=holdout,
            multiprocessing_context=IN_TRAINING_START,
        )
        if n * self.manifest.channels * self.img_size**2 / self.world > EVAL_CACHE_BUDGET:
            return loader  # the rank's part in bytes (uint8) would not fit: streamed
        self.kept[key] = [(x.to(self.device), y.to(self.device)) for x, y in loader]
        return self.kept[key]


def knn_monitor(
    backbone: nn.Module,
    mean: list[float],
    std: list[float],
    cfg: MonitorConfig,
    manifest: Manifest,
    img_size: int,
    in_chans: int,
) -> float:
    """kNN top-1 (k = cfg.k, T = 0.07) of the current pooled features (`--pool auto`): a
    gallery of the first `num_train` samples of the train split, queried by the first
    `num_eval` of the eval split."""
    from ssl_vit.knn import knn_eval  # FAISS loads only when the monitor runs

    was_training = backbone.training
    frozen = EvalBackbone(
        model=backbone,
        meta={"mean": mean, "std": std},
        ident="online",
        img_size=img_size,
        in_chans=in_chans,
        source="training",
    )
    device = next(backbone.parameters()).device
    sets = []
    for split, n in ((cfg.train_split, cfg.num_train), (cfg.eval_split, cfg.num_eval)):
        loader = make_eval_loader(manifest, split, batch_size=256, img_size=img_size, num_workers=0)
        batches = itertools.islice(loader, -(-n // 256))  # those of the first n samples
        sets.append(extract_features(frozen, batches, device=device, desc=f"monitor {split}"))
    backbone.train(was_training)
    (gx, gy), (qx, qy) = sets
    result = knn_eval(
        gx[: cfg.num_train],
        gy[: cfg.num_train],
        qx[: cfg.num_eval],
        qy[: cfg.num_eval],
        ks=(cfg.k,),
        retrieval=False,
    )
    return float(result[f"knn_top1@k={cfg.k}"])


class InTrainingEvals:
    """When to evaluate during training, what to log, and the best checkpoint's export.

    - Classifier objectives (supervised, joint, finetune): top-1 every `run.eval_every` steps
      (0: each epoch) and at the end, on the selection split and on `run.report_split`. The
      selection split is `run.eval_split`, by default the held-out part of the training split
      (`data.holdout_fraction`, 2% when fine-tuning as in appendix B.1.1) or a val split; the
      checkpoint best on it is exported to RUN/export_best. The report split (test) is only
      reported: it never chooses. Without a selection split nothing is chosen.
    - Any objective, with `monitor.knn_every > 0` and a labelled set: the online kNN monitor.
    Called by every rank (the evaluation and the export are collective).
    """

    def __init__(
        self,
        cfg: Config,
        manifest: Manifest,
        spec: ModelSpec,
        rank: int,
        world: int,
        steps_per_epoch: int,
        total_steps: int,
        autocast: bool,
        state: dict,
        export: Callable[[Path, dict], None] | None = None,
    ) -> None:
        self.cfg, self.manifest, self.rank, self.world = cfg, manifest, rank, world
        self.img_size, self.in_chans, self.autocast = cfg.model.img_size, spec.in_chans, autocast
        self.mean, self.std = spec.mean, spec.std
        self.total, self.export = total_steps, export
        self.every = cfg.run.eval_every or steps_per_epoch
        self.holdout = cfg.holdout_share
        self.split = cfg.run.eval_split or (
            HOLDOUT_SPLIT if self.holdout > 0 else "val" if "val" in manifest.splits else None
        )
        if self.split is not None and self.split != HOLDOUT_SPLIT:
            self.split = self.split if self.split in manifest.splits else None
        report = cfg.run.report_split
        self.report = report if report in manifest.splits and report != self.split else None
        self.classify = cfg.objective.kind != "mpp" and (self.split or self.report) is not None
        if self.classify and self.split is None and rank == 0:
            log.warning(
                "no held-out or val split: export_best/ is not written (set "
                "data.holdout_fraction to choose a checkpoint)"
            )
        m = cfg.monitor
        self.knn_every = m.knn_every if manifest.num_classes is not None else 0
        if self.knn_every and not {m.train_split, m.eval_split} <= set(manifest.splits):
            log.warning(
                "monitor: splits %s/%s not in the shard set; kNN monitor off",
                m.train_split,
                m.eval_split,
            )
            self.knn_every = 0
        if self.knn_every and cfg.train.zero_stage == 3:
            log.warning("monitor: the kNN monitor needs whole weights on rank 0; off under ZeRO-3")
            self.knn_every = 0
        self.splits: EvalSplits | None = None  # made at the first evaluation
        self.best_top1: float | None = state.get("best_top1")
        self.best_step: int | None = state.get("best_step")
        # [step, selection top-1 or None, report top-1 or None] per eval
        self.history: list[list[float | None]] = [
            [h[0], None, h[1]] if len(h) == 2 else h  # 2-column rows: older runs, reported
            for h in state.get("eval_history", [])
        ]

    def _accuracy(self, classifier: nn.Module, split: str) -> float:
        if self.splits is None:
            self.splits = EvalSplits(
                self.manifest,
                self.img_size,
                rank=self.rank,
                world=self.world,
                num_workers=min(2, self.cfg.data.num_workers),
                device=next(classifier.parameters()).device,
            )
        held = split == HOLDOUT_SPLIT
        name = self.cfg.data.split if held else split
        batches = self.splits.batches(name, self.holdout if held else None)
        return classifier_accuracy(
            classifier,
            batches,
            channels=self.in_chans,
            img_size=self.img_size,
            autocast=self.autocast,
        )

    def maybe_run(self, objective: nn.Module, step: int, tracker) -> None:
        metrics: dict[str, float] = {}
        classifier = classifier_of(objective) if self.classify else None
        if classifier is not None and (step % self.every == 0 or step == self.total):
            top1 = self._accuracy(classifier, self.split) if self.split else None
            shown = self._accuracy(classifier, self.report) if self.report else None
            self.history = [h for h in self.history if h[0] < step] + [[step, top1, shown]]
            if shown is not None:
                metrics[f"eval/{self.report}_top1"] = shown
            if top1 is not None:
                metrics[f"eval/{self.split}_top1"] = top1
                if self.best_top1 is None or top1 > self.best_top1:  # chosen on held-out only
                    self.best_top1, self.best_step = top1, step
                    self.export(
                        Path(self.cfg.run.dir) / "export_best",
                        {
                            "step": step,
                            "selection_split": self.split,
                            "selection_top1": top1,
                            "objective": self.cfg.objective.kind,
                        },
                    )
                metrics[f"eval/{self.split}_best_top1"] = self.best_top1
        if self.knn_every and step % self.knn_every == 0:
            if self.rank == 0:
                metrics["monitor/knn_top1"] = knn_monitor(
                    objective.backbone,
                    self.mean,
                    self.std,
                    self.cfg.monitor,
                    self.manifest,
                    img_size=self.img_size,
                    in_chans=self.in_chans,
                )
            barrier()
        if metrics and self.rank == 0:
            tracker.log_metrics(metrics, step=step)
            log.info("step %d %s", step, " ".join(f"{k}={v:.4f}" for k, v in metrics.items()))

    def state(self) -> dict:
        return {
            "best_top1": self.best_top1,
            "best_step": self.best_step,
            "eval_history": self.history,
        }

    def write_results(self, path: Path, tracker) -> None:
        """RUN/results.json (rank 0): the step chosen on the selection split, and the report
        split's top-1 of that step (`selected_top1`) and of the last (`final_top1`)."""
        if self.rank != 0 or not self.history:
            return
        at_best = next((h for h in self.history if h[0] == self.best_step), None)
        held = f"{self.cfg.data.split} (held-out {self.holdout:g}, data.holdout_fraction)"
        result = {
            "selection_split": held if self.split == HOLDOUT_SPLIT else self.split,
            "report_split": self.report,
            "best_step": self.best_step,
            "selection_best_top1": self.best_top1,
            "selection_final_top1": self.history[-1][1],
            "selected_top1": at_best[2] if at_best else None,
            "final_top1": self.history[-1][2],
            "history_columns": ["step", "selection_top1", "report_top1"],
            "history": self.history,
        }
        atomic_write_text(path, json.dumps(result, indent=2) + "\n")
        tracker.log_artifact(path)
