import pytest
import torch


def pytest_collection_modifyitems(config, items):
    """GPU tests are skipped, visibly, where CUDA is absent (CI); they run on the device."""
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
