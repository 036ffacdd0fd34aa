"""Where each kernel op decides between its Triton kernel and its torch path.

Triton runs when the tensors live on CUDA, or when ``KVMESH_KERNELS=triton``
(tests set it with ``TRITON_INTERPRET=1`` to run the kernels on CPU).
``KVMESH_KERNELS=torch`` forces the torch path everywhere. The variable is
read per call, not cached, so a test or a process can switch it; it is the
kernels' own switch (per call, on the hot path) rather than a ``Settings``
field built once per service.
"""

from __future__ import annotations

import os

import torch

ENV_VAR = "KVMESH_KERNELS"


def use_triton(tensor: torch.Tensor) -> bool:
    """True when this call should run the Triton kernel for ``tensor``."""
    mode = os.environ.get(ENV_VAR, "auto").lower()
    if mode == "torch":
        return False
    if mode == "triton":
        return True
    return tensor.is_cuda
