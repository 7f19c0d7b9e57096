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
DTYPES = ("fp16", "bf16")
# Opt-in dynamic shared memory per CTA (bytes), as cudaDevAttrMaxSharedMemoryPerBlockOptin reports.
SMEM_LIMIT = {80: 166912, 90: 232448}
ELEMENT_BYTES = 2
COPY_BYTES = 16  # one cp.async / vector load: 128 bits
ALIGN = COPY_BYTES // ELEMENT_BYTES  # elements per 128-bit copy: strides and head dims come in these


def head_dim_bucket(d: int) -> int:
    """Smallest bucket >= d; a head dim under its bucket runs with K predicates (Is_even_K)."""
    if not 1 <= d <= HEAD_DIM_BUCKETS[-1]:
        raise ValueError(f"head dim must be in [1, {HEAD_DIM_BUCKETS[-1]}], got {d}")
    return next(b for b in HEAD_DIM_BUCKETS if b >= d)


@dataclass(frozen=True)
class FwdTraits:
    head_dim: int          # kHeadDim: the bucket, a multiple of 32
    block_m: int           # kBlockM: query rows per CTA
    block_n: int           # kBlockN: key rows per main-loop step
    num_warps: int         # kNWarps: warps tile M, 16 rows each per MMA step
    dtype: str = "bf16"    # "fp16" | "bf16"; accumulation is always fp32

    def __post_init__(self):
        if self.head_dim not in HEAD_DIM_BUCKETS:
            raise ValueError(f"head_dim {self.head_dim} is not a bucket {HEAD_DIM_BUCKETS}")
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {DTYPES}, got {self.dtype!r}")
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
    `python -m cute_flash tune` on the H200 (docs/perf.md): 128x64/4 warps up to d=128 (at
    d=64, 128x128 spills ~600 B and ran 2-5% slower from 1k keys up; d=32 follows d=64 untimed,
    its 128x64 kernel being spill-free too), and 128x64/8 warps above, d=160 included (128x32
    would leave the S tile narrow for the softmax's row reductions; not timed).
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
