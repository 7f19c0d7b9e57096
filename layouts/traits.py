"""Compile-time parameters of the forward kernel and the heuristic that picks them.

flash-attn 2's `Flash_fwd_kernel_traits<kHeadDim, kBlockM, kBlockN, kNWarps, ..., T>` as a
frozen dataclass (its Is_Q_in_regs / Share_Q_K_smem options are not built: no kernel here keeps
Q in registers). Pure Python: usable outside a trace, so the
dispatcher, the compile cache key and the property tests all read the same object.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

HEAD_DIM_BUCKETS = (32, 64, 96, 128, 160, 192, 224, 256)
LATENT_DIMS = (576, 512)  # MLA's absorbed decode: q / k 512 latent + 64 rope columns, v the 512 latent ones
DTYPES = ("fp16", "bf16")
# Opt-in dynamic shared memory per CTA (bytes), as cudaDevAttrMaxSharedMemoryPerBlockOptin reports:
# 163 KB on sm_80 and sm_87, 99 KB on sm_86 and sm_89 (consumer Ampere and Ada), 227 KB on sm_90.
SMEM_LIMIT = {80: 166912, 86: 101376, 87: 166912, 89: 101376, 90: 232448}
ELEMENT_BYTES = 2
COPY_BYTES = 16  # one cp.async / vector load: 128 bits
ALIGN = COPY_BYTES // ELEMENT_BYTES  # elements per 128-bit copy: strides and head dims come in these


def tile_arch(arch: int) -> int:
    """The SMEM_LIMIT entry a GPU's tiles are chosen for: its own where listed; a newer GPU by
    its opt-in shared memory per block: 99 KB on consumer Blackwell (sm_120 and up) as sm_89,
    227 KB on the data-center ones (sm_100 ..) as sm_90. No kernel here has run on those GPUs;
    taking sm_90's limit for every newer GPU gave sm_120 tiles it cannot launch."""
    if arch in SMEM_LIMIT:
        return arch
    return 89 if arch >= 120 else 90


def head_dim_bucket(d: int) -> int:
    """Smallest bucket >= d; a head dim under its bucket runs with K predicates (Is_even_K)."""
    if not 1 <= d <= HEAD_DIM_BUCKETS[-1]:
        raise ValueError(f"head dim must be in [1, {HEAD_DIM_BUCKETS[-1]}], got {d}")
    return next(b for b in HEAD_DIM_BUCKETS if b >= d)


def check_bucket_and_dtype(head_dim: int, dtype: str) -> None:
    """What every traits requires of its head dim and dtype."""
    if head_dim not in HEAD_DIM_BUCKETS:
        raise ValueError(f"head_dim {head_dim} is not a bucket {HEAD_DIM_BUCKETS}")
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {DTYPES}, got {dtype!r}")


@dataclass(frozen=True)
class FwdTraits:
    head_dim: int          # kHeadDim: the bucket, a multiple of 32
    block_m: int           # kBlockM: query rows per CTA
    block_n: int           # kBlockN: key rows per main-loop step
    num_warps: int         # kNWarps: warps tile M, 16 rows each per MMA step
    dtype: str = "bf16"    # "fp16" | "bf16"; accumulation is always fp32

    def __post_init__(self):
        check_bucket_and_dtype(self.head_dim, self.dtype)
        if self.block_m % (16 * self.num_warps):
            raise ValueError("block_m must be a multiple of 16 * num_warps (one MMA row group per warp)")
        if self.block_n % 16:
            raise ValueError("block_n must be a multiple of 16")

    @property
    def num_threads(self) -> int:
        return 32 * self.num_warps

    @property
    def block_k_smem(self) -> int:
        """Width of one swizzle atom row: 64 elements (128 B) when the head dim allows, else 32."""
        return 64 if self.head_dim % 64 == 0 else 32

    @property
    def swizzle_bits(self) -> int:
        """Swizzle<B,3,3>: B=3 permutes 8 16-byte chunks of a 128 B row, B=2 four of a 64 B row."""
        return 3 if self.block_k_smem == 64 else 2

    @property
    def gmem_threads_per_row(self) -> int:
        return self.block_k_smem // 8  # 8 elements = 16 bytes per cp.async

    @property
    def smem_bytes(self) -> int:
        return ELEMENT_BYTES * (self.block_m + 2 * self.block_n) * self.head_dim

    def fits(self, arch: int) -> bool:
        return self.smem_bytes <= SMEM_LIMIT[arch]

    @property
    def name(self) -> str:
        return f"d{self.head_dim}_m{self.block_m}_n{self.block_n}_w{self.num_warps}_{self.dtype}"


