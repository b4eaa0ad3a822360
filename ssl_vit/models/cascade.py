"""Dynamic ViT: a cascade of ViTs over increasing token grids with early exit.

After Wang et al. 2021 ("Not All Images are Worth 16x16 Words"): stage s sees the image
downsized so the fixed patch size gives a coarser grid, each stage has its own classifier, and
an image leaves at the first stage whose softmax confidence reaches that stage's threshold.
`CascadeViT` holds the stages (`CascadeStage`, each a timm VisionTransformer; the last is the
backbone given); later stages reuse earlier work, each reuse a switch: the previous stage's
[class] feature added to every token (`FeatureReuse`, `feature_reuse`) and its attention logits
resized to this stage's grid (`resize_matrix`: R @ logits @ R^T) added to this stage's
(`relation_reuse`). Written for ssl-vit, not a port.

How it is trained and evaluated: docs/evaluation.md#dynamic-vit.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence

import torch
import torch.nn.functional as F
from timm.models.vision_transformer import VisionTransformer
from torch import nn

from ssl_vit.models.networks import FinetuneHead, token_geometry

__all__ = ["CascadeViT", "CascadeStage", "FeatureReuse", "resize_matrix"]


def _interp_1d(n_in: int, n_out: int) -> torch.Tensor:
    """(n_out, n_in) linear-interpolation weights, as F.interpolate(align_corners=False)."""
    eye = torch.eye(n_in).unsqueeze(0)  # (1, n_in, n_in): channel i is basis vector i
    return F.interpolate(eye, size=n_out, mode="linear", align_corners=False)[0].T


def resize_matrix(old: tuple[int, int], new: tuple[int, int]) -> torch.Tensor:
    """(1 + Hn*Wn, 1 + Ho*Wo): maps token axes of a [class]-first grid to a new grid.

    The [class] entry maps to itself; patch entries are bilinearly interpolated in 2-D, so
    `R @ L @ R.T` resizes an attention-logit map L (query x key) on both axes."""
    grid = torch.kron(_interp_1d(old[0], new[0]), _interp_1d(old[1], new[1]))
    r = torch.zeros(1 + grid.shape[0], 1 + grid.shape[1])
    r[0, 0] = 1.0
    r[1:, 1:] = grid
    return r


class FeatureReuse(nn.Module):
    """The previous stage's [class] feature (B, D) -> one additive token bias per block
    (B, L, D): LayerNorm -> Linear -> GELU -> Linear (zero-initialised)."""

    def __init__(self, dim: int, depth: int, hidden: int | None = None) -> None:
        super().__init__()
        hidden = hidden or max(dim // 2, 1)
        self.depth, self.dim = depth, dim
        self.norm = nn.LayerNorm(dim)
        self.fc1 = nn.Linear(dim, hidden)
        self.act = nn.GELU()
        self.fc2 = nn.Linear(hidden, depth * dim)
        nn.init.zeros_(self.fc2.weight)
        nn.init.zeros_(self.fc2.bias)

    def forward(self, feat: torch.Tensor) -> torch.Tensor:  # (B, D) -> (B, L, D)
        return self.fc2(self.act(self.fc1(self.norm(feat)))).view(-1, self.depth, self.dim)


class CascadeStage(nn.Module):
    """One stage: a timm ViT at its own input size, its classifier and its reuse modules.

    forward(images at any size, prev) -> (logits (B, K), [class] feature (B, D), attention logits
    per layer [(B, H, T, T)]); `prev` is the previous stage's (feature, attention logits) or
    None for the first stage (or when no reuse is on)."""

    def __init__(
        self,
        vit: VisionTransformer,
        num_classes: int,
        prev_grid: tuple[int, int] | None,
        feature_reuse: bool,
        relation_reuse: bool,
    ) -> None:
        super().__init__()
        if getattr(vit, "reg_token", None) is not None or vit.num_prefix_tokens != 1:
            raise ValueError("CascadeViT: stages need a ViT with one [class] token, no registers")
        if getattr(vit, "no_embed_class", False) or getattr(vit, "dynamic_img_size", False):
            raise ValueError("CascadeViT: no_embed_class / dynamic_img_size ViTs are unsupported")
        self.vit = vit
        self.img_size = int(token_geometry(vit).img_size[0])
        self.grid = tuple(token_geometry(vit).grid)
        dim, depth = int(vit.embed_dim), len(vit.blocks)
        heads = int(vit.blocks[0].attn.num_heads)
        self.head = FinetuneHead(dim, num_classes)  # zero-initialised (appendix B.1.1)
        self.feature = FeatureReuse(dim, depth) if (feature_reuse and prev_grid) else None
        self.relation_weight = None
        if relation_reuse and prev_grid:
            self.relation_weight = nn.Parameter(torch.zeros(depth, heads))  # (L, H)
            self.register_buffer("resize", resize_matrix(prev_grid, self.grid), persistent=False)

    def _block(
        self, blk: nn.Module, x: torch.Tensor, bias: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """timm's Block.forward with the attention written out, to add `bias` to its logits and
        return them (pre-softmax, bias included)."""
        attn = blk.attn
        if getattr(attn, "gate", None) is not None:
            raise ValueError("CascadeViT: gated attention is unsupported")
        b, n, _ = x.shape
        h = blk.norm1(x)
        qkv = attn.qkv(h).reshape(b, n, 3, attn.num_heads, attn.head_dim).permute(2, 0, 3, 1, 4)
        q, k, v = qkv.unbind(0)  # (B, H, T, hd) each
        q, k = attn.q_norm(q), attn.k_norm(k)
        logits = (q * attn.scale) @ k.transpose(-2, -1)  # (B, H, T, T)
        if bias is not None:
            logits = logits + bias
        a = attn.attn_drop(logits.softmax(dim=-1))
        o = (a @ v).transpose(1, 2).reshape(b, n, -1)  # (B, T, H*hd)
        o = attn.proj_drop(attn.proj(attn.norm(o)))
        x = x + blk.drop_path1(blk.ls1(o))
        x = x + blk.drop_path2(blk.ls2(blk.mlp(blk.norm2(x))))
        return x, logits

    def forward(
        self,
        images: torch.Tensor,
        prev: tuple[torch.Tensor, list[torch.Tensor]] | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor, list[torch.Tensor]]:
        vit = self.vit
        if images.shape[-1] != self.img_size or images.shape[-2] != self.img_size:
            size = (self.img_size, self.img_size)  # the downsized image: a coarser token grid
            images = F.interpolate(images, size=size, mode="bilinear", antialias=True)
        x = vit.patch_embed(images)  # (B, N, D)
        x = torch.cat([vit.cls_token.expand(x.shape[0], -1, -1), x], dim=1) + vit.pos_embed
        x = vit.norm_pre(vit.patch_drop(vit.pos_drop(x)))  # (B, T, D)
        feats = rel = None
        if prev is not None and self.feature is not None:
            feats = self.feature(prev[0])  # (B, L, D)
        if prev is not None and self.relation_weight is not None:
            rel = prev[1]
        all_logits = []
        for i, blk in enumerate(vit.blocks):
            if feats is not None:
                x = x + feats[:, i].unsqueeze(1)
            bias = None
            if rel is not None:  # (B, H, T', T') -> (B, H, T, T), weighted per head
                bias = self.resize @ rel[i] @ self.resize.T
                bias = bias * self.relation_weight[i].view(1, -1, 1, 1)
            x, logits = self._block(blk, x, bias)
            all_logits.append(logits)
        feat = vit.forward_head(vit.norm(x), pre_logits=True)  # [class] token (B, D)
        return self.head(feat).float(), feat, all_logits


class CascadeViT(nn.Module):
    """Stages of the same ViT at increasing input sizes `coarse_sizes + [backbone's size]`.

    The coarser stages start as copies of `backbone` with position embeddings resampled to
    their grids (sec. 3.2); the last stage *is* `backbone`. `forward(images)` returns every
    stage's logits [(B, K)] (training); `early_exit(images, thresholds)` runs the adaptive
    inference, dropping confident images from the batch after each stage."""

    def __init__(
        self,
        backbone: VisionTransformer,
        coarse_sizes: Sequence[int],
        num_classes: int,
        *,
        feature_reuse: bool = True,
        relation_reuse: bool = True,
    ) -> None:
        super().__init__()
        if not isinstance(backbone, VisionTransformer):
            raise ValueError(f"CascadeViT: needs a timm VisionTransformer, not {type(backbone)}")
        geo = token_geometry(backbone)
        sizes = [int(s) for s in coarse_sizes] + [int(geo.img_size[0])]
        if len(sizes) < 2 or any(a >= b for a, b in zip(sizes, sizes[1:], strict=False)):
            raise ValueError(f"cascade sizes {sizes}: give increasing sizes below the last stage's")
        if any(s % geo.patch_px for s in sizes):
            raise ValueError(
                f"cascade sizes {sizes}: each must be a multiple of the patch size {geo.patch_px}"
            )
        stages, prev_grid = [], None
        for i, size in enumerate(sizes):
            vit = backbone
            if i < len(sizes) - 1:
                vit = copy.deepcopy(backbone)
                vit.set_input_size(img_size=(size, size))
            stage = CascadeStage(vit, num_classes, prev_grid, feature_reuse, relation_reuse)
            stages.append(stage)
            prev_grid = stage.grid
        self.stages = nn.ModuleList(stages)
        self.sizes = sizes
        self.feature_reuse, self.relation_reuse = bool(feature_reuse), bool(relation_reuse)

    @property
    def num_stages(self) -> int:
        return len(self.stages)

    def loose_parameters(self) -> list[nn.Parameter]:
        """Parameters read outside their owner's forward (each ViT's pos_embed, cls_token)."""
        return [p for st in self.stages for p in st.vit.parameters(recurse=False)]

    def forward(self, images: torch.Tensor, upto: int | None = None) -> list[torch.Tensor]:
        """Normalised images (B, C, H, W) -> logits of stages 0..upto (default all)."""
        last = self.num_stages - 1 if upto is None else upto
        out, prev = [], None
        for s in range(last + 1):
            logits, feat, rel = self.stages[s](images, prev)
            out.append(logits)
            prev = (feat, rel)
        return out

    @torch.no_grad()
    def early_exit(
        self, images: torch.Tensor, thresholds: Sequence[float]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Adaptive inference: (logits (B, K) from each image's exit stage, exit stage (B,)).

        An image leaves after stage s < last when its max softmax probability is >= thresholds[s]
        (one threshold per stage but the last); the rest continue as a smaller batch."""
        if len(thresholds) != self.num_stages - 1:
            raise ValueError(
                f"{len(thresholds)} thresholds for {self.num_stages} stages: "
                f"give {self.num_stages - 1}"
            )
        b = images.shape[0]
        idx = torch.arange(b, device=images.device)
        out: torch.Tensor | None = None
        exits = torch.full((b,), self.num_stages - 1, dtype=torch.long, device=images.device)
        prev = None
        for s, stage in enumerate(self.stages):
            logits, feat, rel = stage(images[idx], prev)
            if out is None:
                out = logits.new_zeros(b, logits.shape[-1])
            if s == self.num_stages - 1:
                out[idx] = logits
                break
            leave = logits.softmax(-1).amax(-1) >= float(thresholds[s])
            out[idx[leave]] = logits[leave]
            exits[idx[leave]] = s
            stay = ~leave
            idx = idx[stay]
            if idx.numel() == 0:
                break
            prev = (feat[stay], [r[stay] for r in rel])
        return out, exits
