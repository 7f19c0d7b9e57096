"""`cute_flash.integrations.flash_attn`: flash-attn's module names served by cute_flash, and
ring-flash-attn importing through them. Each case runs in a fresh interpreter, since `install`
changes `sys.modules` for the whole process. tests/gpu/test_ring_flash_attn_gpu.py runs
ring-flash-attn on the kernels over several GPUs."""
import importlib.util
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def run(code: str) -> str:
    result = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], cwd=ROOT, capture_output=True, text=True,
                            timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    return result.stdout


def test_flash_attn_imports_resolve_to_cute_flash():
    run("""
        from cute_flash.integrations.flash_attn import install
        import cute_flash, cute_flash.flash_attn_interface as ours
        module = install()
        assert install() is module  # a second install changes nothing
        import flash_attn
        from flash_attn.flash_attn_interface import _flash_attn_forward, _flash_attn_varlen_backward
        from flash_attn import flash_attn_func
        assert flash_attn is module and flash_attn.__version__ == "2.8.3"
        assert _flash_attn_forward is ours._flash_attn_forward
        assert _flash_attn_varlen_backward is ours._flash_attn_varlen_backward
        assert flash_attn_func is cute_flash.flash_attn_func
        try:
            import flash_attn.bert_padding
        except ImportError:
            pass
        else:
            raise AssertionError("only flash_attn_interface is served")
    """)


def test_an_imported_flash_attn_is_kept_unless_replaced():
    run("""
        import sys, types
        sys.modules["flash_attn"] = real = types.ModuleType("flash_attn")
        from cute_flash.integrations.flash_attn import install
        try:
            install()
        except RuntimeError as exc:
            assert "already imported" in str(exc)
        else:
            raise AssertionError("install() took the place of an imported flash_attn")
        assert sys.modules["flash_attn"] is real
        assert install(replace=True) is sys.modules["flash_attn"] is not real
    """)


def test_ring_flash_attn_runs_its_forwards_on_our_private_functions():
    """ring, zigzag-ring and stripe attention in a one-process group, on `meta` tensors (which
    our private forwards answer with their outputs' shapes): every call site of ring-flash-attn
    binds to our signatures and takes our return values; the GPU test checks the numbers."""
    if importlib.util.find_spec("ring_flash_attn") is None:
        pytest.skip("ring-flash-attn is not installed (pip install -e .[ring])")
    out = run("""
        import os, torch, torch.distributed as dist
        import cute_flash.flash_attn_interface as ours
        from cute_flash.integrations.flash_attn import import_ring_flash_attn
        ring = import_ring_flash_attn()
        assert ring.ring_flash_attn.__dict__["_flash_attn_forward"] is ours._flash_attn_forward
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(29500 + os.getpid() % 1000))
        dist.init_process_group("gloo", rank=0, world_size=1)
        for fn, causals in ((ring.ring_flash_attn_func, (False, True)), (ring.zigzag_ring_flash_attn_func, (True,)),
                            (ring.stripe_flash_attn_func, (True,))):  # zigzag and stripe are for causal attention
            for causal in causals:
                q = torch.empty(2, 256, 4, 64, dtype=torch.bfloat16, device="meta")
                k = v = torch.empty(2, 256, 2, 64, dtype=torch.bfloat16, device="meta")
                out = fn(q, k, v, causal=causal)
                assert out.shape == q.shape and out.is_meta, (fn.__name__, out.shape)
        print("ran")
    """)
    assert out.strip() == "ran"
