"""The Hopper recipes of `layouts/hopper.py` on one tile, before any attention kernel uses them:
TMA loads Q (block_m x d), K and V (block_n x d) into GMMA-swizzled shared memory on one
mbarrier; wgmma computes S = Q K^T from shared memory, then O = P V with P = S rounded to the
input dtype in the S accumulators' own registers. S and O (fp32) are stored through the
accumulator partitions. They match torch only if the smem layouts, the TMA boxes, both
TiledMMAs and the accumulator-as-operand view all agree on where every element lives.
"""
from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass.cute.nvgpu import cpasync

from cute_flash.kernels.common.gemm import wgmma
from layouts import hopper
from layouts import smem as lsmem
from layouts.hopper import HopperTileTraits
from layouts.traits import element_type


class HopperTile:
    def __init__(self, traits: HopperTileTraits):
        self.t = traits
        self.dtype = element_type(traits)

    @cute.jit
    def __call__(self, mQ: cute.Tensor, mK: cute.Tensor, mV: cute.Tensor, mS: cute.Tensor, mO: cute.Tensor,
                 stream):
        """mQ (block_m, d), mK / mV (block_n, d) in the input dtype; mS (block_m, block_n), mO
        (block_m, d) fp32."""
        t = self.t
        sQ_layout = hopper.smem_layout(t, t.block_m)
        sKV_layout = hopper.smem_layout(t, t.block_n)
        tma_q, tma_mQ = hopper.tma_load_atom(t, mQ, sQ_layout, t.block_m)
        tma_k, tma_mK = hopper.tma_load_atom(t, mK, sKV_layout, t.block_n)
        tma_v, tma_mV = hopper.tma_load_atom(t, mV, sKV_layout, t.block_n)

        kv = (self.dtype, cute.cosize(sKV_layout), 1024)
        SharedStorage = lsmem.smem_struct({"full": (cutlass.Int64, 1, None),
                                           "sQ": (self.dtype, cute.cosize(sQ_layout), 1024), "sK": kv, "sV": kv})

        self.kernel(tma_q, tma_mQ, tma_k, tma_mK, tma_v, tma_mV, mS, mO, sQ_layout, sKV_layout,
                    hopper.tiled_mma_qk(t), hopper.tiled_mma_pv(t), SharedStorage).launch(
            grid=(1, 1, 1), block=[t.num_threads, 1, 1], smem=SharedStorage.size_in_bytes(), stream=stream)

    @cute.kernel
    def kernel(self, tma_q: cute.CopyAtom, tma_mQ: cute.Tensor, tma_k: cute.CopyAtom, tma_mK: cute.Tensor,
               tma_v: cute.CopyAtom, tma_mV: cute.Tensor, mS: cute.Tensor, mO: cute.Tensor,
               sQ_layout: cute.ComposedLayout, sKV_layout: cute.ComposedLayout, mma_qk: cute.TiledMma,
               mma_pv: cute.TiledMma, SharedStorage: cutlass.Constexpr):
        t = self.t
        tidx, _, _ = cute.arch.thread_idx()
        warp = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        storage = cutlass.memory.SmemAllocator().allocate(SharedStorage)
        full = storage.full.data_ptr()
        sQ = storage.sQ.get_tensor(sQ_layout.outer, swizzle=sQ_layout.inner)    # (bm, d)
        sK = storage.sK.get_tensor(sKV_layout.outer, swizzle=sKV_layout.inner)  # (bn, d)
        sV = storage.sV.get_tensor(sKV_layout.outer, swizzle=sKV_layout.inner)  # (bn, d)

        if warp == 0:
            for atom in (tma_q, tma_k, tma_v):
                cpasync.prefetch_descriptor(atom)
        if tidx == 0:
            cute.arch.mbarrier_init(full, 1)
            cute.arch.mbarrier_init_fence()
        cute.arch.sync_threads()
        if warp == 0:  # a TMA copy is issued by a whole warp: it elects one lane (elect.sync) itself
            if tidx == 0:
                nbytes = cute.size_in_bytes(self.dtype, sQ_layout) + 2 * cute.size_in_bytes(self.dtype, sKV_layout)
                cute.arch.mbarrier_arrive_and_expect_tx(full, nbytes)
            cute.arch.sync_warp()
            for atom, src, dst, rows in ((tma_q, tma_mQ, sQ, t.block_m), (tma_k, tma_mK, sK, t.block_n),
                                         (tma_v, tma_mV, sV, t.block_n)):
                g = cute.local_tile(src, (rows, t.head_dim), (0, 0))  # (rows, d) TMA coordinates
                tXsX, tXgX = cpasync.tma_partition(atom, 0, cute.make_layout(1), cute.group_modes(dst, 0, 2),
                                                   cute.group_modes(g, 0, 2))  # (TMA,), (TMA,)
                cute.copy(atom, tXgX, tXsX, tma_bar_ptr=full)
        cute.arch.mbarrier_wait(full, 0)

        wg = cute.make_layout(t.warpgroups, stride=128)  # A / B partitions are per warpgroup: its first thread
        thr_qk = mma_qk.get_slice(wg(tidx // 128))
        tSrQ = mma_qk.make_fragment_A(thr_qk.partition_A(sQ))  # (MMA, MMA_M, MMA_K) descriptors
        tSrK = mma_qk.make_fragment_B(thr_qk.partition_B(sK))  # (MMA, MMA_N, MMA_K)
        acc_s = cute.make_rmem_tensor(thr_qk.partition_shape_C((t.block_m, t.block_n)), cutlass.Float32)
        wgmma(mma_qk, acc_s, tSrQ, tSrK)
        cute.autovec_copy(acc_s, mma_qk.get_slice(tidx).partition_C(mS))  # C: each thread its own values

        thr_pv = mma_pv.get_slice(wg(tidx // 128))
        tOrV = mma_pv.make_fragment_B(thr_pv.partition_B(lsmem.transposed_view(sV)))  # (MMA, MMA_N, MMA_K)
        tOrP = hopper.p_operand(acc_s, self.dtype)  # ((2, 2, 2), MMA_M, MMA_K)
        acc_o = cute.make_rmem_tensor(thr_pv.partition_shape_C((t.block_m, t.head_dim)), cutlass.Float32)
        wgmma(mma_pv, acc_o, tOrP, tOrV)
        cute.autovec_copy(acc_o, mma_pv.get_slice(tidx).partition_C(mO))


def compile_hopper_tile(traits: HopperTileTraits, arch: int | None = None, extra_options: str = ""):
    """Build the tile kernel for `traits` on fake (rows, head_dim) tensors (no GPU with an
    explicit arch)."""
    from cutlass.cute.runtime import make_fake_tensor

    from cute_flash.compile.registry import compile_tvm_ffi
    from cute_flash.kernels.common.fake import fake_stream

    def tile(dtype, rows, cols):
        return make_fake_tensor(dtype, (rows, cols), (cols, 1), assumed_align=16)

    d, el = traits.head_dim, element_type(traits)
    args = [tile(el, traits.block_m, d), tile(el, traits.block_n, d), tile(el, traits.block_n, d),
            tile(cutlass.Float32, traits.block_m, traits.block_n), tile(cutlass.Float32, traits.block_m, d),
            fake_stream()]
    return compile_tvm_ffi(HopperTile(traits), args, arch, extra_options)


def hopper_tile(q, k, v, traits: HopperTileTraits):
    """Run the tile on CUDA tensors q (block_m, d), k / v (block_n, d); returns (S, O) fp32,
    NaN-filled first so that an element the kernel misses shows."""
    import torch

    s = torch.full((traits.block_m, traits.block_n), float("nan"), device=q.device)
    o = torch.full((traits.block_m, traits.head_dim), float("nan"), device=q.device)
    compile_hopper_tile(traits)(q, k, v, s, o)
    return s, o
