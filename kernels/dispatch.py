"""Where each kernel op decides between its Triton kernel and its torch path.

Triton runs when the tensors live on CUDA, or when ``KVMESH_KERNELS=triton``
(tests set it with ``TRITON_INTERPRET=1`` to run the kernels on CPU).
``KVMESH_KERNELS=torch`` forces the torch path everywhere; ``auto`` (unset)
is the default. The variable is read per call, not cached, so a process can
switch it; it is listed as ``Settings.kernels`` in shared/config.py, but
read here because the choice is made on the hot path, per call.
"""

from __future__ import annotations

import os

import torch

ENV_VAR = "KVMESH_KERNELS"
MODES = ("auto", "torch", "triton")


def use_triton(tensor: torch.Tensor) -> bool:
    """True when this call should run the Triton kernel for ``tensor``."""
    mode = os.environ.get(ENV_VAR, "auto").lower() or "auto"
    if mode not in MODES:
        raise ValueError(f"{ENV_VAR}={mode!r}: choose one of {', '.join(MODES)}")
    if mode == "auto":
        return tensor.is_cuda
    return mode == "triton"
