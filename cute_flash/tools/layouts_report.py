"""`python -m cute_flash layouts [--arch 80|90|all] [--draw DIR]`

Checks every traits the heuristic ships (layouts.verify) and prints one row per traits, its bank
conflicts on a line under it (so that rows stay within 120 columns); exits 1 if any check fails,
so CI can gate on it. Each bank entry gives the worst phase's conflicts (ways - 1) and, in
parentheses when nonzero, the extra wavefronts summed over the CTA: ldsmQ/ldsmK/ldsmVt are
the ldmatrix reads of sQ, sK and sV^T, cpQ/cpKV the cp.async writes into sQ and sK/sV (cpKVp: the
paged copy's), stO the 32-bit accumulator stores into sO and ldO the 128-bit reads of sO for the
gmem store. `runs` is the paged copy's rows per page run, "ok" when no run can straddle a page.

A second table per arch checks the backward's traits (layouts.verify_bwd): cpQ/cpKV the
cp.async writes into sQ (and sdO) and sK/sV; ldsmQ/ldsmK the reads of S = Q K^T (and of
dP = dO V^T); stPdS the 32-bit stores of P and dS; ldsmPt/ldsmQt the transposed reads of
dV += P^T dO and dK += dS^T Q; ldsmdS/ldsmKt those of dQ = dS K; stdKV/lddKV the dK, dV
staging through smem. `cover` counts each element once per copy and once per warp that reads
it in an MMA warp grid.

On sm90 a third table checks the Hopper traits (layouts.verify_hopper), each at every K / V
stage count a shipped variant gives it (the row's `_sN`): the GMMA smem tiles
are bijections (sQ, sKV, and K/V staged), every stage starts 1024-byte aligned, `P->A` says
for how many threads the S accumulator re-viewed as the A operand of P V holds the element the
wgmma expects at each position, `acc cover` that the threads' S and O accumulators hold
every element once, and `O boxes` that each warpgroup's TMA store boxes (one swizzle atom
wide) read exactly its rows of O's staging tile, from 1024-byte aligned bases. A fourth checks
the Hopper backward's tiles (layouts.verify_hopper.bwd_checks): sQ / sKV / sdS bijections with
aligned stages, `P->A` the S^T and dP^T accumulators as the register A operands of dV and dK,
the S^T / dKV / dQ accumulators' cover, dQ's warpgroup runs filling the chunk, and the dK / dV
TMA store boxes; beside the buckets' tiles, those the policy's dQ path gives a second Q / dO
stage (`-atomic`: no dQ staging tile in the shared-memory count).
"""
from pathlib import Path

from cute_flash.launch.policy import hopper_bwd_dq
from cute_flash.launch.variants import sm90_traits_stages
from layouts import verify, verify_bwd, verify_hopper
from layouts.hopper import bwd_smem_bytes, shipped_hopper_bwd_traits
from layouts.traits import ELEMENT_BYTES, SMEM_LIMIT, shipped_bwd_traits, shipped_fwd_traits

BANK_COLUMNS = {"ldsm_q": "ldsmQ", "ldsm_k": "ldsmK", "ldsm_vt": "ldsmVt", "cpasync_q": "cpQ",
                "cpasync_kv": "cpKV", "cpasync_kv_paged": "cpKVp", "sts_o": "stO", "lds_o": "ldO"}


def _ok(flag: bool) -> str:
    return "ok" if flag else "FAIL"


def _failed_names(checks: dict) -> str:
    bad = [name for name, good in checks.items() if not good]
    return "ok" if not bad else "FAIL " + ",".join(bad)


def _banks(b: dict) -> str:
    text = str(b["worst"]) + (f"(+{b['extra_wavefronts']})" if b["extra_wavefronts"] else "")
    return text if b["vector_ok"] else text + "!vec"


def _gmem(gmem: dict) -> str:
    runs = sorted({r for g in gmem.values() for r in g["run_bytes"]})
    vec = {g["vector_bytes"] for g in gmem.values()}
    text = f"{'/'.join(map(str, vec))}B/{'+'.join(map(str, runs))}B"
    return text + (" ok" if all(g["ok"] for g in gmem.values()) else " FAIL")


