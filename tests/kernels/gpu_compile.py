"""Compile every Triton kernel for a CUDA target, no GPU needed (run as a script).

The interpreter runs kernels as numpy and accepts things the GPU compiler
rejects (dot shapes under 16, type mismatches, unsupported constructs), so
this builds each kernel through Triton's real pipeline down to a cubin with
the ptxas that ships in the triton wheel. Signatures mirror the launches in
kernels/triton/*.py. Must run without TRITON_INTERPRET (test_triton_kernels.py
starts it in a clean process). Prints one line per compiled variant.
"""

from __future__ import annotations

import sys

import triton
from kvmesh.kernels.triton.block_copy import _copy_blocks_kernel
from kvmesh.kernels.triton.kv_write import _kv_write_kernel
from kvmesh.kernels.triton.paged_attention import _paged_attention_kernel
from kvmesh.kernels.triton.rope import _rope_kernel
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource


def _signature(fn: triton.JITFunction, pointers: dict[str, str], floats: tuple[str, ...] = ()) -> dict[str, str]:
    """Pointer types as given, named floats fp32, upper-case names constexpr, the rest i32."""
    sig = {}
    for name in fn.arg_names:
        if name in pointers:
            sig[name] = pointers[name]
        elif name in floats:
            sig[name] = "fp32"
        elif name.isupper():
            sig[name] = "constexpr"
        else:
            sig[name] = "i32"
    return sig


def variants() -> list[tuple[str, triton.JITFunction, dict[str, str], dict[str, object]]]:
    out = []
    for dt, precision in (("fp32", "ieee"), ("fp16", None)):
        tiles = ((3, 21, 64, 64), (3, 1, 16, 64), (2, 32, 64, 16)) if dt == "fp32" else ((3, 1, 16, 64),)
        ptrs = {p: f"*{dt}" for p in ("q_ptr", "k_ptr", "v_ptr", "out_ptr")}
        ptrs |= {p: "*i32" for p in ("bt_ptr", "qstart_ptr", "qlen_ptr", "ctx_ptr")}
        sig = _signature(_paged_attention_kernel, ptrs, floats=("scale",))
        # small preset (group 3, D 64) prefill and decode tiles; tiny preset head_dim 16
        for g, bq, bm, bd in tiles:
            consts = {"G": g, "BLOCK_Q": bq, "BLOCK_M": bm, "BLOCK_N": 64, "BLOCK_D": bd, "BLOCK_SIZE": 16}
            consts["DOT_PRECISION"] = precision
            out.append((f"paged_attention {dt} G={g} BLOCK_Q={bq} D={bd}", _paged_attention_kernel, sig, consts))
    rope_ptrs = {"x_ptr": "*fp32", "out_ptr": "*fp32", "pos_ptr": "*i64", "cos_ptr": "*fp32", "sin_ptr": "*fp32"}
    rope_sig = _signature(_rope_kernel, rope_ptrs)
    out.append(("rope", _rope_kernel, rope_sig, {"HALF": 32, "BLOCK_H": 16, "BLOCK_HALF": 32}))
    kv_ptrs = {"k_ptr": "*fp32", "v_ptr": "*fp32", "cache_ptr": "*fp16", "slot_ptr": "*i64"}
    kv_sig = _signature(_kv_write_kernel, kv_ptrs)
    out.append(("kv_write", _kv_write_kernel, kv_sig, {"BLOCK_H": 4, "BLOCK_D": 64}))
    copy_sig = _signature(_copy_blocks_kernel, {"src_ptr": "*fp32", "dst_ptr": "*fp32", "ids_ptr": "*i64"})
    for gather in (True, False):
        out.append((f"copy_blocks gather={gather}", _copy_blocks_kernel, copy_sig, {"GATHER": gather, "CHUNK": 1024}))
    return out


def main() -> int:
    target = GPUTarget("cuda", 90, 32)
    for name, fn, sig, consts in variants():
        compiled = triton.compile(ASTSource(fn, sig, consts), target=target)
        assert compiled.asm.get("cubin"), name
        print(f"compiled {name} for sm_90")
    return 0


if __name__ == "__main__":
    sys.exit(main())
