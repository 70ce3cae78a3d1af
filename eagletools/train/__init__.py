"""Training: training-time test, trainer, checkpoints."""
