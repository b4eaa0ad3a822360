"""Attention weights out of timm's fused attention, without changing what the model computes.

timm's `Attention` calls `F.scaled_dot_product_attention`, which never materialises the
softmax, so there is nothing to hook directly (timm's own `AttentionExtract` hooks `attn_drop`
or the `softmax` fx node, both absent on the fused path, and switching `fused_attn` off would
change the numerics of the run being inspected). Instead, a forward hook on each block's
`attn.qkv` projection takes the q and k it produced and recomputes
softmax(q_norm(q) k_norm(k)^T * scale) on the side, in float32. The model's own forward pass
is untouched: hooks only read.
"""

from __future__ import annotations

from types import TracebackType

import torch
from torch import nn


def attention_modules(model: nn.Module) -> list[nn.Module]:
    """The self-attention module of each transformer block, in depth order."""
    blocks = getattr(model, "blocks", None)
    if blocks is None:
        raise TypeError(
            f"{type(model).__name__} has no .blocks; attention inspection needs a timm "
            "VisionTransformer-like model"
        )
    mods = []
    for i, blk in enumerate(blocks):
        attn = getattr(blk, "attn", None)
        needed = ("qkv", "num_heads", "head_dim", "scale", "q_norm", "k_norm")
        if attn is None or not all(hasattr(attn, a) for a in needed):
            raise TypeError(
                f"block {i} ({type(blk).__name__}) has no timm-style attention with a fused "
                f"qkv projection; got {type(attn).__name__}"
            )
        mods.append(attn)
    return mods


def attention_from_qkv(attn: nn.Module, qkv_out: torch.Tensor) -> torch.Tensor:
    """Recompute the attention probabilities from the output of `attn.qkv`.

    qkv_out: (B, T, 3 * H * Dh), as produced by the model. Returns (B, H, T, T) float32,
    rows summing to 1. Mirrors timm's unfused path: q_norm/k_norm, then `scale`.
    """
    B, T, _ = qkv_out.shape
    qkv = qkv_out.reshape(B, T, 3, attn.num_heads, attn.head_dim).permute(2, 0, 3, 1, 4)
    q, k = attn.q_norm(qkv[0]), attn.k_norm(qkv[1])  # (B, H, T, Dh) each
    logits = (q.float() * attn.scale) @ k.float().transpose(-2, -1)  # (B, H, T, T)
    return logits.softmax(dim=-1)


class AttentionRecorder:
    """Context manager recording every block's attention probabilities during forward passes.

    with AttentionRecorder(model) as rec:
        model(x)
    rec.maps  # list over blocks of (B, H, T, T) float32, detached

    Each forward pass replaces the previous maps. Masked or causal attention is refused
    (ViT encoders use neither; recomputing it would need the mask).
    """

    def __init__(self, model: nn.Module, *, to_cpu: bool = False) -> None:
        self.modules = attention_modules(model)
        self.to_cpu = to_cpu
        self.maps: list[torch.Tensor] = []
        self._pending: list[torch.Tensor | None] = [None] * len(self.modules)
        self._handles: list[torch.utils.hooks.RemovableHandle] = []

    def _pre_hook(self, idx: int):
        def hook(mod: nn.Module, args: tuple, kwargs: dict) -> None:
            if kwargs.get("attn_mask") is not None or kwargs.get("is_causal", False):
                raise ValueError(
                    f"AttentionRecorder: block {idx} was called with a mask or is_causal; "
                    "only unmasked self-attention can be recomputed"
                )
            if idx == 0:
                self._pending = [None] * len(self.modules)

        return hook

    def _qkv_hook(self, idx: int):
        attn = self.modules[idx]

        def hook(mod: nn.Module, args: tuple, out: torch.Tensor) -> None:
            with torch.no_grad():
                a = attention_from_qkv(attn, out.detach())
            self._pending[idx] = a.cpu() if self.to_cpu else a
            if idx == len(self.modules) - 1:
                self.maps = [m for m in self._pending if m is not None]

        return hook

    def __enter__(self) -> AttentionRecorder:
        for i, attn in enumerate(self.modules):
            self._handles.append(
                attn.register_forward_pre_hook(self._pre_hook(i), with_kwargs=True)
            )
            self._handles.append(attn.qkv.register_forward_hook(self._qkv_hook(i)))
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()
