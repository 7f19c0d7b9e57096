"""Fixtures of the CPU tests: the launchers with recorders for compiled kernels, and the public
API with a recorder for the launch layer."""
import pytest

from tests.helpers import interface, recorder as recording


@pytest.fixture
def recorder(monkeypatch):
    """The `tests.helpers.recorder.Recorder` standing in for every compiled kernel (see
    `recorder.install`): `recorder.launches` are the launches the test's calls made."""
    memos = recording.memos()  # the memos themselves, whatever later stands in for them
    for memo in memos:
        memo.cache_clear()
    yield recording.install(monkeypatch)
    for memo in memos:
        memo.cache_clear()


@pytest.fixture
def gpu_free():
    """The public API with no GPU: `_validate.check_cuda` skipped and a recorder standing in
    for `cute_flash.launch` (`tests.helpers.interface.FakeKernels`), yielded."""
    with interface.no_gpu_needed() as fake:
        yield fake
