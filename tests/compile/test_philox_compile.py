"""The device Philox (kernels/common/philox.py) compiled for sm_80 and sm_90a on the CPU, through
the probe kernel of tests/helpers/philox_probe.py; its words are checked against layouts/philox.py
by tests/gpu/test_philox_gpu.py, and layouts/philox.py itself by tests/cpu/test_philox.py."""
import pytest


@pytest.mark.parametrize("arch", [80, 90])
def test_device_philox_compiles_to_wide_multiplies(arch, tmp_path):
    """kernels/common/philox.py: one Philox call is 7 rounds of two 32x32 -> 64-bit multiplies."""
    from tests.helpers.philox_probe import compile_philox_probe

    compile_philox_probe(arch, f"--keep-ptx --dump-dir={tmp_path}")
    (ptx,) = tmp_path.glob("*.ptx")
    assert ptx.read_text().count("mul.wide.u32") == 14
