"""Predicated tile copies: a tiled copy over (CPY, CPY_ROWS, CPY_K) partitions, skipping
rows past the sequence end and 16-byte column chunks past the head dim.

Skipped destination chunks in shared memory are zero-filled, because S = Q K^T and O = P V
read whole tiles: a stale K column would add garbage to S, and a NaN in a stale V row would
survive multiplication by P = 0.
"""
import cutlass
import cutlass.cute as cute


@cute.jit
def column_predicate(tXcX: cute.Tensor, head_dim):
    """(CPY_K,) booleans: is each 16-byte column chunk of this thread inside the head dim."""
    pred = cute.make_rmem_tensor((cute.size(tXcX, mode=[2]),), cutlass.Boolean)
    for k in cutlass.range_constexpr(cute.size(pred)):
        pred[k] = cute.elem_less(tXcX[0, 0, k][1], head_dim)
    return pred


@cute.jit
def copy_tile(tiled_copy: cute.TiledCopy, src: cute.Tensor, dst: cute.Tensor, tXcX: cute.Tensor,
              kpred: cute.Tensor, max_rows, check_rows: cutlass.Constexpr, even_k: cutlass.Constexpr,
              zero_fill: cutlass.Constexpr):
    """Copy the rows of `src` whose tile row (from the identity partition tXcX) is < max_rows.

    zero_fill: write zeros where nothing is copied (shared-memory destinations); global
    destinations are left untouched instead.
    """
    if cutlass.const_expr(not check_rows and even_k):
        cute.copy(tiled_copy, src, dst)
    else:
        for m in cutlass.range_constexpr(cute.size(dst, mode=[1])):
            row_ok = True
            if cutlass.const_expr(check_rows):
                row_ok = cute.elem_less(tXcX[0, m, 0][0], max_rows)
            copy_or_fill_row(tiled_copy, lambda: src, dst, m, kpred, row_ok, even_k, zero_fill)


@cute.jit
def copy_or_fill_row(tiled_copy: cute.TiledCopy, source, dst: cute.Tensor, m: cutlass.Constexpr, kpred: cute.Tensor,
                     row_ok, even_k: cutlass.Constexpr, zero_fill: cutlass.Constexpr):
    """Row m of `dst` from `source()` when row_ok, else zeros (shared-memory destinations) or
    nothing (global ones). `source` gives the (CPY, CPY_ROWS, CPY_K) source partition and is
    traced inside the copying branch only, so a paged row's address is computed only for rows
    that are copied."""
    if row_ok:
        copy_row(tiled_copy, source(), dst, m, kpred, even_k, zero_fill)
    else:
        if cutlass.const_expr(zero_fill):
            dst[None, m, None].fill(0)


@cute.jit
def copy_row(tiled_copy: cute.TiledCopy, src: cute.Tensor, dst: cute.Tensor, m: cutlass.Constexpr,
             kpred: cute.Tensor, even_k: cutlass.Constexpr, zero_fill: cutlass.Constexpr):
    """Row m of (CPY, CPY_ROWS, CPY_K) partitions: the 16-byte chunks inside the head dim."""
    for k in cutlass.range_constexpr(cute.size(dst, mode=[2])):
        if cutlass.const_expr(even_k):
            cute.copy(tiled_copy, src[None, m, k], dst[None, m, k])
        else:
            if kpred[k]:
                cute.copy(tiled_copy, src[None, m, k], dst[None, m, k])
            else:
                if cutlass.const_expr(zero_fill):
                    dst[None, m, k].fill(0)
