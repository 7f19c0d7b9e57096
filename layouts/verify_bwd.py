"""Host-side checks of the backward kernel's layouts, with `layouts.verify`'s machinery (numpy
models of the DSL's layouts, cross-checked by the DSL, and its bank and coalescing models).

The backward reads each smem tile in more than one orientation: Q and dO as A operands of S and
dP and, transposed, as B operands of dK and dV; K as B of S and, transposed, of dQ; P and dS
(written from the S/dP accumulators) as A of dQ and, transposed, of dK and dV. Every one of
those ldmatrix reads and every store into smem is checked conflict-free against the swizzled
layout it touches, every layout a bijection, every partition covering its tile, and the gmem
copies 128-bit and coalesced. A partition of a TiledMMA grid with warps_m x warps_n warps reads
each A element warps_n times and each B element warps_m times: coverage counts that many.
"""
from __future__ import annotations

from functools import lru_cache

import numpy as np

from layouts import copy, mma, smem, verify
from layouts.traits import BwdTraits
from layouts.verify import Partition, _tile, bank_conflicts, gmem_access, is_bijection, layout_table

SMEM_LAYOUTS = {
    "sQ": smem.smem_layout_q,                                   # also sdO
    "sKV": smem.smem_layout_kv,
    "sPdS": smem.smem_layout_pds,
    "sQt": lambda t: smem.transposed_view(smem.smem_layout_q(t)),     # (d, bm): Q^T, dO^T
    "sKt": lambda t: smem.transposed_view(smem.smem_layout_kv(t)),    # (d, bn): K^T
    "sPdSt": lambda t: smem.transposed_view(smem.smem_layout_pds(t)),  # (bn, bm): P^T, dS^T
}


def _sdp(t):
    return mma.tiled_mma_grid(t, t.atom_m_sdp)


def _dkv(t):
    return mma.tiled_mma_grid(t, t.atom_n_dkv)


def _dq(t):
    return mma.tiled_mma_grid(t, t.atom_m_dq)


# name: (builder, method, tile, smem layout it touches or None, times each element is covered)
PARTITIONS = {
    "gmem_q": (copy.gmem_tiled_copy_qkv, "partition_S", "mk", None, None),
    "gmem_kv": (copy.gmem_tiled_copy_qkv, "partition_S", "nk", None, None),
    "cpasync_q": (copy.gmem_tiled_copy_qkv, "partition_D", "mk", "sQ", None),
    "cpasync_kv": (copy.gmem_tiled_copy_qkv, "partition_D", "nk", "sKV", None),
    "ldsm_q": (lambda t: copy.smem_tiled_copy_a(t, _sdp(t), False), "partition_S", "mk", "sQ", "a_sdp"),
    "ldsm_k": (lambda t: copy.smem_tiled_copy_b(t, _sdp(t), False), "partition_S", "nk", "sKV", "b_sdp"),
    "sts_pds": (lambda t: copy.smem_tiled_copy_c(t, _sdp(t)), "partition_D", "mn", "sPdS", None),
    "ldsm_pt": (lambda t: copy.smem_tiled_copy_a(t, _dkv(t), True), "partition_S", "nm", "sPdSt", "a_dkv"),
    "ldsm_qt": (lambda t: copy.smem_tiled_copy_b(t, _dkv(t), True), "partition_S", "km", "sQt", "b_dkv"),
    "ldsm_ds": (lambda t: copy.smem_tiled_copy_a(t, _dq(t), False), "partition_S", "mn", "sPdS", "a_dq"),
    "ldsm_kt": (lambda t: copy.smem_tiled_copy_b(t, _dq(t), True), "partition_S", "kn", "sKt", "b_dq"),
    "sts_dkv": (lambda t: copy.smem_tiled_copy_c(t, _dkv(t)), "partition_D", "nk", "sKV", None),
    "lds_dkv": (copy.gmem_tiled_copy_o, "partition_S", "nk", "sKV", None),
    "gmem_dkv": (copy.gmem_tiled_copy_o, "partition_D", "nk", None, None),
}
BWD_GMEM = ("gmem_q", "gmem_kv", "gmem_dkv")


def _times(t: BwdTraits, which):
    """How many warps read each element of an MMA operand (1 for copies)."""
    if which is None:
        return 1
    atom = {"sdp": t.atom_m_sdp, "dkv": t.atom_n_dkv, "dq": t.atom_m_dq}[which[2:]]
    return t.num_warps // atom if which[0] == "a" else atom


@lru_cache(maxsize=None)
def partitions(traits: BwdTraits) -> dict:
    """Every PARTITIONS entry for `traits` as a `Partition`."""
    coords = verify.capture_partitions(traits, {name: entry[:3] for name, entry in PARTITIONS.items()})
    return {name: Partition(c, _tile(traits, PARTITIONS[name][2])) for name, c in coords.items()}


def coverage(part: Partition, times: int) -> dict:
    """All threads together hit every tile element exactly `times` times, nothing outside."""
    rows, cols = part.tile
    c = part.coords.reshape(-1, 2)
    inside = ((c >= 0) & (c < np.array(part.tile))).all(-1)
    counts = np.bincount(np.where(inside, c[:, 0] * cols + c[:, 1], rows * cols), minlength=rows * cols + 1)
    hits = counts[: rows * cols]
    return {"ok": bool((hits == times).all() and not counts[-1]), "times": times,
            "wrong": int((hits != times).sum()), "outside": int(counts[-1])}


@lru_cache(maxsize=None)
def verify_traits(traits: BwdTraits) -> dict:
    parts = partitions(traits)
    tables = {name: layout_table(build, traits) for name, build in SMEM_LAYOUTS.items()}
    bijection = {name: is_bijection(table) for name, table in tables.items()}
    banks = {name: bank_conflicts(parts[name], tables[layout])
             for name, (_, _, _, layout, _) in PARTITIONS.items() if layout is not None}
    gmem = {name: gmem_access(parts[name]) for name in BWD_GMEM}
    cover = {name: coverage(parts[name], _times(traits, which)) for name, (*_, which) in PARTITIONS.items()}
    ok = (all(bijection.values()) and all(b["ok"] for b in banks.values()) and all(g["ok"] for g in gmem.values())
          and all(c["ok"] for c in cover.values()))
    return {"bijection": bijection, "banks": banks, "gmem": gmem, "coverage": cover, "ok": ok}


def report(traits: BwdTraits, arch: int) -> dict:
    return verify.report(traits, arch, verify_traits(traits))
