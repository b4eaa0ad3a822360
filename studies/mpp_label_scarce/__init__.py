"""Does MPP learn useful features? A label-scarce study of Fashion-MNIST (PLAN.md)."""
