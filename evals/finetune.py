"""Fine-tune a backbone at a higher resolution than it was pretrained at (appendix B.1.1).

    python evals/finetune.py --config configs/fmnist_finetune.yaml --backbone RUN_DIR
    deepspeed --num_gpus 8 evals/finetune.py --config configs/fmnist_finetune.yaml --backbone RUN
    python evals/finetune.py --config configs/fmnist_finetune.yaml model.init_from=null  # scratch

    python evals/finetune.py --config configs/fmnist_finetune.yaml --backbone RUN \
        --sweep optim.lr=0.003,0.01,0.03,0.06 run.dir=runs/ft-sweep   # the paper's lr sweep

Same engine as pretraining (DeepSpeed, checkpoints, resume, MLflow). A hashed 2% of the training
split is held out (data.holdout_fraction) and chooses the best epoch (RUN/export_best) and, with
--sweep, the value: RUN/results.json names the choice; test top-1 is only reported.
"""

import sys

from ssl_vit import startup
from ssl_vit.engine.cli import main

if __name__ == "__main__":
    startup.begin()  # no GC passes over the modules it loads (ssl_vit/startup.py)
    sys.exit(main("finetune", __doc__.splitlines()[0]))
