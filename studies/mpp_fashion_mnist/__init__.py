"""The ViT paper's masked patch prediction study (sec. 4.6) on Fashion-MNIST: `study.py` runs its
steps (`steps.py`) and writes RESULTS.md from the committed results (`report.py`)."""
