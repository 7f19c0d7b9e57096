"""The compile-time configuration of a forward kernel: one hashable value per compiled variant.

`FwdConfig` names every choice a kernel is specialised on (traits, which carry the dtype, and
each feature flag by name); everything else (lengths, strides, scales, window sizes, the split
count) is a run-time argument. The config is the compile key (with the target arch), builds the
fake arguments a compile needs, and names the variant in `python -m cute_flash compile`. Pure
Python: the dispatcher and the tests read it without the DSL.
"""
from __future__ import annotations

from dataclasses import dataclass, fields

from layouts.traits import SMEM_LIMIT, BwdTraits, FwdTraits, tile_arch


@dataclass(frozen=True)
class FwdConfig:
    traits: FwdTraits
    # score modifiers
    has_left: bool = False        # a left window edge (local attention)
    has_right: bool = False       # a right window edge (causal is right = 0)
    has_alibi: bool = False
    has_softcap: bool = False
    has_dropout: bool = False     # P's elements dropped by the Philox mask (docs/semantics.md, Dropout)
    even_k: bool = True           # the head dim fills traits.head_dim: no column predicates
    # input form: dense (default), packed varlen, or a KV cache
    varlen: bool = False
    has_seqused_k: bool = False   # varlen: seqused_k caps each sequence's keys
    paged: bool = False           # keys through a block table (varlen or kvcache)
    any_page_size: bool = False   # paged, pages not a multiple of 16 rows: a page lookup per row
    kvcache: bool = False
    split: bool = False           # kvcache: split-KV partials merged in the same launch
    has_leftpad: bool = False     # kvcache: cache_leftpad
    has_batch_idx: bool = False   # kvcache: cache_batch_idx
    pack_gqa: bool = False        # kvcache, one query row: a GQA group's heads become query rows

    def __post_init__(self):
        if self.kvcache and self.varlen:
            raise ValueError("kvcache and varlen are two different entry points")
        if (self.split or self.has_leftpad or self.has_batch_idx) and not self.kvcache:
            raise ValueError("split, has_leftpad and has_batch_idx belong to the kvcache entry")
        if self.has_seqused_k and not self.varlen:
            raise ValueError("has_seqused_k belongs to the varlen entry (KV caches always read their lengths)")
        if self.paged and not (self.varlen or self.kvcache):
            raise ValueError("paged KV needs the varlen or kvcache entry")
        if self.paged and (self.has_leftpad or self.has_batch_idx):
            raise ValueError("a paged cache has neither leftpad nor cache_batch_idx (as in flash-attn)")
        if self.any_page_size and not self.paged:
            raise ValueError("any_page_size is a form of paged KV")
        if self.has_dropout and self.kvcache:
            raise ValueError("a KV cache is read without dropout (flash-attn's flash_attn_with_kvcache has none)")
        if self.pack_gqa and not (self.kvcache and not (self.has_left or self.has_right or self.has_alibi)):
            raise ValueError("pack_gqa folds single-row decode queries: kvcache, no window, no ALiBi")

    @property
    def entry(self) -> str:
        """Which entry point of `FlashFwd` the variant compiles: dense, varlen or kvcache."""
        return "varlen" if self.varlen else "kvcache" if self.kvcache else "dense"

    @property
    def q_head_axis(self) -> int:
        """The heads mode of q, o (and unpaged k, v): (total, heads, d) packed, else (batch, seqlen, heads, d)."""
        return 1 if self.varlen else 2

    @property
    def reads_seqused_k(self) -> bool:
        """Per-sequence key counts read from a tensor: varlen's seqused_k, a cache's cache_seqlens."""
        return self.has_seqused_k or self.kvcache

    @property
    def overlap_kv(self) -> bool:
        """KV-cache kernels are memory-bound with few key blocks per split: K[n-1] and V[n-1] stay
        in flight together (one memory latency per block instead of two), at the price of two
        more barriers per block."""
        return self.kvcache

    @property
    def paged_runs(self) -> bool:
        """Paged prefill with pages of a multiple of 16 rows: K/V gathered in runs of rows that
        share a page (KV-cache kernels share page ids across a warp instead; kv_tiles.py)."""
        return self.paged and not self.kvcache and not self.any_page_size

    @property
    def smem_bytes(self) -> int:
        return self.traits.smem_bytes

    def flags(self) -> dict:
        """The feature flags that are on, by name."""
        return {f.name: True for f in fields(self) if f.name != "traits" and getattr(self, f.name)}

    @property
    def letters(self) -> str:
        """One letter per flag field, '.' when off: the variant's name in compile reports."""
        return "".join(FLAG_LETTERS[f.name] if getattr(self, f.name) else "."
                       for f in fields(self) if f.name != "traits")

    @property
    def name(self) -> str:
        return f"{self.traits.name}-{self.letters}"


