"""Compile kernels without a GPU and read their resource use (registers, spills, smem) from ptxas.

The DSL compiles to a cubin in-process; with `--keep-ptx` it also leaves the PTX, which the
CUDA toolkit's `ptxas -v` (when installed) turns into the usual resource line. Spills and a
255-register ceiling are what to look at first when a kernel is slower than predicted.
"""
from __future__ import annotations

import glob
import os
import re
import shutil
import subprocess
import tempfile
import time

from layouts.traits import sm_name

_PTXAS_CANDIDATES = ("ptxas", "/usr/local/cuda/bin/ptxas")


def find_ptxas() -> str | None:
    for c in _PTXAS_CANDIDATES:
        p = shutil.which(c)
        if p:
            return p
    hits = sorted(glob.glob("/usr/local/cuda*/bin/ptxas"))
    return hits[-1] if hits else None


def ptxas_report(ptx_path: str, arch: int) -> dict:
    ptxas = find_ptxas()
    if ptxas is None:
        return {}
    res = subprocess.run([ptxas, f"-arch={sm_name(arch)}", "-v", ptx_path, "-o", os.devnull],
                         capture_output=True, text=True)
    text = res.stderr + res.stdout
    out = {}
    for key, pat in (("registers", r"Used (\d+) registers"), ("spill_stores", r"(\d+) bytes spill stores"),
                     ("spill_loads", r"(\d+) bytes spill loads"), ("stack", r"(\d+) bytes stack frame")):
        m = re.search(pat, text)
        if m:
            out[key] = int(m.group(1))
    if "C7512" in text:  # "wgmma.mma_async instructions are serialized due to ..."
        out["wgmma_serialized"] = True
    return out


def compile_with_report(compile_fn, arch: int) -> tuple[object, dict]:
    """compile_fn(extra_options) -> compiled; returns it and its ptxas resource numbers."""
    with tempfile.TemporaryDirectory() as tmp:
        compiled = compile_fn(f"--keep-ptx --dump-dir={tmp}")
        ptx = glob.glob(os.path.join(tmp, "*.ptx"))
        report = ptxas_report(ptx[0], arch) if ptx else {}
    return compiled, report


def compile_variant(arch: int, config, cached: bool) -> tuple[dict, float]:
    """Compile one variant, into the compile cache when `cached`: its ptxas numbers and seconds.
    What `python -m cute_flash compile` runs per variant (in a worker process with --jobs)."""
    from cute_flash.compile import cache as compile_cache
    from cute_flash.compile.registry import build as compile_config

    compile_cache.log.setLevel("WARNING")  # the caller prints a row per variant
    report, t0 = {}, time.time()

    def build():
        result, numbers = compile_with_report(lambda opts: compile_config(config, arch, opts), arch)
        report.update(numbers)
        return result

    if cached:
        compile_cache.get_or_compile((config, arch), build)
    else:
        build()
    return report, time.time() - t0
