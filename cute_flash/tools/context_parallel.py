"""Context parallelism through ring-flash-attn on cute-flash: forward + backward of one long
sequence on one GPU and on N (zigzag ring attention, causal), the speed-up and each GPU's peak
memory. `python -m cute_flash cp [--gpus N] [--seqlen ...]` launches one torchrun per GPU count;
each rank runs `rank_main` (`torchrun -m cute_flash.tools.context_parallel ...`).
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile


def rank_main(argv=None):
    """One rank: time forward + backward of each sequence length (its shard under zigzag ring
    attention when the group has several ranks; the whole sequence on one GPU otherwise) and
    write rank 0's median ms and every rank's peak memory to OUT."""
    import torch
    import torch.distributed as dist

    from cute_flash import flash_attn_func

    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("--seqlen", type=int, nargs="+", required=True)
    parser.add_argument("--heads", type=int, default=32)
    parser.add_argument("--heads-k", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--iters", type=int, default=10)
    args = parser.parse_args(argv)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    if world > 1:
        from cute_flash.integrations.flash_attn import import_ring_flash_attn

        dist.init_process_group("nccl")
        attend = import_ring_flash_attn().zigzag_ring_flash_attn_func
    else:
        attend = flash_attn_func
    rows = []
    for seqlen in args.seqlen:
        local = seqlen // world
        q, dout = (torch.randn(1, local, args.heads, args.head_dim, device="cuda", dtype=torch.bfloat16)
                   for _ in range(2))
        k, v = (torch.randn(1, local, args.heads_k, args.head_dim, device="cuda", dtype=torch.bfloat16)
                for _ in range(2))
        q, k, v = (x.requires_grad_() for x in (q, k, v))

        def step():
            attend(q, k, v, causal=True).backward(dout)

        step()  # compiles, allocates
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        times = []
        for _ in range(args.iters):
            if world > 1:
                dist.barrier()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            step()
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end))
        peak = torch.cuda.max_memory_allocated() / 2**30
        peaks = [peak]
        if world > 1:
            gathered = [None] * world
            dist.all_gather_object(gathered, peak)
            peaks = gathered
        rows.append(dict(seqlen=seqlen, ms=sorted(times)[len(times) // 2], peak_gib=max(peaks)))
    if rank == 0:
        with open(args.out, "w") as f:
            json.dump(dict(world=world, rows=rows), f)
    if world > 1:
        dist.destroy_process_group()


def main(argv=None) -> int:
    """Time 1 GPU and N GPUs and print the table (markdown)."""
    import torch

    parser = argparse.ArgumentParser(prog="python -m cute_flash cp", description=(
        "Context parallelism through ring-flash-attn (zigzag, causal) on cute-flash: forward + backward of one "
        "long sequence, bf16, on 1 GPU and on N, with the speed-up and each GPU's peak memory."))
    parser.add_argument("--gpus", type=int, default=None, help="N (default: every visible GPU)")
    parser.add_argument("--seqlen", type=int, nargs="+", default=[65536, 131072])
    parser.add_argument("--iters", type=int, default=10)
    args = parser.parse_args(argv)
    gpus = args.gpus or torch.cuda.device_count()
    if gpus < 2:
        print(f"python -m cute_flash cp: needs 2 GPUs or more, this machine shows {torch.cuda.device_count()}",
              file=sys.stderr)
        return 2
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        for n in (1, gpus):
            out = os.path.join(tmp, f"{n}.json")
            cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={n}", "-m",
                   "cute_flash.tools.context_parallel", out, "--seqlen", *map(str, args.seqlen), "--iters",
                   str(args.iters)]
            subprocess.run(cmd, check=True)
            with open(out) as f:
                results[n] = {row["seqlen"]: row for row in json.load(f)["rows"]}
    print(f"| tokens | 1 GPU ms | {gpus} GPUs ms | speed-up | peak GiB, 1 GPU | peak GiB per GPU, {gpus} |")
    print("| --- | --- | --- | --- | --- | --- |")
    for seqlen in args.seqlen:
        one, many = results[1][seqlen], results[gpus][seqlen]
        print(f"| {seqlen} | {one['ms']:.1f} | {many['ms']:.1f} | {one['ms'] / many['ms']:.2f}x | "
              f"{one['peak_gib']:.1f} | {many['peak_gib']:.1f} |")
    return 0


if __name__ == "__main__":
    rank_main()
