"""`python -m cute_flash bench`: forward TFLOP/s against torch SDPA's FLASH (flash-attn 2 C++) and
CUDNN backends and flash-attn-4 (when importable), measured side by side in one run; on sm_90
GPUs, where our default is the Hopper kernel, our SM80 kernel has a column of its own.

TFLOP/s counts the FLOPs of the visible (i, j) pairs: 4 * b * h * d per pair, which is docs/semantics.md's
4*b*h*sq*sk*d (halved for causal) up to the diagonal's rounding, and for a local window the work
actually left to do. Each time is the median of `triton.testing.do_bench` (a grid cell's, the
median of `GRID_ROUNDS` of them taken in turns); inputs are fresh normal data, larger than L2
in every grid cell.
"""
from __future__ import annotations

import contextlib
import functools
import itertools
import json
import math
import statistics
import time
from dataclasses import dataclass

from cute_flash.tools.peers import arch_path, fa4_func, graph_time_ms, hopper_gpu, sdpa, time_ms, visible_pairs

SEQLENS = (512, 1024, 2048, 4096, 8192, 16384)
HEAD_DIMS = (64, 128)
TOKENS = 16384
HIDDEN = 2048
# Rounds a grid cell times each column in (the median counts): single medians of
# `triton.testing.do_bench` on an H200 fell 6-27% below their neighbours now and then, for ours
# and flash-attn-4 alike (d 128 causal 512, five rounds in one process: ours 357.9, 361.7, 282.1,
# 360.8, 357.2 TFLOP/s; flash-attn-4 268.9, 197.4, 199.0, 269.8, 269.6; docs/tuning/hopper-forward.md).
GRID_ROUNDS = 3


