"""Tiled copies of the forward kernel.

- gmem -> smem for Q, K, V: cp.async 128-bit with CACHEGLOBAL (each byte is read once per CTA,
  so L1 allocation only evicts useful lines). Threads are laid `(kNThreads / tpr, tpr)`, tpr =
  kBlockKSmem / 8, each moving 8 contiguous elements: a warp covers whole 128 B (or 64 B) rows.
- smem -> registers: ldmatrix x4 shaped after the TiledMMA's A and B partitions; V goes
  through the transposed ldmatrix because the MMA wants V^T as its B operand.
- registers -> smem for O (the accumulator partition), then smem -> gmem 128-bit stores.
"""
import cutlass.cute as cute
from cutlass.cute.nvgpu import cpasync, warp

from layouts.traits import FwdTraits, element_type

COPY_BITS = 128


def _thread_layout(traits: FwdTraits):
    tpr = traits.gmem_threads_per_row
    return cute.make_layout((traits.num_threads // tpr, tpr), stride=(tpr, 1))


def _value_layout(traits: FwdTraits):
    return cute.make_layout((1, COPY_BITS // element_type(traits).width))


def gmem_tiled_copy_qkv(traits: FwdTraits):
    atom = cute.make_copy_atom(
        cpasync.CopyG2SOp(cache_mode=cpasync.LoadCacheMode.GLOBAL),
        element_type(traits),
        num_bits_per_copy=COPY_BITS,
    )
    return cute.make_tiled_copy_tv(atom, _thread_layout(traits), _value_layout(traits))


def gmem_tiled_copy_o(traits: FwdTraits):
    atom = cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), element_type(traits), num_bits_per_copy=COPY_BITS)
    return cute.make_tiled_copy_tv(atom, _thread_layout(traits), _value_layout(traits))


def _ldmatrix(traits: FwdTraits, transpose: bool):
    return cute.make_copy_atom(warp.LdMatrix8x8x16bOp(transpose=transpose, num_matrices=4), element_type(traits))


def smem_tiled_copy_q(traits: FwdTraits, mma):
    """ldmatrix x4 feeding the A operand (Q, row-major in smem)."""
    return cute.make_tiled_copy_A(_ldmatrix(traits, False), mma)


def smem_tiled_copy_k(traits: FwdTraits, mma):
    """ldmatrix x4 feeding the B operand of S = Q K^T (K rows are B's N)."""
    return cute.make_tiled_copy_B(_ldmatrix(traits, False), mma)


def smem_tiled_copy_vt(traits: FwdTraits, mma):
    """ldmatrix.trans x4 feeding the B operand of O = P V from the row-major sV."""
    return cute.make_tiled_copy_B(_ldmatrix(traits, True), mma)


def smem_tiled_copy_o(traits: FwdTraits, mma):
    """Accumulator fragment (converted to the element type) -> sO, 32-bit pairs."""
    atom = cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), element_type(traits), num_bits_per_copy=32)
    return cute.make_tiled_copy_C(atom, mma)
