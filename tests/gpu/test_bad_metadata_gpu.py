"""Bad metadata on the GPU: each case of tests/helpers/bad_metadata.py run directly (guards around every
written tensor, values far enough out that an unclamped access faults), all of them under
compute-sanitizer memcheck, and flash-attn's host error for a block table too short."""
import os
import subprocess
import sys

import pytest
import torch

from cute_flash.tools.sanitize import sanitizer_path
from tests.helpers.bad_metadata import CASES, DTYPE, Skipped, i32
from tests.helpers.gpu_utils import UNDER_MEMCHECK

pytestmark = pytest.mark.gpu

SANITIZER = sanitizer_path()
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repository


@pytest.mark.parametrize("name", sorted(CASES))
def test_bad_metadata_is_survived(name):
    try:
        CASES[name]()
    except Skipped as why:
        pytest.skip(str(why))
    torch.cuda.synchronize()


@pytest.mark.skipif(UNDER_MEMCHECK,
                    reason="the whole run is under compute-sanitizer already (python -m cute_flash memcheck)")
def test_bad_metadata_under_memcheck():
    # asked for (a GPU run, not already sanitized): a missing sanitizer fails, it is no pass
    assert os.path.exists(SANITIZER), f"compute-sanitizer not found at {SANITIZER} (the CUDA toolkit's)"
    logs = []
    # Every case with each tensor its own allocation; then the graph case, which needs torch's
    # caching allocator (an access far outside its pool is still caught).
    for caching, cases in ((False, []), (True, ["paged_kvcache_seqlens_past_table_in_graph"])):
        env = {k: v for k, v in os.environ.items() if k != "PYTORCH_NO_CUDA_MEMORY_CACHING"}
        if not caching:
            env["PYTORCH_NO_CUDA_MEMORY_CACHING"] = "1"
        run = subprocess.run([SANITIZER, "--tool", "memcheck", "--report-api-errors", "no", "--error-exitcode", "86",
                              sys.executable, "-m", "tests.helpers.bad_metadata", *cases],
                             capture_output=True, text=True, env=env, cwd=ROOT, timeout=900)
        log = run.stdout + run.stderr
        assert run.returncode == 0, log[-6000:]
        assert "ERROR SUMMARY: 0 errors" in log, log[-6000:]
        logs.append(log)
    for name in CASES:
        assert any(f"survived: {name}" in log for log in logs), name


@pytest.mark.parametrize("seqlens, append", [(257, False), (256, True)])
def test_block_table_too_short_raises_like_flash_attn(seqlens, append):
    """flash-attn's regression case: batch 1, 1 head, d 64, pages of 256, a (1, 1) table into a
    4-page pool, cache_seqlens [257], or [256] plus one appended row: RuntimeError naming
    block_table, before any kernel touches the caches."""
    from cute_flash import flash_attn_with_kvcache

    k_cache = torch.randn(4, 256, 1, 64, device="cuda", dtype=DTYPE)
    v_cache = torch.randn_like(k_cache)
    before = k_cache.clone(), v_cache.clone()
    q = torch.randn(1, 1, 1, 64, device="cuda", dtype=DTYPE)
    k = v = torch.randn(1, 1, 1, 64, device="cuda", dtype=DTYPE) if append else None
    with pytest.raises(RuntimeError, match="block_table"):
        flash_attn_with_kvcache(q, k_cache, v_cache, k, v, cache_seqlens=i32(seqlens),
                                block_table=i32(0).view(1, 1))
    torch.cuda.synchronize()
    assert torch.equal(k_cache, before[0]) and torch.equal(v_cache, before[1])
