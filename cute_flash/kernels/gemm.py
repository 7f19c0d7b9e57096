"""Warp-level GEMMs over the head dim / key block, operands fetched from smem one k-slice ahead
with ldmatrix so the next slice's loads overlap this slice's mma.sync."""
import cutlass
import cutlass.cute as cute


@cute.jit
def gemm_ss(tiled_mma: cute.TiledMma, acc: cute.Tensor,
            copy_A: cute.TiledCopy, tCsA: cute.Tensor, tCrA_view: cute.Tensor, tCrA: cute.Tensor,
            copy_B: cute.TiledCopy, tCsB: cute.Tensor, tCrB_view: cute.Tensor, tCrB: cute.Tensor):
    """acc += A B^T, both operands in shared memory (S = Q K^T)."""
    num_k = cute.size(tCsA, mode=[2])
    cute.copy(copy_A, tCsA[None, None, 0], tCrA_view[None, None, 0])
    cute.copy(copy_B, tCsB[None, None, 0], tCrB_view[None, None, 0])
    for k in cutlass.range_constexpr(num_k):
        if cutlass.const_expr(k + 1 < num_k):
            cute.copy(copy_A, tCsA[None, None, k + 1], tCrA_view[None, None, k + 1])
            cute.copy(copy_B, tCsB[None, None, k + 1], tCrB_view[None, None, k + 1])
        cute.gemm(tiled_mma, acc, tCrA[None, None, k], tCrB[None, None, k], acc)


@cute.jit
def gemm_rs(tiled_mma: cute.TiledMma, acc: cute.Tensor, tCrA: cute.Tensor,
            copy_B: cute.TiledCopy, tCsB: cute.Tensor, tCrB_view: cute.Tensor, tCrB: cute.Tensor):
    """acc += A B^T with A already in registers (O += P V)."""
    num_k = cute.size(tCsB, mode=[2])
    cute.copy(copy_B, tCsB[None, None, 0], tCrB_view[None, None, 0])
    for k in cutlass.range_constexpr(num_k):
        if cutlass.const_expr(k + 1 < num_k):
            cute.copy(copy_B, tCsB[None, None, k + 1], tCrB_view[None, None, k + 1])
        cute.gemm(tiled_mma, acc, tCrA[None, None, k], tCrB[None, None, k], acc)