def _failed_coverage(cover: dict) -> str:
    bad = [f"{name}(-{c['missing']} x{c['duplicated']} out{c['outside']})" for name, c in cover.items() if not c["ok"]]
    return "ok" if not bad else "FAIL " + " ".join(bad)


WIDTHS = dict(traits=22, smem=7, fits=4, bij=4, gmem=12, cover=6, runs=6)


def _row(cells, widths) -> str:
    return "  ".join(str(x).ljust(w) for x, w in zip(cells, widths)).rstrip()


def _bank_line(banks: dict, columns: dict) -> str:
    """A traits' bank columns on a line of their own under its row (the tables stay within 120
    columns): `name worst(+extra)`, `!vec` where a copy is not vectorized."""
    return "    banks: " + "  ".join(f"{label} {_banks(banks[key])}" for key, label in columns.items())


def print_report(arch: int) -> bool:
    """One row per shipped traits, printed as each finishes (a traits takes a few seconds)."""
    header = ["traits", "smem B", "fits", "bij", "gmem", "cover", "runs"]
    widths = [WIDTHS["traits"], WIDTHS["smem"], WIDTHS["fits"], WIDTHS["bij"], WIDTHS["gmem"], WIDTHS["cover"],
              WIDTHS["runs"]]
    print(f"sm{arch}: smem limit {SMEM_LIMIT[arch]} B; bank conflicts = worst phase ways-1 (+extra wavefronts/CTA)")
    print(_row(header, widths), flush=True)
    rows = []
    for t in shipped_fwd_traits(arch):
        r = verify.report(t, arch)
        rows.append(r)
        print(_row([r["name"], f"{r['smem_bytes']}", _ok(r["fits"]), _failed_names(r["bijection"]), _gmem(r["gmem"]),
                    _failed_coverage(r["coverage"]), f"{r['page_runs']['run']} {_ok(r['page_runs']['ok'])}"], widths))
        print(_bank_line(r["banks"], BANK_COLUMNS), flush=True)
    failed = [r["name"] for r in rows if not r["ok"]]
    summary = f"sm{arch}: {len(rows) - len(failed)}/{len(rows)} traits pass"
    print(summary + (f"; FAILED: {', '.join(failed)}" if failed else ""), flush=True)
    return not failed


BWD_BANK_COLUMNS = {"cpasync_q": "cpQ", "cpasync_kv": "cpKV", "ldsm_q": "ldsmQ", "ldsm_k": "ldsmK",
                    "sts_pds": "stPdS", "ldsm_pt": "ldsmPt", "ldsm_qt": "ldsmQt", "ldsm_ds": "ldsmdS",
                    "ldsm_kt": "ldsmKt", "sts_dkv": "stdKV", "lds_dkv": "lddKV"}


def print_bwd_report(arch: int) -> bool:
    """The backward's traits, one row each, as `print_report`."""
    header = ["backward traits", "smem B", "fits", "bij", "gmem", "cover"]
    widths = [34, WIDTHS["smem"], WIDTHS["fits"], WIDTHS["bij"], WIDTHS["gmem"], WIDTHS["cover"]]
    print(_row(header, widths), flush=True)
    rows = []
    for t in shipped_bwd_traits(arch):
        r = verify_bwd.report(t, arch)
        rows.append(r)
        cover = [f"{n}(x{c['wrong']} out{c['outside']})" for n, c in r["coverage"].items() if not c["ok"]]
        print(_row([r["name"], f"{r['smem_bytes']}", _ok(r["fits"]), _failed_names(r["bijection"]), _gmem(r["gmem"]),
                    "ok" if not cover else "FAIL " + " ".join(cover)], widths))
        print(_bank_line(r["banks"], BWD_BANK_COLUMNS), flush=True)
    failed = [r["name"] for r in rows if not r["ok"]]
    print(f"sm{arch}: {len(rows) - len(failed)}/{len(rows)} backward traits pass"
          + (f"; FAILED: {', '.join(failed)}" if failed else ""), flush=True)
    return not failed


