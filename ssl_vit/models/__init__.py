"""Backbones built through timm, heads, position-embedding resampling, export/load."""

from ssl_vit.models.export import export_backbone, load_backbone
from ssl_vit.models.networks import (
    FinetuneHead,
    PretrainHead,
    TokenGeometry,
    backbone_kind,
    build_backbone,
    token_geometry,
)
from ssl_vit.models.pos_embed import adapt_pos_embed_state, resample_pos_embed

__all__ = [
    "build_backbone",
    "backbone_kind",
    "token_geometry",
    "TokenGeometry",
    "export_backbone",
    "load_backbone",
    "PretrainHead",
    "FinetuneHead",
    "resample_pos_embed",
    "adapt_pos_embed_state",
]
