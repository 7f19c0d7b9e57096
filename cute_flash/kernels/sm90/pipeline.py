"""Helpers both Hopper kernels share around their TMA loads and mbarrier pipelines."""
import cutlass
import cutlass.cute as cute
from cutlass import pipeline

from layouts import hopper
from layouts.traits import ELEMENT_BYTES


def use_state(n, stages: int, producer: bool) -> pipeline.PipelineState:
    """The pipeline state of the n-th stage use (n from 0): stage n % stages, its phase bit
    flipping each round (a producer's starts flipped). Computed from n rather than carried
    through the loop by `advance()`: a state object rebound in a helper is not a loop variable
    the DSL can carry. n >= 0, so a power-of-two depth takes a mask and a shift: the signed %
    and // had cost 8 instructions per warp and key block (d 128: 499 -> 491, SASS)."""
    if stages & (stages - 1) == 0:
        index, phase = n & (stages - 1), (n >> (stages.bit_length() - 1)) & 1
    else:
        index, phase = n % stages, (n // stages) % 2
    return pipeline.PipelineState(stages, n, index, phase ^ (1 if producer else 0))


def seq_first(t: cute.Tensor) -> cute.Tensor:
    """(batch, seqlen, heads, d) as (seqlen, d, heads, batch), packed (total, heads, d) as
    (total, d, heads): a TMA box is a (rows, d) tile and the trailing modes are coordinates."""
    modes = [1, 3, 2, 0] if cute.rank(t) == 4 else [0, 2, 1]
    return cute.make_tensor(t.iterator, cute.select(t.layout, mode=modes))


def tma_rows(tma_mX: cute.Tensor, start, bidh, bidb) -> cute.Tensor:
    """(rows, d) TMA coordinates of one head of one sequence: dense (rows, d, heads, batch)
    indexed, packed (total, d, heads) shifted to the sequence's first row `start`."""
    if start is None:
        return tma_mX[None, None, bidh, bidb]
    return cute.domain_offset((start, 0), tma_mX[None, None, bidh])


@cute.jit
def copy_rows(src: cute.Tensor, src_row0, dst: cute.Tensor, dst_row0, rows, cols, wg_tidx,
              head_dim: cutlass.Constexpr):
    """A warpgroup's 64 rows of a (rows, d) shared-memory tile, from src_row0, into dst from
    dst_row0, 16 bytes a copy (`layouts.hopper.o_copy_coord`), leaving out rows from `rows` on
    (a packed batch's next sequence: a TMA store would write them) and columns from `cols` on
    (a head dim narrower than the tile's, a multiple of 8)."""
    vec = 16 // ELEMENT_BYTES
    for i in cutlass.range_constexpr(hopper.o_copy_steps(head_dim)):
        row, chunk = hopper.o_copy_coord(wg_tidx, i, head_dim)
        if row < rows and chunk * vec < cols:
            s_vec = cute.local_tile(src[src_row0 + row, None], (vec,), (chunk,))  # (vec,)
            g_vec = cute.local_tile(dst[dst_row0 + row, None], (vec,), (chunk,))  # (vec,)
            cute.autovec_copy(s_vec, g_vec)
