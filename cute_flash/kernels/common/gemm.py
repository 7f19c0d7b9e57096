"""Warp-level GEMMs over the head dim / key block, operands fetched from smem one k-slice ahead
with ldmatrix so the next slice's loads overlap this slice's mma.sync."""
from dataclasses import dataclass

import cutlass
import cutlass.cute as cute
from cutlass.cute.nvgpu import warpgroup


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
def wgmma(tiled_mma: cute.TiledMma, acc: cute.Tensor, tA: cute.Tensor, tB: cute.Tensor,
          accumulate: cutlass.Constexpr = False):
    """Hopper: acc (+)= A B over the k mode, one warpgroup's batch of wgmma, issued and waited for."""
    wgmma_issue(tiled_mma, acc, tA, tB, accumulate)
    warpgroup.wait_group(0)


@cute.jit
def wgmma_issue(tiled_mma: cute.TiledMma, acc: cute.Tensor, tA: cute.Tensor, tB: cute.Tensor,
                accumulate: cutlass.Constexpr = False):
    """Hopper: issue acc (+)= A B (A from smem descriptors or registers, B from smem) as one
    committed wgmma group, without waiting: acc, and A in registers, stay untouchable until a
    `warpgroup.wait_group` says the group is done. The fence orders earlier register writes
    (a rescaled acc, a converted P) before the wgmma reads them."""
    tiled_mma.set(warpgroup.Field.ACCUMULATE, accumulate)
    warpgroup.fence()
    for k in cutlass.range_constexpr(cute.size(tA, mode=[2])):
        cute.gemm(tiled_mma, acc, tA[None, None, k], tB[None, None, k], acc)
        tiled_mma.set(warpgroup.Field.ACCUMULATE, True)
    warpgroup.commit_group()


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


@dataclass(frozen=True)
class SmemGemm:
    """One GEMM of the backward, acc += A B^T with both operands in shared memory: a thread's
    register fragments and the ldmatrix copies (transposed for an operand stored M- or N-major)
    that fill them."""
    tiled_mma: cute.TiledMma
    copy_A: object
    tCsA: cute.Tensor       # (CPY, CPY_M, CPY_K) smem source of A
    tCrA_view: cute.Tensor  # A's registers as the copy's destination
    tCrA: cute.Tensor       # (MMA, MMA_M, MMA_K)
    copy_B: object
    tCsB: cute.Tensor       # (CPY, CPY_N, CPY_K)
    tCrB_view: cute.Tensor
    tCrB: cute.Tensor       # (MMA, MMA_N, MMA_K)

    @staticmethod
    def make(tiled_mma: cute.TiledMma, copy_A: cute.TiledCopy, sA: cute.Tensor, copy_B: cute.TiledCopy,
             sB: cute.Tensor, tidx):
        """sA (M, K), sB (N, K) views of shared memory (transposed views where stored so)."""
        thr_mma = tiled_mma.get_slice(tidx)
        tCrA = thr_mma.make_fragment_A(thr_mma.partition_A(sA))
        tCrB = thr_mma.make_fragment_B(thr_mma.partition_B(sB))
        thr_copy_A, thr_copy_B = copy_A.get_slice(tidx), copy_B.get_slice(tidx)
        return SmemGemm(tiled_mma, thr_copy_A, thr_copy_A.partition_S(sA), thr_copy_A.retile(tCrA), tCrA,
                        thr_copy_B, thr_copy_B.partition_S(sB), thr_copy_B.retile(tCrB), tCrB)

    @cute.jit
    def run(self, acc: cute.Tensor):
        gemm_ss(self.tiled_mma, acc, self.copy_A, self.tCsA, self.tCrA_view, self.tCrA,
                self.copy_B, self.tCsB, self.tCrB_view, self.tCrB)
