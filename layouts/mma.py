"""The TiledMMA: SM80 mma.sync 16x8x16, fp16/bf16 in, fp32 accumulate.

Warps are stacked along M (`(kNWarps, 1, 1)`), so each warp owns 16 query rows of every
MMA_M step and the row statistics of the softmax never leave a warp. The permutation
`(16 * kNWarps, 16, 16)` makes one tile step cover 16 columns of N, i.e. two 8-wide atoms,
so that an ldmatrix x4 feeds a whole step of B.
"""
import cutlass
import cutlass.cute as cute
from cutlass.cute.nvgpu import warp

from layouts.traits import FwdTraits, element_type


def tiled_mma(traits: FwdTraits):
    op = warp.MmaF16BF16Op(element_type(traits), cutlass.Float32, (16, 8, 16))
    return cute.make_tiled_mma(
        op, (traits.num_warps, 1, 1), permutation_mnk=(16 * traits.num_warps, 16, 16)
    )


def acc_mn_view(acc):
    """((2, MMA_M), (2, MMA_N)) row/column view of an accumulator fragment ((2, 2), MMA_M, MMA_N).

    The atom's C values are (2 adjacent columns, 2 rows 8 apart): regrouping them with the
    repeat modes gives `acc_mn[r, c]` = row r, column c of what this thread holds, which is what
    masks and row reductions index. A Hopper wgmma accumulator ((2, 2, N / 8), MMA_M, MMA_N)
    repeats the same pair of rows every 8 columns: ((2, MMA_M), (2, N / 8, MMA_N)).
    """
    col_major = cute.make_layout(acc.layout.shape)
    (v, m, n), (vs, ms, ns) = col_major.shape, col_major.stride
    col_modes = [0] + list(range(2, cute.rank(v)))  # 2 columns (and the 8-column groups of a wgmma)
    mn = cute.make_layout(((v[1], m), (*(v[i] for i in col_modes), n)),
                          stride=((vs[1], ms), (*(vs[i] for i in col_modes), ns)))
    return cute.make_tensor(acc.iterator, cute.composition(acc.layout, mn))


def acc_as_a_operand(acc):
    """((2, 2, 2), MMA_M, MMA_N / 2) view of a C fragment ((2, 2), MMA_M, MMA_N) for use as A.

    The A fragment of a 16x8x16 MMA holds the C values of two neighbouring 8-column atoms, so P
    feeds O += P V straight from registers, with no smem round trip (flash-attn 2's
    convert_layout_acc_Aregs).
    """
    div = cute.logical_divide(acc.layout, (None, None, 2))
    view = cute.make_layout(
        ((div.shape[0], div.shape[2][0]), div.shape[1], div.shape[2][1]),
        stride=((div.stride[0], div.stride[2][0]), div.stride[1], div.stride[2][1]),
    )
    return cute.make_tensor(acc.iterator, view)


def tiled_mma_grid(traits, warps_m: int):
    """The backward's TiledMMAs: warps in a warps_m x (num_warps / warps_m) grid, one tile step
    16 * warps_m x 16 * warps_n x 16 (flash-attn 2's `Tile<16 * AtomM, 16 * AtomN, 16>`), so each
    warp's B fragment of a step is 16 columns, one ldmatrix x4."""
    warps_n = traits.num_warps // warps_m
    op = warp.MmaF16BF16Op(element_type(traits), cutlass.Float32, (16, 8, 16))
    return cute.make_tiled_mma(op, (warps_m, warps_n, 1), permutation_mnk=(16 * warps_m, 16 * warps_n, 16))
