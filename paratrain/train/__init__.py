"""Training: configuration, the per-rank loop, the single-process reference, the command."""
