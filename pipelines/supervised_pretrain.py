"""Supervised pretraining on labels (sec. 4.1), or joint: loss = a * MPP + b * supervised.

    python pipelines/supervised_pretrain.py --config configs/fmnist_vit_tiny_supervised.yaml
    python pipelines/supervised_pretrain.py --config ... objective.kind=joint

Every option is a config key, overridable as key=value; --help lists the flags.
"""

import sys

from ssl_vit import startup
from ssl_vit.engine.cli import main

if __name__ == "__main__":
    startup.begin()  # no GC passes over the modules it loads (ssl_vit/startup.py)
    sys.exit(main("supervised", __doc__.splitlines()[0]))
