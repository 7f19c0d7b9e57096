"""A kernel that writes past its tensor on purpose, so that `python -m cute_flash memcheck` can
show its kernel filter reaches our kernels: memcheck instruments only kernels named like ours
(`sanitize.OUR_KERNELS`), and a filter that matched none would report 0 errors on any suite.
`python -m cute_flash.tools.overrun_canary` compiles it for the current GPU and launches it once
(under memcheck, torch's caching allocator off: the tensor is an allocation of its own).
"""
from __future__ import annotations

import cutlass
import cutlass.cute as cute

from cute_flash.compile.registry import compile_tvm_ffi
from cute_flash.kernels.common.fake import fake_stream, fake_tensor

THREADS = 128  # out's words, one a thread


@cute.kernel
def overrun_kernel(out: cute.Tensor):
    """Thread t writes word t + 1: the last thread writes one word past the end of `out`."""
    tidx, _, _ = cute.arch.thread_idx()
    out[tidx + 1] = tidx


@cute.jit
def overrun(out: cute.Tensor, stream):
    """out (THREADS,) int32."""
    overrun_kernel(out).launch(grid=(1, 1, 1), block=(THREADS, 1, 1), stream=stream)


def compile_overrun(arch: int | None = None, extra_options: str = ""):
    """The TVM-FFI function of `overrun`, for `arch` (80, 90) or the current GPU (None)."""
    return compile_tvm_ffi(overrun, (fake_tensor(cutlass.Int32, 1), fake_stream()), arch, extra_options)


def main():
    import torch

    out = torch.zeros(THREADS, dtype=torch.int32, device="cuda")
    compile_overrun()(out)
    torch.cuda.synchronize()


if __name__ == "__main__":
    main()
