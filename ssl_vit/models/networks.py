"""The networks: backbones built through timm (ViT Ti/S/B/L/H, the paper's hybrid, MLP-Mixer)
and the paper's heads (sec. 3.1): a tanh MLP at pretraining, a zero-initialised linear at
fine-tuning.

The backbone API: `build_backbone(arch, *, img_size, in_chans, patch_size=None,
**timm_kwargs)` returns a timm model with `num_classes=0`, so `forward_features(x)` gives the tokens
(B, T, D) and `forward_head(tokens, pre_logits=True)` / `model(x)` the pooled feature (B, D).

Examples (28x28 grayscale Fashion-MNIST):
    build_backbone("vit_tiny_patch16_224", img_size=28, in_chans=1, patch_size=4)   # 7x7 tokens
    build_backbone("vit_tiny_r_s16_p8_224", img_size=28, in_chans=1, patch_size=1)  # hybrid:
        # ResNet stem (stride 4) -> 7x7 feature map -> 1x1 "patches" (paper sec. 3.1, Hybrid)
    build_backbone("mixer_s16_224", img_size=28, in_chans=1, patch_size=4)          # MLP-Mixer
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass

import timm
import torch
from timm.layers import HybridEmbed
from timm.models.mlp_mixer import MixerBlock, MlpMixer
from timm.models.vision_transformer import VisionTransformer
from torch import nn

__all__ = [
    "build_backbone",
    "PretrainHead",
    "FinetuneHead",
    "constructor_kwargs",
    "TokenGeometry",
    "token_geometry",
    "backbone_kind",
    "is_hybrid",
    "normalize",
]


def _mixer_with_patch_size(
    arch: str, *, img_size: int, in_chans: int, patch_size: int, **kwargs
) -> MlpMixer:
    """timm's mixer_* entry points hard-code patch_size; rebuild MlpMixer with the same widths."""
    with torch.device("meta"):  # reads the registered sizes without allocating weights
        ref = timm.create_model(arch, pretrained=False, num_classes=0)
    if type(ref) is not MlpMixer or not isinstance(ref.blocks[0], MixerBlock):
        raise ValueError(
            f"arch {arch!r}: patch_size override is supported for plain mixer_* models only; "
            "drop patch_size or pick a mixer_* / vit_* arch"
        )
    blk = ref.blocks[0]
    dim = ref.embed_dim
    args = dict(
        num_blocks=len(ref.blocks),
        embed_dim=dim,
        mlp_ratio=(blk.mlp_tokens.fc1.out_features / dim, blk.mlp_channels.fc1.out_features / dim),
    )
    args.update(kwargs)
    return MlpMixer(
        num_classes=0, img_size=img_size, in_chans=in_chans, patch_size=patch_size, **args
    )


def constructor_kwargs(arch: str) -> tuple[str, frozenset[str] | None]:
    """(the name of the class timm builds for `arch`, the keyword arguments its constructor
    takes; None when it takes any). timm's entry points pass their keyword arguments on to that
    class, and `timm.create_model` drops those whose value is None, so this is the list a
    `**timm_kwargs` key must be in to have any effect. The class is found by building the
    architecture on the meta device (no memory, no weights; a fraction of a second)."""
    with torch.device("meta"):
        cls = type(timm.create_model(arch, pretrained=False, num_classes=0))
    params = inspect.signature(cls.__init__).parameters.values()
    kind = inspect.Parameter
    if any(p.kind is kind.VAR_KEYWORD for p in params):
        return cls.__name__, None
    named = (kind.POSITIONAL_OR_KEYWORD, kind.KEYWORD_ONLY)
    return cls.__name__, frozenset(p.name for p in params if p.kind in named and p.name != "self")


