"""Split-KV (Flash-Decoding): several CTAs share one tile's key blocks, each writes a partial
result, and the last to finish merges them (flash-attn 2's flash_fwd_splitkv_combine_kernel,
run inside the split kernel). The device side of splits is here: the workspace layout the host
allocates, each CTA's partials and arrival counter, stream-K's shares, and the merge; how many
splits a call takes is `cute_flash.launch.policy.split_choice`.

Split s saw keys K_s and wrote O_s = softmax over K_s times V and LSE_s = log sum_{K_s} exp(s)
(-inf when K_s was empty). The full row is LSE = log sum_s exp(LSE_s) and O = sum_s
exp(LSE_s - LSE) O_s: a weighted sum, no second pass over keys. A row no split saw keeps O = 0
and LSE = +inf, the unsplit kernel's convention.

It runs inside the split-KV kernel, not as a kernel of its own: the CTA that finishes last among
the splits of a tile (`SplitKV.merge`) merges that tile's rows while the others exit. The Hopper
KV-cache entry, at most 8 splits, launches a tile's splits as one thread-block cluster instead
(`ClusterMerge`): partials stay in each CTA's shared memory and rank 0 merges them through
distributed shared memory, with no workspace, fence or counter in global memory. Stream-K
(`StreamSplit`, the Hopper entry) gives each tile as many CTAs as its share of the grid, one CTA
an SM taking the end of one tile and the start of the next, merged as `SplitKV` merges.
Merging in the kernel saves a launch per decode step, which at small batches costs more host
time than the whole GPU work.

Tile: kHeadDim / 4 threads per row, each owning 4 columns (one 128-bit load per split), so a
128-thread CTA merges 128 / (kHeadDim / 4) rows per pass. Every thread of a row accumulates
exp(LSE_s - m) and exp(LSE_s - m) O_s in one pass over the splits, m the running max of the
LSEs seen (the sums rescaled when it grows, as the softmax's are), so each split's LSE and O
loads issue together. The loop is unrolled so that the loads of several splits are in flight at
once: a rolled loop waits one L2 round trip per split (docs/tuning/decode-splits.md, "The split
merge in one pass, without per-thread fences, with 128-bit DSMEM loads").
"""
import re
import warnings
from dataclasses import dataclass

import cutlass
import cutlass.cute as cute
from cutlass._mlir.dialects import llvm
from cutlass.base_dsl.ast_helpers import DSLOptimizationWarning
from cutlass.cutlass_dsl import T, dsl_user_op

from cute_flash.kernels.common.constants import LN2, LOG2E

VEC = 4  # fp32 columns per thread: one 128-bit load
UNROLL = 8  # splits whose loads are issued together

# The column loops over a thread's register tile (partial O) stay static (range_constexpr), 64
# iterations where a tile is wide: each column is its own register. As dynamic loops
# (cutlass.range(..., unroll_full=True)) they grew the PTX of sm_90a kernels, so the DSL's advice
# for long static loops is silenced for this module only (docs/tuning/decode-splits.md, "Numbers
# moved out of docstrings").
warnings.filterwarnings("ignore", category=DSLOptimizationWarning, module=re.escape(__name__) + "$")


def workspace_shapes(num_splits: int, batch: int, heads: int, rows: int, head_dim: int, m_blocks: int):
    """(partial O, partial LSE, arrival counters) shapes of one split launch: partials by (split,
    batch, head, row) -- rows and heads as the kernel tiles them -- and one int32 counter per
    (batch, head, m-block) tile, zero at launch and left zero by the kernel."""
    return ((num_splits, batch, heads, rows, head_dim), (num_splits, batch, heads, rows),
            (m_blocks * batch * heads,))


