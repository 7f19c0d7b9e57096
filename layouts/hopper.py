"""Hopper (sm_90a) recipes for the attention tiles: GMMA shared-memory layouts, TMA atoms and
the two warpgroup TiledMMAs (S = Q K^T from shared memory, O = P V with P in registers).

wgmma reads its shared-memory operands through descriptors, so a tile must sit in one of the
canonical GMMA layouts: rows of the contiguous mode cut into swizzle atoms of 128, 64 or 32
bytes (the widest that divides the row; 128 for d >= 64 in 16-bit types). TMA writes the same
layouts, its box being the whole tile. Q and K are K-major operands (the head dim contiguous);
V is the B operand of P V with its N mode (the head dim) contiguous: MN-major, read through a
transposed view of the same row-major tile. One warpgroup covers 64 rows per wgmma.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass, replace

import cutlass
import cutlass.cute as cute
import cutlass.utils.hopper_helpers as sm90
from cutlass.cute.nvgpu import cpasync, warpgroup
from cutlass.tensor_utils import LayoutEnum

from layouts.traits import (DTYPES, ELEMENT_BYTES, HEAD_DIM_BUCKETS, LATENT_DIMS, SMEM_LIMIT, BwdTraits,
                            check_bucket_and_dtype, element_type, head_dim_bucket)

WGMMA_M = 64  # rows of one warpgroup's wgmma


@dataclass(frozen=True)
class HopperTileTraits:
    """Tile sizes of a Hopper attention tile: block_m query rows (a multiple of 64, one
    warpgroup per 64), block_n keys, head_dim; head_dim_v, V's and O's head dim where it is
    not head_dim's (MLA's 192 / 128), else None. `latent`: MLA's absorbed decode (`LATENT_DIMS`),
    V being the first head_dim_v columns of K's rows (one latent cache), read from K's stage,
    and two warpgroups a 64-row block, each computing its S and half of O's columns (O's 512
    fp32 columns are 256 registers a thread on one warpgroup)."""
    head_dim: int
    block_m: int = 64
    block_n: int = 128
    dtype: str = "bf16"
    head_dim_v: int | None = None
    latent: bool = False

    def __post_init__(self):
        if self.latent:
            if (self.head_dim, self.head_dim_v) != LATENT_DIMS or self.block_m != WGMMA_M:
                raise ValueError(f"latent tiles are (head_dim, head_dim_v) = {LATENT_DIMS} on {WGMMA_M} rows")
            if self.dtype not in DTYPES:
                raise ValueError(f"dtype must be one of {DTYPES}, got {self.dtype!r}")
        else:
            check_bucket_and_dtype(self.head_dim, self.dtype)
        if self.head_dim_v is not None and not self.latent:
            check_bucket_and_dtype(self.head_dim_v, self.dtype)
            if self.head_dim_v == self.head_dim:
                raise ValueError("head_dim_v is V's head dim where it differs from head_dim; leave it None otherwise")
        if self.block_m % WGMMA_M:
            raise ValueError(f"block_m must be a multiple of {WGMMA_M} (one warpgroup's wgmma)")
        if self.block_n % 16 or not 16 <= self.block_n <= 256:
            raise ValueError("block_n must be a multiple of 16 in [16, 256] (a wgmma's N)")

    @property
    def row_warpgroups(self) -> int:
        """Consumer warpgroups along the rows, 64 each."""
        return self.block_m // WGMMA_M

    @property
    def col_warpgroups(self) -> int:
        """Consumer warpgroups sharing a 64-row block, each with its share of O's columns."""
        return 2 if self.latent else 1

    @property
    def warpgroups(self) -> int:
        return self.row_warpgroups * self.col_warpgroups

    @property
    def dv_wg(self) -> int:
        """O's columns a consumer warpgroup holds."""
        return self.dv // self.col_warpgroups

    @property
    def num_threads(self) -> int:
        return 128 * self.warpgroups

    @property
    def dv(self) -> int:
        """V's and O's head dim."""
        return self.head_dim if self.head_dim_v is None else self.head_dim_v

    def smem_bytes(self, stages: int = 1) -> int:
        """Q, and K and V tiles in `stages` stages (latent: V lies in K's)."""
        q_k = (self.block_m + stages * self.block_n) * self.head_dim
        return ELEMENT_BYTES * (q_k + (0 if self.latent else stages * self.block_n * self.dv))

    @property
    def name(self) -> str:
        value = "" if self.head_dim_v is None else f"_v{self.head_dim_v}"
        value += "_lat" if self.latent else ""
        return f"sm90_d{self.head_dim}{value}_m{self.block_m}_n{self.block_n}_{self.dtype}"


