"""`python -m cute_flash occupancy`: achieved and theoretical occupancy, registers, time and
DRAM / SM throughput of the kernels each representative call launches, measured by Nsight
Compute (`ncu`, which must be on PATH or in /usr/local/cuda/bin). Each case runs in its own
`ncu` process: a warm-up call (compiles, fills caches), then one call between
cudaProfilerStart / Stop, so that only its kernels are profiled."""
from __future__ import annotations

import csv
import os
import shutil
import subprocess
import sys
from dataclasses import dataclass

METRICS = {  # column: ncu metric
    "grid": "launch__grid_size",
    "block": "launch__block_size",
    "regs": "launch__registers_per_thread",
    "theoretical %": "sm__maximum_warps_per_active_cycle_pct",
    "achieved %": "sm__warps_active.avg.pct_of_peak_sustained_active",
    "us": "gpu__time_duration.sum",
    "DRAM %": "dram__throughput.avg.pct_of_peak_sustained_elapsed",
    "SM %": "sm__throughput.avg.pct_of_peak_sustained_elapsed",
}


@dataclass(frozen=True)
class Case:
    """One call: `kind` dense / varlen / decode / bwd; (batch, seqlen, heads, head_dim) as the
    kind reads them (decode: seqlen is the cache, 32 / 8 heads)."""
    name: str
    kind: str
    batch: int
    seqlen: int
    heads: int
    head_dim: int
    causal: bool = False


CASES = (
    Case("fwd d64 1k", "dense", 16, 1024, 32, 64),
    Case("fwd d64 4k causal", "dense", 4, 4096, 32, 64, True),
    Case("fwd d128 1k", "dense", 16, 1024, 16, 128),
    Case("fwd d128 8k", "dense", 2, 8192, 16, 128),
    Case("fwd d128 4k causal", "dense", 4, 4096, 16, 128, True),
    Case("fwd d256 4k", "dense", 4, 4096, 8, 256),
    Case("varlen d128 16 x 1k", "varlen", 16, 1024, 16, 128, True),
    Case("decode b1 1k", "decode", 1, 1024, 32, 128),
    Case("decode b32 1k", "decode", 32, 1024, 32, 128),
    Case("decode b64 32k", "decode", 64, 32768, 32, 128),
    Case("bwd d128 4k causal", "bwd", 4, 4096, 16, 128, True),
)


def _call(case: Case):
    """A function making the case's call on fresh bf16 inputs."""
    import torch

    from cute_flash import flash_attn_func, flash_attn_varlen_func, flash_attn_with_kvcache

    b, s, h, d = case.batch, case.seqlen, case.heads, case.head_dim
    bf16 = dict(device="cuda", dtype=torch.bfloat16)
    if case.kind == "decode":
        q = torch.randn(b, 1, h, d, **bf16)
        kc, vc = (torch.randn(b, s, 8, d, **bf16) for _ in range(2))
        return lambda: flash_attn_with_kvcache(q, kc, vc, cache_seqlens=s)
    if case.kind == "varlen":
        q, k, v = (torch.randn(b * s, h, d, **bf16) for _ in range(3))
        cu = torch.arange(0, b * s + 1, s, dtype=torch.int32, device="cuda")
        return lambda: flash_attn_varlen_func(q, k, v, cu, cu, s, s, causal=case.causal)
    q, k, v = (torch.randn(b, s, h, d, **bf16, requires_grad=case.kind == "bwd") for _ in range(3))
    if case.kind == "bwd":
        out = flash_attn_func(q, k, v, causal=case.causal)
        dout = torch.randn_like(out)
        return lambda: torch.autograd.grad(out, (q, k, v), dout, retain_graph=True)
    return lambda: flash_attn_func(q, k, v, causal=case.causal)


def profile_case(name: str):
    """Child side (under ncu): warm up, then one call inside the profiler's range."""
    import torch

    fn = _call(next(c for c in CASES if c.name == name))
    fn()
    torch.cuda.synchronize()
    torch.cuda.profiler.start()
    fn()
    torch.cuda.synchronize()
    torch.cuda.profiler.stop()


def _ncu() -> str | None:
    return shutil.which("ncu") or next((p for p in ("/usr/local/cuda/bin/ncu",) if os.path.exists(p)), None)


def _rows(stdout: str) -> list[dict]:
    """ncu's `--csv --page raw` output: a header row, a units row, then one row per kernel."""
    lines = [line for line in stdout.splitlines() if line.startswith('"')]
    table = list(csv.DictReader(lines))
    return table[1:]


def _short(kernel: str) -> str:
    """The kernel's name without its template / argument decorations, at most 48 characters
    (the DSL's names run on with the argument types)."""
    return kernel.split("(")[0].split("<")[0][:48]


def main() -> int:
    ncu = _ncu()
    if ncu is None:
        print("python -m cute_flash occupancy: ncu (Nsight Compute) not found", file=sys.stderr)
        return 2
    print("| case | kernel | " + " | ".join(METRICS) + " |")
    print("|" + "---|" * (len(METRICS) + 2))
    failed = 0
    for case in CASES:
        cmd = [ncu, "--csv", "--page", "raw", "--print-units", "base", "--profile-from-start", "off",
               "--metrics", ",".join(METRICS.values()),
               sys.executable, "-m", "cute_flash", "occupancy", "--case", case.name]
        run = subprocess.run(cmd, capture_output=True, text=True)
        rows = _rows(run.stdout)
        if run.returncode or not rows:
            failed += 1
            print(f"| {case.name} | ncu exit {run.returncode}: {(run.stderr or run.stdout)[-300:]!r} |", flush=True)
            continue
        for r in rows:
            values = []
            for metric in METRICS.values():
                v = r.get(metric, "")
                if metric == "gpu__time_duration.sum":  # ns (base units)
                    v = f"{float(v.replace(',', '')) / 1e3:.1f}"
                values.append(v)
            print(f"| {case.name} | {_short(r.get('Kernel Name', '?'))} | " + " | ".join(values) + " |", flush=True)
    return int(failed > 0)
