"""Drive a timm backbone in two halves so MPP can corrupt patch embeddings in between.

ViT (and hybrid): patch_embed -> [corrupt] -> _pos_embed -> patch_drop -> norm_pre -> blocks ->
norm, i.e. timm's own forward_features with the corruption after the patch projection and before
position embeddings are added (paper sec. 4.6). Mixer: stem -> [corrupt] -> blocks -> norm.
"""

from __future__ import annotations

import torch
from timm.models import checkpoint_seq
from torch import nn

from ssl_vit.models.backbones import backbone_kind

__all__ = ["normalize", "embed_patches", "encode_patches", "num_prefix_tokens", "embed_dim"]


def normalize(images: torch.Tensor, mean: torch.Tensor, std: torch.Tensor, like: nn.Module):
    """(images - mean) / std computed in float32, returned in the dtype of `like`'s weights:
    float32 under autocast, bf16 when an engine (DeepSpeed bf16) cast the parameters (it leaves
    buffers such as `mean` in float32, so their dtype says nothing)."""
    dtype = next(like.parameters()).dtype
    return ((images.float() - mean.float()) / std.float()).to(dtype)


def num_prefix_tokens(backbone: nn.Module) -> int:
    """Tokens before the patch tokens in forward_features' output ([class], registers)."""
    return int(getattr(backbone, "num_prefix_tokens", 0)) if backbone_kind(backbone) == "vit" else 0


def embed_dim(backbone: nn.Module) -> int:
    return int(backbone.embed_dim)


def embed_patches(backbone: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """Normalised images (B, C, H, W) -> patch embeddings (B, N, D), before position embeddings."""
    embed = backbone.patch_embed if backbone_kind(backbone) == "vit" else backbone.stem
    t = embed(x)
    return t.flatten(1, 2) if t.ndim == 4 else t  # dynamic_img_size gives NHWC


def encode_patches(
    backbone: nn.Module, tokens: torch.Tensor, grid: tuple[int, int]
) -> torch.Tensor:
    """(Corrupted) patch embeddings (B, N, D) -> output tokens (B, T, D), prefix tokens first."""
    if backbone_kind(backbone) == "vit":
        if getattr(backbone, "dynamic_img_size", False):
            tokens = tokens.unflatten(1, grid)  # _pos_embed wants NHWC here
        x = backbone._pos_embed(tokens)
        x = backbone.patch_drop(x)
        x = backbone.norm_pre(x)
    else:
        x = tokens
    if backbone.grad_checkpointing and not torch.jit.is_scripting():
        x = checkpoint_seq(backbone.blocks, x)
    else:
        x = backbone.blocks(x)
    return backbone.norm(x)