TALL_D64_MIN_SEQLEN_K = 2048           # d 64 takes 192-row tiles from 16 key blocks of 128 under a mask,
TALL_D64_UNMASKED_MIN_SEQLEN_K = 1024  # from 8 without one
WIDE_KEYS_MAX_DIMS = (192, 128)  # (head_dim, head_dim_v) to which unmasked calls take 128 keys (no spill)
TWO_CTAS_MAX_HEAD_DIM = 128   # the KV-cache entry's two-CTAs-an-SM tiles: ptxas spilled 0 B at d 64 / 128


@functools.lru_cache(maxsize=None)
def choose_hopper_traits(head_dim: int, dtype: str = "bf16", long_keys: bool = False,
                         head_dim_v: int | None = None, unmasked: bool = False) -> HopperTileTraits:
    """The Hopper forward's tiles: 128 query rows (two warpgroups); 128 keys per block up to
    d 128, 64 above (two K / V stages then fit: 196 KB at d 256). d 64 with long_keys (a flag,
    so the cache stays small; the launcher sets it from `TALL_D64_MIN_SEQLEN_K` keys under a
    causal / local mask, `TALL_D64_UNMASKED_MIN_SEQLEN_K` without one): 192 rows (three
    warpgroups, persistent), faster than 128 rows from 2k keys under a mask and from 1k without
    one. 1k causal keeps 128 rows, which ran faster there, as does 512, where 192 rows did not
    win every A/B (docs/tuning/hopper-forward.md, Hopper steps 10-11). A V head dim of its own
    (`head_dim_v`, bucketed): key blocks by the wider of the two, no tall tiles; `unmasked` (the
    launcher's `takes_value_dim_wide_keys`): 128 keys up to `WIDE_KEYS_MAX_DIMS`, O then staged
    in Q's tile (`o_fits_q_tile`), one CTA a tile."""
    d = head_dim_bucket(head_dim)
    dv = None if head_dim_v is None or head_dim_bucket(head_dim_v) == d else head_dim_bucket(head_dim_v)
    if dv is not None:
        wide = max(d, dv) <= 128 or (unmasked and d <= WIDE_KEYS_MAX_DIMS[0] and dv <= WIDE_KEYS_MAX_DIMS[1])
        return HopperTileTraits(d, 128, 128 if wide else 64, dtype, dv)
    if d == 64 and long_keys:
        return HopperTileTraits(d, 192, 128, dtype)
    return HopperTileTraits(d, 128, 128 if d <= 128 else 64, dtype)


def choose_hopper_cache_traits(head_dim: int, dtype: str = "bf16", ctas_per_sm: int = 1) -> HopperTileTraits:
    """The KV-cache entry's tiles: 64 query rows (one consumer warpgroup), keys as
    `choose_hopper_traits`. Decode rows are few (seqlen_q, or the GQA group when folded), and
    64-row tiles streamed K / V faster than 128-row ones, whose key blocks take twice the wgmma
    work beyond those rows (docs/tuning/decode-splits.md, "The Hopper forward on decode cells").
    Two CTAs an SM (`TWO_CTAS_MAX_HEAD_DIM` at most) take 64-key blocks, so that two fit in an
    SM's shared memory."""
    if ctas_per_sm == 2:
        return HopperTileTraits(head_dim_bucket(head_dim), WGMMA_M, 64, dtype)
    return HopperTileTraits(head_dim_bucket(head_dim), WGMMA_M, choose_hopper_traits(head_dim, dtype).block_n, dtype)


