"""Host-side checks of the forward kernel's static layouts and thread-value partitions.

A wrong swizzle or copy shape does not crash a kernel, it silently conflicts on banks, misses
coalescing or reads an element twice; these checks catch that on a CPU, from the same recipes
the kernel traces.

Evaluation. Layout functions exist only inside a trace, and there the DSL evaluates a static
layout at ~100 us per point (~550 us to index a partitioned tensor): seconds for a 128x256 tile.
So a trace reads each layout's static structure (flattened shape; strides, which are integers or
basis vectors for identity-tensor partitions; the partition's base coordinate; swizzle and offset
of a composed layout) into a `HostLayout`, and numpy evaluates it over the whole domain. The DSL
itself re-evaluates a spread of points of every smem layout and of the first and last thread of
every partition, and a disagreement raises, so the numpy model cannot drift from the DSL's
semantics. Results are cached per traits.

Shared-memory bank model (SM80/SM90): 32 banks of 4 bytes, bank = (byte_offset // 4) % 32.
- A warp's 16-byte-per-thread access (cp.async 16 B into smem, st.shared.v4, ld.shared.v4) is
  served in 4 phases of 8 consecutive lanes (0-7, 8-15, 16-23, 24-31), 128 B each.
- ldmatrix .x4 is served in 4 phases too: phase k reads matrix k, whose 8 rows of 16 bytes start
  at the addresses supplied by lanes 8k..8k+7 (lane i: row i%8 of matrix i//8). The atom's source
  TV layout (32,8):(8,1) gives lane i 8 elements, contiguous in smem, so its row address is the
  smem offset of the first of them; we check the 8 are contiguous and 16-byte aligned.
- A 4-byte access is one phase of all 32 lanes (generally: 128 // access_bytes lanes per phase).
In a phase, ways = max over banks of the number of distinct 4-byte words mapped to that bank (the
same word twice is a broadcast, free); the phase takes `ways` wavefronts, i.e. ways - 1 conflicts.
All lanes of a warp are assumed to issue the same access (same index of the partition's rest
modes) together. A copy reports its worst phase (max ways - 1) and the extra wavefronts summed
over every phase of one CTA-wide execution.

Global memory: every thread access must be 16 contiguous bytes along the head dim (one 128-bit
transaction, 16-byte aligned), and within one warp access the lanes on a row must cover one
contiguous run of whole 64-byte-aligned 64-byte blocks (64 B or 128 B here), so no sector is
partly used.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache

import cutlass
import cutlass.cute as cute
import numpy as np

from layouts import copy, mma, smem
from layouts.traits import ELEMENT_BYTES, SMEM_LIMIT, FwdTraits

WARP = 32
BANKS = 32
BANK_BYTES = 4
PHASE_BYTES = BANKS * BANK_BYTES
GMEM_BLOCK_BYTES = 64
_CROSSCHECK_POINTS = 8


@cute.jit
def _traced(fn: cutlass.Constexpr, args: cutlass.Constexpr):
    return fn(*args)


def in_trace(fn, *args):
    """Run `fn(*args)` inside a @cute.jit trace (where layout functions exist); return its result."""
    return _traced(fn, args)


def in_arch_trace(arch: str, fn, *args):
    """`in_trace` for a target whose atoms check the arch (sm_90a wgmma): traced by a compile
    for `arch`, the result kept from the trace."""
    box = []
    cute.compile(_traced, lambda: box.append(fn(*args)), (), options=f"--gpu-arch={arch}")
    return box[0]


def _leaves(t):
    return [x for e in t for x in _leaves(e)] if isinstance(t, tuple) else [t]


def _stride_vector(s, rank):
    """An integer stride (rank 1, or 0 in a coordinate layout), or a ScaledBasis `v@m` of an
    identity tensor as the vector v * e_m; None when neither."""
    if isinstance(s, int):
        if rank == 1:
            return [s]
        return [0] * rank if s == 0 else None
    if len(s.mode) != 1 or not isinstance(s.value, int):
        return None
    vec = [0] * rank
    vec[s.mode[0]] = s.value
    return vec


@dataclass(frozen=True)
class HostLayout:
    """A static CuTe layout as numpy data: f(i) = swizzle(base + sum_k crd_k(i) * stride_k).

    `shape` is the flattened shape (colexicographic index order), `stride` one row per leaf with
    `rank` components (1 for offsets, the tile rank for coordinates), `modes` the sizes of the
    top-level modes, `swizzle` (bits, base, shift) or None.
    """

    shape: tuple
    stride: np.ndarray
    base: np.ndarray
    modes: tuple
    swizzle: tuple | None = None

    @property
    def size(self) -> int:
        return math.prod(self.shape)

    @staticmethod
    def of(layout) -> "HostLayout":
        """Capture a Layout or a Swizzle-o-offset-o-Layout ComposedLayout (inside a trace)."""
        swz, offset = None, 0
        if isinstance(layout, cute.ComposedLayout):
            inner = layout.inner
            if not isinstance(inner, cute.Swizzle) or isinstance(layout.outer, cute.ComposedLayout):
                raise NotImplementedError(f"only Swizzle o offset o Layout is modelled: {layout}")
            swz, offset, outer = (inner.num_bits, inner.num_base, inner.num_shift), layout.offset, layout.outer
        else:
            outer = layout
        host = HostLayout._make(outer, [offset], swz)
        _crosscheck(host, lambda i: [layout(i)], _spread(host.size, _CROSSCHECK_POINTS))
        return host

    @staticmethod
    def of_coordinates(tensor, checks: int = _CROSSCHECK_POINTS) -> "HostLayout":
        """Capture a partition of an identity tensor: index -> tile coordinate (inside a trace).
        `checks` points are re-evaluated by the DSL (~0.5 ms each)."""
        base = list(tensor.iterator)
        host = HostLayout._make(tensor.layout, base, None)
        _crosscheck(host, lambda i: list(tensor[i]), _spread(host.size, checks))
        return host

    @staticmethod
    def _make(layout, base, swizzle):
        if any(not isinstance(x, int) for x in base):
            raise NotImplementedError(f"not a static base {base}")
        leaves, strides, modes = _structure(layout, len(base))
        return HostLayout(leaves, strides, np.array(base, dtype=np.int64), modes, swizzle)

    def __call__(self, idx) -> np.ndarray:
        """Evaluate at flat indices: shape idx.shape (offsets) or idx.shape + (rank,) (coordinates)."""
        idx = np.asarray(idx, dtype=np.int64)
        out = np.broadcast_to(self.base, idx.shape + self.base.shape).copy()
        rest = idx.copy()
        for extent, vec in zip(self.shape, self.stride):
            out += (rest % extent)[..., None] * vec
            rest //= extent
        if self.swizzle is not None:
            out = _swizzle(out, *self.swizzle)
        return out[..., 0] if self.base.shape == (1,) else out

    def table(self) -> np.ndarray:
        """Values over natural coordinates of a rank-2 layout: table[m, n] = f((m, n))."""
        if len(self.modes) != 2:
            raise ValueError(f"table() needs a rank-2 layout, modes {self.modes}")
        return self(np.arange(self.size)).reshape(self.modes, order="F")


_STRUCTURES: dict = {}


def _structure(layout, rank: int):
    """(flat shape, stride rows, top-mode sizes) of a static layout, memoised on its type string:
    reading .shape/.stride costs ~0.25 ms, and the threads of a partition share one layout."""
    key = (str(layout.type), rank)
    if key not in _STRUCTURES:
        shape, stride = layout.shape, layout.stride
        top = shape if isinstance(shape, tuple) else (shape,)
        leaves = tuple(_leaves(top))
        vecs = [_stride_vector(s, rank) for s in _leaves(stride if isinstance(stride, tuple) else (stride,))]
        if any(not isinstance(x, int) for x in leaves) or None in vecs:
            raise NotImplementedError(f"not a static layout of ints / basis strides: {layout}")
        strides = np.array(vecs, dtype=np.int64).reshape(len(leaves), rank)
        strides.flags.writeable = False
        _STRUCTURES[key] = (leaves, strides, tuple(math.prod(_leaves(m)) for m in top))
    return _STRUCTURES[key]


def _swizzle(x, bits, base, shift):
    """CuTe Swizzle<B,M,S>: XOR the B bits at M + max(0,S) into the B bits at M - min(0,S)."""
    mask = (1 << bits) - 1
    hi = x & (mask << (base + max(0, shift)))
    return x ^ (hi >> shift if shift >= 0 else hi << -shift)


def _spread(n: int, count: int) -> list:
    """`count` indices spread over [0, n), both ends included."""
    return sorted(set(np.linspace(0, n - 1, count, dtype=int).tolist())) if count else []


def _crosscheck(host: HostLayout, dsl_eval, points):
    """The DSL's own evaluation at `points` must match numpy's."""
    for i in points:
        want = [int(v) for v in dsl_eval(int(i))]
        got = np.atleast_1d(host(np.int64(i))).tolist()
        if got != want:
            raise AssertionError(f"host evaluation {got} != DSL {want} at index {i}")


# --------------------------------------------------------------------------------------------
# Smem layouts


def _smem_vt(traits: FwdTraits):
    return smem.transposed_view(smem.smem_layout_kv(traits))


SMEM_LAYOUTS = {
    "sQ": smem.smem_layout_q,
    "sKV": smem.smem_layout_kv,
    "sO": smem.smem_layout_o,
    "sVt": _smem_vt,
}


@lru_cache(maxsize=None)
def layout_table(build, *args) -> np.ndarray:
    """2-D table of element offsets of the rank-2 layout `build(*args)` (built inside a trace)."""
    table = in_trace(lambda: HostLayout.of(build(*args)).table())
    table.flags.writeable = False
    return table


def smem_table(name: str, traits: FwdTraits) -> np.ndarray:
    return layout_table(SMEM_LAYOUTS[name], traits)


def is_bijection(table: np.ndarray) -> bool:
    """Every offset in [0, cosize) is hit exactly once (cosize = max offset + 1)."""
    flat = np.sort(table.ravel())
    return bool(np.array_equal(flat, np.arange(flat.size)))


# --------------------------------------------------------------------------------------------
# Thread-value partitions


@dataclass(frozen=True)
class Partition:
    """coords[t, v, a] = (row, col) in `tile` of value v of access a of thread t.

    v runs over the values one copy-atom call moves (8 for ldmatrix x4 / 128-bit copies, 2 for a
    32-bit copy, 1 for MMA fragments); a over every other mode (repeats). `replicas` thread groups
    (consecutive warps) each cover the whole tile, e.g. every warp reads all of B.
    """

    coords: np.ndarray
    tile: tuple
    replicas: int = 1

    @property
    def threads(self) -> int:
        return self.coords.shape[0]


def partition_coords(tiled, method: str, tile) -> np.ndarray:
    """(Inside a trace) coords[t, v, a] of each thread's slice of a tiled copy / MMA applied, by
    `method` ("partition_S", "partition_D", "partition_A", ...), to an identity tensor of `tile`."""
    vec = cute.size(tiled.layout_src_tv, mode=[1]) if hasattr(tiled, "layout_src_tv") else 1
    ident = cute.make_identity_tensor(tuple(tile))
    threads = tiled.size
    per_thread = []
    for t in range(threads):
        # threads share the layout and differ in the base: re-check the first and last only
        checks = _CROSSCHECK_POINTS if t in (0, threads - 1) else 0
        host = HostLayout.of_coordinates(getattr(tiled.get_slice(t), method)(ident), checks)
        if host.modes[0] % vec:
            raise ValueError(f"first mode {host.modes[0]} is not whole atom calls of {vec} values")
        coords = host(np.arange(host.size))
        per_thread.append(coords.reshape(-1, vec, coords.shape[-1]).transpose(1, 0, 2))
    coords = np.stack(per_thread)
    coords.flags.writeable = False
    return coords


def capture_partition(build, args, method: str, tile, replicas: int = 1) -> Partition:
    """Partition of `tile` by the tiled copy / MMA `build(*args)` (one trace, not cached)."""
    return Partition(in_trace(lambda: partition_coords(build(*args), method, tile)), tuple(tile), replicas)


def _ldsm_q(t):
    return copy.smem_tiled_copy_q(t, mma.tiled_mma(t))


def _ldsm_k(t):
    return copy.smem_tiled_copy_k(t, mma.tiled_mma(t))


def _ldsm_vt(t):
    return copy.smem_tiled_copy_vt(t, mma.tiled_mma(t))


def _sts_o(t):
    return copy.smem_tiled_copy_o(t, mma.tiled_mma(t))


def _tile(traits: FwdTraits, which: str):
    dims = {"m": traits.block_m, "n": traits.block_n, "k": traits.head_dim}
    return dims[which[0]], dims[which[1]]


# name: (tiled copy / MMA builder, partition method, tile "rows cols" in m/n/k, one replica per warp)
PARTITIONS = {
    "gmem_q": (copy.gmem_tiled_copy_qkv, "partition_S", "mk", False),
    "gmem_kv": (copy.gmem_tiled_copy_qkv, "partition_S", "nk", False),
    "cpasync_q": (copy.gmem_tiled_copy_qkv, "partition_D", "mk", False),
    "cpasync_kv": (copy.gmem_tiled_copy_qkv, "partition_D", "nk", False),
    "gmem_kv_paged": (copy.gmem_tiled_copy_kv_paged, "partition_S", "nk", False),
    "cpasync_kv_paged": (copy.gmem_tiled_copy_kv_paged, "partition_D", "nk", False),
    "ldsm_q": (_ldsm_q, "partition_S", "mk", False),
    "ldsm_k": (_ldsm_k, "partition_S", "nk", True),
    "ldsm_vt": (_ldsm_vt, "partition_S", "kn", True),
    "sts_o": (_sts_o, "partition_D", "mk", False),
    "lds_o": (copy.gmem_tiled_copy_o, "partition_S", "mk", False),
    "gmem_o": (copy.gmem_tiled_copy_o, "partition_D", "mk", False),
    "mma_a_qk": (mma.tiled_mma, "partition_A", "mk", False),
    "mma_b_qk": (mma.tiled_mma, "partition_B", "nk", True),
    "mma_c_qk": (mma.tiled_mma, "partition_C", "mn", False),
    "mma_a_pv": (mma.tiled_mma, "partition_A", "mn", False),
    "mma_b_pv": (mma.tiled_mma, "partition_B", "kn", True),
    "mma_c_pv": (mma.tiled_mma, "partition_C", "mk", False),
}
# smem accesses: copy partition -> the smem layout it reads or writes
SMEM_ACCESSES = {
    "ldsm_q": "sQ",
    "ldsm_k": "sKV",
    "ldsm_vt": "sVt",
    "cpasync_q": "sQ",
    "cpasync_kv": "sKV",
    "cpasync_kv_paged": "sKV",
    "sts_o": "sO",
    "lds_o": "sO",
}
GMEM_ACCESSES = ("gmem_q", "gmem_kv", "gmem_kv_paged", "gmem_o")


def capture_partitions(traits, entries: dict) -> dict:
    """coords of every `name: (builder, method, tile "rows cols" in m/n/k)` entry for `traits`,
    captured in one trace (a trace costs ~0.1 s); each builder is called once."""

    def run():
        built, coords = {}, {}
        for name, (build, method, which) in entries.items():
            if build not in built:
                built[build] = build(traits)
            coords[name] = partition_coords(built[build], method, _tile(traits, which))
        return coords

    return in_trace(run)


@lru_cache(maxsize=None)
def partitions(traits: FwdTraits) -> dict:
    """Every PARTITIONS entry for `traits` as a `Partition`."""
    coords = capture_partitions(traits, {name: entry[:3] for name, entry in PARTITIONS.items()})
    return {name: Partition(c, _tile(traits, PARTITIONS[name][2]), traits.num_warps if PARTITIONS[name][3] else 1)
            for name, c in coords.items()}


def coverage(part: Partition) -> dict:
    """Each of `replicas` consecutive thread groups must hit every tile element exactly once."""
    rows, cols = part.tile
    groups = part.coords.reshape(part.replicas, -1, 2)
    inside = ((groups >= 0) & (groups < np.array(part.tile))).all(-1)
    flat = np.where(inside, groups[..., 0] * cols + groups[..., 1], rows * cols)
    counts = np.stack([np.bincount(g, minlength=rows * cols + 1) for g in flat])
    hits = counts[:, : rows * cols]
    return {
        "ok": bool((hits == 1).all() and not counts[:, -1].any()),
        "missing": int((hits == 0).sum()),
        "duplicated": int((hits > 1).sum()),
        "outside": int(counts[:, -1].sum()),
    }


def ownership(part: Partition) -> np.ndarray:
    """tile[row, col] = thread of the first replica group that owns it (-1: nobody)."""
    owner = np.full(part.tile, -1, dtype=np.int64)
    threads = part.threads // part.replicas
    c = part.coords[:threads]
    tid = np.broadcast_to(np.arange(threads)[:, None, None], c.shape[:-1])
    owner[c[..., 0].ravel(), c[..., 1].ravel()] = tid.ravel()
    return owner


# --------------------------------------------------------------------------------------------
# Banks


def vector_offsets(part: Partition, table: np.ndarray, elem_bytes: int = ELEMENT_BYTES) -> dict:
    """Per (thread, access) start byte in smem; ok when each access is contiguous and aligned."""
    off = table[part.coords[..., 0], part.coords[..., 1]]          # (threads, vec, accesses)
    start = off.min(axis=1)
    vec = off.shape[1]
    contiguous = np.array_equal(np.sort(off, axis=1), start[:, None, :] + np.arange(vec)[None, :, None])
    aligned = bool((start * elem_bytes % (vec * elem_bytes) == 0).all())
    return {"start_bytes": start * elem_bytes, "access_bytes": vec * elem_bytes,
            "ok": bool(contiguous and aligned)}


def bank_ways(start_bytes: np.ndarray, access_bytes: int) -> np.ndarray:
    """ways[warp, access, phase] for start_bytes[thread, access] under the module's bank model."""
    threads, accesses = start_bytes.shape
    lanes = min(WARP, PHASE_BYTES // access_bytes)
    phases = (accesses, threads // WARP, WARP // lanes)
    words = start_bytes.T.reshape(*phases, lanes, 1) // BANK_BYTES
    words = (words + np.arange(max(1, access_bytes // BANK_BYTES))).reshape(*phases, -1)
    words = np.sort(words, axis=-1)
    first = np.ones(words.shape, dtype=bool)
    first[..., 1:] = words[..., 1:] != words[..., :-1]
    per_bank = ((words % BANKS)[..., None] == np.arange(BANKS)) & first[..., None]
    return per_bank.sum(axis=-2).max(axis=-1).transpose(1, 0, 2)


def bank_conflicts(part: Partition, table: np.ndarray, elem_bytes: int = ELEMENT_BYTES) -> dict:
    """Bank conflicts of the smem side of a copy partition against an offset table."""
    acc = vector_offsets(part, table, elem_bytes)
    ways = bank_ways(acc["start_bytes"], acc["access_bytes"])
    worst = int(ways.max()) - 1
    return {"worst": worst, "extra_wavefronts": int((ways - 1).sum()), "vector_ok": acc["ok"],
            "access_bytes": acc["access_bytes"], "ok": worst == 0 and acc["ok"]}


# --------------------------------------------------------------------------------------------
# Global memory


def gmem_access(part: Partition, elem_bytes: int = ELEMENT_BYTES) -> dict:
    """16-byte vectors along the row, and per warp access whole aligned 64-byte runs per row."""
    c = part.coords
    vec = c.shape[1]
    rows, cols = c[..., 0], c[..., 1]
    start = cols.min(axis=1)
    vector_ok = bool(
        vec * elem_bytes == 16
        and (rows == rows[:, :1]).all()
        and np.array_equal(np.sort(cols, axis=1), start[:, None, :] + np.arange(vec)[None, :, None])
        and (start * elem_bytes % 16 == 0).all()
    )
    runs, coalesced = set(), True
    for warp in range(part.threads // WARP):
        lanes = slice(warp * WARP, (warp + 1) * WARP)
        for a in range(c.shape[2]):
            r, s = rows[lanes, 0, a], start[lanes, a]
            for row in np.unique(r):
                chunks = np.sort(s[r == row]) * elem_bytes
                run = int(chunks[-1] - chunks[0]) + vec * elem_bytes
                runs.add(run)
                coalesced &= bool(
                    np.array_equal(np.diff(chunks), np.full(chunks.size - 1, vec * elem_bytes))
                    and chunks[0] % GMEM_BLOCK_BYTES == 0
                    and run % GMEM_BLOCK_BYTES == 0
                )
    return {"vector_bytes": vec * elem_bytes, "vector_ok": vector_ok, "run_bytes": sorted(runs),
            "coalesced": coalesced, "ok": vector_ok and coalesced}


def page_runs(part: Partition, run: int) -> dict:
    """The paged K/V copy's promise (kernels/sm80/kv_tiles.py): a thread's copies m = g run .. g run +
    run - 1 hit rows of one aligned group of 16 (pages hold a multiple of 16 rows, so the run
    lies in one page), the same rows for every column chunk."""
    rows = part.coords[:, 0, :, 0]                      # (threads, accesses); access = m + M * chunk
    per_chunk = len(np.unique(rows[0]))
    by_m = rows.reshape(part.threads, -1, per_chunk)   # (threads, chunks, M)
    same_rows = bool((by_m == by_m[:, :1]).all())
    groups = (by_m[:, 0] // 16).reshape(part.threads, -1, run)
    return {"run": run, "ok": same_rows and bool((groups == groups[..., :1]).all())}


# --------------------------------------------------------------------------------------------
# Everything for one traits


@lru_cache(maxsize=None)
def verify_traits(traits: FwdTraits) -> dict:
    """All checks for one traits (arch-independent; see `report` for the smem limit)."""
    parts = partitions(traits)
    bijection = {name: is_bijection(smem_table(name, traits)) for name in SMEM_LAYOUTS}
    banks = {name: bank_conflicts(parts[name], smem_table(layout, traits))
             for name, layout in SMEM_ACCESSES.items()}
    gmem = {name: gmem_access(parts[name]) for name in GMEM_ACCESSES}
    cover = {name: coverage(parts[name]) for name in PARTITIONS}
    runs = page_runs(parts["gmem_kv_paged"], copy.paged_row_group(traits))
    ok = (all(bijection.values()) and all(b["ok"] for b in banks.values())
          and all(g["ok"] for g in gmem.values()) and all(c["ok"] for c in cover.values()) and runs["ok"])
    return {"bijection": bijection, "banks": banks, "gmem": gmem, "coverage": cover, "page_runs": runs, "ok": ok}


def report(traits, arch: int, checks: dict | None = None) -> dict:
    """The row of `python -m layouts report`: `checks` (default: this module's verify_traits)
    plus the smem budget of `arch`."""
    checks = verify_traits(traits) if checks is None else checks
    fits = traits.fits(arch)
    return {"name": traits.name, "arch": arch, "smem_bytes": traits.smem_bytes,
            "smem_limit": SMEM_LIMIT[arch], "fits": fits, **checks, "ok": fits and checks["ok"]}


def draw_layout(layout_table: np.ndarray, path, title: str | None = None) -> None:
    """Render a 2-D table (offsets, bank groups or thread ownership) to a PNG; small tables get
    their values written in the cells. Needs the optional matplotlib extra."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows, cols = layout_table.shape
    fig, ax = plt.subplots(figsize=(min(2 + cols * 0.08, 24), min(1.5 + rows * 0.08, 24)))
    values = int(layout_table.max()) + 1
    # one distinct colour per value when there are few (tab10 for bank groups 0..7), else a ramp
    cmap = (matplotlib.colors.ListedColormap(plt.get_cmap("tab10").colors[:values]) if values <= 10
            else "tab20" if values <= 20 else "viridis")
    image = ax.imshow(layout_table, cmap=cmap, interpolation="nearest", aspect="equal")
    if rows * cols <= 64 * 64:
        for (r, c), v in np.ndenumerate(layout_table):
            ax.text(c, r, str(v), ha="center", va="center", fontsize=4)
    ax.set_xlabel("column")
    ax.set_ylabel("row")
    ax.set_title(title or "")
    fig.colorbar(image, ax=ax, shrink=0.6)
    fig.savefig(path, dpi=120, bbox_inches="tight")
    plt.close(fig)
