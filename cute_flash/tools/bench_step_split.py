"""`python -m cute_flash bench --sections step_split`: where one training step's GPU time goes,
kernel by kernel, ours beside flash-attn-4, so that a gap in the backward or packed tables can
be put on the forward, the backward's main kernel, its preprocess or dQ conversion, or the
torch calls around them (issue "Train at Hopper speed in every configuration").

Each cell is one forward + backward through autograd on 16k tokens (hidden 2048) laid out
three ways: dense (batch x mean length), packed with equal lengths (the same rows as one
packed batch: the packed path's own cost) and packed with exponential lengths of that mean
(`bench_train_varlen.exponential_lengths`: the lengths' imbalance on top). `torch.profiler`
times the kernels of STEPS steps; each kernel's name puts it in a role (`role_of`).
"""
from __future__ import annotations

import collections
import itertools

from cute_flash.tools.bench_train_varlen import HIDDEN, TOKENS, exponential_lengths
from cute_flash.tools.peers import fa4_func, fa4_varlen_func, grad_ms, visible_pairs

STEPS = 20  # profiled steps a cell
LAYOUTS = ("dense", "packed_equal", "packed_exp")
ROLES = ("forward", "backward", "preprocess", "dq_convert", "other")


def role_of(kernel: str) -> str:
    """A kernel's part of the step from its name: both libraries' kernels are named after their
    modules and classes (the backward's preprocess and dQ conversion / postprocess first, as
    their names hold "bwd" too); torch's own kernels and the launch-order lists are "other"."""
    name = kernel.lower()
    if "preprocess" in name:
        return "preprocess"
    if "postprocess" in name or "convert" in name:
        return "dq_convert"
    if "bwd" in name or "backward" in name:
        return "backward"
    if "fwd" in name or "forward" in name:
        return "forward"
    return "other"


def kernel_split(step, steps: int = STEPS) -> tuple[dict, int]:
    """(ms a step by kernel name, launches a step) of `step` under `torch.profiler`."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            step()
        torch.cuda.synchronize()
    ms, launches = collections.Counter(), 0
    for event in prof.events():
        if event.device_type == torch.autograd.DeviceType.CUDA:
            ms[event.name] += event.time_range.elapsed_us() / 1000 / steps
            launches += 1
    return dict(ms), launches // steps


def _callables(layout, lengths, causal):
    """(ours, flash-attn-4 or None) as fn(q, k, v) -> out for the layout."""
    import torch

    from cute_flash import flash_attn_func, flash_attn_varlen_func

    if layout == "dense":
        fa4 = fa4_func()
        return (lambda q, k, v: flash_attn_func(q, k, v, causal=causal)), fa4 and (
            lambda q, k, v: fa4(q, k, v, causal))
    cu = torch.tensor([0, *itertools.accumulate(lengths)], dtype=torch.int32, device="cuda")
    longest = max(lengths)
    fa4 = fa4_varlen_func()
    return (lambda q, k, v: flash_attn_varlen_func(q, k, v, cu, cu, longest, longest, causal=causal)), fa4 and (
        lambda q, k, v: fa4(q, k, v, cu, longest, causal))


def bench_cell(d: int, mean: int, causal: bool, layout: str) -> list[dict]:
    """One row per library of one (head dim, mean length, mask, layout) cell."""
    import torch

    nheads = HIDDEN // d
    lengths = exponential_lengths(mean) if layout == "packed_exp" else [mean] * (TOKENS // mean)
    shape = (len(lengths), mean, nheads, d) if layout == "dense" else (TOKENS, nheads, d)
    torch.manual_seed(0)
    q, k, v, dout = (torch.randn(shape, device="cuda", dtype=torch.bfloat16) for _ in range(4))
    leaves = [x.requires_grad_() for x in (q, k, v)]
    flops = 3.5 * sum(4 * nheads * d * visible_pairs(n, n, causal) for n in lengths)
    rows = []
    for library, fn in zip(("ours", "fa4"), _callables(layout, lengths, causal)):
        step_ms = grad_ms(fn, leaves, dout) if fn else None  # None: absent, or it refused the call
        if step_ms is None:
            continue
        kernels, launches = kernel_split(lambda fn=fn: torch.autograd.grad(fn(*leaves), leaves, dout))
        rows.append(dict(d=d, mean=mean, causal=causal, layout=layout, library=library, sequences=len(lengths),
                         longest=max(lengths), step_ms=step_ms, tflops=flops / step_ms / 1e9, launches=launches,
                         kernels=kernels))
        print(rows[-1]["library"], layout, d, causal, f"{step_ms:.3f} ms", flush=True)
    return rows


def run_step_split(head_dims=(64, 128), mean: int = 2048) -> list[dict]:
    return [row for d in head_dims for causal in (False, True) for layout in LAYOUTS
            for row in bench_cell(d, mean, causal, layout)]


def format_step_split(rows) -> str:
    """One line per (cell, library): the step's wall time and rate, then its kernels' GPU time
    by role (ms a step), their sum and the launches a step."""
    out = ["One training step (forward + backward), GPU time by kernel role, ms a step:", "",
           "| d | causal | layout | sequences (longest) | library | step ms | TFLOP/s | "
           + " | ".join(ROLES) + " | kernels | launches |",
           "|" + "---|" * (9 + len(ROLES))]
    for r in rows:
        by_role = collections.Counter()
        for name, ms in r["kernels"].items():
            by_role[role_of(name)] += ms
        cells = [f"{by_role[role]:.3f}" for role in ROLES]
        out.append(f"| {r['d']} | {r['causal']} | {r['layout']} | {r['sequences']} ({r['longest']}) | {r['library']} "
                   f"| {r['step_ms']:.3f} | {r['tflops']:.0f} | " + " | ".join(cells)
                   + f" | {sum(by_role.values()):.3f} | {r['launches']} |")
    return "\n".join(out)
