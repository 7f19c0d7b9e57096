"""Fixtures of the GPU tests."""
import os
import sys

import pytest
import torch


@pytest.fixture(params=["default", "sm80"])
def arch_path(request, monkeypatch) -> str:
    """Each test twice: on the default path (the Hopper kernels on an sm_90 GPU) and on the SM80
    kernels (`CUTE_FLASH_ARCH_PATH=sm80`); the path's name, for `gpu_utils.on_path`."""
    if request.param == "sm80":
        monkeypatch.setenv("CUTE_FLASH_ARCH_PATH", "sm80")
    else:
        monkeypatch.delenv("CUTE_FLASH_ARCH_PATH", raising=False)
    return request.param


@pytest.fixture(autouse=True)
def _sanitized_processes_hold_no_cache(request):
    """Under the sanitizer commands (several pytest processes share a GPU) each test gives its
    cached blocks back to the driver, so a process holds its live tensors only, and prints what
    the process then holds on the GPU (to the sanitizer's log, past pytest's capture): one
    sanitized process grew to 80 GB from test to test (docs/tuning/gpu-suite.md, eleventh
    session), which these lines pin to a test."""
    yield
    if os.environ.get("CUTE_FLASH_MEMCHECK"):
        from cute_flash.tools.sanitize import gpu_mib

        torch.cuda.empty_cache()
        sys.__stderr__.write(f"[gpu memory] {request.node.nodeid}: {gpu_mib(os.getpid())} MiB after it\n")