@dataclass(frozen=True)
class StreamSplit:
    """Stream-K split-KV: `ctas` CTAs share the key blocks of `tiles` tiles evenly, as if the
    tiles lay end to end, so a CTA may finish one tile's blocks and start the next tile's. Equal
    splits come in steps of the tile count (88 tiles: 88 or 176 CTAs for 132 SMs, where the
    split rule took 11-12 splits over many waves); one CTA an SM sharing everything keeps every
    SM streaming keys to the end, faster than those splits (docs/tuning/decode-splits.md, "Stream-K
    in place of many waves of splits"). Each tile is `ctas` units long and each CTA takes `tiles`
    units: CTA c covers units [c tiles, (c + 1) tiles) of tiles x ctas, and its share of tile t
    is the part of [t ctas, (t + 1) ctas) inside them, cut into key blocks in proportion (so
    tiles of unequal key counts split as the equal splits do). A tile's CTAs are numbered
    within it (split_idx) and merge through the workspace as `SplitKV`'s equal splits do.
    Integer arithmetic only: the host (workspace size, tests) runs the same methods on ints."""
    tiles: object  # Int32 (batch, head, m-block) tiles
    ctas: object   # Int32 CTAs the grid launches

    def tiles_of(self, cta):
        """[first, end): the tiles CTA `cta` has a share of."""
        return cta * self.tiles // self.ctas, ((cta + 1) * self.tiles - 1) // self.ctas + 1

    def splits_of(self, tile):
        """(first CTA, CTAs) sharing tile `tile`."""
        first = tile * self.ctas // self.tiles
        return first, ((tile + 1) * self.ctas - 1) // self.tiles - first + 1

    def share(self, cta, tile, n_block_min, n_block_max):
        """[lo, hi): CTA `cta`'s key blocks of tile `tile`, whose blocks are [n_block_min,
        n_block_max); empty where the tile has fewer blocks than CTAs."""
        start = tile * self.ctas
        lo_unit = cutlass.max(cta * self.tiles, start) - start  # in [0, ctas]
        hi_unit = cutlass.min((cta + 1) * self.tiles, start + self.ctas) - start
        blocks = cutlass.max(n_block_max - n_block_min, 0)
        return n_block_min + lo_unit * blocks // self.ctas, n_block_min + hi_unit * blocks // self.ctas

    def max_splits(self) -> int:
        """The most CTAs any tile has (host ints): the workspace's split dimension."""
        return max(self.splits_of(t)[1] for t in range(self.tiles))


