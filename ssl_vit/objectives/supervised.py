"""Supervised pretraining objective (paper sec. 3.1 / 4.1) and the joint MPP + supervised mode.

The classifier is the paper's pretraining head, an MLP with one tanh hidden layer, on the
backbone's pooled feature ([class] token for ViT, average for Mixer).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from ssl_vit.models.networks import FinetuneHead, PretrainHead, normalize
from ssl_vit.objectives.mpp import MaskedPatchPrediction

__all__ = ["SupervisedObjective", "JointObjective"]


class SupervisedObjective(nn.Module):
    """Cross-entropy (optionally label-smoothed) through a tanh-MLP head.

    `objective(images01, labels) -> (loss, {"sup/loss", "sup/acc"})`; labels of -1 (unlabelled)
    are left out of loss and accuracy; a batch with none labelled gives loss 0 (still a graph).
    """

    def __init__(
        self,
        backbone: nn.Module,
        *,
        num_classes: int,
        mean: Sequence[float],
        std: Sequence[float],
        label_smoothing: float = 0.0,
        head_hidden: int | None = None,
        head: str = "mlp",
    ) -> None:
        super().__init__()
        if head not in ("mlp", "linear"):
            raise ValueError(f"head={head!r}: choose mlp (pretraining) or linear (fine-tuning)")
        if num_classes < 2:
            raise ValueError(f"num_classes must be >= 2, got {num_classes}")
        self.backbone = backbone
        self.num_classes = int(num_classes)
        self.label_smoothing = float(label_smoothing)
        dim = int(getattr(backbone, "head_hidden_size", backbone.num_features))
        # Pretraining: MLP with one tanh hidden layer; fine-tuning: one zero-initialised linear
        # layer (paper sec. 3.1).
        if head == "mlp":
            self.head = PretrainHead(dim, self.num_classes, head_hidden)
        else:
            self.head = FinetuneHead(dim, self.num_classes)
        self.register_buffer("mean", torch.tensor(mean, dtype=torch.float32).view(1, -1, 1, 1))
        self.register_buffer("std", torch.tensor(std, dtype=torch.float32).view(1, -1, 1, 1))

    def no_weight_decay(self) -> set[str]:
        names = getattr(self.backbone, "no_weight_decay", set)()
        return {f"backbone.{n}" for n in names}

    def features(self, images: torch.Tensor) -> torch.Tensor:
        """images (B, C, H, W) in [0, 1] -> pooled features (B, D)."""
        x = normalize(images, self.mean, self.std, self.backbone)
        return self.backbone.forward_head(self.backbone.forward_features(x), pre_logits=True)

    def logits(self, images: torch.Tensor) -> torch.Tensor:
        """images (B, C, H, W) in [0, 1] -> class scores (B, K)."""
        return self.head(self.features(images)).float()

    def loss_from_features(
        self, feats: torch.Tensor, labels: torch.Tensor
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        logits = self.head(feats).float()  # (B, K)
        valid = labels >= 0
        per = F.cross_entropy(
            logits, labels.clamp_min(0), label_smoothing=self.label_smoothing, reduction="none"
        )
        n = valid.sum().clamp_min(1)
        loss = (per * valid).sum() / n
        acc = ((logits.argmax(-1) == labels) & valid).sum() / n
        return loss, {"sup/loss": loss.detach(), "sup/acc": acc.float()}

    def forward(
        self, images: torch.Tensor, labels: torch.Tensor
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        return self.loss_from_features(self.features(images), labels)


class JointObjective(nn.Module):
    """loss = mpp_weight * MPP + supervised_weight * supervised, on one shared backbone.

    MPP sees the corrupted image and the classifier the clean one (two forward passes), so the
    supervised signal is the ordinary one and MPP's the paper's. Metrics: both objectives' and
    "joint/loss".
    """

    def __init__(
        self,
        mpp: MaskedPatchPrediction,
        supervised: SupervisedObjective,
        *,
        mpp_weight: float = 1.0,
        supervised_weight: float = 1.0,
    ) -> None:
        super().__init__()
        if mpp.backbone is not supervised.backbone:
            raise ValueError("JointObjective: mpp and supervised must share one backbone")
        self.mpp, self.supervised = mpp, supervised
        self.backbone = mpp.backbone
        self.mpp_weight, self.supervised_weight = float(mpp_weight), float(supervised_weight)

    def no_weight_decay(self) -> set[str]:
        return {f"mpp.{n}" for n in self.mpp.no_weight_decay()} | {
            f"supervised.{n}" for n in self.supervised.no_weight_decay()
        }

    def forward(
        self, images: torch.Tensor, labels: torch.Tensor
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        l_mpp, m_mpp = self.mpp(images, labels)
        l_sup, m_sup = self.supervised(images, labels)
        loss = self.mpp_weight * l_mpp + self.supervised_weight * l_sup
        return loss, {**m_mpp, **m_sup, "joint/loss": loss.detach()}
