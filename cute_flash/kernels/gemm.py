"""Warp-level GEMMs over the head dim / key block, operands fetched from smem one k-slice ahead
with ldmatrix so the next slice's loads overlap this slice's mma.sync."""
from dataclasses import dataclass

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


@dataclass(frozen=True)
class MmaOperands:
    """The MMA operands of one thread and the ldmatrix copies that fill them from smem:
    Q and K for S = Q K^T, V^T for O += P V (P stays in registers)."""
    tiled_mma: cute.TiledMma
    tSrQ: cute.Tensor       # (MMA, MMA_M, MMA_K) registers
    tSrK: cute.Tensor       # (MMA, MMA_N, MMA_K)
    tOrVt: cute.Tensor      # (MMA, MMA_K, MMA_N)
    copy_Q: object          # ldmatrix thread copies
    copy_K: object
    copy_V: object
    tSsQ: cute.Tensor       # (CPY, CPY_M, CPY_K) smem sources of the copies
    tSsK: cute.Tensor       # (CPY, CPY_N, CPY_K)
    tOsVt: cute.Tensor      # (CPY, CPY_K, CPY_N)
    tSrQ_view: cute.Tensor  # the register operands retiled as the copies' destinations
    tSrK_view: cute.Tensor
    tOrVt_view: cute.Tensor

    @cute.jit
    def qk(self, acc_s: cute.Tensor):
        """acc_s += Q K^T."""
        gemm_ss(self.tiled_mma, acc_s, self.copy_Q, self.tSsQ, self.tSrQ_view, self.tSrQ,
                self.copy_K, self.tSsK, self.tSrK_view, self.tSrK)

    @cute.jit
    def pv(self, acc_o: cute.Tensor, tOrP: cute.Tensor):
        """acc_o += P V, P (MMA, MMA_M, MMA_K) in registers."""
        gemm_rs(self.tiled_mma, acc_o, tOrP, self.copy_V, self.tOsVt, self.tOrVt_view, self.tOrVt)
