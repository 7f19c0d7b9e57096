"""Swizzled shared-memory layouts for Q, K, V, V-transposed and the O staging tile.

The atom is `Swizzle<B,3,3> o (8, kBlockKSmem):(kBlockKSmem, 1)`: eight rows of one 128 B (or
64 B) line, with the 16-byte chunk index XORed by the row index, so that the eight rows an
ldmatrix phase reads, or a cp.async phase writes, land in eight different bank groups.
`tile_to_shape` repeats the atom over the tile, column-atoms innermost, as flash-attn 2's
`tile_to_shape(SmemLayoutAtomQ{}, Shape<kBlockM, kHeadDim>)`.
"""
import cutlass.cute as cute

from layouts.traits import FwdTraits


def swizzled_atom(width: int):
    """(8, width) atom, width 64 (Swizzle<3,3,3>, 128 B rows) or 32 (Swizzle<2,3,3>, 64 B rows)."""
    return cute.make_composed_layout(
        cute.make_swizzle(3 if width == 64 else 2, 3, 3), 0, cute.make_layout((8, width), stride=(width, 1))
    )


def smem_layout_atom(traits: FwdTraits):
    """(8, kBlockKSmem) swizzled atom."""
    return swizzled_atom(traits.block_k_smem)


def smem_layout_q(traits: FwdTraits):
    """(kBlockM, kHeadDim)"""
    return cute.tile_to_shape(smem_layout_atom(traits), (traits.block_m, traits.head_dim), (0, 1))


def smem_layout_kv(traits: FwdTraits):
    """(kBlockN, kHeadDim), shared by sK and sV."""
    return cute.tile_to_shape(smem_layout_atom(traits), (traits.block_n, traits.head_dim), (0, 1))


def smem_layout_o(traits: FwdTraits):
    """(kBlockM, kHeadDim): O is staged through sQ's storage before the 128-bit stores."""
    return smem_layout_q(traits)


def transposed_view(s_v):
    """(kHeadDim, kBlockN) view of a (kBlockN, kHeadDim) sV tensor or layout, no data moved;
    (kHeadDim, kBlockN, stages) of a staged (kBlockN, kHeadDim, stages) one.

    The B operand of O = P V is V^T; ldmatrix.trans (or an MN-major wgmma) reads it from the
    same swizzled storage.
    """
    n, d = cute.size(s_v.shape[0]), cute.size(s_v.shape[1])
    if cute.rank(s_v.shape) == 3:
        return cute.composition(s_v, cute.make_layout((d, n, cute.size(s_v.shape[2])), stride=(n, 1, n * d)))
    return cute.composition(s_v, cute.make_layout((d, n), stride=(n, 1)))


def smem_struct(fields: dict):
    """A kernel's shared-memory struct from {name: element type, element count, alignment}
    (alignment None: a plain MemRange, e.g. mbarriers). Built from type objects, not a class
    body: under `from __future__ import annotations` those are strings, which the DSL failed to
    resolve in some call stacks (seen in the CPU suite)."""
    annotations = {}
    for name, (dtype, count, align) in fields.items():
        member = cute.struct.MemRange[dtype, count]
        annotations[name] = member if align is None else cute.struct.Align[member, align]
    return cute.struct(type("SharedStorage", (), {"__annotations__": annotations}))


def smem_layout_unswizzled(rows: int, cols: int):
    """(rows, cols) row-major with no swizzle: the counter-example that bank checks must flag."""
    return cute.make_layout((rows, cols), stride=(cols, 1))


def smem_layout_pds(traits):
    """(kBlockM, kBlockN) P and dS tiles of the backward, keys contiguous (flash-attn 2's
    SmemLayoutPdS); dV = P^T dO and dK = dS^T Q read them transposed through ldmatrix.trans."""
    return cute.tile_to_shape(swizzled_atom(traits.block_k_pds), (traits.block_m, traits.block_n), (0, 1))