def choose_hopper_latent_traits(dtype: str = "bf16") -> HopperTileTraits:
    """MLA decode's tiles (`HopperTileTraits.latent`): 64 rows, 64 keys a block: Q (72 KB) and
    two K stages (72 KB each) fill 216 KB of an SM's shared memory; O is staged in Q's tile."""
    return HopperTileTraits(LATENT_DIMS[0], WGMMA_M, 64, dtype, LATENT_DIMS[1], latent=True)


def shipped_hopper_latent_traits() -> list[HopperTileTraits]:
    """MLA decode's latent tiles, every dtype."""
    return [choose_hopper_latent_traits(dt) for dt in DTYPES]


VALUE_DIM_PAIRS = ((192, 128),)  # (head_dim, head_dim_v) shipped with a V head dim of its own: MLA's


def shipped_hopper_traits() -> list[HopperTileTraits]:
    same = [choose_hopper_traits(d, dt, long_keys) for d in HEAD_DIM_BUCKETS for dt in DTYPES
            for long_keys in (False, True)]
    return list(dict.fromkeys(same + [choose_hopper_traits(d, dt, head_dim_v=dv, unmasked=u)
                                      for d, dv in VALUE_DIM_PAIRS for dt in DTYPES for u in (False, True)]))


def wide_value_keys(traits: HopperTileTraits) -> bool:
    """A V head dim of its own above d 128 on 128-key blocks (`choose_hopper_traits`'
    `unmasked`): tiles for calls without a mask, packed batches or pages."""
    return (traits.head_dim_v is not None and not traits.latent and max(traits.head_dim, traits.dv) > 128
            and traits.block_n == 128)


def o_fits_q_tile(traits: HopperTileTraits) -> bool:
    """O's (block_m, dv) tile lies in Q's (block_m, head_dim) one, each element at its (row,
    column) of Q: dv <= head_dim in the same swizzle atom, whose copies go down the rows first
    (`smem_layout`), so O's are Q's first ones and a warpgroup's rows stay its own."""
    return traits.dv <= traits.head_dim and atom_cols(traits) == atom_cols(traits, traits.dv)


def atom_cols(traits: HopperTileTraits, cols: int | None = None) -> int:
    """Columns of `swizzle_atom`'s span (cols the head dim unless given), in plain Python: the
    widest of 128, 64 and 32 bytes that divides the row (16 bytes: no swizzle)."""
    row_bytes = ELEMENT_BYTES * (cols or traits.head_dim)
    return next(span for span in (128, 64, 32, 16) if row_bytes % span == 0) // ELEMENT_BYTES


def shipped_hopper_cache_traits(ctas_per_sm: int = 1) -> list[HopperTileTraits]:
    """The KV-cache entry's traits (`choose_hopper_cache_traits`), every bucket and dtype (up to
    `TWO_CTAS_MAX_HEAD_DIM` for two CTAs an SM)."""
    dims = HEAD_DIM_BUCKETS if ctas_per_sm == 1 else [d for d in HEAD_DIM_BUCKETS if d <= TWO_CTAS_MAX_HEAD_DIM]
    return [choose_hopper_cache_traits(d, dt, ctas_per_sm) for d in dims for dt in DTYPES]


def smem_layout(traits: HopperTileTraits, rows: int, cols: int | None = None):
    """(rows, cols) row-major tile in the widest GMMA swizzle atom its rows allow; cols the
    head dim unless given (V's and O's `dv`)."""
    cols = cols or traits.head_dim
    return cute.tile_to_shape(swizzle_atom(traits, cols), (rows, cols), order=(0, 1))


def smem_layout_staged(traits: HopperTileTraits, rows: int, stages: int, cols: int | None = None):
    """(rows, cols, stages): `stages` such tiles, one after the other."""
    cols = cols or traits.head_dim
    return cute.tile_to_shape(swizzle_atom(traits, cols), (rows, cols, stages), order=(0, 1, 2))


