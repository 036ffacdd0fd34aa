"""The one error kvconvert raises: its message names what is incompatible."""

from __future__ import annotations


class IncompatibleKV(ValueError):
    """E.g. "fingerprint mismatch: file a1b2.. vs target c3d4..", "cannot re-chunk 16 -> 24: not a multiple"."""
