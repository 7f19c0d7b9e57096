"""`python -m cute_flash bench --sections held`: TFLOP/s held for seconds, where the board's power
cap sets the clock, beside the first calls, which run before it does.

Why a section of its own: on the H200 (700 W cap) the grid's d 128 non-causal cells run at the
cap, and a `do_bench` window (225 ms) catches the power controller part way. Measured
(2026-12-04, docs/tuning/decode.md "Held at the power cap"): a train of 3000 back-to-back d 128 8k calls
ran 789 TFLOP/s for its first 20 calls and 664-689 after call 50, CUDNN 683-686 then 556-594;
cuBLAS bf16 GEMMs ran 743-807 in their first 10 calls and 659-692 held. The held number is
what a training step sees, and the ratio of two kernels' held numbers is their ratio of energy
per flop.

Each kernel runs after `IDLE_S` of idle for `HOLD_S`, timed in chunks of `CHUNK` calls; "held"
is the median chunk from `SETTLE_S` on. `nvidia-smi`, where present, logs the SM clock and the
board power every 100 ms beside it (`SmiLog`), summarised over the same window.
"""
from __future__ import annotations

import datetime
import os
import shutil
import statistics
import subprocess
import tempfile
import time
from dataclasses import dataclass

IDLE_S = 1.0
HOLD_S = 4.0
SETTLE_S = 1.5  # the controller has pulled the clock down within ~50 calls (70 ms) in the train above
CHUNK = 20
SMI_FIELDS = "timestamp,clocks.sm,power.draw"


@dataclass(frozen=True)
class SmiSample:
    t: float  # seconds since the epoch (nvidia-smi's local time, read as local time)
    sm_mhz: float
    power_w: float


def parse_smi(lines) -> list[SmiSample]:
    """`nvidia-smi --query-gpu=timestamp,clocks.sm,power.draw --format=csv,noheader,nounits`
    lines; lines that do not parse (a "[N/A]", a cut last line) are left out."""
    samples = []
    for line in lines:
        fields = [x.strip() for x in line.split(",")]
        try:
            t = datetime.datetime.strptime(fields[0], "%Y/%m/%d %H:%M:%S.%f").timestamp()
            samples.append(SmiSample(t, float(fields[1]), float(fields[2])))
        except (ValueError, IndexError):
            continue
    return samples


@dataclass(frozen=True)
class Window:
    """Median SM clock and board power of the samples in [t0, t1], None without samples."""
    sm_mhz: float | None
    power_w: float | None

    @classmethod
    def of(cls, samples: list[SmiSample], t0: float, t1: float) -> Window:
        inside = [s for s in samples if t0 <= s.t <= t1]
        if not inside:
            return cls(None, None)
        return cls(statistics.median(s.sm_mhz for s in inside), statistics.median(s.power_w for s in inside))


class SmiLog:
    """`nvidia-smi` sampling the current GPU every 100 ms while inside; `samples()` after. Without
    `nvidia-smi` (or if it fails) there are no samples, and the table shows "-"."""

    def __init__(self):
        self._proc, self._file = None, None

    def __enter__(self):
        smi = shutil.which("nvidia-smi")
        if smi is None:
            return self
        import torch

        cmd = [smi, f"--query-gpu={SMI_FIELDS}", "--format=csv,noheader,nounits", "-lms", "100"]
        uuid = getattr(torch.cuda.get_device_properties(torch.cuda.current_device()), "uuid", None)
        if uuid is not None:
            cmd += ["-i", f"GPU-{uuid}"]
        self._file = tempfile.NamedTemporaryFile("w+", suffix=".csv", delete=False)
        self._proc = subprocess.Popen(cmd, stdout=self._file, stderr=subprocess.DEVNULL)
        return self

    def __exit__(self, *exc):
        if self._proc is not None:
            self._proc.terminate()
            self._proc.wait()
            self._file.close()
        return False

    def samples(self) -> list[SmiSample]:
        if self._file is None:
            return []
        with open(self._file.name) as f:
            samples = parse_smi(f)
        os.unlink(self._file.name)
        self._file = None
        return samples


@dataclass(frozen=True)
class Held:
    """One kernel held: TFLOP/s of its first chunk and of each chunk from SETTLE_S on, and the
    wall-clock span of that part (for the clock log)."""
    name: str
    shape: str
    first: float
    chunks: tuple[float, ...]
    t0: float
    t1: float

    @property
    def held(self) -> float:
        return statistics.median(self.chunks)


