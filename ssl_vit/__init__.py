"""ssl-vit: masked patch prediction and supervised pretraining of timm Vision Transformers."""

__version__ = "0.1.0"
