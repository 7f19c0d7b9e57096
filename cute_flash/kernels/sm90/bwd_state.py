"""The Hopper backward's state (kernels/sm90/bwd.py): its compile-time recipe, tensors, shared
memory, pipelines and this CTA's key tile, as named frozen dataclasses."""
from __future__ import annotations

from dataclasses import dataclass

import cutlass
import cutlass.cute as cute

from cute_flash.kernels.common.seq_info import SeqInfo
from cute_flash.kernels.common.varlen_tiles import VarlenTiles


@dataclass(frozen=True)
class Sm90BwdRecipe:
    """Compile-time layouts, TMA atoms and TiledMMAs (layouts/hopper.py)."""
    sQ_layout: cute.ComposedLayout    # (bm, d, q_stages)
    sdO_layout: cute.ComposedLayout   # (bm, dv, do_stages)
    sK_layout: cute.ComposedLayout    # (bn, d)
    sV_layout: cute.ComposedLayout    # (bn, dv)
    sdS_layout: cute.ComposedLayout   # (bn, bm, stages): dS^T, also P^T's above d 128; 96 keys: (bm, bn, 1), dS, P
    tma_q: cute.CopyAtom
    tma_do: cute.CopyAtom
    tma_k: cute.CopyAtom
    tma_v: cute.CopyAtom
    tma_dk: cute.CopyAtom             # stores one warpgroup's (64, d) rows (above d 128, all bn rows)
    tma_dv: cute.CopyAtom             # (64, dv) (above d 128, (bn, dv))
    mma_sdp: cute.TiledMma            # S^T's: (bn, bm); on the 96-key tiles S's, (bm, bn)
    mma_dkv: cute.TiledMma            # dK's: (bn, d); on the 96-key tiles dK^T's, (d, bn)
    mma_dv: cute.TiledMma             # dV's: (bn, dv); on the 96-key tiles dV^T's, (dv, bn)
    mma_dq: cute.TiledMma


@dataclass(frozen=True)
class Sm90BwdVarlen:
    """A packed batch's metadata, and dK / dV as tensors (their rows are copied, not TMA-stored)."""
    mCuSeqlensQ: cute.Tensor  # (batch + 1,) int32
    mCuSeqlensK: cute.Tensor  # (batch + 1,) int32
    mSeqUsedK: object         # (batch,) int32 or None
    mdK: cute.Tensor          # (total_k, heads, d): per query head
    mdV: cute.Tensor          # (total_k, heads, dv)
    tiles: VarlenTiles        # (sequence, key block) of each CTA


@dataclass(frozen=True)
class Sm90BwdTensors:
    tma_mQ: cute.Tensor    # (seqlen_q, d, heads, batch) TMA coordinates; packed (total_q, d, heads)
    tma_mK: cute.Tensor    # (seqlen_k, d, heads_k, batch); packed (total_k, d, heads_k)
    tma_mV: cute.Tensor    # (seqlen_k, dv, heads_k, batch); packed (total_k, dv, heads_k)
    tma_mdO: cute.Tensor   # like tma_mQ, dv wide
    tma_mdK: cute.Tensor   # (seqlen_k, d, heads, batch): per query head
    tma_mdV: cute.Tensor   # (seqlen_k, dv, heads, batch)
    mLSE: cute.Tensor      # (batch, heads, seqlen_q_pad) fp32: LSE * log2(e), +inf past seqlen_q; packed (heads, rows)
    mD: cute.Tensor        # (batch, heads, seqlen_q_pad) fp32: rowsum(dO * O), 0 past seqlen_q; packed (heads, rows)
    mdQaccum: cute.Tensor  # (1, batch, heads, tiles, bm * d) fp32, zeroed; packed (1, heads, tiles, bm * d)
    mAlibi: object         # (batch, heads) fp32 slopes
    mRng: object           # (4,) uint32: dropout's Philox key, offset and keep threshold
    mSemaphore: object     # (batch, heads, tiles) int32 zeroed, packed (heads, tiles): deterministic's `DqTurn`s
    varlen: object         # Sm90BwdVarlen, or None (dense)
    aux: object = None     # the mods' aux tensors (a list), or None
    sparse: object = None  # block_sparse.BlockSparse by key block (a block-sparse launch), or None


@dataclass(frozen=True)
class Sm90BwdSmem:
    sQ: cute.Tensor        # (bm, d, q_stages)
    sdO: cute.Tensor       # (bm, dv, do_stages)
    sK: cute.Tensor        # (bn, d)
    sV: cute.Tensor        # (bn, dv)
    sdS: cute.Tensor       # (bn, bm, stages): dS^T; on the 96-key tiles (bm, bn, 1): dS
    sLSE: cute.Tensor      # (bm, q_stages) fp32
    sD: cute.Tensor        # (bm, do_stages) fp32
    sdQaccum: object       # (bm * d,) fp32: a run per consumer warpgroup; None on the "atomic" dQ path
    sP: object = None      # (bn, bm, stages): P^T above d 128 (`bwd_splits_head_dim`; 96 keys: P), else None


@dataclass(frozen=True)
class Sm90BwdPipes:
    kv_full: object        # K and V landed (one use per CTA)
    q: object              # Q + LSE stages (`PipelineTmaAsync`)
    do: object             # dO + D stages


@dataclass(frozen=True)
class DqTurn:
    """Deterministic mode: when this CTA's warpgroups may add their dQ into one query tile.
    The tile's semaphore counts the warpgroup adds done; key blocks add in increasing order (in
    decreasing order with `Sm90BwdConfig.dq_descending`), so a warpgroup waits until every
    warpgroup of the tile's key blocks before it in that order has added. Those CTAs were
    launched before this one (dense: lower x, which counts key blocks down when descending;
    packed: earlier in `VarlenTiles`), so they run or are done: no wait is on a CTA that waits
    for a slot."""
    semaphore: object  # pointer to the tile's int32 count
    before: object     # adds that come first: warpgroups x the key blocks of this tile before this one


@dataclass(frozen=True)
class KeyTile:
    """This CTA's key block and the query blocks [m_block_min, m_block_max) that see it, or its
    sparse row's (`count`, `m_block`)."""
    n_block: object
    bidh: object
    bidb: object
    seq: SeqInfo
    m_block_min: object
    m_block_max: object
    sparse: object = None  # block_sparse.SparseRow of a block-sparse launch, else None

    def count(self):
        """Query blocks to visit (>= 0)."""
        if cutlass.const_expr(self.sparse is not None):
            return self.sparse.count()
        return self.m_block_max - self.m_block_min

    @cute.jit
    def m_block(self, i):
        """The i-th query block the tile visits."""
        m = self.m_block_min + i
        if cutlass.const_expr(self.sparse is not None):
            m = self.sparse.block(i)
        return m