@functools.lru_cache(maxsize=None)
def choose_fwd_traits(head_dim: int, dtype: str = "bf16", arch: int = 90, causal: bool = False) -> FwdTraits:
    """Tile sizes per head-dim bucket.

    flash-attn 2.8.3 (non-dropout, A100/H100 path) uses 128x128/4 warps up to d=64, 128x64/4
    warps for d=96..128, 128x32/4 warps at d=160 and 128x64/8 warps for d=192..256. Ours, from
    `python -m cute_flash tune` (docs/tuning/sm80-forward.md, "Tuning log", step 3): 128x64/4
    warps up to d=128 (at d=64, 128x128 spills ~600 B and ran slower from 1k keys up; d=32
    follows d=64 untimed, its 128x64 kernel being spill-free too), and 128x64/8 warps above,
    d=160 included (128x32 would leave the S tile narrow for the softmax's row reductions; not
    timed).
    `causal` is accepted so the heuristic can specialise per mask; no tile won there yet.
    """
    d = head_dim_bucket(head_dim)
    if d <= 128:
        m, n, w = 128, 64, 4
    else:
        m, n, w = 128, 64, 8
    t = FwdTraits(head_dim=d, block_m=m, block_n=n, num_warps=w, dtype=dtype)
    if not t.fits(arch):
        t = FwdTraits(head_dim=d, block_m=64, block_n=64, num_warps=4, dtype=dtype)
    return t


@functools.lru_cache(maxsize=None)
def choose_decode_traits(head_dim: int, dtype: str = "bf16", arch: int = 90) -> FwdTraits:
    """Tiles of the KV-cache (split-KV) kernel, flash-attn 2's: kBlockM 64 (decode has few query
    rows, even after folding a GQA group into M), kBlockN 256 / 128 / 64 for d <= 64 / 128 /
    more, 4 warps. Wide key blocks mean fewer, larger cp.async batches per main-loop step on a
    memory-bound loop."""
    d = head_dim_bucket(head_dim)
    n = 256 if d <= 64 else 128 if d <= 128 else 64
    return FwdTraits(head_dim=d, block_m=64, block_n=n, num_warps=4, dtype=dtype)


def shipped_fwd_traits(arch: int = 90) -> list[FwdTraits]:
    """Every traits the heuristics can return for `arch` (what `python -m layouts report` checks):
    the forward kernel's and the KV-cache kernel's."""
    seen = {}
    for d in HEAD_DIM_BUCKETS:
        for dtype in DTYPES:
            for causal in (False, True):
                seen[choose_fwd_traits(d, dtype, arch, causal)] = None
            seen[choose_decode_traits(d, dtype, arch)] = None
    return list(seen)


