"""Parallelism, applied to a model from outside it: data/ (this layer), tensor/ and pipeline/."""
