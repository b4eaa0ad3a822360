"""Heads as in the paper (sec. 3.1): a tanh MLP at pretraining, a zero-initialised linear at
fine-tuning."""

from __future__ import annotations

import torch
from torch import nn

__all__ = ["PretrainHead", "FinetuneHead"]


class PretrainHead(nn.Module):
    """MLP with one hidden layer and tanh: Linear(D, H) -> tanh -> Linear(H, K).

    Used for supervised pretraining on the [class]/pooled feature and, per token, for MPP.
    `hidden_dim` defaults to the input width D (the paper's "pre-logits" layer).
    """

    def __init__(self, in_dim: int, out_dim: int, hidden_dim: int | None = None) -> None:
        super().__init__()
        hidden_dim = hidden_dim or in_dim
        self.fc1 = nn.Linear(in_dim, hidden_dim)
        self.act = nn.Tanh()
        self.fc2 = nn.Linear(hidden_dim, out_dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (..., D) -> (..., K)
        return self.fc2(self.act(self.fc1(x)))


class FinetuneHead(nn.Linear):
    """A single linear layer D x K with zero weights and bias (appendix B.1.1 / sec. 3.1):
    the first fine-tuning step starts from uniform logits, not from a random projection."""

    def __init__(self, in_dim: int, num_classes: int) -> None:
        super().__init__(in_dim, num_classes)
        nn.init.zeros_(self.weight)
        nn.init.zeros_(self.bias)