def swizzle_atom(traits: HopperTileTraits, cols: int | None = None):
    """The GMMA swizzle atom of a (rows, cols) row-major tile (cols the head dim unless given):
    8 rows of the widest swizzle span (128, 64 or 32 bytes) the row allows."""
    return row_major_atom(element_type(traits), cols or traits.head_dim)


def row_major_atom(dtype, cols: int):
    """8 rows of `cols` elements in the widest GMMA swizzle span the row allows."""
    return warpgroup.make_smem_layout_atom(sm90.get_smem_layout_atom(LayoutEnum.ROW_MAJOR, dtype, cols), dtype)


def tma_load_atom(traits: HopperTileTraits, gmem_tensor, smem_tile, rows: int, multicast: int = 1,
                  cols: int | None = None):
    """(TMA atom, TMA coordinate tensor) loading (rows, cols) boxes of `gmem_tensor`, whose
    first two modes are (rows, head dim) with the head dim contiguous (further modes are
    coordinates), into one (rows, cols) tile of layout `smem_tile` (cols the head dim unless
    given); with multicast > 1, each of that many CTAs of a cluster loads its share of the box
    into all of them."""
    box = (rows, cols or traits.head_dim)
    if multicast > 1:
        return cpasync.make_tiled_tma_atom(cpasync.CopyBulkTensorTileG2SMulticastOp(), gmem_tensor, smem_tile, box,
                                           num_multicast=multicast)
    return cpasync.make_tiled_tma_atom(cpasync.CopyBulkTensorTileG2SOp(), gmem_tensor, smem_tile, box)


def tma_store_atom(traits: HopperTileTraits, gmem_tensor, smem_tile, rows: int, cols: int | None = None):
    """(TMA atom, TMA coordinate tensor) storing one (rows, cols) tile of layout `smem_tile`
    into boxes of `gmem_tensor` (modes as `tma_load_atom`); TMA drops what falls past the
    tensor's end."""
    return cpasync.make_tiled_tma_atom(cpasync.CopyBulkTensorTileS2GOp(), gmem_tensor, smem_tile,
                                       (rows, cols or traits.head_dim))


def tiled_mma_qk(traits: HopperTileTraits):
    """S = Q K^T: both operands K-major in shared memory; fp32 accumulators, a warpgroup per
    64 rows."""
    dtype = element_type(traits)
    return sm90.make_trivial_tiled_mma(dtype, dtype, cute.nvgpu.OperandMajorMode.K, cute.nvgpu.OperandMajorMode.K,
                                       cutlass.Float32, (traits.row_warpgroups, 1, 1), (WGMMA_M, traits.block_n))


def tiled_mma_pv(traits: HopperTileTraits):
    """O = P V: P from registers (the S accumulators converted in place, `acc_as_operand_a`),
    V MN-major in shared memory; N is V's head dim (`dv`), split between `col_warpgroups`."""
    dtype = element_type(traits)
    return sm90.make_trivial_tiled_mma(dtype, dtype, cute.nvgpu.OperandMajorMode.K, cute.nvgpu.OperandMajorMode.MN,
                                       cutlass.Float32, (traits.row_warpgroups, traits.col_warpgroups, 1),
                                       (WGMMA_M, traits.dv_wg), a_source=warpgroup.OperandSource.RMEM)


def p_operand(acc_s, dtype):
    """P = the S accumulator converted to `dtype`, laid out as P V's register A operand."""
    view = acc_as_operand_a(acc_s)  # ((2, 2, 2), MMA_M, MMA_K) fp32
    p = cute.make_rmem_tensor(view.layout, dtype)
    p.store(view.load().to(dtype))
    return p


def o_copy_steps(head_dim: int) -> int:
    """16-byte copies each thread of a warpgroup makes to move its (64, head_dim) tile of O
    (packed batches, kernels/sm90/fwd.py:copy_o_rows)."""
    return WGMMA_M * head_dim * ELEMENT_BYTES // 16 // 128


