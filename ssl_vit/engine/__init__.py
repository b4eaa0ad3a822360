"""The training engine: DeepSpeed trainer, optimizer, checkpoints, in-training evals."""
