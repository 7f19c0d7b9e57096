"""Tiled copies of the forward kernel.

- gmem -> smem for Q, K, V: cp.async 128-bit with CACHEGLOBAL (each byte is read once per CTA,
  so L1 allocation only evicts useful lines). Threads are laid `(kNThreads / tpr, tpr)`, tpr =
  kBlockKSmem / 8, each moving 8 contiguous elements: a warp covers whole 128 B (or 64 B) rows.
  K and V gathered from pages use the same threads and vectors with the rows dealt out in page
  runs: each run of a thread's rows lies in one aligned group of 16 rows (`paged_row_group`).
- smem -> registers: ldmatrix x4 shaped after the TiledMMA's A and B partitions; V goes
  through the transposed ldmatrix because the MMA wants V^T as its B operand.
- registers -> smem for O (the accumulator partition), then smem -> gmem 128-bit stores.
"""
import math

import cutlass.cute as cute
from cutlass.cute.nvgpu import cpasync, warp

from layouts.traits import COPY_BYTES, FwdTraits, element_type

COPY_BITS = 8 * COPY_BYTES


def _rows_per_pass(traits: FwdTraits) -> int:
    """Thread rows of the gmem copies: tile rows one pass of the CTA covers."""
    return traits.num_threads // traits.gmem_threads_per_row


def _thread_layout(traits: FwdTraits):
    tpr = traits.gmem_threads_per_row
    return cute.make_layout((_rows_per_pass(traits), tpr), stride=(tpr, 1))


def _value_layout(traits: FwdTraits):
    return cute.make_layout((1, COPY_BITS // element_type(traits).width))


def _cp_async_atom(traits: FwdTraits):
    return cute.make_copy_atom(
        cpasync.CopyG2SOp(cache_mode=cpasync.LoadCacheMode.GLOBAL),
        element_type(traits),
        num_bits_per_copy=COPY_BITS,
    )


def gmem_tiled_copy_qkv(traits: FwdTraits):
    return cute.make_tiled_copy_tv(_cp_async_atom(traits), _thread_layout(traits), _value_layout(traits))


def _rows_per_phase(traits: FwdTraits) -> int:
    """Thread rows of the K/V copy that share one 128-byte smem phase (8 lanes x 16 B)."""
    return max(1, 8 // traits.gmem_threads_per_row)


def paged_row_group(traits: FwdTraits) -> int:
    """Rows per page run of the paged K/V copy (gmem_tiled_copy_kv_paged): as many of a
    thread's rows as fit, with the rows-per-phase interleave, in an aligned group of 16."""
    return math.gcd(max(1, traits.block_n // _rows_per_pass(traits)), 16 // _rows_per_phase(traits))


def gmem_tiled_copy_kv_paged(traits: FwdTraits):
    """gmem_tiled_copy_qkv with its rows dealt out in page runs, for K/V gathered from pages.

    With R thread rows, P = thread rows per smem phase and G = paged_row_group, pass m of thread
    row t = t0 + P t1 (t0 < P) copies block row t0 + P (m % G) + P G t1 + G R (m // G). So the G
    copies m = G g .. G g + G - 1 of a thread lie in one aligned group of P G <= 16 rows, and
    pages hold a multiple of 16 rows: one table lookup and one base address per run, not per
    row. The P thread rows of a phase still write adjacent rows (no bank conflicts), and a
    warp's access still covers whole 128 B (or 64 B) row segments.
    """
    phase = _rows_per_phase(traits)
    rows = cute.make_layout((phase, _rows_per_pass(traits) // phase), stride=(1, phase * paged_row_group(traits)))
    tiler = (rows, cute.make_layout(traits.block_k_smem))
    return cute.make_tiled_copy(_cp_async_atom(traits), gmem_tiled_copy_qkv(traits).layout_tv_tiled, tiler)


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


def smem_tiled_copy_a(traits, mma, transpose: bool):
    """ldmatrix x4 feeding a TiledMMA's A operand; `transpose` reads an operand stored M-major
    (the backward's P^T and dS^T from the row-major P / dS tiles)."""
    return cute.make_tiled_copy_A(_ldmatrix(traits, transpose), mma)


def smem_tiled_copy_b(traits, mma, transpose: bool):
    """ldmatrix x4 feeding a TiledMMA's B operand; `transpose` reads one stored N-major (dO^T,
    Q^T, K^T in the backward)."""
    return cute.make_tiled_copy_B(_ldmatrix(traits, transpose), mma)


def smem_tiled_copy_c(traits, mma):
    """A TiledMMA's accumulator fragment (converted to the element type) -> smem, 32-bit pairs."""
    atom = cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), element_type(traits), num_bits_per_copy=32)
    return cute.make_tiled_copy_C(atom, mma)
