"""`python -m cute_flash [compile|layouts|check|bench|overhead|coldstart|traincheck|cp|tune|memcheck|racecheck|
occupancy]`.

With no command: on a machine with a GPU, `check` then `bench`; without one, compile-only mode:
`compile` (the CI set of kernel variants for sm_80 and sm_90a, into the compile cache, with
each one's resources) and `layouts`, the layout checks. Every command but `compile` and
`layouts` needs a CUDA GPU.
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path


def cmd_compile(archs, full, workers=1, keys_file=None):
    """Compile every variant the dispatcher can choose for `archs` into the compile cache (no
    GPU needed: a CPU machine can warm the cache for GPUs of the same arch), with each
    variant's resources from ptxas; variants already cached are skipped. `workers` > 1 compiles
    in that many processes (the cache's file locks keep them apart). `keys_file`: exactly the
    variants a workload recorded (CUTE_FLASH_RECORD) instead."""
    from tqdm import tqdm

    from cute_flash.compile import cache as compile_cache
    from cute_flash.kernels.common.flags import FLAG_LETTERS
    from cute_flash.launch.variants import every_variant
    from cute_flash.tools.resources import find_ptxas
    from layouts.traits import SMEM_LIMIT, sm_name

    if keys_file is not None:
        try:
            recorded = compile_cache.read_keys(keys_file)
        except compile_cache.KeysFileError as exc:
            print(f"python -m cute_flash compile: {exc}", file=sys.stderr)
            return 2
        jobs = [(arch, config) for config, arch in recorded]
        archs = sorted({arch for _, arch in recorded})
        what = f"the {len(jobs)} recorded in {keys_file}"
    else:
        jobs = every_variant(archs, full)
        what = 'every traits x every flag combination' if full else 'the CI subset; --full for all'
    where = compile_cache.cache_root() / compile_cache.fingerprint() if compile_cache.enabled() else None
    print(f"compile-only (no GPU used): {len(jobs)} variants for {', '.join(sm_name(a) for a in archs)} "
          f"({what}), "
          f"about 4 s each on one core when not cached, {workers} worker process(es); "
          f"cache: {where or 'off (CUTE_FLASH_CACHE=0)'}", flush=True)
    print(f"ptxas for resource numbers: {find_ptxas() or 'not found (registers not reported)'}")
    print(f"{'arch':6} {'variant':34} {'smem':>7} {'regs':>5} {'spill':>6} {'s':>5}")
    t_start = time.time()
    pending = [(arch, config) for arch, config in jobs
               if where is None or not compile_cache.entry_path((config, arch)).exists()]
    worst = 0
    with tqdm(total=len(pending), unit="variant", dynamic_ncols=True) as bar:
        for (arch, config), (report, seconds) in _run_compiles(pending, where is not None, workers):
            bar.set_description(f"{sm_name(arch)} {config.name}")
            bar.update(1)
            spill = report.get("spill_stores", 0) + report.get("spill_loads", 0)
            worst = max(worst, spill)
            smem = getattr(config, "smem_bytes", 0)
            assert smem <= SMEM_LIMIT[arch]
            serialized = "  wgmma SERIALIZED (ptxas C7512)" if report.get("wgmma_serialized") else ""
            bar.write(f"{sm_name(arch):6} {config.name:34} {smem or '-':>7} {report.get('registers', '-'):>5} "
                      f"{spill if report else '-':>6} {seconds:5.1f}{serialized}")
    legend = ", ".join(f"{letter}={name}" for name, letter in FLAG_LETTERS.items())
    print(f"flags (FwdConfig fields in order): {legend}; append: P=paged B=batch_idx R=rotary "
          f"I=interleaved Q=per-row q angle")
    print(f"compile: {len(pending)} compiled, {len(jobs) - len(pending)} already cached, "
          f"{time.time() - t_start:.0f} s; largest spill {worst} bytes")
    return 0


def _run_compiles(pending, cached, workers):
    """Yield (job, compile_variant's result) for each (arch, config) job, in this process or,
    with workers > 1, in spawned processes as they finish."""
    from cute_flash.tools.resources import compile_variant

    if workers <= 1:
        for arch, config in pending:
            yield (arch, config), compile_variant(arch, config, cached)
        return
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor, as_completed

    with ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("spawn")) as pool:
        futures = {pool.submit(compile_variant, *job, cached): job for job in pending}
        for future in as_completed(futures):
            yield futures[future], future.result()


def cmd_check():
    """A quick GPU correctness pass by the criterion of docs/semantics.md (the full suite is
    `pytest -m gpu`)."""
    import torch

    from cute_flash import flash_attn_func
    from cute_flash.reference import attention_ref

    bad = 0
    for (b, sq, sk, h, hk, d, causal) in [(2, 129, 257, 4, 2, 64, False), (1, 255, 100, 4, 1, 128, True),
                                          (2, 77, 77, 2, 2, 40, True), (1, 300, 513, 2, 2, 256, False)]:
        for dtype in (torch.float16, torch.bfloat16):
            q = torch.randn(b, sq, h, d, device="cuda", dtype=dtype)
            k, v = (torch.randn(b, sk, hk, d, device="cuda", dtype=dtype) for _ in range(2))
            out, lse, _ = flash_attn_func(q, k, v, causal=causal, return_attn_probs=True)
            ref, ref_lse = attention_ref(q, k, v, causal=causal)
            ref_lp, _ = attention_ref(q, k, v, causal=causal, upcast=False)
            err = (out.float() - ref.float()).abs().max().item()
            bar = 2 * (ref_lp.float() - ref.float()).abs().max().item() + 1e-5
            fin = torch.isfinite(ref_lse)
            lse_err = (lse[fin] - ref_lse[fin]).abs().max().item()
            ok = err <= bar and lse_err <= 1e-3
            bad += not ok
            print(f"{'ok ' if ok else 'BAD'} b{b} sq{sq} sk{sk} h{h}/{hk} d{d} causal={causal} "
                  f"{str(dtype)[6:]}: err {err:.2e} <= {bar:.2e}, lse {lse_err:.1e}")
    print(f"check: {bad} failed")
    return bad


def cmd_overhead():
    """Host cost of a cached call on a tiny input, split into the interface (validation), the
    launcher (alignment, allocation, kernel lookup) and the TVM-FFI call itself, against SDPA's
    FLASH backend on the same input; and the same call through the custom op's dispatcher
    (`torch.ops.cute_flash.*`, what torch.compile calls), which eager calls bypass.
    Timed with `torch.utils.benchmark.Timer` (it synchronizes CUDA around each timed block)."""
    import torch
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.utils.benchmark import Timer

    from cute_flash import flash_attn_func
    from cute_flash.kernels.common.constants import LOG2E
    from cute_flash.launch.dense import flash_fwd, fwd_kernel

    q, k, v = (torch.randn(1, 8, 1, 64, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    qt, kt, vt = (x.transpose(1, 2) for x in (q, k, v))
    out, lse = torch.empty_like(q), torch.empty(1, 1, 8, device="cuda")
    index = torch.cuda.current_device()
    compiled = fwd_kernel(64, q.dtype, index, False, None, (
        ("has_left", False), ("has_right", False), ("has_alibi", False), ("has_softcap", False),
        ("has_dropout", False)))

    def per_call_us(fn):
        fn()
        torch.cuda.synchronize()
        return Timer(stmt="fn()", globals={"fn": fn}).blocked_autorange(min_run_time=0.5).median * 1e6

    rows = {
        "flash_attn_func": per_call_us(lambda: flash_attn_func(q, k, v)),
        "op (dispatcher)": per_call_us(
            lambda: torch.ops.cute_flash.fwd(q, k, v, 0.125, False, -1, -1, 0.0, None, [], [], [])),
        "launcher (flash_fwd)": per_call_us(lambda: flash_fwd(q, k, v, softmax_scale=0.125)),
        "TVM-FFI call alone": per_call_us(
            lambda: compiled(q, k, v, out, lse, None, None, None, None, None, 0.125 * LOG2E, 1.0, 8.0, -1, -1)),
    }
    with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
        rows["SDPA FLASH"] = per_call_us(lambda: torch.nn.functional.scaled_dot_product_attention(qt, kt, vt))
    for name, us in rows.items():
        print(f"{name:22} {us:7.1f} us/call")
    ratio = rows["flash_attn_func"] / rows["SDPA FLASH"]
    print(f"host overhead (1x8x1x64 bf16): ours/SDPA {ratio:.2f}; the dispatcher adds "
          f"{rows['op (dispatcher)'] - rows['launcher (flash_fwd)']:.1f} us over the launcher")

    # Decode: one query row over a 64-token cache (32/8 heads, d 128), split in 2 and not.
    from cute_flash import flash_attn_with_kvcache

    qd = torch.randn(1, 1, 32, 128, device="cuda", dtype=torch.bfloat16)
    kc, vc = (torch.randn(1, 64, 8, 128, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    seqlens = torch.full((1,), 64, dtype=torch.int32, device="cuda")
    qdt, kct, vct = qd.transpose(1, 2), kc.transpose(1, 2), vc.transpose(1, 2)
    dec = {f"with_kvcache splits={n}": per_call_us(
        lambda n=n: flash_attn_with_kvcache(qd, kc, vc, cache_seqlens=seqlens, num_splits=n)) for n in (1, 2)}
    dec["  op (dispatcher)"] = per_call_us(lambda: torch.ops.cute_flash.fwd_kvcache(
        qd, kc, vc, None, None, None, None, seqlens, None, None, None, None, 0.088, False, -1, -1, 0.0, True,
        None, 1))
    # Paged: the same cache in 4 pages of 16 rows; flash-attn's host check of the block table
    # reads max(cache_seqlens) (a device sync) on every call: timed with it and without it.
    from cute_flash.tools.bench import host_check_off

    pk, pv = kc.view(4, 16, 8, 128), vc.view(4, 16, 8, 128)
    table = torch.arange(4, dtype=torch.int32, device="cuda").view(1, 4)

    def paged():
        return flash_attn_with_kvcache(qd, pk, pv, cache_seqlens=seqlens, block_table=table, num_splits=1)

    dec["with_kvcache paged"] = per_call_us(paged)
    with host_check_off():
        dec["  same, no host check"] = per_call_us(paged)
    with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
        dec["SDPA FLASH (gqa)"] = per_call_us(
            lambda: torch.nn.functional.scaled_dot_product_attention(qdt, kct, vct, enable_gqa=True))
    for name, us in dec.items():
        print(f"{name:22} {us:7.1f} us/call")
    return rows | dec


COLD_START = """
import time
t0 = time.perf_counter()
import torch
from cute_flash import flash_attn_func, flash_attn_with_kvcache
q = torch.randn(2, 512, 16, 128, device="cuda", dtype=torch.bfloat16)
t1 = time.perf_counter()
flash_attn_func(q, q, q, causal=True)
torch.cuda.synchronize()
t2 = time.perf_counter()
kc = torch.randn(2, 4096, 4, 128, device="cuda", dtype=torch.bfloat16)
flash_attn_with_kvcache(q[:, :1], kc, kc, cache_seqlens=4000)
torch.cuda.synchronize()
t3 = time.perf_counter()
print(f"import+setup {t1 - t0:.2f} s, first flash_attn_func {t2 - t1:.2f} s, first decode {t3 - t2:.2f} s")
"""


def cmd_coldstart():
    """The first calls of a fresh process (a causal prefill and a split decode) with an empty
    compile cache, then in another fresh process with the cache the first one filled."""
    import os
    import subprocess
    import tempfile

    with tempfile.TemporaryDirectory() as cache:
        env = dict(os.environ, CUTE_FLASH_CACHE_DIR=cache, CUTE_FLASH_CACHE="1")
        for label in ("empty cache", "warm cache"):
            run = subprocess.run([sys.executable, "-c", COLD_START], env=env, capture_output=True, text=True)
            print(f"{label:12}: {run.stdout.strip() or run.stderr[-2000:]}", flush=True)


def main(argv=None):
    p = argparse.ArgumentParser(prog="python -m cute_flash", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd")

    def command(name, help):
        """A subcommand whose --help says what it does: its one line in the list, as description."""
        return sub.add_parser(name, help=help, description=help)

    c = command("compile", "compile kernel variants into the compile cache, no GPU needed "
                                       "(ahead of time); print each one's resources")
    c.add_argument("--arch", type=int, nargs="+", default=[80, 90], choices=[80, 90],
                   help="target archs (default: 80 90)")
    c.add_argument("--full", action="store_true",
                   help="every traits x every flag combination (thousands of variants: hours) instead of the CI subset")
    c.add_argument("--jobs", type=int, default=os.cpu_count() or 1,
                   help="compile in this many processes (default: one per core)")
    c.add_argument("--keys", metavar="FILE",
                   help="compile the variants a workload recorded with CUTE_FLASH_RECORD=FILE")
    command("check", "quick GPU correctness against cute_flash.reference")
    b = command("bench", "TFLOP/s against torch SDPA FLASH and CUDNN (GPU)")
    b.add_argument("--quick", action="store_true")
    b.add_argument("--out", default=None, help="directory for bench.json, bench.md, bench.png")
    from cute_flash.tools.bench_mods import VARIANTS

    b.add_argument("--mods", default=None,
                   help=f"the mods section's variants, comma-separated (default: every one: {', '.join(VARIANTS)})")
    b.add_argument("--sections", default="grid,extra,varlen,paged,decode,unaligned,bwd,bwd_dims,dropout,held,"
                                         "shapes,train_varlen,mla_decode",
                   help="comma-separated: grid (the forward grid), extra (window/softcap), varlen, paged, "
                        "decode, unaligned (caches served through aligned copies), bwd (backward alone and "
                        "forward + backward), bwd_dims (the same at d 96 / 192 / 256, 4k), dropout, held (d "
                        "128 8k / 16k and a cuBLAS GEMM held for seconds at the board's power cap), shapes "
                        "(MLA's v head dim, learnable sinks, packed queries in the KV-cache call), "
                        "train_varlen (packed batches forward + backward), mods (Python-written variants against "
                        "FlexAttention and flash-attn-4), mla_decode (q / cache 576 against V 512 in GB/s, against "
                        "torch SDPA), step_split (one training step's GPU time by kernel role, dense and packed, "
                        "ours and flash-attn-4; not in the default list)")
    command("overhead", "host cost of a cached call vs SDPA (GPU)")
    command("coldstart", "first calls of a fresh process, empty vs warm compile cache (GPU)")
    t = command("tune", "TFLOP/s of each tile candidate per head dim (GPU)")
    t.add_argument("--bwd", action="store_true", help="the backward's tile candidates instead of the forward's")
    t.add_argument("--bwd-dq", action="store_true",
                   help="the Hopper backward's dQ paths, deterministic mode and the policy's choice, interleaved "
                        "(sm_90 GPUs)")
    t.add_argument("--sm90", action="store_true", help="the Hopper forward's tile candidates (sm_90 GPUs)")
    t.add_argument("--decode", action="store_true",
                   help="the Hopper KV-cache entry's candidates on decode cells, GB/s (sm_90 GPUs)")
    t.add_argument("--splits", action="store_true",
                   help="every split count of decode calls at 48-128 (batch, kv head) tiles, GB/s under "
                        "CUDA graphs, beside the heuristic's count and CUDNN")
    tc = command("traincheck", "a 2-block transformer trained 200 steps with cute-flash and with SDPA: "
                               "the two loss curves compared (GPU, about a minute)")
    tc.add_argument("--packed", action="store_true",
                    help="each step one packed row of documents: flash_attn_varlen_func against SDPA per document")
    cp = command("cp", "context parallelism through ring-flash-attn (zigzag, causal): forward + backward of one "
                       "long sequence on 1 GPU and on N, speed-up and peak memory per GPU (2+ GPUs)")
    cp.add_argument("--gpus", type=int, default=None, help="N (default: every visible GPU)")
    cp.add_argument("--seqlen", type=int, nargs="+", default=[65536, 131072], help="tokens of the sequence")
    cp.add_argument("--iters", type=int, default=10, help="timed steps per length (the median is shown)")
    for tool, finds in (("memcheck", "out-of-bounds and misaligned accesses"),
                        ("racecheck", "shared-memory hazards between a CTA's threads")):
        m = command(tool, f"the GPU suite under compute-sanitizer {tool}: {finds} (GPU); "
                                      "other arguments go to pytest (default: tests)")
        m.add_argument("--jobs", type=int, default=1, help="sanitized pytest processes at a time, spread over the GPUs")
        m.add_argument("--chunk", type=int, default=None,
                       help="tests per process, in collected order (default: all dealt round-robin to --jobs)")
        m.add_argument("--only", type=lambda s: [int(x) for x in s.split(",")], default=None,
                       help="run only these process numbers (comma-separated): finish a run cut short")
        m.add_argument("--retry-aborted", action="store_true",
                       help="run the tests of each process the sanitizer aborted again, one process each, launches "
                            "blocking, and name the first call to see the fault")
        m.add_argument("--deadline", type=float, default=None, metavar="S",
                       help="after S seconds start no process and stop the running ones; name those left for --only")
    o = command("occupancy", "achieved occupancy, registers, time and throughput of representative "
                                         "calls' kernels under Nsight Compute (GPU, ncu)")
    o.add_argument("--case", default=None, help=argparse.SUPPRESS)  # the child ncu profiles
    lay = command("layouts", "bijection, bank-conflict, coalescing and coverage checks of every shipped traits, "
                             "no GPU needed; exits 1 when one fails")
    lay.add_argument("--arch", choices=("80", "90", "all"), default="all")
    lay.add_argument("--draw", type=Path, metavar="DIR", help="write PNGs of the sQ swizzle and ldmatrix thread map")
    args, extra = p.parse_known_args(argv)
    if extra and args.cmd not in ("memcheck", "racecheck"):
        p.error(f"unrecognized arguments: {' '.join(extra)}")

    cmd = args.cmd
    if cmd == "layouts":
        from cute_flash.tools import layouts_report

        return layouts_report.run((80, 90) if args.arch == "all" else (int(args.arch),), args.draw)
    if cmd not in (None, "compile"):
        import torch

        if not torch.cuda.is_available():
            print(f"python -m cute_flash {cmd}: needs a CUDA GPU, and torch sees none here "
                  f"(`python -m cute_flash compile` works without one)", file=sys.stderr)
            return 2
    if cmd is None:
        import torch

        if torch.cuda.is_available():
            bad = cmd_check()
            from cute_flash.tools.bench import main as bench

            bench()
            return int(bad > 0)
        print("no CUDA GPU: compile-only mode (the CI variant set, then the layout checks)", flush=True)
        cmd_compile([80, 90], False, os.cpu_count() or 1)
        from cute_flash.tools import layouts_report

        return layouts_report.run((80, 90))
    if cmd == "compile":
        return cmd_compile(args.arch, args.full, args.jobs, args.keys)
    elif cmd == "check":
        return int(cmd_check() > 0)
    elif cmd == "bench":
        from cute_flash.tools.bench import main as bench

        bench(args.out, args.quick, tuple(args.sections.split(",")),
              mods=tuple(args.mods.split(",")) if args.mods else None)
    elif cmd == "overhead":
        cmd_overhead()
    elif cmd == "coldstart":
        cmd_coldstart()
    elif cmd in ("memcheck", "racecheck"):
        from cute_flash.tools import sanitize

        return sanitize.run(cmd, extra, args.jobs, args.chunk, args.only, args.retry_aborted, args.deadline)
    elif cmd == "occupancy":
        from cute_flash.tools import occupancy

        if args.case is not None:
            occupancy.profile_case(args.case)
            return 0
        return occupancy.main()
    elif cmd == "cp":
        from cute_flash.tools import context_parallel

        return context_parallel.main([*(["--gpus", str(args.gpus)] if args.gpus else []), "--seqlen",
                                      *map(str, args.seqlen), "--iters", str(args.iters)])
    elif cmd == "traincheck":
        from cute_flash.tools.train_check import main as traincheck

        traincheck(args.packed)
    elif cmd == "tune":
        from cute_flash.tools import bench as tuners

        tuner = (tuners.tune_bwd if args.bwd else tuners.tune_bwd_dq if args.bwd_dq else tuners.tune_sm90 if args.sm90
                 else tuners.tune_decode if args.decode else tuners.tune_decode_splits if args.splits else tuners.tune)
        tuner()
    return 0


if __name__ == "__main__":
    sys.exit(main())
