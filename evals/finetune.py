"""Fine-tune a backbone at a higher resolution than it was pretrained at (appendix B.1.1).

    python evals/finetune.py --config configs/fmnist_finetune.yaml --backbone RUN_DIR
    deepspeed --num_gpus 8 evals/finetune.py --config configs/fmnist_finetune.yaml --backbone RUN
    python evals/finetune.py --config configs/fmnist_finetune.yaml model.init_from=null  # scratch

Same engine as pretraining (DeepSpeed, checkpoints, resume, MLflow); writes RUN/results.json
with the final and best top-1 and RUN/export_best with the best weights.
"""

import sys

from ssl_vit.engine.cli import main

if __name__ == "__main__":
    sys.exit(main("finetune", __doc__.splitlines()[0]))
