"""The backward's preprocess (flash-attn 2's compute_dot_do_o): D = rowsum(dO * O) in fp32,
one value per query row and head, read by every key-block CTA of the main kernel.

A CTA takes kBlockM rows of one (batch, head); the forward's O-store thread layout reads them
with 128-bit loads, each row spread over `gmem_threads_per_row` adjacent lanes, whose partial
sums a butterfly shuffle completes. A thread loads and reduces one 16-byte chunk of O and dO at
a time: holding its whole share of the tile first spilled from d 128 up (ptxas: 64 + 32 bytes
at d 128, 5068 + 3128 at d 256, which also fell to 32 registers and a 2.9 KB stack).

For the Hopper backward (`PreprocessConfig.hopper_rows`) it also writes D and LSE times log2 e
into that kernel's layout: rows padded to whole query blocks, 0 and +inf past the sequence
(packed: each sequence's from row (cu_seqlens_q[b] // block + b) * block, `dq_accum.first_tile`),
which the host otherwise built with a fill, a scale and a pad (dense) or some twenty torch
calls (packed).
"""
from __future__ import annotations

from dataclasses import dataclass

import cutlass
import cutlass.cute as cute

from cute_flash.kernels.common.constants import LOG2E
from cute_flash.kernels.common.dq_accum import first_tile
from cute_flash.kernels.common.fake import fake_stream, fake_tensor
from cute_flash.kernels.common.seq_info import head_rows, query_rows
from cute_flash.kernels.common.tile_copy import column_predicate
from layouts import copy as lcopy
from layouts.traits import ALIGN, COPY_BYTES, FwdTraits, element_type


@dataclass(frozen=True)
class PreprocessConfig:
    """The compile key of a preprocess variant: head-dim bucket, dtype, entry."""
    head_dim: int
    dtype: str = "bf16"
    even_k: bool = True
    varlen: bool = False
    hopper_rows: int = 0  # also D and LSE times log2 e in rows padded to blocks of this many (the Hopper backward's)

    @property
    def traits(self) -> FwdTraits:
        """The copy geometry: 128 rows per CTA, 4 warps."""
        return FwdTraits(self.head_dim, 128, 64, 4, self.dtype)

    def __post_init__(self):
        if self.hopper_rows and self.traits.block_m % self.hopper_rows:
            raise ValueError("the padded rows are the Hopper backward's, whose query blocks divide this kernel's")

    @property
    def entry(self) -> str:
        return "varlen" if self.varlen else "dense"

    smem_bytes = 0  # registers only

    @property
    def name(self) -> str:
        return (f"dot_do_o_d{self.head_dim}_{self.dtype}{'' if self.even_k else '-k'}{'-V' if self.varlen else ''}"
                + (f"-p{self.hopper_rows}" if self.hopper_rows else ""))