def o_copy_coord(thread, step, head_dim: int):
    """(row, 16-byte chunk) of a warpgroup's (64, head_dim) O tile that its thread `thread`
    copies at step `step` < o_copy_steps: a flat index over (row, chunk), so every head dim's
    tile is covered once (layouts/verify_hopper.py:o_copy_checks). Integer-generic: Python
    ints, numpy arrays or DSL integers."""
    chunks = head_dim * ELEMENT_BYTES // 16
    flat = thread + 128 * step
    return flat // chunks, flat % chunks


def acc_as_operand_a(acc):
    """The (MMA, MMA_M, MMA_N) fp32 accumulator of a wgmma, viewed as the register A operand
    ((2, 2, 2), MMA_M, MMA_N / 16) of the next one: a thread's accumulator values come in
    groups of (2 columns, 2 row halves) per 8 columns, and an A fragment takes two such groups
    per 16-wide k step, so the same registers serve without moving (the m64nNk16 layouts)."""
    n8 = cute.size(acc.shape[0]) // 4
    return cute.make_tensor(acc.iterator, cute.make_layout(((2, 2, 2), cute.size(acc.shape[1]), n8 // 2),
                                                           stride=((1, 2, 4), 4 * n8, 8)))


# The backward (kernels/sm90/bwd.py). One CTA owns block_n keys, a consumer warpgroup per 64 of
# them (above d 128, `bwd_splits_head_dim`: 64 keys and two warpgroups splitting the head dim,
# below); it walks block_m-row query blocks. S and dP are computed transposed (S^T = K Q^T, keys
# on the wgmma's M), so each warpgroup's P^T and dS^T sit in its accumulators in the layout of
# the register A operand of dV += P^T dO and dK += dS^T Q: neither goes through shared memory
# for those GEMMs. dQ = dS K needs dS whole (every key of the block): dS^T goes to a (block_n,
# block_m) row-major tile, read back transposed as dQ's MN-major A operand. MLA's 96-key tiles
# (`bwd_keys_on_n`) compute S and dP with the queries on M and dK^T, dV^T with the head dim on M;
# P and dS go to (block_m, block_n) tiles as the S accumulators lie (`smem_layout_ds`).

BWD_STAGES = 2  # dS^T (and P^T), and the Q and dO pipelines unless the traits' q_stages is 1
BWD_HEAD_DIMS = (32, 64, 96, 128, 192, 256)
# head-dim bucket -> the Hopper backward bucket that runs it: 160 on the d 192 tiles, 224 on the d 256
# ones, their columns past the head dim zero (as d 97..127 run on the d 128 tiles)
BWD_SERVES = {32: 32, 64: 64, 96: 96, 128: 128, 160: 192, 192: 192, 224: 256, 256: 256}


@functools.lru_cache(maxsize=None)
def choose_hopper_bwd_traits(head_dim: int, dtype: str = "bf16", head_dim_v: int | None = None) -> BwdTraits:
    """The Hopper backward's tiles (BwdTraits; its SM80 warp grids only shape the dQ convert's
    copies): 128 keys per CTA (64 above d 128, `bwd_splits_head_dim`; 96 for MLA's 192 / 128,
    `bwd_keys_on_n`: 1.09-1.17x forward + backward, where d 192 with V 192 ran 1.01x at best,
    docs/tuning/backward.md, "d 192 on 96-key tiles"); query blocks of 128 rows at d 32, 64
    above, the faster of the two at each (docs/tuning/backward.md, "The Hopper backward"; the
    policy's tiles, `policy.hopper_bwd_dq`, may differ: d 64 on 128 rows with
    `bwd_dk_reads_smem`, d 192 on 96 keys with one dO stage); d 96 on tiles of its
    own (1.10-1.16x the d 128 tiles it took before, backward alone: "d 96 on tiles of its
    own"); the buckets 160 and 224 on the d 192 and 256 tiles (`BWD_SERVES`). Q and dO take two
    stages where they fit beside the dQ staging tile, else one. A V head dim of its own
    (`head_dim_v`, a pair of `VALUE_DIM_PAIRS`): the tiles of head_dim, V's, dO's and dV's
    `head_dim_v` wide."""
    dv = None
    if head_dim_v is not None and head_dim_bucket(head_dim_v) != head_dim_bucket(head_dim):
        dv = head_dim_bucket(head_dim_v)
        if (head_dim_bucket(head_dim), dv) not in VALUE_DIM_PAIRS:
            raise ValueError(f"the Hopper backward takes a V head dim of its own in {VALUE_DIM_PAIRS}, not "
                             f"{(head_dim_bucket(head_dim), dv)}")
    d = BWD_SERVES.get(head_dim_bucket(head_dim))
    if d is None:
        raise ValueError(f"the Hopper backward takes head-dim buckets {tuple(BWD_SERVES)}, not "
                         f"{head_dim_bucket(head_dim)}")
    if d == 32:
        return BwdTraits(d, 128, 128, 8, 4, 4, 4, dtype=dtype, head_dim_v=dv)
    if d > 128:  # 64 keys; MLA's 192 / 128 96 (FA3's tiles, `bwd_keys_on_n`)
        t = BwdTraits(d, 64, 96 if dv is not None else 64, 8, 4, 2, 2, dtype=dtype, head_dim_v=dv)
        return t if bwd_smem_bytes(t) <= SMEM_LIMIT[90] else replace(t, q_stages=1)
    return BwdTraits(d, 64, 128, 8, 2, 4, 4 if d in (64, 96) else 2, dtype=dtype, head_dim_v=dv)  # d 96: FA2's grids


def shipped_hopper_bwd_traits() -> list[BwdTraits]:
    return ([choose_hopper_bwd_traits(d, dt) for d in BWD_HEAD_DIMS for dt in DTYPES]
            + [choose_hopper_bwd_traits(d, dt, dv) for d, dv in VALUE_DIM_PAIRS for dt in DTYPES])


def bwd_splits_head_dim(traits) -> bool:
    """Above d 128 one warpgroup cannot hold dK and dV of 64 keys (2 x 64 x d fp32 over 128
    threads: 256 registers at d 256), so two warpgroups share a CTA's keys: 64 keys, every GEMM
    split along N (S^T and dP^T by queries, dK, dV and dQ by head-dim columns), or 96 keys
    (`bwd_keys_on_n`). P^T and dS^T go through shared memory, where dV and dK read them as
    operands."""
    return traits.head_dim > 128


def bwd_keys_on_n(traits) -> bool:
    """96 keys a CTA (MLA's 192 / 128, FA3's tiles), not a multiple of a warpgroup's 64 rows: S
    and dP with queries on wgmma's M and the keys on N, 48 a warpgroup; dK^T and dV^T with the
    head dim on M and the warpgroup's 48 keys on N (P and dS from shared memory, as the S
    accumulators lie, as MN-major B operands); dQ split by head-dim columns as on the 64-key
    tiles."""
    return traits.block_n % WGMMA_M != 0


def bwd_dk_reads_smem(traits) -> bool:
    """dK += dS^T Q with dS^T from its shared-memory tile (there for dQ anyway) rather than
    from registers: above d 128 (`bwd_splits_head_dim`, dS^T read whole) and on 128-row query
    blocks, where S^T and dP^T take 64 registers each and dS^T's 32 more as dK's A serialized
    the wgmmas (ptxas C7512, d 64)."""
    return bwd_splits_head_dim(traits) or traits.block_m > WGMMA_M


def bwd_ds_stages(traits) -> int:
    """Stages of dS^T (and P^T): one of dS and P on the 96-key tiles (two do not fit beside two
    Q / dO stages and the dQ staging tile; a named barrier orders a stage's reuse), else
    `BWD_STAGES`."""
    return 1 if bwd_keys_on_n(traits) else BWD_STAGES


def bwd_atom_cols(traits, cols: int | None = None) -> int:
    """The columns a backward tile `cols` wide (the head dim unless given: V's and dO's are
    `dv`) picks its swizzle atom for: a warpgroup's share where the warpgroups split the head
    dim (its wgmma operands must start on an atom: d 192's 96 columns take 32-column atoms),
    d 96's share of dQ (48 columns: 16-column atoms, K being dQ's B operand), else `cols`."""
    cols = cols or traits.head_dim
    if cols == 96 and not bwd_splits_head_dim(traits):
        return 48
    return cols // 2 if bwd_splits_head_dim(traits) else cols


def bwd_smem_layout(traits, rows: int, stages: int | None = None, cols: int | None = None):
    """(rows, cols) or (rows, cols, stages) row-major tile of the backward (cols the head dim
    unless given) in the swizzle atom of `bwd_atom_cols` (up to d 128 `smem_layout` /
    `smem_layout_staged`'s)."""
    cols = cols or traits.head_dim
    atom = row_major_atom(element_type(traits), bwd_atom_cols(traits, cols))
    if stages is None:
        return cute.tile_to_shape(atom, (rows, cols), order=(0, 1))
    return cute.tile_to_shape(atom, (rows, cols, stages), order=(0, 1, 2))


def bwd_smem_bytes(traits, staging: bool = True) -> int:
    """The backward's shared memory: Q and LSE (q_stages each), dO and D (`stages_do` each), K,
    V, dS^T (`bwd_ds_stages`; P^T too above d 128), the fp32 dQ staging tile unless dQ goes out
    by atomics (`staging`) and the mbarriers."""
    t = traits
    staged = 2 if bwd_splits_head_dim(t) else 1  # dS^T, and P^T
    tiles = ELEMENT_BYTES * (t.q_stages * t.block_m * t.head_dim + t.stages_do * t.block_m * t.dv
                             + t.block_n * (t.head_dim + t.dv) + staged * bwd_ds_stages(t) * t.block_n * t.block_m)
    dq = 4 * t.block_m * t.head_dim if staging else 0
    stages = t.q_stages + t.stages_do
    return tiles + dq + 4 * stages * t.block_m + 8 * (1 + 2 * stages)


def bwd_warpgroups(traits) -> int:
    """Consumer warpgroups of the backward: one per 64 keys, or two splitting the head dim."""
    return 2 if bwd_splits_head_dim(traits) else traits.block_n // WGMMA_M


def smem_layout_ds(traits, stages: int):
    """(block_n, block_m, stages): dS^T, keys as rows, each row's block_m queries contiguous and
    swizzled as a GMMA row-major tile (the S^T accumulators' own orientation). On the 96-key
    tiles (`bwd_keys_on_n`) (block_m, block_n, stages): dS itself, as the S accumulators lie,
    each row's keys contiguous in atoms of a warpgroup's 48 (32-byte swizzle, 16 keys an atom),
    so that each warpgroup's keys start on an atom: pairs of keys go out as 32-bit stores."""
    if bwd_keys_on_n(traits):
        return cute.tile_to_shape(row_major_atom(element_type(traits), traits.block_n // 2),
                                  (traits.block_m, traits.block_n, stages), order=(0, 1, 2))
    return cute.tile_to_shape(row_major_atom(element_type(traits), traits.block_m),
                              (traits.block_n, traits.block_m, stages), order=(0, 1, 2))


def tiled_mma_sdp_t(traits):
    """S^T = K Q^T and dP^T = V dO^T: (block_n, block_m) tiles, both operands K-major (the head
    dim contiguous), a warpgroup per 64 keys. On the 96-key tiles (`bwd_keys_on_n`) S = Q K^T
    and dP = dO V^T instead: (block_m, block_n), the warpgroups taking half the keys each."""
    dtype = element_type(traits)
    atoms, tiler = (bwd_warpgroups(traits), 1, 1), (WGMMA_M, traits.block_m)
    if bwd_keys_on_n(traits):
        atoms, tiler = (1, 2, 1), (WGMMA_M, traits.block_n // 2)
    elif bwd_splits_head_dim(traits):  # the warpgroups take half the queries each
        atoms, tiler = (1, 2, 1), (WGMMA_M, traits.block_m // 2)
    return sm90.make_trivial_tiled_mma(dtype, dtype, cute.nvgpu.OperandMajorMode.K, cute.nvgpu.OperandMajorMode.K,
                                       cutlass.Float32, atoms, tiler)


def bwd_scores_shape(traits) -> tuple:
    """The (M, N) tile of `tiled_mma_sdp_t`: (block_n, block_m) keys by queries, or on the
    96-key tiles (block_m, block_n)."""
    if bwd_keys_on_n(traits):
        return traits.block_m, traits.block_n
    return traits.block_n, traits.block_m


def tiled_mma_dkv(traits, cols: int | None = None, a_smem: bool = False):
    """dV += P^T dO and dK += dS^T Q: (block_n, cols), cols the head dim unless given (dV's are
    `dv`); A from registers (the converted S^T / dP^T accumulators; above d 128 from their
    shared-memory tiles), B = dO^T / Q^T read MN-major from their row-major tiles. On the
    96-key tiles (`bwd_keys_on_n`) transposed: dV^T += dO^T P and dK^T += Q^T dS, (cols,
    block_n), A = dO^T / Q^T MN-major, B = P / dS MN-major from their (block_m, block_n) tiles
    (`smem_layout_ds`), each warpgroup its own 48 keys. a_smem: A from its shared-memory tile
    up to d 128 too (`tiled_mma_dk`, on 128-row query blocks)."""
    dtype = element_type(traits)
    cols = cols or traits.head_dim
    if bwd_keys_on_n(traits):
        return sm90.make_trivial_tiled_mma(dtype, dtype, cute.nvgpu.OperandMajorMode.MN,
                                           cute.nvgpu.OperandMajorMode.MN, cutlass.Float32, (1, 2, 1),
                                           (WGMMA_M, traits.block_n // 2))
    if bwd_splits_head_dim(traits):  # A = P^T / dS^T whole from shared memory, half the columns each
        return sm90.make_trivial_tiled_mma(dtype, dtype, cute.nvgpu.OperandMajorMode.K,
                                           cute.nvgpu.OperandMajorMode.MN, cutlass.Float32, (1, 2, 1),
                                           (WGMMA_M, cols // 2))
    source = {} if a_smem else dict(a_source=warpgroup.OperandSource.RMEM)
    return sm90.make_trivial_tiled_mma(dtype, dtype, cute.nvgpu.OperandMajorMode.K, cute.nvgpu.OperandMajorMode.MN,
                                       cutlass.Float32, (bwd_warpgroups(traits), 1, 1), (WGMMA_M, cols), **source)


def tiled_mma_dk(traits):
    """dK's `tiled_mma_dkv`: A = dS^T from shared memory where `bwd_dk_reads_smem`."""
    return tiled_mma_dkv(traits, a_smem=bwd_dk_reads_smem(traits))


def bwd_dkv_shape(traits, cols: int | None = None) -> tuple:
    """The (M, N) tile of `tiled_mma_dkv(traits, cols)`: (block_n, cols), or (cols, block_n)
    on the 96-key tiles."""
    cols = cols or traits.head_dim
    return (cols, traits.block_n) if bwd_keys_on_n(traits) else (traits.block_n, cols)


def tiled_mma_dq(traits):
    """dQ = dS K: (block_m, head_dim), A = dS (the dS^T tile read MN-major; on the 96-key tiles
    the dS tile, K-major), B = K^T (MN-major). The warpgroups split dQ's rows where there are
    64 per warpgroup (block_m 128), else its columns."""
    dtype = element_type(traits)
    wgs = bwd_warpgroups(traits)
    if traits.block_m >= WGMMA_M * wgs:
        atoms, tiler = (wgs, 1, 1), (WGMMA_M, traits.head_dim)
    else:
        atoms, tiler = (1, wgs, 1), (WGMMA_M, traits.head_dim // wgs)
    a_major = cute.nvgpu.OperandMajorMode.K if bwd_keys_on_n(traits) else cute.nvgpu.OperandMajorMode.MN
    return sm90.make_trivial_tiled_mma(dtype, dtype, a_major, cute.nvgpu.OperandMajorMode.MN, cutlass.Float32, atoms,
                                       tiler)
