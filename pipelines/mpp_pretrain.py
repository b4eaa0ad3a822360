"""Masked patch prediction pretraining (ViT paper, sec. 4.6 and appendix B.1.2).

    python pipelines/mpp_pretrain.py --config configs/fmnist_vit_tiny_mpp.yaml
    deepspeed --num_gpus 8 pipelines/mpp_pretrain.py --config configs/vit_b16_imagenet_mpp.yaml

Every option is a config key, overridable as key=value; --help lists the flags.
"""

import sys

from ssl_vit import startup
from ssl_vit.engine.cli import main

if __name__ == "__main__":
    startup.begin()  # no GC passes over the modules it loads (ssl_vit/startup.py)
    sys.exit(main("mpp", __doc__.splitlines()[0]))
