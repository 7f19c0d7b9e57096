"""A probe kernel for the GPU tests: the dropout words of every element of a grid, from the
kernels' own Philox (`cute_flash.kernels.common.philox.dropout_words`)."""
import cutlass
import cutlass.cute as cute

from cute_flash.compile.registry import compile_tvm_ffi
from cute_flash.kernels.common.fake import fake_stream, fake_tensor
from cute_flash.kernels.common.philox import dropout_words
from layouts import philox


class PhiloxProbe:
    """A test kernel: out[i, j, :] = dropout_words(key, offset, bh, row0 + i, col0 + j) for
    every element of an (rows, cols) grid, one thread each; what tests/gpu/test_philox_gpu.py
    compares with the numpy reference."""

    @cute.jit
    def __call__(self, out: cute.Tensor, key_lo: cutlass.Uint32, key_hi: cutlass.Uint32,
                 offset_lo: cutlass.Uint32, bh: cutlass.Int32, row0: cutlass.Int32, col0: cutlass.Int32, stream):
        """out (rows, cols, 4) uint32."""
        n = out.shape[0] * out.shape[1]
        self.kernel(out, key_lo, key_hi, offset_lo, bh, row0, col0).launch(
            grid=(cute.ceil_div(n, 128), 1, 1), block=[128, 1, 1], stream=stream)

    @cute.kernel
    def kernel(self, out: cute.Tensor, key_lo: cutlass.Uint32, key_hi: cutlass.Uint32, offset_lo: cutlass.Uint32,
               bh: cutlass.Int32, row0: cutlass.Int32, col0: cutlass.Int32):
        tidx, _, _ = cute.arch.thread_idx()
        bidx, _, _ = cute.arch.block_idx()
        e = bidx * 128 + tidx
        cols = out.shape[1]
        if e < out.shape[0] * cols:
            i, j = e // cols, e % cols
            words = dropout_words(key_lo, key_hi, offset_lo, bh, row0 + i, col0 + j)
            for k in cutlass.range_constexpr(4):
                out[i, j, k] = words[k]


def compile_philox_probe(arch: int | None = None, extra_options: str = ""):
    """The probe on a placeholder (rows, cols, 4) tensor (no GPU with an explicit arch)."""
    out = fake_tensor(cutlass.Uint32, 3, last_extent=4)
    return compile_tvm_ffi(PhiloxProbe(), [out, cutlass.Uint32(0), cutlass.Uint32(0), cutlass.Uint32(0),
                                           cutlass.Int32(0), cutlass.Int32(0), cutlass.Int32(0), fake_stream()],
                           arch, extra_options)


def philox_probe(out, seed: int, offset: int, bh: int, row0: int = 0, col0: int = 0):
    """Fill the CUDA uint32 tensor out (rows, cols, 4) with the dropout words of head row bh,
    rows row0.., columns col0.."""
    key_lo, key_hi = philox.split_seed(seed)
    compile_philox_probe()(out, key_lo, key_hi, offset & philox.MASK32, bh, row0, col0)
    return out