@dataclass(frozen=True)
class SplitKV:
    """One split CTA's share of the workspace. Held by the kernel (composition): methods of a
    frozen dataclass trace like the kernel's own methods, which a run-time `if` needs (a
    module-level jit function with run-time loops called inside one was re-traced badly by the
    DSL: "requires a code object with 0 free vars, not 2")."""
    mOpart: cute.Tensor        # (seqlen_q, kHeadDim) fp32: this split's normalised O
    mLSEpart: cute.Tensor      # (seqlen_q,) fp32: its LSE, -inf where it saw no key
    mOaccum_bh: cute.Tensor    # (num_splits, seqlen_q, kHeadDim): every split's O of this (batch, head)
    mLSEaccum_bh: cute.Tensor  # (num_splits, seqlen_q)
    counter: object            # pointer to this tile's int32 arrival counter
    num_splits: object
    block_m: int
    head_dim: int              # kHeadDim
    num_threads: int           # the threads that store, merge and synchronise (the CTA's, or its consumers')
    barrier_id: int            # 0: the whole CTA's barrier; else a named barrier over num_threads

    @staticmethod
    def make(mOaccum: cute.Tensor, mLSEaccum: cute.Tensor, mCounters: cute.Tensor, split_idx, num_splits,
             tile: tuple, traits, num_m_blocks, barrier_id: int = 0):
        """tile: (m_block, batch, head, heads) of this CTA; num_m_blocks: query blocks per (batch,
        head). mOaccum (num_splits, batch, heads, seqlen_q, kHeadDim), mLSEaccum (num_splits,
        batch, heads, seqlen_q), mCounters (m_blocks * batch * heads,). traits: FwdTraits, or the
        Hopper kernel's (its num_threads: the consumers, which then synchronise on named barrier
        barrier_id while the producer warps stay out)."""
        m_block, bidb, bidh, nheads = tile
        return SplitKV(mOaccum[split_idx, bidb, bidh, None, None], mLSEaccum[split_idx, bidb, bidh, None],
                       mOaccum[None, bidb, bidh, None, None], mLSEaccum[None, bidb, bidh, None],
                       mCounters.iterator + (bidb * nheads + bidh) * num_m_blocks + m_block, num_splits,
                       traits.block_m, traits.head_dim, traits.num_threads, barrier_id)

    @cute.jit
    def sync(self):
        if cutlass.const_expr(self.barrier_id == 0):
            cute.arch.barrier()
        else:
            cute.arch.barrier(barrier_id=self.barrier_id, number_of_threads=self.num_threads)

    @cute.jit
    def store_partial(self, acc_o_mn: cute.Tensor, lse: cute.Tensor, tOcO_mn: cute.Tensor, m_block, rows_q):
        """This split's normalised fp32 O and its LSE, straight from the accumulator: decode tiles
        have few rows, so the smem staging of the unsplit store would buy nothing."""
        row0 = m_block * self.block_m
        for r in cutlass.range_constexpr(cute.size(acc_o_mn.shape[0])):
            row = tOcO_mn[r, 0][0]
            if row < rows_q:
                for c in cutlass.range_constexpr(cute.size(acc_o_mn.shape[1])):
                    self.mOpart[row0 + row, tOcO_mn[0, c][1]] = acc_o_mn[r, c]
                if tOcO_mn[0, 0][1] == 0:
                    self.mLSEpart[row0 + row] = lse[r]

    @cute.jit
    def merge(self, mO_s: cute.Tensor, mLSE_s: cute.Tensor, sRank: cute.Tensor, m_block, rows_q, tidx):
        """The split CTA of this tile that arrives last merges every split's partials into O and
        LSE; the others just leave. One thread counts the CTA's arrival with an acquire-release
        atomic after a CTA barrier: the barrier orders the CTA's partial stores before that
        release, which carries them to the GPU (the release is cumulative), and in the last
        CTA it orders the acquire before every thread's loads of the others' partials. The
        last arrival also re-arms the counter for the next launch. tidx: the thread's index
        among num_threads; sRank: an int32 of shared memory no thread reads meanwhile (the
        first element of a tensor), where the rank goes to every thread."""
        bm = self.block_m
        self.sync()  # also: every thread is done with sRank's memory (the SM80 kernel's sQ)
        if tidx == 0:
            sRank[0] = cute.arch.atomic_add(self.counter, cutlass.Int32(1), sem="acq_rel", scope="gpu")
        self.sync()
        if sRank[0] == self.num_splits - 1:
            if tidx == 0:
                cute.make_tensor(self.counter, cute.make_layout(1))[0] = cutlass.Int32(0)
            row0 = m_block * bm
            self.combine_tile(cute.domain_offset((0, row0, 0), self.mOaccum_bh),
                              cute.domain_offset((0, row0), self.mLSEaccum_bh), cute.domain_offset((row0, 0), mO_s),
                              cute.domain_offset((row0,), mLSE_s), cutlass.min(rows_q, bm), tidx)

    @cute.jit
    def combine_tile(self, mOaccum: cute.Tensor, mLSEaccum: cute.Tensor, mO: cute.Tensor, mLSE: cute.Tensor,
                     rows, tidx):
        """Merge `rows` rows. mOaccum (splits, rows, kHeadDim) and mLSEaccum (splits, rows) fp32
        partials, of which the tile's num_splits are read (a stream-K workspace holds as many
        as the tile with the most); mO (rows, d <= kHeadDim) and mLSE (rows,) fp32, any strides."""
        tpr = self.head_dim // VEC  # threads per row
        partials = GlobalPartials(mOaccum, mLSEaccum)
        for i in cutlass.range(tidx // tpr, rows, self.num_threads // tpr, unroll=1):
            partials.merge_row(self.num_splits, i, tidx % tpr, mO, mLSE)


@dataclass(frozen=True)
class ClusterMerge:
    """Split-KV inside a thread-block cluster (the Hopper KV-cache entry, at most 8 splits): the
    splits of a tile are the CTAs of one cluster, each leaves its partials in its own shared
    memory, and cluster rank 0 reads them all through distributed shared memory and merges
    them, with no workspace, fence or arrival counter in global memory. Two cluster barriers:
    the partials are written (every CTA is then also known to be running), and rank 0 is done
    reading (no CTA may leave while its shared memory is read)."""
    sOpart: cute.Tensor   # (block_m, kHeadDim) fp32: this CTA's normalised O (K's stages, idle by then)
    sLSEpart: cute.Tensor  # (block_m,) fp32: its LSE, -inf where it saw no key (V's stages)
    num_splits: object
    block_m: int
    head_dim: int
    num_threads: int       # the consumer threads, which store and merge

    @staticmethod
    def make(k_stages, v_stages, num_splits, traits):
        """k_stages / v_stages: raw (unswizzled) pointers to K's and V's stages, which hold at
        least block_m x kHeadDim fp32 (2 block_m <= block_n x stages) and block_m fp32."""
        bm, d = traits.block_m, traits.head_dim
        sOpart = cute.make_tensor(cute.recast_ptr(k_stages, dtype=cutlass.Float32),
                                  cute.make_layout((bm, d), stride=(d, 1)))
        sLSEpart = cute.make_tensor(cute.recast_ptr(v_stages, dtype=cutlass.Float32), cute.make_layout(bm))
        return ClusterMerge(sOpart, sLSEpart, num_splits, bm, d, traits.num_threads)

    @cute.jit
    def store_partial(self, acc_o_mn: cute.Tensor, lse: cute.Tensor, tOcO_mn: cute.Tensor):
        """This split's normalised fp32 O and LSE into its own shared memory, every row."""
        for r in cutlass.range_constexpr(cute.size(acc_o_mn.shape[0])):
            row = tOcO_mn[r, 0][0]
            for c in cutlass.range_constexpr(cute.size(acc_o_mn.shape[1])):
                self.sOpart[row, tOcO_mn[0, c][1]] = acc_o_mn[r, c]
            if tOcO_mn[0, 0][1] == 0:
                self.sLSEpart[row] = lse[r]

    @cute.jit
    def merge(self, mO: cute.Tensor, mLSE: cute.Tensor, rows, tidx):
        """Rank 0 merges `rows` rows into mO (rows, d <= kHeadDim) and mLSE (rows,), the
        others wait for it; every consumer thread of every CTA calls this (the producer
        warpgroup passes the same two barriers, `cluster_sync`)."""
        cluster_sync()  # every split's partials are in its shared memory
        if cute.arch.block_idx_in_cluster() == 0:
            tpr = self.head_dim // VEC  # threads per row
            partials = ClusterPartials(self.sOpart, self.sLSEpart)
            for i in cutlass.range(tidx // tpr, rows, self.num_threads // tpr, unroll=1):
                partials.merge_row(self.num_splits, i, tidx % tpr, mO, mLSE)
        cluster_sync()  # rank 0 is done reading the others' shared memory


class SplitPartials:
    """Every split's partials of a tile, as a merge reads them: the global workspace
    (`GlobalPartials`, `SplitKV.combine_tile`) or the cluster's shared memories
    (`ClusterPartials`, `ClusterMerge.merge`). A subclass says how to read split s's LSE and O
    chunk of row i; the merge of a row is this one."""

    @cute.jit
    def merge_row(self, num_splits, i, chunk, mO: cute.Tensor, mLSE: cute.Tensor):
        """Row i, this thread's columns chunk * VEC..: sum_s w_s O_s and sum_s w_s with w_s =
        exp2(LSE_s log2(e) - ref), in one pass over the splits: ref is the running max of the
        LSEs seen (0 while all are -inf: every weight is then exp2(-inf) = 0, and a row no
        split saw keeps sum 0 and gets LSE +inf), and the sums are rescaled when it grows, as
        the softmax's are. One pass issues each split's LSE and O loads together; a first pass
        for the max waited for the LSEs before any O load. `write_merged_row` divides."""
        max_log2 = -cutlass.Float32.inf
        ref = cutlass.Float32(0.0)
        total = cutlass.Float32(0.0)
        acc = cute.make_rmem_tensor((VEC,), cutlass.Float32)
        acc.fill(0.0)
        part = cute.make_rmem_tensor((VEC,), cutlass.Float32)
        for s in cutlass.range(num_splits, unroll=UNROLL):
            lse_log2 = self.lse(s, i) * LOG2E
            self.load_o(s, i, chunk, part)
            seen_log2 = max_log2
            max_log2 = cute.arch.fmax(max_log2, lse_log2)
            ref = 0.0 if max_log2 == -cutlass.Float32.inf else max_log2
            rescale = cute.math.exp2(seen_log2 - ref, fastmath=True)  # <= 1; 0 before any split
            weight = cute.math.exp2(lse_log2 - ref, fastmath=True)
            total = total * rescale + weight
            for v in cutlass.range_constexpr(VEC):
                acc[v] = acc[v] * rescale + weight * part[v]
        write_merged_row(mO, mLSE, i, chunk, acc, total, ref)


@dataclass(frozen=True)
class GlobalPartials(SplitPartials):
    """The workspace's partials of a tile: mOaccum (num_splits, rows, kHeadDim), mLSEaccum
    (num_splits, rows) fp32."""
    mOaccum: cute.Tensor
    mLSEaccum: cute.Tensor

    @cute.jit
    def lse(self, s, i):
        return self.mLSEaccum[s, i]

    @cute.jit
    def load_o(self, s, i, chunk, part: cute.Tensor):
        """part (VEC,) <- split s's columns chunk * VEC.. of row i, one 128-bit load."""
        cute.autovec_copy(cute.local_tile(self.mOaccum[s, i, None], (VEC,), (chunk,)), part)


@dataclass(frozen=True)
class ClusterPartials(SplitPartials):
    """The partials in the shared memory of each CTA of a cluster (`ClusterMerge`), split s in
    rank s's, at the addresses of this CTA's sOpart (block_m, kHeadDim) and sLSEpart (block_m,):
    distributed shared memory takes no tensor loads, so each value goes through its pointer."""
    sOpart: cute.Tensor
    sLSEpart: cute.Tensor

    @cute.jit
    def lse(self, s, i):
        return remote_f32(self.sLSEpart.iterator + i, s)

    @cute.jit
    def load_o(self, s, i, chunk, part: cute.Tensor):
        """part (VEC,) <- split s's columns chunk * VEC.. of row i, one 128-bit load (16-byte
        aligned: rows of kHeadDim fp32 from the start of K's stages)."""
        values = remote_f32x4(self.sOpart.iterator + i * self.sOpart.shape[1] + chunk * VEC, s)
        for v in cutlass.range_constexpr(VEC):
            part[v] = values[v]


@cute.jit
def write_merged_row(mO: cute.Tensor, mLSE: cute.Tensor, i, chunk, acc: cute.Tensor, total, max_log2):
    """Row i of a merge (`SplitPartials.merge_row`) from its weighted sums:
    acc (VEC,) = sum_s w_s O_s over this thread's columns chunk * VEC.., total = sum_s w_s with
    w_s = exp2(LSE_s log2(e) - max_log2). O = acc / total, LSE = ln(total) + max; a row no split
    saw (total 0, or NaN) gets O = 0 and LSE = +inf."""
    empty = total == 0.0 or total != total
    inv = 0.0 if empty else cute.arch.rcp_approx(total)
    if chunk * VEC < mO.shape[1]:
        out = cute.make_rmem_tensor((VEC,), mO.element_type)
        out.store((acc.load() * inv).to(mO.element_type))
        cute.autovec_copy(out, cute.local_tile(mO[i, None], (VEC,), (chunk,)))
    if chunk == 0:
        mLSE[i] = cutlass.Float32.inf if empty else (cute.math.log2(total, fastmath=True) + max_log2) * LN2


@dsl_user_op
def remote_f32(ptr, rank, *, loc=None, ip=None) -> cutlass.Float32:
    """The fp32 at `ptr` (this CTA's shared memory) in cluster CTA `rank`'s shared memory:
    `ld.shared::cluster` on the mapped address (the DSL's loads take no distributed shared
    memory pointer). A side effect, so that it stays after the cluster barrier."""
    remote = cute.arch.map_dsmem_ptr(ptr, rank, loc=loc, ip=ip)
    addr = llvm.ptrtoint(T.i32(), remote.to_llvm_ptr(loc=loc, ip=ip), loc=loc, ip=ip)
    return cutlass.Float32(llvm.inline_asm(T.f32(), [addr], "ld.shared::cluster.f32 $0, [$1];", "=f,r",
                                           has_side_effects=True, is_align_stack=False,
                                           asm_dialect=llvm.AsmDialect.AD_ATT))


@dsl_user_op
def remote_f32x4(ptr, rank, *, loc=None, ip=None) -> tuple:
    """The 4 fp32 at `ptr` (16-byte aligned, this CTA's shared memory) in cluster CTA `rank`'s
    shared memory, one `ld.shared::cluster.v4.f32` (as `remote_f32`)."""
    remote = cute.arch.map_dsmem_ptr(ptr, rank, loc=loc, ip=ip)
    addr = llvm.ptrtoint(T.i32(), remote.to_llvm_ptr(loc=loc, ip=ip), loc=loc, ip=ip)
    quad = llvm.inline_asm(llvm.StructType.get_literal([T.f32()] * VEC), [addr],
                           "ld.shared::cluster.v4.f32 {$0, $1, $2, $3}, [$4];", "=f,=f,=f,=f,r",
                           has_side_effects=True, is_align_stack=False, asm_dialect=llvm.AsmDialect.AD_ATT)
    return tuple(cutlass.Float32(llvm.extractvalue(T.f32(), quad, [v], loc=loc, ip=ip)) for v in range(VEC))


@cute.jit
def cluster_sync():
    """Every non-exited thread of the cluster arrives, then waits for all the others."""
    cute.arch.cluster_arrive()
    cute.arch.cluster_wait()