def bench_cell(d, seqlen, causal=False, window=(-1, -1), softcap=0.0, peers=True, batch=None, nheads=None,
               rounds=GRID_ROUNDS):
    """ours (the default path: the Hopper kernel on sm_90 GPUs), `sm80` (our SM80 kernel, on
    sm_90 GPUs), SDPA FLASH and CUDNN and flash-attn-4 (when importable), in TFLOP/s: each the
    median over `rounds` rounds that time every column in turn."""
    import torch
    from torch.nn.attention import SDPBackend

    from cute_flash import flash_attn_func

    batch = batch or max(1, TOKENS // seqlen)
    nheads = nheads or HIDDEN // d
    q, k, v = (torch.randn(batch, seqlen, nheads, d, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    flops = 4 * batch * nheads * d * visible_pairs(seqlen, seqlen, causal, window)
    row = dict(d=d, seqlen=seqlen, batch=batch, nheads=nheads, causal=causal, window=list(window),
               softcap=softcap, flops=flops)

    def ours():
        return flash_attn_func(q, k, v, causal=causal, window_size=window, softcap=softcap)

    def sm80_time():
        with arch_path("sm80"):
            return time_ms(ours)

    timers = {"ours": functools.partial(time_ms, ours)}
    if hopper_gpu():
        timers["sm80"] = sm80_time
    if peers:
        fa4 = fa4_func()
        if fa4 is not None:
            timers["fa4"] = functools.partial(time_ms, lambda: fa4(q, k, v, causal=causal))
        for name, backend in (("flash", SDPBackend.FLASH_ATTENTION), ("cudnn", SDPBackend.CUDNN_ATTENTION)):
            fn = sdpa(q, k, v, backend, causal)
            if fn:
                timers[name] = functools.partial(time_ms, fn)
            else:
                row[f"{name}_tflops"] = None
    times = {name: [] for name in timers}
    for _ in range(rounds):
        for name, timer in timers.items():
            times[name].append(timer())
    for name, ms in times.items():
        row[f"{name}_tflops"] = flops / statistics.median(ms) / 1e9
    return row


def bench_bwd_cell(d, seqlen, causal=False):
    """Backward alone (`bwd`: 2.5x the forward's FLOPs) and forward + backward (`fwd+bwd`: 3.5x),
    each side through autograd (`torch.autograd.grad` on a kept graph), ours (also with
    deterministic=True) and SDPA's FLASH and CUDNN backends on the same inputs."""
    import torch
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from cute_flash import flash_attn_func

    batch, nheads = max(1, TOKENS // seqlen), HIDDEN // d
    q, k, v, dout = (torch.randn(batch, seqlen, nheads, d, device="cuda", dtype=torch.bfloat16) for _ in range(4))
    fwd_flops = 4 * batch * nheads * d * visible_pairs(seqlen, seqlen, causal)
    row = dict(d=d, seqlen=seqlen, batch=batch, nheads=nheads, causal=causal, fwd_flops=fwd_flops)

    def ours_fwd(q, k, v):
        return flash_attn_func(q, k, v, causal=causal)

    def sdpa_fwd(backend):
        def fwd(q, k, v):
            with sdpa_kernel(backend):
                return torch.nn.functional.scaled_dot_product_attention(
                    q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=causal).transpose(1, 2)
        return fwd

    def timed(fwd):
        """(backward ms, forward + backward ms) through autograd, or None where fwd refuses."""
        leaves = [x.detach().requires_grad_() for x in (q, k, v)]
        try:
            out = fwd(*leaves)
        except RuntimeError:
            return None
        return (time_ms(lambda: torch.autograd.grad(out, leaves, dout, retain_graph=True)),
                time_ms(lambda: torch.autograd.grad(fwd(*leaves), leaves, dout)))

    peers = [("ours", ours_fwd), ("det", lambda q, k, v: flash_attn_func(q, k, v, causal=causal, deterministic=True)),
             ("flash", sdpa_fwd(SDPBackend.FLASH_ATTENTION)),
             ("cudnn", sdpa_fwd(SDPBackend.CUDNN_ATTENTION))]
    if hopper_gpu():
        peers.insert(1, ("sm80", ours_fwd))
    fa4 = fa4_func()
    if fa4 is not None:
        peers.append(("fa4", lambda q, k, v: fa4(q, k, v, causal=causal)))
    for name, fwd in peers:
        with arch_path("sm80") if name == "sm80" else contextlib.nullcontext():
            ms = timed(fwd)
        row[f"{name}_bwd"] = 2.5 * fwd_flops / ms[0] / 1e9 if ms else None
        row[f"{name}_fwdbwd"] = 3.5 * fwd_flops / ms[1] / 1e9 if ms else None
    return row


def run_bwd(seqlens=SEQLENS, head_dims=HEAD_DIMS):
    return [bench_bwd_cell(d, s, causal) for d in head_dims for causal in (False, True) for s in seqlens]


def ratio_line(name: str, xs) -> str:
    """A table's closing line for one ratio: geometric mean, minimum, cells >= 1."""
    gm = math.exp(statistics.fmean(math.log(x) for x in xs))
    return f"{name}: geometric mean {gm:.3f}; min {min(xs):.3f}; cells >= 1.0: {sum(x >= 1.0 for x in xs)}/{len(xs)}"


def ratio_summary(ratios) -> str:
    """The closing line of a table of ours/FLASH ratios: geometric mean, minimum, cells >= 1."""
    gm = math.exp(statistics.fmean(math.log(x) for x in ratios))
    return (f"\ngeometric mean ours/FLASH: {gm:.3f}; min {min(ratios):.3f}; cells >= 1.0: "
            f"{sum(x >= 1.0 for x in ratios)}/{len(ratios)}")


def format_bwd(rows) -> str:
    """ours (the default path: the Hopper backward on sm_90 where it applies), ours with
    deterministic=True, SM80 (our SM80 kernels, sm_90 only), the peers, and ours over FLASH and
    over the best of CUDNN and FA4; deterministic over ours closes each table."""
    out = []
    for key, title in (("bwd", "backward alone (FLOPs 2.5x forward)"), ("fwdbwd", "forward + backward (3.5x)")):
        out += [f"{title}, TFLOP/s:", "", "| d | causal | seqlen | batch x heads | ours | deterministic | SM80 "
                "| FLASH | CUDNN | FA4 | ours/FLASH | ours/best peer |", "|---" * 12 + "|"]
        ratios, vs_peers, det = [], [], []
        for r in rows:
            ours, det_, sm80, flash, cudnn, fa4 = (r.get(f"{name}_{key}") for name in ("ours", "det", "sm80", "flash",
                                                                                       "cudnn", "fa4"))
            if ours and det_:
                det.append(det_ / ours)
            best = max((x for x in (cudnn, fa4) if x), default=None)
            rf = ours / flash if ours and flash else math.nan
            rp = ours / best if ours and best else math.nan
            if not math.isnan(rf):
                ratios.append(rf)
            if not math.isnan(rp):
                vs_peers.append(rp)
            cells = [f"{x:.0f}" if x else "-" for x in (ours, det_, sm80, flash, cudnn, fa4)]
            out.append(f"| {r['d']} | {r['causal']} | {r['seqlen']} | {r['batch']}x{r['nheads']} | "
                       f"{' | '.join(cells)} | {rf:.3f} | {rp:.3f} |")
        if ratios:
            out.append(ratio_summary(ratios))
        if vs_peers:
            out.append(ratio_line("ours / max(CUDNN, FA4)", vs_peers))
        if det:
            out.append(ratio_line("deterministic / ours", det))
        out.append("")
    return "\n".join(out)


def bench_dropout_cell(d, seqlen, causal=False, p=0.1):
    """The cost of dropout: forward and backward (through autograd, as `bench_bwd_cell`) at
    dropout p against p = 0, ours (the public function, its per-call state draw included) and
    SDPA's FLASH (flash-attn 2's C++ dropout) and CUDNN backends, TFLOP/s of the same FLOP
    count; a peer that refuses the call is left out of the row (None)."""
    import torch
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from cute_flash import flash_attn_func

    batch, nheads = max(1, TOKENS // seqlen), HIDDEN // d
    q, k, v, dout = (torch.randn(batch, seqlen, nheads, d, device="cuda", dtype=torch.bfloat16) for _ in range(4))
    fwd_flops = 4 * batch * nheads * d * visible_pairs(seqlen, seqlen, causal)
    row = dict(d=d, seqlen=seqlen, batch=batch, nheads=nheads, causal=causal, p=p, fwd_flops=fwd_flops)

    def ours(q, k, v, p):
        return flash_attn_func(q, k, v, dropout_p=p, causal=causal)

    def sdpa(backend):
        def run(q, k, v, p):
            with sdpa_kernel(backend):
                return torch.nn.functional.scaled_dot_product_attention(
                    q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), dropout_p=p,
                    is_causal=causal).transpose(1, 2)
        return run

    for name, fn in (("ours", ours), ("flash", sdpa(SDPBackend.FLASH_ATTENTION)),
                     ("cudnn", sdpa(SDPBackend.CUDNN_ATTENTION))):
        for tag, prob in (("p0", 0.0), ("p", p)):
            try:
                with torch.no_grad():
                    row[f"{name}_fwd_{tag}"] = fwd_flops / time_ms(lambda: fn(q, k, v, prob)) / 1e9
                leaves = [x.detach().requires_grad_() for x in (q, k, v)]
                out = fn(*leaves, prob)
                ms = time_ms(lambda: torch.autograd.grad(out, leaves, dout, retain_graph=True))
                row[f"{name}_bwd_{tag}"] = 2.5 * fwd_flops / ms / 1e9
            except RuntimeError:
                if name == "ours":
                    raise
                row[f"{name}_fwd_{tag}"] = row[f"{name}_bwd_{tag}"] = None
    if hopper_gpu():  # the SM80 kernels' dropout, what sm_90 ran before the Hopper kernels had it
        with arch_path("sm80"):
            with torch.no_grad():
                row["sm80_fwd_p"] = fwd_flops / time_ms(lambda: ours(q, k, v, p)) / 1e9
            leaves = [x.detach().requires_grad_() for x in (q, k, v)]
            out = ours(*leaves, p)
            ms = time_ms(lambda: torch.autograd.grad(out, leaves, dout, retain_graph=True))
            row["sm80_bwd_p"] = 2.5 * fwd_flops / ms / 1e9
    return row


def run_dropout(seqlens=SEQLENS, head_dims=HEAD_DIMS):
    return [bench_dropout_cell(d, s, causal) for d in head_dims for causal in (False, True) for s in seqlens]


def format_dropout(rows) -> str:
    """Each pass's overhead = time at p / time at p = 0 - 1 (the TFLOP/s ratio inverted), the
    same kernels at both; ours at p over the better peer at p (FLASH, CUDNN). On sm_90 also the
    SM80 kernels at p (`--sm80`) and ours / them."""
    def overhead(r, name, kind):
        if r.get(f"{name}_{kind}_p") is None or r.get(f"{name}_{kind}_p0") is None:
            return None
        return r[f"{name}_{kind}_p0"] / r[f"{name}_{kind}_p"] - 1

    def pct(x):
        return "-" if x is None else f"{x:+.1%}"

    def times(x):
        return "-" if x is None else f"{x:.2f}"

    def vs_peers(r, kind):
        peers = [r.get(f"{n}_{kind}_p") for n in ("flash", "cudnn")]
        peers = [x for x in peers if x is not None]
        return r[f"ours_{kind}_p"] / max(peers) if peers else None

    p = rows[0]["p"] if rows else 0.1
    sm80 = all("sm80_bwd_p" in r for r in rows)
    head = {kind: f"{kind} p SM80 | ours/SM80 | " if sm80 else "" for kind in ("fwd", "bwd")}
    rule = "---|---|" if sm80 else ""
    out = [f"dropout p = {p} against p = 0, TFLOP/s (bf16) and overhead; `vs peers`: ours at p over the "
           "better of FLASH and CUDNN at p:", "",
           f"| d | causal | seqlen | fwd p=0 | fwd p | fwd overhead | {head['fwd']}FLASH fwd overhead | "
           f"CUDNN fwd overhead | fwd vs peers | bwd p=0 | bwd p | bwd overhead | {head['bwd']}FLASH bwd overhead | "
           "CUDNN bwd overhead | bwd vs peers |",
           f"|---|---|---|---|---|---|{rule}---|---|---|---|---|---|{rule}---|---|---|"]
    for r in rows:
        vs = {kind: f"{r[f'sm80_{kind}_p']:.0f} | {r[f'ours_{kind}_p'] / r[f'sm80_{kind}_p']:.2f} | " if sm80 else ""
              for kind in ("fwd", "bwd")}
        peer = {kind: times(vs_peers(r, kind)) for kind in ("fwd", "bwd")}
        out.append(f"| {r['d']} | {r['causal']} | {r['seqlen']} | {r['ours_fwd_p0']:.0f} | {r['ours_fwd_p']:.0f} | "
                   f"{pct(overhead(r, 'ours', 'fwd'))} | {vs['fwd']}{pct(overhead(r, 'flash', 'fwd'))} | "
                   f"{pct(overhead(r, 'cudnn', 'fwd'))} | {peer['fwd']} | "
                   f"{r['ours_bwd_p0']:.0f} | {r['ours_bwd_p']:.0f} | {pct(overhead(r, 'ours', 'bwd'))} | "
                   f"{vs['bwd']}{pct(overhead(r, 'flash', 'bwd'))} | {pct(overhead(r, 'cudnn', 'bwd'))} | "
                   f"{peer['bwd']} |")
    if rows:
        fwd = [overhead(r, "ours", "fwd") for r in rows]
        bwd = [overhead(r, "ours", "bwd") for r in rows]
        out.append(f"\noverheads against p = 0: forward max {max(fwd):+.1%}, cells <= 15%: "
                   f"{sum(x <= 0.15 for x in fwd)}/{len(fwd)}; backward max {max(bwd):+.1%}, cells <= 20%: "
                   f"{sum(x <= 0.20 for x in bwd)}/{len(bwd)}")
        for kind in ("fwd", "bwd"):
            ratios = [x for x in (vs_peers(r, kind) for r in rows) if x is not None]
            if ratios:
                out.append(ratio_line(f"{kind} at p, ours / better peer at p", ratios))
    return "\n".join(out)


def run_grid(seqlens=SEQLENS, head_dims=HEAD_DIMS):
    return [bench_cell(d, s, causal) for d in head_dims for causal in (False, True) for s in seqlens]


def run_extra(seqlens=(8192, 16384)):
    """Issue 'score modifiers' rows: local windows and softcap, against our own dense numbers
    (SDPA's FLASH backend has neither option)."""
    rows = []
    for s in seqlens:
        for w in (256, 1024):
            rows.append(bench_cell(128, s, window=(w, 0), peers=False))
    for s in seqlens:
        rows.append(bench_cell(128, s, softcap=30.0, peers=False))
    return rows


VARLEN_SEED_LENGTHS = (16, 128, 8192)  # sequences, shortest, longest


def _varlen_lengths():
    import random

    n, lo, hi = VARLEN_SEED_LENGTHS
    rng = random.Random(0)
    return [rng.randint(lo, hi) for _ in range(n)]


def run_varlen(d=128, nheads=16):
    """A packed batch of 16 sequences of 128..8192 tokens (seeded) against the same batch padded
    to its longest sequence, run by SDPA FLASH and by our dense kernel. TFLOP/s count only the
    FLOPs of the real tokens, so padding shows up as lost throughput."""
    import torch
    from torch.nn.attention import SDPBackend

    from cute_flash import flash_attn_func, flash_attn_varlen_func

    lengths = _varlen_lengths()
    total, smax, b = sum(lengths), max(lengths), len(lengths)
    cu = torch.tensor([0] + list(itertools.accumulate(lengths)), dtype=torch.int32, device="cuda")
    q, k, v = (torch.randn(total, nheads, d, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    qp, kp, vp = (torch.randn(b, smax, nheads, d, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    rows = []
    for causal in (False, True):
        flops = sum(4 * nheads * d * visible_pairs(n, n, causal) for n in lengths)
        row = dict(d=d, nheads=nheads, causal=causal, sequences=b, tokens=total, padded_tokens=b * smax,
                   flops=flops)
        def varlen():
            return flash_attn_varlen_func(q, k, v, cu, cu, smax, smax, causal=causal)

        row["ours_varlen"] = flops / time_ms(varlen) / 1e9
        if hopper_gpu():
            for path in ("sm80", "sm90"):
                with arch_path(path):
                    row[f"{path}_varlen"] = flops / time_ms(varlen) / 1e9
        row["ours_dense_padded"] = flops / time_ms(lambda: flash_attn_func(qp, kp, vp, causal=causal)) / 1e9
        fn = sdpa(qp, kp, vp, SDPBackend.FLASH_ATTENTION, causal)
        row["flash_padded"] = flops / time_ms(fn) / 1e9 if fn else None
        rows.append(row)
    return rows


def shuffled_pages(k, v, page_size):
    """(k_pages, v_pages, block_table) holding contiguous (b, s, hk, d) caches in shuffled pages
    of `page_size` rows: the same storage re-viewed when s is a multiple of page_size, else a
    copy with each sequence padded to whole pages (the pad rows are never read)."""
    import torch

    b, s = k.shape[:2]
    per_seq = -(-s // page_size)
    if per_seq * page_size != s:
        pad = (0, 0, 0, 0, 0, per_seq * page_size - s)
        k, v = torch.nn.functional.pad(k, pad), torch.nn.functional.pad(v, pad)
    table = torch.randperm(b * per_seq, device=k.device).view(b, per_seq).int()
    return (k.reshape(b * per_seq, page_size, *k.shape[2:]), v.reshape(b * per_seq, page_size, *v.shape[2:]), table)


@contextlib.contextmanager
def host_check_off():
    """Paged `flash_attn_with_kvcache` calls without flash-attn's host check of the block table
    (a device sync per call), to time what the check costs."""
    from cute_flash import _validate

    check = _validate.check_block_table_capacity
    _validate.check_block_table_capacity = lambda *args: None
    try:
        yield
    finally:
        _validate.check_block_table_capacity = check


# Multiples of 16 take the page-run (prefill) and shared-page-id (decode) copies; 1, 8 and 1000
# take the per-row page lookup.
PAGE_SIZES = (1, 8, 16, 64, 256, 1000)
PAGED_DECODE_CELLS = ((8, 32768), (64, 8192))


def run_paged(d=128, nheads=16, seqlen=4096, batch=8, decode_cells=PAGED_DECODE_CELLS):
    """Prefill over a paged cache (varlen entry with block_table) and decode over one
    (flash_attn_with_kvcache, DECODE_HEADS), each against the same keys stored contiguously; the
    ratio is contiguous time / paged time (1.0 = no paging cost). Paged decode calls pay
    flash-attn's host check of the block table (a device sync); each decode cell is also timed
    with the check switched off, which is its cost."""
    import torch

    from cute_flash import flash_attn_varlen_func, flash_attn_with_kvcache

    cu = torch.arange(0, (batch + 1) * seqlen, seqlen, dtype=torch.int32, device="cuda")
    q, k, v = (torch.randn(batch * seqlen, nheads, d, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    rows = []
    for causal in (False, True):
        flops = batch * 4 * nheads * d * visible_pairs(seqlen, seqlen, causal)
        flat = time_ms(lambda: flash_attn_varlen_func(q, k, v, cu, cu, seqlen, seqlen, causal=causal))
        for ps in PAGE_SIZES:
            kp, vp, table = shuffled_pages(k.view(batch, seqlen, nheads, d), v.view(batch, seqlen, nheads, d), ps)
            paged = time_ms(lambda: flash_attn_varlen_func(q, kp, vp, cu, cu, seqlen, seqlen, causal=causal,
                                                           block_table=table))
            rows.append(dict(kind="prefill", d=d, nheads=nheads, seqlen=seqlen, batch=batch, causal=causal,
                             page_size=ps, contiguous=flops / flat / 1e9, paged=flops / paged / 1e9,
                             ratio=flat / paged))
            del kp, vp
    del q, k, v
    for b, cache in decode_cells:
        call = DecodeCall.make(b, cache)
        nbytes = call.nbytes
        flat = time_ms(lambda: flash_attn_with_kvcache(call.q, call.k_cache, call.v_cache,
                                                        cache_seqlens=call.cache_seqlens))
        for ps in PAGE_SIZES:
            kp, vp, table = shuffled_pages(call.k_cache, call.v_cache, ps)

            def paged():
                return flash_attn_with_kvcache(call.q, kp, vp, cache_seqlens=call.cache_seqlens, block_table=table)

            t_paged = time_ms(paged)
            with host_check_off():
                t_unchecked = time_ms(paged)
            rows.append(dict(kind="decode", batch=b, cache=cache, page_size=ps, contiguous=nbytes / flat / 1e6,
                             paged=nbytes / t_paged / 1e6, ratio=flat / t_paged,
                             host_check_us=1e3 * (t_paged - t_unchecked), unchecked_ratio=flat / t_unchecked))
            print(rows[-1], flush=True)
            del kp, vp
        del call
        torch.cuda.empty_cache()
    return rows


UNALIGNED_CELLS = ((1, 32768), (8, 8192), (64, 1024))


def run_unaligned(cells=UNALIGNED_CELLS):
    """Decode over caches whose rows break 128-bit copies, which `flash_attn_with_kvcache` serves
    through aligned copies of both caches (copied back when the call appends): a base address off
    16 bytes (d 128), and d 100 (padded to 104). Each is timed against an aligned d 128 cache of
    the same size, without and with one appended row; the ratio is aligned time / this time."""
    import torch

    from cute_flash import flash_attn_with_kvcache

    h, hk, _ = DECODE_HEADS
    rows = []
    for b, cache in cells:
        seqlens = torch.full((b,), cache - 1, dtype=torch.int32, device="cuda")
        layouts = {}
        for name, d, offset in (("aligned", 128, 0), ("address off 16 B", 128, 1), ("d 100", 100, 0)):
            k_cache, v_cache = (torch.randn(b * cache * hk * d + offset, device="cuda", dtype=torch.bfloat16)
                                [offset:].view(b, cache, hk, d) for _ in range(2))
            layouts[name] = (d, k_cache, v_cache)
        base = {}
        for name, (d, k_cache, v_cache) in layouts.items():
            q = torch.randn(b, 1, h, d, device="cuda", dtype=torch.bfloat16)
            k_new, v_new = (torch.randn(b, 1, hk, d, device="cuda", dtype=torch.bfloat16) for _ in range(2))
            for append in (False, True):
                extra = dict(k=k_new, v=v_new) if append else {}
                ms = time_ms(lambda: flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=seqlens, **extra))
                base.setdefault(append, ms)
                rows.append(dict(batch=b, cache=cache, layout=name, append=append, us=1e3 * ms,
                                 ratio=base[append] / ms))
                print(rows[-1], flush=True)
        del layouts
        torch.cuda.empty_cache()
    return rows


def format_unaligned(rows) -> str:
    out = ["| decode | cache rows | append | us/call | aligned time / this time |", "|---|---|---|---|---|"]
    for r in rows:
        out.append(f"| b{r['batch']} cache {r['cache']} | {r['layout']} | {r['append']} | {r['us']:.1f} | "
                   f"{r['ratio']:.3f} |")
    return "\n".join(out)


DECODE_BATCHES = (1, 8, 32, 64)
DECODE_CACHES = (1024, 8192, 32768, 131072)
DECODE_HEADS = (32, 8, 128)  # nheads, nheads_k, d


@dataclass(frozen=True)
class DecodeCall:
    """One decode cell's inputs (`DECODE_HEADS`, bf16): q (b, 1, h, d), full caches k_cache /
    v_cache (b, cache, hk, d) with cache_seqlens (b,) int32 all `cache`, and nbytes, the K / V
    bytes a call reads (2 * b * cache * hk * d * 2), over which GB/s is counted."""
    q: object
    k_cache: object
    v_cache: object
    cache_seqlens: object
    nbytes: int

    @classmethod
    def make(cls, b: int, cache: int) -> DecodeCall:
        import torch

        h, hk, d = DECODE_HEADS
        q = torch.randn(b, 1, h, d, device="cuda", dtype=torch.bfloat16)
        k_cache, v_cache = (torch.randn(b, cache, hk, d, device="cuda", dtype=torch.bfloat16) for _ in range(2))
        seqlens = torch.full((b,), cache, dtype=torch.int32, device="cuda")
        return cls(q, k_cache, v_cache, seqlens, 2 * b * cache * hk * d * 2)


def copy_bandwidth_gbs(nbytes=4 << 30):
    """Device copy bandwidth (bytes read + written per second), the decode ceiling."""
    import torch

    src = torch.empty(nbytes // 2, dtype=torch.bfloat16, device="cuda")
    dst = torch.empty_like(src)
    return 2 * nbytes / time_ms(lambda: dst.copy_(src)) / 1e6


def run_decode(batches=DECODE_BATCHES, caches=DECODE_CACHES):
    """seqlen_q = 1 over full caches: GB/s of K/V read (2 * b * cache * nheads_k * d * 2 bytes per
    call) for ours (the default path, num_splits heuristic), on sm_90 GPUs also our SM80 kernel
    (`CUTE_FLASH_ARCH_PATH=sm80`), SDPA FLASH and CUDNN on the same contiguous cache (GQA
    through enable_gqa), and flash-attn-4's `flash_attn_func` when importable and it takes the
    call (its GQA packing; it has no split-KV on sm_90: "SplitKV not supported on SM 9.0").
    Paged caches: `run_paged`."""
    import torch
    from torch.nn.attention import SDPBackend

    from cute_flash import flash_attn_with_kvcache

    h, hk, d = DECODE_HEADS
    fa4 = fa4_func()
    rows = []
    for b in batches:
        for cache in caches:
            call = DecodeCall.make(b, cache)
            q, kc, vc, nbytes = call.q, call.k_cache, call.v_cache, call.nbytes
            row = dict(batch=b, cache=cache, nheads=h, nheads_k=hk, d=d, bytes=nbytes)

            def ours():
                return flash_attn_with_kvcache(q, kc, vc, cache_seqlens=call.cache_seqlens)

            def timed(name, fn):
                row[f"{name}_gbs"] = nbytes / time_ms(fn) / 1e6 if fn else None
                graph_ms = graph_time_ms(fn) if fn else None
                row[f"{name}_graph_gbs"] = nbytes / graph_ms / 1e6 if graph_ms else None

            timed("ours", ours)
            if hopper_gpu():  # our SM80 kernel, the path of sm_80/86/89 GPUs
                with arch_path("sm80"):
                    timed("sm80", ours)
            for name, backend in (("flash", SDPBackend.FLASH_ATTENTION), ("cudnn", SDPBackend.CUDNN_ATTENTION)):
                timed(name, sdpa(q, kc, vc, backend, False, enable_gqa=True))
            timed("fa4", _fa4_decode(fa4, q, kc, vc))
            rows.append(row)
            print(row, flush=True)
            del call, kc, vc
            torch.cuda.empty_cache()
    return rows


def _fa4_decode(fa4, q, kc, vc):
    """flash-attn-4 (`fa4_func`) on a decode call as fn() -> out, or None where it is absent or
    refuses it."""
    if fa4 is None:
        return None

    def run():
        return fa4(q, kc, vc, False)

    try:
        run()
        return run
    except (RuntimeError, AssertionError, ValueError):
        return None


def format_varlen(rows) -> str:
    paths = [p for p in ("sm80", "sm90") if rows and f"{p}_varlen" in rows[0]]
    out = ["| causal | tokens (padded) | ours varlen | " + "".join(f"{p} varlen | " for p in paths)
           + "ours dense, padded | FLASH, padded | varlen / FLASH padded |",
           "|---|---|---|---|---|---|" + "---|" * len(paths)]
    for r in rows:
        flash = r.get("flash_padded")
        rel = f"{r['ours_varlen'] / flash:.2f}" if flash else "-"
        out.append(f"| {r['causal']} | {r['tokens']} ({r['padded_tokens']}) | {r['ours_varlen']:.0f} | "
                   + "".join(f"{r[f'{p}_varlen']:.0f} | " for p in paths)
                   + f"{r['ours_dense_padded']:.0f} | {flash or 0:.0f} | {rel} |")
    return "\n".join(out)


def format_paged(rows) -> str:
    out = ["| workload | page size | contiguous | paged | contiguous time / paged time | host check (us/call) "
           "| ratio without it |", "|---|---|---|---|---|---|---|"]
    for r in rows:
        if r["kind"] == "prefill":
            out.append(f"| prefill {r['batch']}x{r['seqlen']} causal={r['causal']} (TFLOP/s) | {r['page_size']} | "
                       f"{r['contiguous']:.0f} | {r['paged']:.0f} | {r['ratio']:.3f} | - | - |")
        else:
            out.append(f"| decode b{r['batch']} cache {r['cache']} (GB/s) | {r['page_size']} | {r['contiguous']:.0f} | "
                       f"{r['paged']:.0f} | {r['ratio']:.3f} | {r['host_check_us']:.1f} | {r['unchecked_ratio']:.3f} |")
    return "\n".join(out)


def format_decode(rows, copy_gbs) -> str:
    """Eager and CUDA-graph tables; ours over each peer and over the best of CUDNN and FA4 (the
    issue's bar); our SM80 kernel's table on sm_90 GPUs."""
    def cell(x):
        return f"{x:.0f}" if x else "-"

    def ratio(a, b):
        return f"{a / b:.2f}" if a and b else "-"

    out = [f"copy bandwidth (read + write): {copy_gbs:.0f} GB/s", ""]
    for title, key in (("eager calls (host time included when the GPU waits for it)", "gbs"),
                       ("the same calls replayed from a CUDA graph (GPU time only)", "graph_gbs")):
        out += [f"GB/s of K/V read, {title}:", "",
                "| batch | cache | ours | % of copy | FLASH | CUDNN | FA4 | ours/FLASH | ours/CUDNN | ours/FA4 "
                "| ours/best peer |", "|---|---|---|---|---|---|---|---|---|---|---|"]
        vs_best = []
        for r in rows:
            o, f, c, a = (r.get(f"{n}_{key}") for n in ("ours", "flash", "cudnn", "fa4"))
            best = max((x for x in (c, a) if x), default=None)
            if o and best:
                vs_best.append(o / best)
            out.append(f"| {r['batch']} | {r['cache']} | {cell(o)} | {100 * (o or 0) / copy_gbs:.0f}% | {cell(f)} | "
                       f"{cell(c)} | {cell(a)} | {ratio(o, f)} | {ratio(o, c)} | {ratio(o, a)} | {ratio(o, best)} |")
        if vs_best:
            out += ["", f"ours / best peer: min {min(vs_best):.2f}, cells >= 1.00: "
                        f"{sum(x >= 1.0 for x in vs_best)}/{len(vs_best)}", ""]
    if any(r.get("sm80_gbs") for r in rows):
        out += ["Our SM80 kernel (`CUTE_FLASH_ARCH_PATH=sm80`, the path of sm_80/86/89 GPUs) on the same "
                "calls:", "", "| batch | cache | SM80 | ours/SM80 | SM80 (graph) | ours/SM80 (graph) |",
                "|---|---|---|---|---|---|"]
        for r in rows:
            s, sg = r.get("sm80_gbs"), r.get("sm80_graph_gbs")
            out.append(f"| {r['batch']} | {r['cache']} | {cell(s)} | {ratio(r['ours_gbs'], s)} | {cell(sg)} | "
                       f"{ratio(r.get('ours_graph_gbs'), sg)} |")
    return "\n".join(out)


# (block_m, block_n, warps) tried per head dim by `tune`; the first is the shipped choice.
TUNE_CANDIDATES = {
    64: [(128, 128, 4), (128, 64, 4), (128, 128, 8), (64, 128, 4)],
    128: [(128, 64, 4), (128, 128, 8), (128, 64, 8), (64, 64, 4), (64, 128, 4)],
}


def _tune_fwd(candidates: dict, seqlens, variant):
    """TFLOP/s of each forward candidate on the forward grid's shapes, bf16: `variant(d, cand)`
    gives (name, fn(q, k, v, causal)) for each entry of candidates[d]."""
    import torch

    rows = []
    for d, cands in candidates.items():
        for causal in (False, True):
            for s in seqlens:
                b, h = max(1, TOKENS // s), HIDDEN // d
                q, k, v = (torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16) for _ in range(3))
                flops = 4 * b * h * d * visible_pairs(s, s, causal)
                for cand in cands:
                    name, fn = variant(d, cand)
                    ms = time_ms(lambda: fn(q, k, v, causal))
                    rows.append(dict(d=d, causal=causal, seqlen=s, traits=name, tflops=flops / ms / 1e9))
                    print(f"d{d} causal={causal!s:5} s{s:6} {name:48} {rows[-1]['tflops']:6.0f}", flush=True)
    return rows


def tune(seqlens=(1024, 4096, 16384)):
    """TFLOP/s of each tile candidate on the forward grid's shapes (docs/semantics.md), bf16, for
    choosing traits."""
    from cute_flash.launch.dense import flash_fwd
    from layouts.traits import FwdTraits

    def variant(d, cand):
        t = FwdTraits(d, *cand, "bf16")
        return t.name, lambda q, k, v, causal: flash_fwd(q, k, v, softmax_scale=d ** -0.5, causal=causal, traits=t)

    return _tune_fwd(TUNE_CANDIDATES, seqlens, variant)


# (block_m, block_n, persistent, speculative maxima: beside S on 128-row tiles, in place on 192-row
# ones, K / V stages: None for the launcher's `kv_stages`, K / V multicast: None for the launcher's
# `takes_kv_multicast`, False for none)
SM90_TUNE_CANDIDATES = {64: [(128, 128, True, True, 2, None), (128, 128, True, True, 3, None),
                             (128, 128, True, False, None, None), (128, 128, False, True, None, None),
                             (192, 128, True, True, None, None), (192, 128, True, False, None, None),
                             (192, 128, False, False, None, None)],
                        128: [(128, 128, True, True, None, None), (128, 128, True, True, None, False),
                              (128, 128, True, False, None, None), (128, 128, False, True, None, None)]}


def tune_sm90(seqlens=(512, 2048, 16384)):
    """TFLOP/s of each Hopper forward candidate (block_m, block_n, persistent, speculative
    maxima, K / V stages, K / V multicast) on the forward grid's shapes, bf16: `python -m
    cute_flash tune --sm90`."""
    from cute_flash.launch.hopper import flash_fwd_sm90
    from layouts.hopper import HopperTileTraits

    def variant(d, cand):
        m, n, persistent, speculative, stages, multicast = cand
        t = HopperTileTraits(d, m, n, "bf16")
        name = (t.name + ("_persistent" if persistent else "") + ("_speculative" if speculative else "")
                + (f"_s{stages}" if stages else "") + {None: "", False: "_unicast"}[multicast])
        return name, lambda q, k, v, causal: flash_fwd_sm90(q, k, v, softmax_scale=d ** -0.5, causal=causal, traits=t,
                                                            persistent=persistent, speculative_max=speculative,
                                                            stages=stages, kv_multicast=multicast)

    return _tune_fwd(SM90_TUNE_CANDIDATES, seqlens, variant)


DECODE_TUNE_CANDIDATES = [(128, 1), (64, 1), (64, 2)]  # (block_n, CTAs an SM) of 64-row tiles; first: shipped
DECODE_TUNE_CELLS = [(1, 1024), (1, 8192), (8, 1024), (8, 8192), (32, 1024), (64, 1024), (32, 8192), (64, 32768)]


def tune_decode(cells=DECODE_TUNE_CELLS):
    """GB/s (CUDA graphs and eager) of each Hopper KV-cache candidate (block_n, CTAs an SM) on
    decode cells (`DECODE_HEADS`, full bf16 caches, the split heuristic for that many CTAs an
    SM), with each candidate's max |out - shipped candidate's out|: `python -m cute_flash tune
    --decode` (sm_90 GPUs)."""
    from cute_flash.launch.kvcache import flash_fwd_kvcache
    from layouts.hopper import HopperTileTraits

    d = DECODE_HEADS[2]
    rows = []
    for b, cache in cells:
        call = DecodeCall.make(b, cache)
        nbytes = call.nbytes
        shipped = None
        for block_n, ctas in DECODE_TUNE_CANDIDATES:
            variant = dict(traits=HopperTileTraits(d, 64, block_n, "bf16"), ctas_per_sm=ctas)
            key = ("tune_decode", b, cache, block_n, ctas)  # the call's setup is kept under it, as a decode loop's

            def run():
                return flash_fwd_kvcache(call.q, call.k_cache, call.v_cache, cache_seqlens=call.cache_seqlens,
                                         softmax_scale=d ** -0.5, return_lse=False, signature=key,
                                         hopper_variant=variant)[0]

            out = run()
            shipped = out if shipped is None else shipped
            graph_ms = graph_time_ms(run)
            rows.append(dict(batch=b, cache=cache, block_n=block_n, ctas_per_sm=ctas,
                             gbs=nbytes / time_ms(run) / 1e6, graph_gbs=nbytes / graph_ms / 1e6 if graph_ms else None,
                             max_diff=(out.float() - shipped.float()).abs().max().item()))
            r = rows[-1]
            print(f"b{b:3} cache {cache:6} n{block_n:3} ctas/SM {ctas} eager {r['gbs']:6.0f} graph "
                  f"{r['graph_gbs'] or 0:6.0f} GB/s  max diff {r['max_diff']:.2e}", flush=True)
    return rows


DECODE_SPLIT_BATCHES = (6, 8, 9, 11, 12, 13, 16)  # 48-128 (batch, kv head) tiles: 6 and 9-13 fill 36-79% of 132 SMs
DECODE_SPLIT_COUNTS = (1, 2, 3, 4, 5, 6, 8, 12, 16)


def tune_decode_splits(batches=DECODE_SPLIT_BATCHES, caches=(8192, 32768, 131072), counts=DECODE_SPLIT_COUNTS):
    """GB/s under CUDA graphs of every split count in `counts` on decode cells (`DECODE_HEADS`,
    full bf16 caches, the default path), beside the default call's (`split_choice`: equal splits
    or, on the Hopper entry, stream-K), CUDNN and, on sm_90, stream-K over every SM forced ("K",
    with its max |out - unsplit out|): `python -m cute_flash tune --splits`. The default
    batches put 48-128 tiles on the GPU, where one wave of splits does not fill the SMs (72
    tiles, 128k keys: unsplit 2834 GB/s, 3 splits 4427, CUDNN 3800; docs/tuning/decode-splits.md, "Split counts
    where one wave leaves SMs idle")."""
    import torch
    from torch.nn.attention import SDPBackend

    from cute_flash import flash_attn_with_kvcache
    from cute_flash.launch import gpu
    from cute_flash.launch.kvcache import flash_fwd_kvcache

    hopper = hopper_gpu()
    sms = gpu.num_sms(torch.cuda.current_device()) if hopper else 0
    rows = []
    for b in batches:
        for cache in caches:
            call = DecodeCall.make(b, cache)
            row = {"batch": b, "cache": cache, "gbs": {}}
            for s in (0, *counts):  # 0: the heuristic's count
                ms = graph_time_ms(functools.partial(flash_attn_with_kvcache, call.q, call.k_cache, call.v_cache,
                                                      cache_seqlens=call.cache_seqlens, num_splits=s))
                row["gbs"][s] = call.nbytes / ms / 1e6 if ms else None
            stream = None
            if hopper:
                stream = functools.partial(flash_fwd_kvcache, call.q, call.k_cache, call.v_cache,
                                           cache_seqlens=call.cache_seqlens, softmax_scale=DECODE_HEADS[2] ** -0.5,
                                           return_lse=False, signature=("tune_stream", b, cache),
                                           hopper_variant=dict(stream_ctas=sms))
                unsplit = flash_attn_with_kvcache(call.q, call.k_cache, call.v_cache, cache_seqlens=call.cache_seqlens,
                                                  num_splits=1)
                row["stream_max_diff"] = (stream()[0].float() - unsplit.float()).abs().max().item()
                ms = graph_time_ms(lambda stream=stream: stream()[0])
                row["gbs"]["K"] = call.nbytes / ms / 1e6 if ms else None
            cudnn = sdpa(call.q, call.k_cache, call.v_cache, SDPBackend.CUDNN_ATTENTION, False, enable_gqa=True)
            cudnn_ms = graph_time_ms(cudnn) if cudnn else None
            row["cudnn_gbs"] = call.nbytes / cudnn_ms / 1e6 if cudnn_ms else None
            rows.append(row)
            best = max(counts, key=lambda s: row["gbs"][s] or 0)
            k_col = f"  K: {row['gbs']['K'] or 0:.0f} (diff {row['stream_max_diff']:.1e})" if hopper else ""
            print(f"b{b:3} cache {cache:6} heuristic {row['gbs'][0] or 0:5.0f}  best {best:2} splits "
                  f"{row['gbs'][best] or 0:5.0f}  CUDNN {row['cudnn_gbs'] or 0:5.0f} |  "
                  + "  ".join(f"{s}: {row['gbs'][s] or 0:.0f}" for s in counts) + k_col, flush=True)
            del call, cudnn, stream
            torch.cuda.empty_cache()
    return rows


BWD_TUNE_CANDIDATES = {  # (block_m, block_n, (atom_m_sdp, atom_n_dkv, atom_m_dq)), 8 warps
    64: [(128, 128, (2, 4, 4)), (128, 128, (4, 4, 4)), (64, 128, (2, 4, 2)), (64, 128, (2, 4, 4)),
         (128, 64, (4, 2, 4))],
    128: [(64, 128, (2, 4, 2)), (64, 128, (2, 4, 4)), (64, 128, (2, 2, 2)), (64, 64, (2, 2, 2)),
          (128, 64, (4, 2, 4))],
}


def tune_bwd(seqlens=(512, 2048, 8192)):
    """Backward-alone TFLOP/s (2.5x the forward's FLOPs) of each backward tile candidate, with
    Q / dO double-buffered where shared memory allows, and on sm_90 with the dQ adds as atomics
    and as bulk reduces where the staging tile fits: `python -m cute_flash tune --bwd`."""
    import torch

    from cute_flash.kernels.sm80.bwd import BwdConfig
    from cute_flash.launch import gpu
    from cute_flash.launch.backward import flash_bwd
    from cute_flash.launch.dense import flash_fwd
    from layouts.traits import SMEM_LIMIT, BwdTraits, tile_arch

    arch = gpu.device_arch(torch.cuda.current_device())
    rows = []
    for d, cands in BWD_TUNE_CANDIDATES.items():
        for causal in (False, True):
            for s in seqlens:
                b, h = max(1, TOKENS // s), HIDDEN // d
                q, k, v, dout = (torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16) for _ in range(4))
                out, lse = flash_fwd(q, k, v, softmax_scale=d ** -0.5, causal=causal)
                flops = 2.5 * 4 * b * h * d * visible_pairs(s, s, causal)
                for m, n, atoms in cands:
                    t = BwdTraits(d, m, n, 8, *atoms, q_stages=2)
                    if not t.fits(tile_arch(arch)):
                        t = BwdTraits(d, m, n, 8, *atoms, q_stages=1)
                    for bulk in ((False, True) if arch >= 90 else (False,)):
                        if BwdConfig(t, dq_vec=4, dq_bulk=bulk).smem_bytes > SMEM_LIMIT[tile_arch(arch)]:
                            continue
                        variant = dict(traits=t, dq_bulk=bulk)
                        ms = time_ms(lambda: flash_bwd(dout, q, k, v, out, lse, softmax_scale=d ** -0.5,
                                                        causal=causal, variant=variant))
                        rows.append(dict(d=d, causal=causal, seqlen=s, traits=t.name, dq_bulk=bulk,
                                         tflops=flops / ms / 1e9))
                        print(f"d{d} causal={causal!s:5} s{s:6} {t.name:40} bulk={bulk!s:5} "
                              f"{rows[-1]['tflops']:6.0f}", flush=True)
    return rows


def _dq_ways(d: int) -> dict:
    """`tune_bwd_dq`'s ways, as flash_bwd / flash_bwd_varlen keywords."""
    from dataclasses import replace

    from layouts.hopper import choose_hopper_bwd_traits

    one = choose_hopper_bwd_traits(d)  # the bucket's tiles, whatever the policy's path changes in them
    ways = {path: dict(hopper_variant=dict(dq_path=path, traits=one)) for path in ("bulk", "writer", "atomic")}
    ways |= {"deterministic": dict(deterministic=True), "policy": dict()}
    if d == 256:
        ways["atomic_2stages"] = dict(hopper_variant=dict(dq_path="atomic", traits=replace(one, q_stages=2)))
    return ways


def _by_sequence(call):
    """`call` with the packed backward launched by sequence whatever the mask (the policy,
    `policy.packed_bwd_by_sequence`, takes that order under a right edge)."""
    from unittest import mock

    from cute_flash.launch import policy

    def run():
        with mock.patch.object(policy, "packed_bwd_by_sequence", lambda config: True):
            return call()
    return run


def _time_ways(label: str, call, ways: dict, flops: float, rounds: int) -> dict:
    """Each way's (call keywords, or a function of no arguments) median backward-alone TFLOP/s
    over `rounds` interleaved timings, and its max |dQ - bulk's dQ| (bulk against itself: the
    unordered adds' spread)."""
    runs = {w: kw if callable(kw) else functools.partial(call, **kw) for w, kw in ways.items()}
    dq_default = runs["bulk"]()[0].float()
    err = {w: (run()[0].float() - dq_default).abs().max().item() for w, run in runs.items()}
    times = {w: [] for w in ways}
    for _ in range(rounds):
        for w, run in runs.items():
            times[w].append(time_ms(run))
    tflops = {w: flops / statistics.median(t) / 1e9 for w, t in times.items()}
    print(f"{label} " + " ".join(f"{w} {tflops[w]:.0f} ({err[w]:.1e}, {tflops[w] / tflops['bulk']:.3f})"
                                 for w in ways), flush=True)
    return dict(tflops=tflops, max_dq_diff=err)


def tune_bwd_dq(seqlens=(4096,), means=(512, 2048), rounds=3):
    """The Hopper backward's dQ paths (`Sm90BwdConfig.dq_path`: "bulk", "writer", "atomic", each
    on the bucket's tiles; at d 256 "atomic" also with two Q / dO stages in the staging tile's
    room), deterministic mode and the policy's choice (`policy.hopper_bwd_dq`; on packed
    batches also launched by sequence whatever the mask, `policy.packed_bwd_by_sequence`),
    interleaved `rounds` times per cell (the median kept):
    backward-alone TFLOP/s at d 64 / 128 / 192 / 256, causal or not, and on packed batches at
    d 128 (the train_varlen section's lengths), each with max |dQ - bulk's dQ| and its rate over
    bulk's: `python -m cute_flash tune --bwd-dq` (sm_90 GPUs)."""
    import itertools

    import torch

    from cute_flash.launch.backward import flash_bwd, flash_bwd_varlen
    from cute_flash.launch.dense import flash_fwd, flash_fwd_varlen
    from cute_flash.tools.bench_train_varlen import exponential_lengths

    def rnd(*shape, g):
        return torch.randn(*shape, device="cuda", dtype=torch.bfloat16, generator=g)

    rows = []
    for d in (64, 128, 192, 256):
        for causal in (False, True):
            for s in seqlens:
                b, h = max(1, TOKENS // s), HIDDEN // d
                g = torch.Generator(device="cuda").manual_seed(d + s)
                q, k, v, dout = (rnd(b, s, h, d, g=g) for _ in range(4))
                out, lse = flash_fwd(q, k, v, softmax_scale=d ** -0.5, causal=causal)
                call = functools.partial(flash_bwd, dout, q, k, v, out, lse, softmax_scale=d ** -0.5, causal=causal)
                flops = 2.5 * 4 * b * h * d * visible_pairs(s, s, causal)
                rows.append(dict(d=d, causal=causal, seqlen=s, **_time_ways(
                    f"d{d} causal={causal!s:5} s{s:6}", call, _dq_ways(d), flops, rounds)))
    d = 128
    for mean in means:
        for causal in (False, True):
            lengths = exponential_lengths(mean, TOKENS)
            cu = torch.tensor([0, *itertools.accumulate(lengths)], dtype=torch.int32, device="cuda")
            h, smax = HIDDEN // d, max(lengths)
            g = torch.Generator(device="cuda").manual_seed(mean)
            q, k, v, dout = (rnd(sum(lengths), h, d, g=g) for _ in range(4))
            lens = dict(cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=smax, max_seqlen_k=smax)
            out, lse = flash_fwd_varlen(q, k, v, softmax_scale=d ** -0.5, causal=causal, **lens)
            call = functools.partial(flash_bwd_varlen, dout, q, k, v, out, lse, softmax_scale=d ** -0.5,
                                     causal=causal, **lens)
            flops = 2.5 * sum(4 * h * d * visible_pairs(n, n, causal) for n in lengths)
            rows.append(dict(d=d, causal=causal, mean=mean, **_time_ways(
                f"packed d{d} causal={causal!s:5} mean {mean} ({len(lengths)} seqs, longest {smax})", call,
                _dq_ways(d) | {"policy_by_sequence": _by_sequence(call)}, flops, rounds)))
    return rows


def format_grid(rows) -> str:
    """ours/FLASH, ours against the better of CUDNN and flash-attn-4, and on sm_90 ours (the
    Hopper kernel) against our SM80 kernel."""
    out = ["| d | causal | seqlen | batch x heads | ours | SM80 | FLASH | CUDNN | FA4 | ours/FLASH | ours/best peer "
           "| ours/SM80 |", "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    ratios, vs_peers, vs_sm80 = [], [], []
    for r in rows:
        ratio = r["ours_tflops"] / r["flash_tflops"] if r.get("flash_tflops") else math.nan
        best = max((r[k] for k in ("cudnn_tflops", "fa4_tflops") if r.get(k)), default=None)
        vs_best = r["ours_tflops"] / best if best else math.nan
        vs_own = r["ours_tflops"] / r["sm80_tflops"] if r.get("sm80_tflops") else math.nan
        for kept, x in ((ratios, ratio), (vs_peers, vs_best), (vs_sm80, vs_own)):
            if not math.isnan(x):
                kept.append(x)
        cells = [f"{r[k]:.0f}" if r.get(k) else "-"
                 for k in ("ours_tflops", "sm80_tflops", "flash_tflops", "cudnn_tflops", "fa4_tflops")]
        out.append(f"| {r['d']} | {r['causal']} | {r['seqlen']} | {r['batch']}x{r['nheads']} | "
                   f"{' | '.join(cells)} | {ratio:.3f} | {vs_best:.3f} | {vs_own:.3f} |")
    if ratios:
        out.append(ratio_summary(ratios))
    for name, xs in (("ours / max(CUDNN, FA4)", vs_peers), ("ours / our SM80 kernel", vs_sm80)):
        if xs:
            out.append(ratio_line(name, xs))
    return "\n".join(out)


def format_extra(rows, dense) -> str:
    """Window/softcap rows next to our dense non-causal number at the same shape."""
    ref = {(r["d"], r["seqlen"]): r["ours_tflops"] for r in dense if not r["causal"]}
    out = ["| seqlen | option | computed FLOP fraction | ours TFLOP/s (computed) | vs ours dense |",
           "|---|---|---|---|---|"]
    for r in rows:
        full = 4 * r["batch"] * r["nheads"] * r["d"] * r["seqlen"] ** 2
        opt = f"window {tuple(r['window'])}" if r["window"] != [-1, -1] else f"softcap {r['softcap']:g}"
        base = ref.get((r["d"], r["seqlen"]))
        rel = f"{r['ours_tflops'] / base:.3f}" if base else "-"
        out.append(f"| {r['seqlen']} | {opt} | {r['flops'] / full:.4f} | {r['ours_tflops']:.0f} | {rel} |")
    return "\n".join(out)


def plot(rows, path):
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    fig, axes = plt.subplots(1, 4, figsize=(18, 4), sharey=True)
    for ax, (d, causal) in zip(axes, [(d, c) for d in HEAD_DIMS for c in (False, True)]):
        cell = [r for r in rows if r["d"] == d and r["causal"] == causal]
        xs = [r["seqlen"] for r in cell]
        for key, label in (("ours_tflops", "cute-flash"), ("sm80_tflops", "cute-flash SM80"),
                           ("flash_tflops", "SDPA FLASH"), ("cudnn_tflops", "SDPA CUDNN"), ("fa4_tflops", "FA4")):
            ys = [r.get(key) or math.nan for r in cell]
            ax.plot(xs, ys, marker="o", label=label)
        ax.set_xscale("log", base=2)
        ax.set_title(f"d={d} causal={causal}")
        ax.set_xlabel("seqlen")
    axes[0].set_ylabel("TFLOP/s (bf16, H200)")
    axes[0].legend()
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    return path


SECTIONS = ("grid", "extra", "varlen", "paged", "decode", "unaligned", "bwd", "bwd_dims", "dropout", "held", "shapes",
            "train_varlen", "mods", "mla_decode", "step_split")
BWD_DIMS = (96, 192, 256)  # the head dims of issue 61's table, at 4k tokens a sequence


def main(out_dir=None, quick=False, sections=SECTIONS, mods=None):
    import os

    import torch

    t0 = time.time()
    result, text = {}, ""
    if "grid" in sections:
        result["grid"] = run_grid((1024, 4096) if quick else SEQLENS)
        text += format_grid(result["grid"]) + "\n"
    if "extra" in sections:
        result["extra"] = run_extra((8192,) if quick else (8192, 16384))
        text += "\n" + format_extra(result["extra"], result.get("grid", [])) + "\n"
    if "varlen" in sections:
        result["varlen"] = run_varlen()
        text += "\n" + format_varlen(result["varlen"]) + "\n"
    if "decode" in sections:
        result["copy_gbs"] = copy_bandwidth_gbs()
        result["decode"] = run_decode((1, 64) if quick else DECODE_BATCHES, (1024, 32768) if quick else DECODE_CACHES)
        text += "\n" + format_decode(result["decode"], result["copy_gbs"]) + "\n"
    if "paged" in sections:
        result["paged"] = run_paged()
        text += "\n" + format_paged(result["paged"]) + "\n"
    if "unaligned" in sections:
        result["unaligned"] = run_unaligned()
        text += "\n" + format_unaligned(result["unaligned"]) + "\n"
    if "bwd" in sections:
        result["bwd"] = run_bwd((1024, 4096) if quick else SEQLENS)
        text += "\n" + format_bwd(result["bwd"]) + "\n"
    if "bwd_dims" in sections:
        result["bwd_dims"] = run_bwd((4096,), BWD_DIMS[:1] if quick else BWD_DIMS)
        text += "\n" + format_bwd(result["bwd_dims"]) + "\n"
    if "dropout" in sections:
        result["dropout"] = run_dropout((1024, 4096) if quick else SEQLENS)
        text += "\n" + format_dropout(result["dropout"]) + "\n"
    if "shapes" in sections:
        from cute_flash.tools.bench_shapes import format_shapes, run_shapes

        result["shapes"] = run_shapes()
        text += "\n" + format_shapes(result["shapes"]) + "\n"
    if "train_varlen" in sections:
        from cute_flash.tools.bench_train_varlen import format_train_varlen, run_train_varlen

        result["train_varlen"] = run_train_varlen((128,) if quick else (64, 128))
        text += "\n" + format_train_varlen(result["train_varlen"]) + "\n"
    if "step_split" in sections:
        from cute_flash.tools.bench_step_split import format_step_split, run_step_split

        result["step_split"] = run_step_split((128,) if quick else (64, 128))
        text += "\n" + format_step_split(result["step_split"]) + "\n"
    if "mods" in sections:
        from cute_flash.tools.bench_mods import format_mods, run_mods

        result["mods"] = run_mods((128,), (4096,), mods) if quick else run_mods(names=mods)
        text += "\n" + format_mods(result["mods"]) + "\n"
    if "mla_decode" in sections:
        from cute_flash.tools.bench_mla import MLA_CELLS, format_mla_decode, run_mla_decode

        result["mla_decode"] = run_mla_decode(MLA_CELLS[:1] if quick else MLA_CELLS)
        text += "\n" + format_mla_decode(result["mla_decode"]) + "\n"
    if "held" in sections:
        from cute_flash.tools.held import HOLD_S, format_held, run_held

        seconds = 2.0 if quick else HOLD_S
        result["held"] = run_held(seconds)
        text += "\n" + format_held(result["held"], seconds) + "\n"
    meta = dict(date=time.strftime("%Y-%m-%d"), gpu=torch.cuda.get_device_name(),
                torch=torch.__version__, seconds=round(time.time() - t0, 1))
    text = f"{meta}\n\n{text}"
    if out_dir:
        os.makedirs(out_dir, exist_ok=True)
        with open(os.path.join(out_dir, "bench.json"), "w") as f:
            json.dump(dict(meta=meta, **result), f, indent=1)
        if "grid" in result:
            plot(result["grid"], os.path.join(out_dir, "bench.png"))
        with open(os.path.join(out_dir, "bench.md"), "w") as f:
            f.write(text)
    print(text)
    return result
