"""GT's `gt.client`: `from gt.client import nn`."""

from gt.client import nn, tensor  # noqa: F401