def build_backbone(
    arch: str,
    *,
    img_size: int,
    in_chans: int,
    patch_size: int | None = None,
    drop_path_rate: float = 0.0,
    **timm_kwargs,
) -> nn.Module:
    """Build a randomly initialised timm backbone without a classifier (num_classes=0).

    Args:
        arch: any timm model name, e.g. "vit_base_patch16_224", "vit_large_patch14_224",
            "vit_tiny_r_s16_p8_224" (hybrid), "mixer_b16_224".
        img_size: input resolution (square).
        in_chans: 3 for RGB, 1 for grayscale.
        patch_size: overrides the architecture's patch size (for hybrids: in feature-map pixels).
        drop_path_rate: stochastic depth for training (> 0 only: timm's default otherwise).
        **timm_kwargs: passed to `timm.create_model` (embed_dim, depth, num_heads...).
    """
    if timm_kwargs.pop("pretrained", False):
        raise ValueError("build_backbone builds random weights; load weights with load_backbone")
    timm_kwargs.pop("num_classes", None)
    if drop_path_rate:
        timm_kwargs["drop_path_rate"] = drop_path_rate
    if arch.startswith("mixer_") and patch_size is not None:
        model = _mixer_with_patch_size(
            arch, img_size=img_size, in_chans=in_chans, patch_size=patch_size, **timm_kwargs
        )
    else:
        if patch_size is not None:
            timm_kwargs["patch_size"] = patch_size
        try:
            model = timm.create_model(
                arch,
                pretrained=False,
                num_classes=0,
                img_size=img_size,
                in_chans=in_chans,
                **timm_kwargs,
            )
        except RuntimeError as e:  # timm raises RuntimeError for an unknown name
            raise ValueError(f"arch {arch!r}: {e}; see timm.list_models('vit_*')") from e
    backbone_kind(model)  # fail early on architectures the objectives cannot drive
    return model


def backbone_kind(model: nn.Module) -> str:
    """'vit' (also hybrids: a VisionTransformer with HybridEmbed) or 'mixer'; else ValueError."""
    if isinstance(model, VisionTransformer):
        return "vit"
    if isinstance(model, MlpMixer):
        return "mixer"
    raise ValueError(
        f"unsupported backbone {type(model).__name__}: use a timm VisionTransformer "
        "(vit_*, hybrid vit_*_r*) or MlpMixer (mixer_*)"
    )


def is_hybrid(model: nn.Module) -> bool:
    """A ViT whose patches come from a CNN's feature map (paper sec. 3.1, Hybrid)."""
    return isinstance(getattr(model, "patch_embed", None), HybridEmbed)


@dataclass(frozen=True)
class TokenGeometry:
    """How patch tokens map to image pixels.

    `patch_px` is the image-pixel side covered by one token: the patch size for ViT and Mixer,
    stem stride x patch size for a hybrid (whose tokens see a wider receptive field).
    """

    img_size: tuple[int, int]
    grid: tuple[int, int]
    patch_px: int
    in_chans: int

    @property
    def num_patches(self) -> int:
        return self.grid[0] * self.grid[1]


def token_geometry(model: nn.Module) -> TokenGeometry:
    """Read image size, token grid, pixel patch and channel count from a timm backbone."""
    embed = model.patch_embed if backbone_kind(model) == "vit" else model.stem
    img = tuple(int(s) for s in embed.img_size)
    grid = tuple(int(g) for g in embed.grid_size)
    if img[0] % grid[0] or img[1] % grid[1] or img[0] // grid[0] != img[1] // grid[1]:
        raise ValueError(f"image {img} is not tiled evenly by the token grid {grid}")
    conv = next(m for m in embed.modules() if isinstance(m, nn.Conv2d))
    if isinstance(embed, HybridEmbed):
        conv = next(m for m in embed.backbone.modules() if isinstance(m, nn.Conv2d))
    return TokenGeometry(img, grid, img[0] // grid[0], int(conv.in_channels))


def normalize(images: torch.Tensor, mean: torch.Tensor, std: torch.Tensor, like: nn.Module):
    """(images - mean) / std computed in float32, returned in the dtype of `like`'s weights:
    float32 under autocast, bf16 when an engine (DeepSpeed bf16) cast the parameters (it leaves
    buffers such as `mean` in float32, so their dtype says nothing)."""
    dtype = next(like.parameters()).dtype
    return ((images.float() - mean.float()) / std.float()).to(dtype)


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
