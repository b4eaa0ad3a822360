"""The `cascade` fine-tuning objective: the sum of the stages' cross-entropies (Dynamic ViT).

Every stage of a `CascadeViT` classifies every training image (no exits while training), and
the loss is the sum of their cross-entropies, as in Wang et al. 2021 (sec. 3.4), so each exit is
trained to be right on its own. The cascade is built around the exported backbone, which
becomes its finest stage: the trainer exports that stage as the run's backbone (a plain ViT any
eval can read), and the whole cascade goes to objective.safetensors (rebuilt by
`ssl_vit.objectives.export.load_objective`).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from ssl_vit.models.cascade import CascadeViT
from ssl_vit.models.networks import normalize

__all__ = ["CascadeObjective"]


class CascadeObjective(nn.Module):
    """`objective(images01, labels) -> (loss, metrics)` for a Dynamic ViT cascade.

    Metrics: "cascade/loss", "cascade/acc_s{i}" per stage and "sup/acc" (the last stage's).
    Labels of -1 are left out. `.logits(images01)` is the last stage's (the in-training
    selection scores the finest stage); `.backbone` is the finest stage's ViT.
    """

    def __init__(
        self,
        backbone: nn.Module,
        *,
        num_classes: int,
        mean: Sequence[float],
        std: Sequence[float],
        coarse_sizes: Sequence[int] = (14, 28),
        feature_reuse: bool = True,
        relation_reuse: bool = True,
        label_smoothing: float = 0.0,
    ) -> None:
        super().__init__()
        if num_classes < 2:
            raise ValueError(f"num_classes must be >= 2, got {num_classes}")
        self.cascade = CascadeViT(
            backbone,
            coarse_sizes,
            num_classes,
            feature_reuse=feature_reuse,
            relation_reuse=relation_reuse,
        )
        self.num_classes = int(num_classes)
        self.label_smoothing = float(label_smoothing)
        self.register_buffer("mean", torch.tensor(mean, dtype=torch.float32).view(1, -1, 1, 1))
        self.register_buffer("std", torch.tensor(std, dtype=torch.float32).view(1, -1, 1, 1))

    @property
    def backbone(self) -> nn.Module:
        """The finest stage's ViT (a property: the cascade owns it, no duplicate state keys)."""
        return self.cascade.stages[-1].vit

    def loose_parameters(self) -> list[nn.Parameter]:
        """For ZeRO-3 (ssl_vit.engine.zero): tensors read outside their owner's forward."""
        return self.cascade.loose_parameters()

    def no_weight_decay(self) -> set[str]:
        return {n for n, _ in self.named_parameters() if n.endswith(("pos_embed", "cls_token"))} | {
            n for n, _ in self.named_parameters() if "relation_weight" in n
        }

    def normalize(self, images: torch.Tensor) -> torch.Tensor:
        return normalize(images, self.mean, self.std, self.backbone)

    def stage_logits(self, images: torch.Tensor) -> list[torch.Tensor]:
        """images (B, C, H, W) in [0, 1] -> every stage's logits [(B, K)]."""
        return self.cascade(self.normalize(images))

    def logits(self, images: torch.Tensor) -> torch.Tensor:
        return self.stage_logits(images)[-1]

    def forward(
        self, images: torch.Tensor, labels: torch.Tensor
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        valid = labels >= 0
        n = valid.sum().clamp_min(1)
        target = labels.clamp_min(0)
        loss = images.new_zeros((), dtype=torch.float32)
        metrics: dict[str, torch.Tensor] = {}
        for s, logits in enumerate(self.stage_logits(images)):
            per = F.cross_entropy(
                logits, target, label_smoothing=self.label_smoothing, reduction="none"
            )
            loss = loss + (per * valid).sum() / n
            acc = ((logits.argmax(-1) == labels) & valid).sum() / n
            metrics[f"cascade/acc_s{s}"] = acc.float()
        metrics["sup/acc"] = metrics[f"cascade/acc_s{self.cascade.num_stages - 1}"]
        metrics["cascade/loss"] = loss.detach()
        return loss, metrics
