"""`python -m cute_flash bench --sections train_varlen`: packed batches as training meets them
(issue "Train at Hopper speed in every configuration"), forward + backward through autograd.

16k tokens a batch, sequence lengths drawn (seeded) from an exponential of mean 512 or 2048, as
packed LLM batches come; d 64 and 128 at hidden 2048; causal and not. Columns: ours (the default
path), our SM80 kernels (sm_90 only), flash-attn-4's varlen, and ours dense on a batch of equal
sequences of the mean length, which the packed call is held to (the bar: 0.9 of it; and at or
above flash-attn-4). TFLOP/s count the real tokens' visible pairs, 3.5x the forward's FLOPs.
A second table times the forward alone (which part of the step loses): ours, our SM80
forward, and on sm_90 the Hopper launcher called directly in both schedules (one CTA per tile,
and `persistent=True`, the policy's up to d 128), so that their ratio carries no API overhead.
"""
from __future__ import annotations

import itertools
import random

from cute_flash.tools.peers import arch_path, fa4_varlen_func, grad_ms, hopper_gpu, time_ms, visible_pairs

TOKENS = 16384
HIDDEN = 2048
MEANS = (512, 2048)
HEAD_DIMS = (64, 128)


def exponential_lengths(mean: int, tokens: int = TOKENS, seed: int = 0) -> list[int]:
    """Lengths drawn from an exponential of `mean` (at least 1) until they hold `tokens`, the last
    one cut so that they sum to exactly `tokens`."""
    rng = random.Random(seed)
    lengths = []
    while sum(lengths) < tokens:
        lengths.append(max(1, round(rng.expovariate(1 / mean))))
    lengths[-1] -= sum(lengths) - tokens
    return [n for n in lengths if n > 0]


def bench_cell(d: int, mean: int, causal: bool) -> dict:
    import torch

    from cute_flash import flash_attn_func, flash_attn_varlen_func

    nheads = HIDDEN // d
    lengths = exponential_lengths(mean)
    cu = torch.tensor([0, *itertools.accumulate(lengths)], dtype=torch.int32, device="cuda")
    smax = max(lengths)
    q, k, v, dout = (torch.randn(TOKENS, nheads, d, device="cuda", dtype=torch.bfloat16) for _ in range(4))
    leaves = [x.requires_grad_() for x in (q, k, v)]
    flops = 3.5 * sum(4 * nheads * d * visible_pairs(n, n, causal) for n in lengths)
    row = dict(d=d, mean=mean, causal=causal, sequences=len(lengths), longest=smax, nheads=nheads, flops=flops)

    def ours(q, k, v):
        return flash_attn_varlen_func(q, k, v, cu, cu, smax, smax, causal=causal)

    def tflops(ms, work=flops):
        return work / ms / 1e9 if ms else None

    row["ours"] = tflops(grad_ms(ours, leaves, dout))
    fwd_flops = flops / 3.5
    with torch.no_grad():
        row["ours_fwd"] = tflops(time_ms(lambda: ours(q, k, v)), fwd_flops)
    if hopper_gpu():
        from cute_flash.launch.hopper import flash_fwd_varlen_sm90

        for schedule, persistent in (("one_cta_fwd", False), ("persistent_fwd", True)):
            with torch.no_grad():
                row[schedule] = tflops(time_ms(lambda p=persistent: flash_fwd_varlen_sm90(
                    q, k, v, cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=smax, softmax_scale=d ** -0.5,
                    causal=causal, persistent=p)), fwd_flops)
        with arch_path("sm80"):
            row["sm80"] = tflops(grad_ms(ours, leaves, dout))
            with torch.no_grad():
                row["sm80_fwd"] = tflops(time_ms(lambda: ours(q, k, v)), fwd_flops)
    fa4 = fa4_varlen_func()
    row["fa4"] = tflops(grad_ms(lambda q, k, v: fa4(q, k, v, cu, smax, causal), leaves, dout)) if fa4 else None
    batch = TOKENS // mean
    dense = [x.view(batch, mean, nheads, d) for x in (q.detach(), k.detach(), v.detach(), dout)]
    dense_leaves = [x.clone().requires_grad_() for x in dense[:3]]
    dense_flops = 3.5 * batch * 4 * nheads * d * visible_pairs(mean, mean, causal)
    row["dense_equal"] = tflops(grad_ms(lambda q, k, v: flash_attn_func(q, k, v, causal=causal), dense_leaves,
                                            dense[3]), dense_flops)
    print(row, flush=True)
    return row


def run_train_varlen(head_dims=HEAD_DIMS, means=MEANS) -> list[dict]:
    return [bench_cell(d, mean, causal) for d in head_dims for mean in means for causal in (False, True)]


def format_train_varlen(rows) -> str:
    out = ["Packed batches, forward + backward (3.5x forward FLOPs), TFLOP/s:", "",
           "| d | causal | mean length | sequences (longest) | ours | SM80 | FA4 | ours dense, equal lengths "
           "| ours/FA4 | ours/dense equal |", "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        cells = [f"{r[k]:.0f}" if r.get(k) else "-" for k in ("ours", "sm80", "fa4", "dense_equal")]
        ratios = [f"{r['ours'] / r[k]:.3f}" if r.get("ours") and r.get(k) else "-" for k in ("fa4", "dense_equal")]
        out.append(f"| {r['d']} | {r['causal']} | {r['mean']} | {r['sequences']} ({r['longest']}) | "
                   + " | ".join(cells + ratios) + " |")
    out += ["", "The forward alone, TFLOP/s:", "",
            "| d | causal | mean length | ours | SM80 | Hopper, a CTA a tile | Hopper, persistent | ours/SM80 "
            "| persistent / a CTA a tile |", "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        cells = [f"{r[k]:.0f}" if r.get(k) else "-" for k in ("ours_fwd", "sm80_fwd", "one_cta_fwd", "persistent_fwd")]
        ratios = [f"{r[a] / r[b]:.3f}" if r.get(a) and r.get(b) else "-"
                  for a, b in (("ours_fwd", "sm80_fwd"), ("persistent_fwd", "one_cta_fwd"))]
        out.append(f"| {r['d']} | {r['causal']} | {r['mean']} | " + " | ".join(cells + ratios) + " |")
    return "\n".join(out)
