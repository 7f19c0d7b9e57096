"""Kernels with findings on purpose, so that `python -m cute_flash racecheck` and `memcheck` can
show their kernel filter reaches our kernels: both tools instrument only kernels named like ours
(`sanitize.OUR_KERNELS`), and a filter that matched none would report nothing on any suite.
`python -m cute_flash.tools.canaries NAME` compiles canary NAME for the current GPU and launches
it once, one block over an int32 tensor of a word a thread (under memcheck, torch's caching
allocator off: the tensor is an allocation of its own).
"""
from __future__ import annotations

import sys

import cutlass
import cutlass.cute as cute

from cute_flash.compile.registry import compile_tvm_ffi
from cute_flash.kernels.common.fake import fake_stream, fake_tensor

WORDS = 32  # the racy kernel's shared buffer


@cute.kernel
def racy_kernel(out: cute.Tensor):
    """Both warps write every word of a shared buffer, then each thread reads a word another
    thread wrote, with no barrier between: write-after-write and read-after-write hazards."""
    tidx, _, _ = cute.arch.thread_idx()
    buf = cutlass.memory.SmemAllocator().allocate_tensor(cutlass.Int32, cute.make_layout(WORDS), 16)  # (WORDS,)
    buf[tidx % WORDS] = tidx
    out[tidx] = buf[(tidx + 1) % WORDS]


@cute.kernel
def overrun_kernel(out: cute.Tensor):
    """Thread t writes word t + 1: the last thread writes one word past the end of `out`."""
    tidx, _, _ = cute.arch.thread_idx()
    out[tidx + 1] = tidx


# name -> (kernel, threads): racecheck's (two warps) and memcheck's
CANARIES = {"race": (racy_kernel, 64), "overrun": (overrun_kernel, 128)}


def compile_canary(name: str, arch: int | None = None, extra_options: str = ""):
    """The TVM-FFI function launching canary `name` on out (threads,) int32, for `arch` (80, 90)
    or the current GPU (None)."""
    kernel, threads = CANARIES[name]

    @cute.jit
    def one_block(out: cute.Tensor, stream):
        kernel(out).launch(grid=(1, 1, 1), block=(threads, 1, 1), stream=stream)

    return compile_tvm_ffi(one_block, (fake_tensor(cutlass.Int32, 1), fake_stream()), arch, extra_options)


def main(name: str):
    import torch

    out = torch.zeros(CANARIES[name][1], dtype=torch.int32, device="cuda")
    compile_canary(name)(out)
    torch.cuda.synchronize()


if __name__ == "__main__":
    main(sys.argv[1])