@dataclass(frozen=True)
class BwdConfig:
    """One compiled backward variant (`kernels/bwd.py`): traits and the feature flags."""
    traits: BwdTraits
    has_left: bool = False
    has_right: bool = False
    has_alibi: bool = False
    has_softcap: bool = False
    has_dropout: bool = False     # the forward's Philox mask, recomputed (kernels/philox.py)
    even_k: bool = True
    varlen: bool = False
    has_seqused_k: bool = False
    deterministic: bool = False   # dQ summed per key-block split in a fixed order, no cross-CTA atomics
    dq_vec: int = 1               # floats per dQ atomic add: 4 on sm_90 (red.global.add.v4.f32), 1 before
    dq_bulk: bool = False         # dQ staged in smem, added by one bulk reduce per warp (sm_90; `dq_reduction`)

    def __post_init__(self):
        if self.has_seqused_k and not self.varlen:
            raise ValueError("has_seqused_k belongs to the varlen entry")
        if self.dq_vec not in (1, 4):
            raise ValueError("dq_vec is 1 or 4")
        if self.dq_bulk and (self.dq_vec != 4 or self.deterministic):
            raise ValueError("dq_bulk needs dq_vec 4 (its layout) and no deterministic mode (bulk adds of one "
                             "CTA to one address are not ordered)")

    @property
    def smem_bytes(self) -> int:
        """The traits' tiles, plus the fp32 dQ staging tile with dq_bulk."""
        t = self.traits
        return t.smem_bytes + (DQ_STAGE_BYTES * t.block_m * t.head_dim if self.dq_bulk else 0)

    @property
    def entry(self) -> str:
        """Which entry point of `FlashBwd` the variant compiles: dense or varlen."""
        return "varlen" if self.varlen else "dense"

    q_head_axis = FwdConfig.q_head_axis

    def flags(self) -> dict:
        return {f.name: True for f in fields(self) if f.name not in DQ_FIELDS and getattr(self, f.name)}

    @property
    def letters(self) -> str:
        return "".join(FLAG_LETTERS[f.name] if getattr(self, f.name) else "."
                       for f in fields(self) if f.name not in DQ_FIELDS)

    @property
    def name(self) -> str:
        return f"{self.traits.name}-{self.letters}-v{self.dq_vec}{'b' if self.dq_bulk else ''}"


DQ_FIELDS = ("traits", "dq_vec", "dq_bulk")
DQ_STAGE_BYTES = 4  # fp32


def dq_reduction(traits: BwdTraits, arch: int, deterministic: bool = False) -> dict:
    """How the backward adds dQ into dQaccum on `arch` (BwdConfig's dq_vec and dq_bulk): one
    float per atomic before sm_90; on sm_90 four (`red.global.add.v4.f32`), and where shared
    memory holds an fp32 (block_m, head_dim) staging tile besides the traits' tiles and the run
    is not deterministic, one `cp.reduce.async.bulk` per warp instead, which hands the adds to
    the TMA unit while the warp goes on with the dK GEMM."""
    if arch < 90:
        return dict(dq_vec=1, dq_bulk=False)
    staging = DQ_STAGE_BYTES * traits.block_m * traits.head_dim
    return dict(dq_vec=4, dq_bulk=not deterministic and traits.smem_bytes + staging <= SMEM_LIMIT[tile_arch(arch)])


FLAG_LETTERS = dict(has_left="L", has_right="R", has_alibi="A", has_softcap="S", has_dropout="Z", even_k="K",
                    varlen="V", has_seqused_k="U", paged="P", any_page_size="p", kvcache="C", split="X",
                    has_leftpad="l", has_batch_idx="B", pack_gqa="G", deterministic="D")
SCORE_FLAGS = ("has_left", "has_right", "has_alibi", "has_softcap", "even_k")
CACHE_FLAGS = ("paged", "split", "has_leftpad", "has_batch_idx", "pack_gqa")


def score_letters(config) -> str:
    """One FLAG_LETTERS letter per `has_*` field of a Hopper config, '.' when off (its name's
    flag part, as `FwdConfig.letters` is the SM80 one's)."""
    return "".join(FLAG_LETTERS[f.name] if getattr(config, f.name) else "." for f in fields(config)
                   if f.name.startswith("has_"))
