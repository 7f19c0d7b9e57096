"""dQaccum to dQ: the last step of both backwards (SM80 instructions; the Hopper backward's
variant reads its warpgroup order).

dQaccum's warp order (`common/dq_accum.py`) means nothing outside the kernels: `DQConvert`
reads each chunk back in the same order (coalesced too), recovers each value's (row, col) from
the same MMA partition, sums the deterministic slices in a fixed order, scales, and writes dQ
through shared memory with 128-bit stores. flash-attn 2's seq-parallel backward pairs its
atomics with a permuted copy partition the same way.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

import cutlass
import cutlass.cute as cute

from cute_flash.kernels.common.dq_accum import fake_dq_accum, first_tile, tiles_of
from cute_flash.kernels.common.fake import fake_stream, fake_tensor
from cute_flash.kernels.common.seq_info import query_rows
from cute_flash.kernels.common.tile_copy import column_predicate, copy_tile
from layouts import copy as lcopy
from layouts import hopper
from layouts import mma as lmma
from layouts import smem as lsmem
from layouts.dq import chunk_index
from layouts.traits import ALIGN, COPY_BYTES, ELEMENT_BYTES, BwdTraits, element_type


@dataclass(frozen=True)
class DQConvertConfig:
    """The compile key of a convert variant: the backward traits (tile, warps, dQ grid)."""
    traits: BwdTraits
    even_k: bool = True
    varlen: bool = False
    dq_vec: int = 1  # as the main kernel's BwdConfig.dq_vec
    hopper: bool = False  # written by the Hopper backward: its dQ wgmma's partition, warpgroup runs

    @classmethod
    def of_hopper(cls, traits: BwdTraits, even_k: bool, varlen: bool) -> DQConvertConfig:
        """The convert of a Hopper backward on `traits`, keyed by the tiles it reads: the main
        kernel's Q / dO stages (two at d 256 on the "atomic" dQ path, one beside its staging
        tile; dO's own, `do_stages`), V's head dim (`head_dim_v`) and its key blocks (MLA's 96,
        `bwd_keys_on_n`) change nothing here."""
        keys = 64 if hopper.bwd_keys_on_n(traits) else traits.block_n
        return cls(replace(traits, q_stages=1, do_stages=None, head_dim_v=None, block_n=keys), even_k, varlen, 4,
                   hopper=True)

    @property
    def entry(self) -> str:
        return "varlen" if self.varlen else "dense"

    @property
    def smem_bytes(self) -> int:
        """The dQ tile in the input dtype, staged for 128-bit stores."""
        return ELEMENT_BYTES * self.traits.block_m * self.traits.head_dim

    @property
    def name(self) -> str:
        t = self.traits
        return (f"dq_convert_d{t.head_dim}_m{t.block_m}_w{t.num_warps}_{t.atom_m_dq}_{t.dtype}"
                f"{'' if self.even_k else '-k'}{'-V' if self.varlen else ''}-v{self.dq_vec}"
                f"{'-sm90' if self.hopper else ''}")


class DQConvert:
    """dQ = scale * (sum of dQaccum's slices), in the input dtype, one CTA per query tile."""

    def __init__(self, config: DQConvertConfig):
        self.config = config
        self.t = config.traits
        self.dtype = element_type(config.traits)

    @cute.jit
    def __call__(self, mdQaccum: cute.Tensor, mdQ: cute.Tensor, scale: cutlass.Float32, stream):
        """mdQaccum (slices, batch, heads, tiles, block_m * kHeadDim) fp32, mdQ (batch, seqlen_q,
        heads, d)."""
        self.launch(mdQaccum, mdQ, None, scale, (cute.ceil_div(mdQ.shape[1], self.t.block_m), mdQ.shape[0],
                                                 mdQ.shape[2]), stream)

    @cute.jit
    def call_varlen(self, mdQaccum: cute.Tensor, mdQ: cute.Tensor, mCuSeqlensQ: cute.Tensor,
                    max_seqlen_q: cutlass.Int32, scale: cutlass.Float32, stream):
        """mdQaccum (slices, heads, tiles, block_m * kHeadDim), mdQ (total_q, heads, d)."""
        self.launch(mdQaccum, mdQ, mCuSeqlensQ, scale,
                    (cute.ceil_div(max_seqlen_q, self.t.block_m), mCuSeqlensQ.shape[0] - 1, mdQ.shape[1]), stream)

    @cute.jit
    def launch(self, mdQaccum, mdQ, mCuSeqlensQ, scale, grid, stream):
        t = self.t
        sdQ_layout = lsmem.smem_layout_q(t)
        if cutlass.const_expr(self.config.hopper and hopper.bwd_atom_cols(t) != t.head_dim):
            # the Hopper dQ partition's columns a warpgroup (d 96: 48, d 192: 96) start on an atom of this layout
            sdQ_layout = hopper.bwd_smem_layout(t, t.block_m)

        @cute.struct
        class SharedStorage:
            sdQ: cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(sdQ_layout)], 1024]

        self.kernel(mdQaccum, mdQ, mCuSeqlensQ, scale, sdQ_layout, SharedStorage).launch(
            grid=grid, block=[t.num_threads, 1, 1], smem=SharedStorage.size_in_bytes(), stream=stream)

    @cute.kernel
    def kernel(self, mdQaccum: cute.Tensor, mdQ: cute.Tensor, mCuSeqlensQ, scale: cutlass.Float32,
               sdQ_layout: cute.ComposedLayout, SharedStorage: cutlass.Constexpr):
        t = self.t
        bm, d = t.block_m, t.head_dim
        varlen = self.config.varlen
        m_block, bidb, bidh = cute.arch.block_idx()
        tidx, _, _ = cute.arch.thread_idx()
        seq, mdQ_s, head_dim = query_rows(mdQ, bidb, bidh, mCuSeqlensQ)  # (seqlen_q, d)
        rows_q = seq.seqlen_q - m_block * bm
        if rows_q > 0:
            hopper_layout = self.config.hopper
            mma_dq = hopper.tiled_mma_dq(t) if hopper_layout else lmma.tiled_mma_grid(t, t.atom_m_dq)
            group = 128 if hopper_layout else 32
            acc_dq = cute.make_rmem_tensor(mma_dq.get_slice(tidx).partition_shape_C((bm, d)), cutlass.Float32)
            acc_dq.fill(0.0)
            tile = first_tile(seq, bidb, bm) + m_block
            for s in cutlass.range(mdQaccum.shape[0], unroll=1):  # slices in a fixed order
                chunk = tiles_of(mdQaccum, s, bidb, bidh, varlen)[tile, None]  # (block_m * kHeadDim,)
                for i in cutlass.range(cute.size(acc_dq), unroll_full=True):
                    acc_dq[i] = acc_dq[i] + chunk[chunk_index(i, tidx, cute.size(acc_dq), self.config.dq_vec, group)]
            rdQ = cute.make_fragment_like(acc_dq, self.dtype)  # (MMA, MMA_M, MMA_D)
            rdQ.store((acc_dq.load() * scale).to(self.dtype))
            storage = cutlass.memory.SmemAllocator().allocate(SharedStorage)
            sdQ = storage.sdQ.get_tensor(sdQ_layout)  # (bm, d)
            if cutlass.const_expr(hopper_layout):
                cute.autovec_copy(rdQ, mma_dq.get_slice(tidx).partition_C(sdQ))
            else:
                smem_copy = lcopy.smem_tiled_copy_c(t, mma_dq).get_slice(tidx)
                cute.copy(smem_copy, smem_copy.retile(rdQ), smem_copy.partition_D(sdQ))
            cute.arch.barrier()
            gmem_tiled_copy = lcopy.gmem_tiled_copy_o(t)
            gmem_thr_copy = gmem_tiled_copy.get_slice(tidx)
            tdQsdQ = gmem_thr_copy.partition_S(sdQ)  # (CPY, CPY_M, CPY_K)
            tdQrdQ = cute.make_fragment_like(tdQsdQ, self.dtype)
            cute.copy(gmem_tiled_copy, tdQsdQ, tdQrdQ)
            tdQcdQ = gmem_thr_copy.partition_D(cute.make_identity_tensor((bm, d)))  # (CPY, CPY_M, CPY_K)
            gdQ = cute.local_tile(mdQ_s, (bm, d), (m_block, 0))  # (bm, d)
            copy_tile(gmem_tiled_copy, tdQrdQ, gmem_thr_copy.partition_D(gdQ), tdQcdQ,
                      column_predicate(tdQcdQ, head_dim), rows_q, True, self.config.even_k, False)


def entry(config: DQConvertConfig):
    """The jit function `config` compiles: `__call__` (dense) or `call_varlen`."""
    kernel = DQConvert(config)
    return kernel.call_varlen if config.varlen else kernel


def fake_args(config: DQConvertConfig) -> list:
    """Placeholders for `DQConvert.__call__` / `call_varlen`, in parameter order."""
    dq = fake_tensor(element_type(config.traits), 3 if config.varlen else 4, ALIGN, COPY_BYTES)
    lens = [fake_tensor(cutlass.Int32, 1), 1] if config.varlen else []
    return [fake_dq_accum(config.traits, config.varlen), dq] + lens + [1.0, fake_stream()]
