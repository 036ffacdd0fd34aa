"""The one error a bad checkpoint dir raises: a one-line message naming the file or field."""

from __future__ import annotations


class CheckpointError(ValueError):
    """A checkpoint dir that cannot be loaded; str(err) names the file, tensor or field."""
