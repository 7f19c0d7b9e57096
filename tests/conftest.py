import hypothesis
import pytest
import torch


class _TorchGenerators:
    """torch's default CPU and CUDA generators as one Random-like object for hypothesis
    (`register_random`): under @given each example's torch draws start from a seed hypothesis
    manages (0, or the seed of an `st.random_module()` argument, printed with a falsifying
    example), so a failure replays with the same tensors, dropout's rng_state included."""

    @staticmethod
    def seed(value):
        torch.manual_seed(value)  # every device's generator (CUDA's lazily)

    @staticmethod
    def getstate():
        cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_available() and torch.cuda.is_initialized() else None
        return torch.random.get_rng_state(), cuda

    @staticmethod
    def setstate(state):
        cpu, cuda = state
        torch.random.set_rng_state(cpu)
        if cuda is not None:
            torch.cuda.set_rng_state_all(cuda)


TORCH_GENERATORS = _TorchGenerators()
hypothesis.register_random(TORCH_GENERATORS)


@pytest.fixture
def kernels(monkeypatch):
    """The attention kernels a test's calls ran, as a set of "sm90_fwd", "sm80_fwd", "sm90_bwd"
    and "sm80_bwd": every lookup of a compiled kernel at the seams the launchers call
    (`launch.compiled.kernel_for`, one lookup for every kernel, and `launch.dense.fwd_kernel`,
    which memoises the SM80 forward per call signature) is recorded by its config's type (the
    preprocess, dQ-convert and append kernels are not attention kernels: not recorded). A test
    that names a path asserts with it that the path ran, so a silent fall back to the other
    kernel fails (`tests.helpers.gpu_utils.on_path`). The KV-cache dispatch kept per call
    signature starts empty, so a test's first call of each signature looks its kernel up."""
    from cute_flash.kernels.sm80.bwd import BwdConfig
    from cute_flash.kernels.sm80.fwd import FwdConfig
    from cute_flash.kernels.sm90.bwd import Sm90BwdConfig
    from cute_flash.kernels.sm90.fwd import Sm90FwdConfig
    from cute_flash.launch import compiled, dense, kvcache

    kinds = {Sm90FwdConfig: "sm90_fwd", FwdConfig: "sm80_fwd", Sm90BwdConfig: "sm90_bwd", BwdConfig: "sm80_bwd"}
    ran = set()

    def recording(lookup, kind):
        def record(*args, **kwargs):
            ran.update({kind(args[0])} - {None})
            return lookup(*args, **kwargs)
        return record

    monkeypatch.setattr(compiled, "kernel_for", recording(compiled.kernel_for, lambda config: kinds.get(type(config))))
    monkeypatch.setattr(dense, "fwd_kernel", recording(dense.fwd_kernel, lambda _: "sm80_fwd"))
    monkeypatch.setattr(kvcache, "_calls", {})
    return ran


def pytest_collection_modifyitems(config, items):
    """GPU tests are skipped, visibly, where CUDA is absent (CI); they run on the device."""
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
