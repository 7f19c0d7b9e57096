"""A kernel with shared-memory races on purpose, so that `python -m cute_flash racecheck` can show
its kernel filter reaches our kernels: racecheck instruments only kernels named like ours
(`sanitize.OUR_KERNELS`), and a filter that matched none would report 0 hazards on any suite.
`python -m cute_flash.tools.race_canary` compiles it for the current GPU and launches it once.
"""
from __future__ import annotations

import cutlass
import cutlass.cute as cute

from cute_flash.compile.registry import compile_tvm_ffi
from cute_flash.kernels.common.fake import fake_stream, fake_tensor

THREADS = 64  # two warps
WORDS = 32


@cute.kernel
def racy_kernel(out: cute.Tensor):
    """Both warps write every word of a shared buffer, then each thread reads a word another
    thread wrote, with no barrier between: write-after-write and read-after-write hazards."""
    tidx, _, _ = cute.arch.thread_idx()
    buf = cutlass.memory.SmemAllocator().allocate_tensor(cutlass.Int32, cute.make_layout(WORDS), 16)  # (WORDS,)
    buf[tidx % WORDS] = tidx
    out[tidx] = buf[(tidx + 1) % WORDS]


@cute.jit
def race(out: cute.Tensor, stream):
    """out (THREADS,) int32."""
    racy_kernel(out).launch(grid=(1, 1, 1), block=(THREADS, 1, 1), stream=stream)


def compile_race(arch: int | None = None, extra_options: str = ""):
    """The TVM-FFI function of `race`, for `arch` (80, 90) or the current GPU (None)."""
    return compile_tvm_ffi(race, (fake_tensor(cutlass.Int32, 1), fake_stream()), arch, extra_options)


def main():
    import torch

    out = torch.zeros(THREADS, dtype=torch.int32, device="cuda")
    compile_race()(out)
    torch.cuda.synchronize()


if __name__ == "__main__":
    main()