@dataclass(frozen=True)
class BwdTraits:
    """flash-attn 2's `Flash_bwd_kernel_traits`: one CTA owns kBlockN keys and loops over
    kBlockM-row query blocks. The three GEMM shapes get their own warp grids: S and dP
    (block_m x block_n, `atom_m_sdp` warps along M), dK and dV (block_n x head_dim,
    `atom_n_dkv` warps along N-of-keys), dQ (block_m x head_dim, `atom_m_dq` warps along M).
    `q_stages` 2 double-buffers Q and dO so the next query block loads under this one's math.
    `head_dim_v`: V's, dO's and dV's head dim where it is not head_dim's (MLA's 192 / 128, the
    Hopper backward only), else None. `do_stages`: dO's (and D's) stages where they are fewer
    than Q's (1 beside two of Q, flash-attn-4's d 192 tiles: room for the dQ staging tile; the
    Hopper backward only), else None."""
    head_dim: int
    block_m: int
    block_n: int
    num_warps: int
    atom_m_sdp: int
    atom_n_dkv: int
    atom_m_dq: int
    q_stages: int = 2
    dtype: str = "bf16"
    head_dim_v: int | None = None
    do_stages: int | None = None

    def __post_init__(self):
        check_bucket_and_dtype(self.head_dim, self.dtype)
        if self.head_dim_v is not None:
            check_bucket_and_dtype(self.head_dim_v, self.dtype)
            if self.head_dim_v == self.head_dim:
                raise ValueError("head_dim_v is V's head dim where it differs from head_dim; leave it None otherwise")
        if self.q_stages not in (1, 2):
            raise ValueError("q_stages is 1 or 2")
        if self.do_stages is not None and not 1 <= self.do_stages < self.q_stages:
            raise ValueError("do_stages is fewer than q_stages where given; leave it None otherwise")
        for atom, (rows, cols) in ((self.atom_m_sdp, (self.block_m, self.block_n)),
                                   (self.atom_n_dkv, (self.block_n, self.head_dim)),
                                   (self.atom_m_dq, (self.block_m, self.head_dim))):
            if self.num_warps % atom or rows % (16 * atom) or cols % (16 * (self.num_warps // atom)):
                raise ValueError(f"a {atom} x {self.num_warps // atom} warp grid does not tile {rows} x {cols}")
        if self.block_m % (self.num_threads // self.gmem_threads_per_row):
            raise ValueError("block_m must be a multiple of the rows one pass of the gmem copy covers")

    num_threads = FwdTraits.num_threads
    block_k_smem = FwdTraits.block_k_smem
    swizzle_bits = FwdTraits.swizzle_bits
    gmem_threads_per_row = FwdTraits.gmem_threads_per_row

    @property
    def dv(self) -> int:
        """V's, dO's and dV's head dim."""
        return self.head_dim if self.head_dim_v is None else self.head_dim_v

    @property
    def stages_do(self) -> int:
        """dO's and D's stages."""
        return self.q_stages if self.do_stages is None else self.do_stages

    @property
    def block_k_pds(self) -> int:
        """Swizzle-atom width of the P / dS tiles (block_m x block_n, keys contiguous)."""
        return 64 if self.block_n % 64 == 0 else 32

    @property
    def smem_bytes(self) -> int:
        qdo = 2 * self.q_stages * self.block_m * self.head_dim
        return ELEMENT_BYTES * (qdo + 2 * self.block_n * self.head_dim + 2 * self.block_m * self.block_n)

    def fits(self, arch: int) -> bool:
        return self.smem_bytes <= SMEM_LIMIT[arch]

    @property
    def name(self) -> str:
        value = "" if self.head_dim_v is None else f"_v{self.head_dim_v}"
        return (f"bwd_d{self.head_dim}{value}_m{self.block_m}_n{self.block_n}_w{self.num_warps}_"
                f"{self.atom_m_sdp}{self.atom_n_dkv}{self.atom_m_dq}_s{self.q_stages}_{self.dtype}")


@functools.lru_cache(maxsize=None)
def choose_bwd_traits(head_dim: int, dtype: str = "bf16", arch: int = 90) -> BwdTraits:
    """Backward tiles per head-dim bucket, flash-attn 2.8.3's for sm80-class GPUs as the start
    (kBlockM x kBlockN / warps / S-dP, dK-dV, dQ warp grids): d32 128x128/8 (4,4,4), d64
    128x128/8 (ours (4,4,4), faster than flash-attn's (2,4,4) under `tune --bwd`:
    docs/tuning/backward.md, "The SM80 backward"), d96 64x128/8 (2,4,4), d128 64x128/8 (2,4,2)
    (best of five candidates), d160 64x64/8 (4,4,4), d192 and d256 64x64/8 (4,2,2), d224 (ours:
    224 is not a multiple of 64) (4,4,4); Q and dO double-buffered where shared memory allows."""
    d = head_dim_bucket(head_dim)
    m, n, grids = {32: (128, 128, (4, 4, 4)), 64: (128, 128, (4, 4, 4)), 96: (64, 128, (2, 4, 4)),
                   128: (64, 128, (2, 4, 2)), 160: (64, 64, (4, 4, 4)), 192: (64, 64, (4, 2, 2)),
                   224: (64, 64, (4, 4, 4)), 256: (64, 64, (4, 2, 2))}[d]
    candidates = [(m, n, grids)] + ([SMALL_SMEM_BWD_TILES[d]] if d in SMALL_SMEM_BWD_TILES else [])
    for m, n, grids in candidates:
        for stages in (2, 1):
            t = BwdTraits(d, m, n, 8, *grids, q_stages=stages, dtype=dtype)
            if t.fits(arch):
                return t
    raise ValueError(f"the backward of head dim {head_dim} (bucket {d}) has no tiles that fit the "
                     f"{SMEM_LIMIT[arch]} bytes of shared memory per block (sm_{arch}'s limit): head dims above 160 "
                     f"need 163 KB or more (sm_80, sm_87, sm_90)")


# Backward tiles where the usual ones do not fit 99 KB of shared memory (sm_86, sm_89): flash-attn
# 2's choices for those GPUs (d 64: 64 x 128; d 128: 64 x 64 with its (2, 4, 2) grids), and
# ours for d 96 (64 x 64: its 64 x 128 tile needs 104 KB single-buffered). d 32 and d 160 fit
# with Q / dO single-buffered. Not timed on such a GPU.
SMALL_SMEM_BWD_TILES = {64: (64, 128, (2, 4, 4)), 96: (64, 64, (2, 4, 4)), 128: (64, 64, (2, 4, 2))}


def shipped_bwd_traits(arch: int = 90) -> list[BwdTraits]:
    """Every backward traits `choose_bwd_traits` can return for `arch` (buckets it has none
    for, d 192 up on 99 KB GPUs, left out)."""
    return list(dict.fromkeys(choose_bwd_traits(d, dt, arch) for d in HEAD_DIM_BUCKETS for dt in DTYPES
                              if bwd_fits(d, arch)))


def bwd_fits(head_dim: int, arch: int) -> bool:
    """Whether `choose_bwd_traits` has tiles for this head dim on `arch`."""
    try:
        choose_bwd_traits(head_dim, "bf16", arch)
    except ValueError:
        return False
    return True


def element_type(traits_or_dtype):
    """The DSL numeric type of Q/K/V/O for traits or a dtype name (imported lazily: traits stay
    usable without the DSL)."""
    import cutlass

    dtype = getattr(traits_or_dtype, "dtype", traits_or_dtype)
    return {"fp16": cutlass.Float16, "bf16": cutlass.BFloat16}[dtype]


def sm_name(arch: int) -> str:
    """The target name of `arch` (80 -> sm_80): sm_90 builds sm_90a, whose wgmma / TMA / setmaxnreg
    instructions only exist in the arch-specific target."""
    return f"sm_{arch}{'a' if arch >= 90 else ''}"