class DotDoO:
    def __init__(self, config: PreprocessConfig):
        self.config = config
        self.t = config.traits
        self.dtype = element_type(self.t)

    @cute.jit
    def __call__(self, mO: cute.Tensor, mdO: cute.Tensor, mD: cute.Tensor, mLSE, mLSEPadded, mDPadded, stream):
        """mO/mdO (batch, seqlen_q, heads, d), mD (batch, heads, seqlen_q) fp32; `hopper_rows`:
        mLSE (batch, heads, seqlen_q) fp32 the forward's, mLSEPadded / mDPadded (batch, heads,
        padded rows) fp32 written (else None)."""
        padded = None
        if cutlass.const_expr(self.config.hopper_rows):
            padded = (mLSE, mLSEPadded, mDPadded)
        self.kernel(mO, mdO, mD, None, padded).launch(
            grid=(cute.ceil_div(mO.shape[1], self.t.block_m), mO.shape[0], mO.shape[2]),
            block=[self.t.num_threads, 1, 1], stream=stream)

    @cute.jit
    def call_varlen(self, mO: cute.Tensor, mdO: cute.Tensor, mD: cute.Tensor, mCuSeqlensQ: cute.Tensor,
                    max_seqlen_q: cutlass.Int32, mLSE, mLSEPadded, mDPadded, stream):
        """mO/mdO (total_q, heads, d), mD (heads, total_q) fp32, mCuSeqlensQ (batch + 1,);
        `hopper_rows`: mLSE (heads, total_q) fp32 the forward's, mLSEPadded / mDPadded (heads,
        padded rows) fp32 written (else None)."""
        padded = None
        if cutlass.const_expr(self.config.hopper_rows):
            padded = (mLSE, mLSEPadded, mDPadded)
        self.kernel(mO, mdO, mD, mCuSeqlensQ, padded).launch(
            grid=(cute.ceil_div(max_seqlen_q, self.t.block_m), mCuSeqlensQ.shape[0] - 1, mO.shape[1]),
            block=[self.t.num_threads, 1, 1], stream=stream)

    @cute.kernel
    def kernel(self, mO: cute.Tensor, mdO: cute.Tensor, mD: cute.Tensor, mCuSeqlensQ, padded):
        t = self.t
        bm, d = t.block_m, t.head_dim
        m_block, bidb, bidh = cute.arch.block_idx()
        tidx, _, _ = cute.arch.thread_idx()
        seq, mO_s, head_dim = query_rows(mO, bidb, bidh, mCuSeqlensQ)  # (seqlen_q, d)
        mdO_s = head_rows(mdO, seq, bidb, bidh)                           # (seqlen_q, d)
        mD_s = head_rows(mD, seq, bidb, bidh)                             # (seqlen_q,)
        rows_q = seq.seqlen_q - m_block * bm
        if rows_q > 0:
            tiled_copy = lcopy.gmem_tiled_copy_o(t)
            thr_copy = tiled_copy.get_slice(tidx)
            tOcO = thr_copy.partition_S(cute.make_identity_tensor((bm, d)))  # (CPY, CPY_M, CPY_K) coordinates
            kpred = column_predicate(tOcO, head_dim)
            tOgO = thr_copy.partition_S(cute.local_tile(mO_s, (bm, d), (m_block, 0)))    # (CPY, CPY_M, CPY_K)
            tOgdO = thr_copy.partition_S(cute.local_tile(mdO_s, (bm, d), (m_block, 0)))  # (CPY, CPY_M, CPY_K)
            for m in cutlass.range_constexpr(cute.size(tOgO, mode=[1])):
                row = tOcO[0, m, 0][0]
                dot = cutlass.Float32(0.0)
                if row < rows_q:
                    for k in cutlass.range_constexpr(cute.size(tOgO, mode=[2])):
                        if cutlass.const_expr(self.config.even_k) or kpred[k]:
                            rO = cute.make_fragment_like(tOgO[None, m, k], self.dtype)  # (CPY,)
                            rdO = cute.make_fragment_like(rO, self.dtype)
                            cute.copy(tiled_copy, tOgO[None, m, k], rO)
                            cute.copy(tiled_copy, tOgdO[None, m, k], rdO)
                            prod = rO.load().to(cutlass.Float32) * rdO.load().to(cutlass.Float32)
                            dot = dot + prod.reduce(cute.ReductionOp.ADD, cutlass.Float32.zero, 0)
                for s in cutlass.range_constexpr(t.gmem_threads_per_row.bit_length() - 1):  # the row's lanes
                    dot = dot + cute.arch.shuffle_sync_bfly(dot, offset=t.gmem_threads_per_row >> (s + 1))
                if tOcO[0, m, 0][1] == 0 and row < rows_q:
                    mD_s[m_block * bm + row] = dot
                if cutlass.const_expr(padded is not None):
                    self.write_padded(padded, seq, bidb, bidh, m_block * bm + row, tOcO[0, m, 0][1] == 0, dot)

    @cute.jit
    def write_padded(self, padded, seq, bidb, bidh, row, writer, dot):
        """Row `row` of the sequence in the Hopper backward's padded rows: D and LSE times log2 e,
        or 0 and +inf past the sequence up to its last block's end (packed: inside the padded
        rows whatever the prefix sums hold)."""
        mLSE, mLSEPadded, mDPadded = padded
        block = self.config.hopper_rows
        lse_row = head_rows(mLSE, seq, bidb, bidh)  # (seqlen_q,)
        if cutlass.const_expr(seq.sum_s_q is None):
            lse_padded, d_padded = mLSEPadded[bidb, bidh, None], mDPadded[bidb, bidh, None]  # (padded rows,)
            at = row
        else:  # the head's rows of every sequence, this one's from its first tile
            lse_padded, d_padded = mLSEPadded[bidh, None], mDPadded[bidh, None]  # (padded rows,)
            at = first_tile(seq, bidb, block) * block + row
        inside = at >= 0 and at < cute.size(lse_padded)
        if writer and inside and row < (seq.seqlen_q + block - 1) // block * block:
            lse_log2 = cutlass.Float32(float("inf"))
            d = cutlass.Float32(0.0)
            if row < seq.seqlen_q:
                lse_log2 = lse_row[row] * LOG2E
                d = dot
            lse_padded[at] = lse_log2
            d_padded[at] = d


def entry(config: PreprocessConfig):
    """The jit function `config` compiles: `__call__` (dense) or `call_varlen`."""
    kernel = DotDoO(config)
    return kernel.call_varlen if config.varlen else kernel


def fake_args(config: PreprocessConfig) -> list:
    """Placeholders for `DotDoO.__call__` / `call_varlen`, in parameter order."""
    rank = 3 if config.varlen else 4
    elems = [fake_tensor(element_type(config.dtype), rank, ALIGN, COPY_BYTES) for _ in range(2)]
    lens = [fake_tensor(cutlass.Int32, 1), 1] if config.varlen else []
    padded = [fake_tensor(cutlass.Float32, rank - 1) if config.hopper_rows else None for _ in range(3)]
    return elems + [fake_tensor(cutlass.Float32, rank - 1)] + lens + padded + [fake_stream()]