def print_hopper_report() -> bool:
    """The Hopper forward's traits (sm_90, the KV-cache entry's too), one row for each K / V
    stage count a shipped variant gives it (`variants.sm90_traits_stages`)."""
    header = ["hopper traits", "smem B", "fits", "bij", "stage align", "P->A", "acc cover", "O boxes"]
    widths = [30, WIDTHS["smem"], WIDTHS["fits"], WIDTHS["bij"], 12, 12, 10, 8]
    print(_row(header, widths), flush=True)
    rows = []
    for t, stages in sm90_traits_stages():
        r = verify_hopper.report(t, stages)
        rows.append(r)
        smem, p = r["smem"], r["p_operand"]
        bij = _failed_names({k: smem[k] for k in ("sQ", "sKV", "staged_bijection")})
        print(_row([r["name"], f"{r['smem_bytes']}", _ok(r["fits"]), bij,
                    f"{smem['stage_bytes']} {_ok(smem['stages_aligned'])}",
                    f"{p['threads'] - p['mismatched_threads']}/{p['threads']} {_ok(p['ok'])}",
                    _failed_names(r["acc_coverage"]), _ok(r["o_staging"]["ok"])], widths), flush=True)
    failed = [r["name"] for r in rows if not r["ok"]]
    print(f"sm90: {len(rows) - len(failed)}/{len(rows)} Hopper traits pass"
          + (f"; FAILED: {', '.join(failed)}" if failed else ""), flush=True)
    return not failed


def print_hopper_bwd_report() -> bool:
    """The Hopper backward's traits (sm_90), one row each: the names of failed checks, if any."""
    header = ["hopper bwd traits", "smem B", "fits", "failed checks"]
    widths = [40, WIDTHS["smem"], WIDTHS["fits"], 30]
    print(_row(header, widths), flush=True)
    failed = []
    shipped = shipped_hopper_bwd_traits()
    chosen = [hopper_bwd_dq(t, deterministic=False) for t in shipped]  # the policy's dQ path may change the tiles
    rows = [(t, True) for t in shipped] + [(c["traits"], c["dq_path"] != "atomic") for c in chosen if "traits" in c]
    for t, staged in rows:
        name = t.name + ("" if staged else "-atomic")  # no dQ staging tile
        checks = verify_hopper.bwd_checks(t)
        smem = bwd_smem_bytes(t, staged)
        fits = smem <= SMEM_LIMIT[90]
        bad = [k for k, v in checks.items() if k != "ok" and not v]
        if bad or not fits:
            failed.append(name)
        print(_row([name, f"{smem}", _ok(fits), ", ".join(bad) or "-"], widths), flush=True)
    n = len(rows)
    print(f"sm90: {n - len(failed)}/{n} Hopper backward traits pass" + (f"; FAILED: {', '.join(failed)}" if failed
                                                                          else ""), flush=True)
    return not failed


def draw(traits, out: Path) -> None:
    """sQ's 16-byte bank group per element (the swizzle) and the Q ldmatrix thread map."""
    out.mkdir(parents=True, exist_ok=True)
    print(f"drawing {2 * len(traits)} PNGs into {out} ...", flush=True)
    for t in traits:
        group = verify.smem_table("sQ", t) * ELEMENT_BYTES // 16 % 8
        verify.draw_layout(group, out / f"{t.name}_sQ_bankgroup.png", f"{t.name}: sQ 16-byte bank group")
        owner = verify.ownership(verify.partitions(t)["ldsm_q"])
        verify.draw_layout(owner, out / f"{t.name}_ldsm_q_threads.png", f"{t.name}: ldmatrix Q thread")


def run(archs=(80, 90), draw_dir: Path | None = None) -> int:
    """Every table for `archs`, and the PNGs into `draw_dir`; 0 when every check passes, else 1."""
    ok = True
    for arch in archs:
        ok &= print_report(arch)
        ok &= print_bwd_report(arch)
        if arch == 90:
            ok &= print_hopper_report()
            ok &= print_hopper_bwd_report()
    if draw_dir:
        traits = list(dict.fromkeys(t for arch in archs for t in shipped_fwd_traits(arch)))
        draw(traits, draw_dir)
        print(f"wrote {2 * len(traits)} PNGs (sQ bank groups, ldmatrix Q threads) to {draw_dir}")
    print("layouts report: " + ("every check passed" if ok else "FAILED (see the rows above)"))
    return 0 if ok else 1
