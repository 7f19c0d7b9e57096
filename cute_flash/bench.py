"""`python -m cute_flash bench`: forward TFLOP/s against torch SDPA's FLASH (flash-attn 2 C++) and
CUDNN backends, measured side by side in one run.

TFLOP/s counts the FLOPs of the visible (i, j) pairs: 4 * b * h * d per pair, which is the SPEC's
4*b*h*sq*sk*d (halved for causal) up to the diagonal's rounding, and for a local window the work
actually left to do. Each time is the median of `triton.testing.do_bench`; inputs are fresh
normal data, larger than L2 in every grid cell.
"""
from __future__ import annotations

import json
import math
import statistics
import time

SEQLENS = (512, 1024, 2048, 4096, 8192, 16384)
HEAD_DIMS = (64, 128)
TOKENS = 16384
HIDDEN = 2048


def visible_pairs(sq: int, sk: int, causal: bool, window=(-1, -1)) -> int:
    """Number of (query, key) pairs the mask leaves visible (bottom-right aligned)."""
    left, right = window
    if causal:
        right = 0
    total = 0
    for i in range(sq):
        lo = 0 if left < 0 else max(0, i + sk - sq - left)
        hi = sk - 1 if right < 0 else min(sk - 1, i + sk - sq + right)
        total += max(0, hi - lo + 1)
    return total


def _time_ms(fn) -> float:
    import triton.testing

    return triton.testing.do_bench(fn, warmup=25, rep=200, return_mode="median")


def _sdpa(q, k, v, backend, causal):
    import torch
    from torch.nn.attention import sdpa_kernel

    qt, kt, vt = (x.transpose(1, 2) for x in (q, k, v))

    def run():
        with sdpa_kernel(backend):
            return torch.nn.functional.scaled_dot_product_attention(qt, kt, vt, is_causal=causal)

    try:
        run()
        return run
    except RuntimeError:
        return None


def bench_cell(d, seqlen, causal=False, window=(-1, -1), softcap=0.0, peers=True, batch=None, nheads=None):
    import torch
    from torch.nn.attention import SDPBackend

    from cute_flash import flash_attn_func

    batch = batch or max(1, TOKENS // seqlen)
    nheads = nheads or HIDDEN // d
    q, k, v = (torch.randn(batch, seqlen, nheads, d, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    flops = 4 * batch * nheads * d * visible_pairs(seqlen, seqlen, causal, window)
    row = dict(d=d, seqlen=seqlen, batch=batch, nheads=nheads, causal=causal, window=list(window),
               softcap=softcap, flops=flops)
    ours = _time_ms(lambda: flash_attn_func(q, k, v, causal=causal, window_size=window, softcap=softcap))
    row["ours_tflops"] = flops / ours / 1e9
    if peers:
        for name, backend in (("flash", SDPBackend.FLASH_ATTENTION), ("cudnn", SDPBackend.CUDNN_ATTENTION)):
            fn = _sdpa(q, k, v, backend, causal)
            row[f"{name}_tflops"] = flops / _time_ms(fn) / 1e9 if fn else None
    return row


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


# (block_m, block_n, warps) tried per head dim by `tune`; the first is the shipped choice.
TUNE_CANDIDATES = {
    64: [(128, 128, 4), (128, 64, 4), (128, 128, 8), (64, 128, 4)],
    128: [(128, 64, 4), (128, 128, 8), (128, 64, 8), (64, 64, 4), (64, 128, 4)],
}


def tune(seqlens=(1024, 4096, 16384)):
    """TFLOP/s of each tile candidate on the SPEC grid's shapes (bf16), for choosing traits."""
    import torch

    from cute_flash.kernels.fwd import flash_fwd
    from layouts.traits import FwdTraits

    rows = []
    for d, cands in TUNE_CANDIDATES.items():
        for causal in (False, True):
            for s in seqlens:
                b, h = max(1, TOKENS // s), HIDDEN // d
                q, k, v = (torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16) for _ in range(3))
                flops = 4 * b * h * d * visible_pairs(s, s, causal)
                for m, n, w in cands:
                    t = FwdTraits(d, m, n, w, "bf16")
                    ms = _time_ms(lambda: flash_fwd(q, k, v, softmax_scale=d ** -0.5, causal=causal, traits=t))
                    rows.append(dict(d=d, causal=causal, seqlen=s, traits=t.name, tflops=flops / ms / 1e9))
                    print(f"d{d} causal={causal!s:5} s{s:6} {t.name:26} {rows[-1]['tflops']:6.0f}", flush=True)
    return rows


def format_grid(rows) -> str:
    out = ["| d | causal | seqlen | batch x heads | ours | FLASH | CUDNN | ours/FLASH |",
           "|---|---|---|---|---|---|---|---|"]
    ratios = []
    for r in rows:
        ratio = r["ours_tflops"] / r["flash_tflops"] if r.get("flash_tflops") else math.nan
        if not math.isnan(ratio):
            ratios.append(ratio)
        cudnn = f"{r['cudnn_tflops']:.0f}" if r.get("cudnn_tflops") else "-"
        out.append(f"| {r['d']} | {r['causal']} | {r['seqlen']} | {r['batch']}x{r['nheads']} | "
                   f"{r['ours_tflops']:.0f} | {r['flash_tflops']:.0f} | {cudnn} | {ratio:.3f} |")
    if ratios:
        gm = math.exp(statistics.fmean(math.log(x) for x in ratios))
        out.append(f"\ngeometric mean ours/FLASH: {gm:.3f}; min {min(ratios):.3f}; cells >= 1.0: "
                   f"{sum(x >= 1.0 for x in ratios)}/{len(ratios)}")
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
        for key, label in (("ours_tflops", "cute-flash"), ("flash_tflops", "SDPA FLASH"), ("cudnn_tflops", "SDPA CUDNN")):
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


def main(out_dir=None, quick=False, extra=True):
    import os

    import torch

    t0 = time.time()
    seqlens = (1024, 4096) if quick else SEQLENS
    grid = run_grid(seqlens)
    extra_rows = run_extra((8192,) if quick else (8192, 16384)) if extra else []
    meta = dict(date=time.strftime("%Y-%m-%d"), gpu=torch.cuda.get_device_name(),
                torch=torch.__version__, seconds=round(time.time() - t0, 1))
    text = f"{meta}\n\n{format_grid(grid)}\n"
    if extra_rows:
        text += "\n" + format_extra(extra_rows, grid) + "\n"
    if out_dir:
        os.makedirs(out_dir, exist_ok=True)
        with open(os.path.join(out_dir, "bench.json"), "w") as f:
            json.dump(dict(meta=meta, grid=grid, extra=extra_rows), f, indent=1)
        plot(grid, os.path.join(out_dir, "bench.png"))
        with open(os.path.join(out_dir, "bench.md"), "w") as f:
            f.write(text)
    print(text)
    return grid, extra_rows