def hold(name: str, shape: str, fn, flops: int, seconds=HOLD_S, settle=SETTLE_S, chunk=CHUNK) -> Held:
    """fn (warmed up) after IDLE_S of idle, back to back for `seconds`."""
    import torch

    torch.cuda.synchronize()
    time.sleep(IDLE_S)
    start = time.time()
    first, chunks = None, []
    while time.time() - start < seconds:
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        e0.record()
        for _ in range(chunk):
            fn()
        e1.record()
        e1.synchronize()
        tflops = flops * chunk / e0.elapsed_time(e1) / 1e9
        if first is None:
            first = tflops
        elif time.time() - start > settle:
            chunks.append(tflops)
    return Held(name, shape, first, tuple(chunks), start + settle, time.time())


def run_held(seconds=HOLD_S):
    """ours at d 128 non-causal 8k (2 x 16 heads) and 16k (1 x 16), CUDNN and flash-attn-4 (when
    importable) at 8k, and a cuBLAS bf16 GEMM (8192^3) as the ceiling of dense tensor work at
    the cap; rows as dicts, with the clock and power where `nvidia-smi` logged them."""
    import torch
    from torch.nn.attention import SDPBackend

    from cute_flash import flash_attn_func
    from cute_flash.tools.peers import fa4_func, sdpa, visible_pairs

    def qkv(batch, seqlen):
        return tuple(torch.randn(batch, seqlen, 16, 128, device="cuda", dtype=torch.bfloat16) for _ in range(3))

    def attention(name, fn, q):
        """A kernel row over (b, s, h, d) inputs: its shape's label and FLOPs as the grid counts them."""
        b, s, h, d = q.shape
        return name, f"d {d}, {s // 1024}k, {b} x {h}", fn, 4 * b * h * d * visible_pairs(s, s, False)

    q, k, v = qkv(2, 8192)
    q16, k16, v16 = qkv(1, 16384)
    a, b = (torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    kernels = [attention("ours", lambda: flash_attn_func(q, k, v), q),
               attention("ours", lambda: flash_attn_func(q16, k16, v16), q16)]
    cudnn = sdpa(q, k, v, SDPBackend.CUDNN_ATTENTION, False)
    if cudnn is not None:
        kernels.append(attention("CUDNN", cudnn, q))
    fa4 = fa4_func()
    if fa4 is not None:
        kernels.append(attention("FA4", lambda: fa4(q, k, v, False), q))
    kernels.append(("cuBLAS GEMM", "8192 x 8192 x 8192", lambda: torch.mm(a, b), 2 * 8192 ** 3))
    for _, _, fn, _ in kernels:
        fn()
    with SmiLog() as log:
        runs = [hold(name, shape, fn, flops, seconds) for name, shape, fn, flops in kernels]
    samples = log.samples()
    rows = []
    for r in runs:
        w = Window.of(samples, r.t0, r.t1)
        rows.append(dict(name=r.name, shape=r.shape, first_tflops=r.first, held_tflops=r.held,
                         chunk_min=min(r.chunks), chunk_max=max(r.chunks), sm_mhz=w.sm_mhz, power_w=w.power_w))
    return rows


def format_held(rows, seconds=HOLD_S) -> str:
    """The table (each kernel held `seconds`, as `run_held` was given), then each attention row's
    held TFLOP/s over the GEMM's and over the best peer's at the same shape (what the grid's
    ratios are, with the power controller settled)."""
    out = [f"Held {seconds:g} s after {IDLE_S:.0f} s idle ({CHUNK}-call chunks; held: median chunk from "
           f"{SETTLE_S} s on)", "",
           "| kernel | shape | first chunk | held | held chunks | SM clock (MHz) | power (W) |",
           "|---|---|---|---|---|---|---|"]
    for r in rows:
        clock = "-" if r["sm_mhz"] is None else f"{r['sm_mhz']:.0f}"
        power = "-" if r["power_w"] is None else f"{r['power_w']:.0f}"
        out.append(f"| {r['name']} | {r['shape']} | {r['first_tflops']:.0f} | {r['held_tflops']:.0f} | "
                   f"{r['chunk_min']:.0f}-{r['chunk_max']:.0f} | {clock} | {power} |")
    gemm = next((r["held_tflops"] for r in rows if r["name"] == "cuBLAS GEMM"), None)
    for r in rows:
        if r["name"] != "ours":
            continue
        peers = [p["held_tflops"] for p in rows if p["shape"] == r["shape"] and p["name"] in ("CUDNN", "FA4")]
        parts = []
        if peers:
            parts.append(f"/ best peer held {r['held_tflops'] / max(peers):.3f}")
        if gemm:
            parts.append(f"/ cuBLAS GEMM held {r['held_tflops'] / gemm:.3f}")
        if parts:
            out.append(f"ours {r['shape']} held " + ", ".join(parts))
    return "\n".join(out)
