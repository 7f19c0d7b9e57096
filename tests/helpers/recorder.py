"""Compiled kernels replaced by recorders at their one seam (`cute_flash.launch.compiled.kernel_for`):
the CPU launcher tests' stand-in (the `recorder` fixture of tests/cpu/conftest.py).

Every recorded launch is bound to the parameter names of the entry point its config compiles
(`registry.kernel_module(config).entry(config)`: `FlashFwd.__call__`, `call_varlen`,
`call_kvcache`, `AppendKV.__call__`, ...), so the checks read arguments by name, and a host call
whose order differs from the compiled signature (two int32 vectors swapped, say) fails on a CPU
instead of on a GPU."""
import inspect

import torch

from tests.helpers.clusters import H200_CLUSTERS


class Launch:
    """One recorded launch: the config it was compiled for and its arguments by parameter name."""

    def __init__(self, config, entry, args):
        signature = inspect.signature(entry)
        bound = signature.bind_partial(*args)
        # everything but the stream, which TVM-FFI takes from torch's current stream
        assert [p for p in signature.parameters if p not in bound.arguments] == ["stream"], bound
        self.config, self.args = config, bound.arguments

    def __getitem__(self, name):
        return self.args[name]


class Recorder:
    """Stands in for `compiled.kernel_for` (and the device queries beside it): the compiled
    kernel of any config (forward, backward, preprocess, dQ convert, append; SM80 or Hopper)
    records its launches as `Launch`es, in order, in `launches`; `configs` lists every config
    looked up."""

    def __init__(self):
        self.launches, self.configs = [], []
        self.stream, self.capturing = 7, False

    def kernel_for(self, config, index):
        from cute_flash.compile import registry

        self.configs.append(config)
        entry = registry.kernel_module(config).entry(config)
        return lambda *args: self.launches.append(Launch(config, entry, args))


def install(monkeypatch) -> Recorder:
    """A `Recorder` at the seam, on a stand-in sm_90 GPU of 132 SMs (an H200's clusters) whose
    launches take the SM80 kernels (`CUTE_FLASH_ARCH_PATH=sm80`; a test deletes the variable for
    the Hopper default), with no stream capturing and fresh per-call state."""
    from cute_flash.launch import compiled, gpu, kvcache, per_stream

    rec = Recorder()
    monkeypatch.setattr(compiled, "kernel_for", rec.kernel_for)
    monkeypatch.setattr(gpu, "device_arch", lambda index: 90)
    monkeypatch.setenv("CUTE_FLASH_ARCH_PATH", "sm80")  # the SM80 launches; the Hopper default has its own test
    monkeypatch.setattr(gpu, "num_sms", lambda index: 132)
    monkeypatch.setattr(kvcache, "resident_clusters", lambda index, ctas, size: H200_CLUSTERS[ctas][:size])
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: rec.capturing)
    monkeypatch.setattr(torch._C, "_cuda_getCurrentRawStream", lambda index: rec.stream, raising=False)
    monkeypatch.setattr(kvcache, "_calls", {})
    monkeypatch.setattr(per_stream, "_reserves", {})
    return rec


def memos() -> tuple:
    """The launchers' memos keyed on call signatures, which hold compiled kernels (the SM80
    forward's per signature, the KV-cache workspaces): cleared around a recording, so that no
    kernel of another test, recorded or real, is reused."""
    from cute_flash.launch import dense, kvcache

    return dense.fwd_kernel, kvcache._workspace
