"""`python -m cute_flash occupancy`'s host side: reading ncu's CSV and naming kernels."""
from cute_flash.tools import occupancy

NCU_OUT = '''==PROF== Connected to process 7
"ID","Kernel Name","launch__grid_size","gpu__time_duration.sum"
"","","","ns"
"0","kernel_cutlass_flash_fwd_0(Tensor, int)","132","12,345"
"1","void at::native::vectorized_elementwise_kernel<4, Fill>(int)","8","1,000"
==PROF== Disconnected from process 7
'''


def test_ncu_rows_skip_the_units_row_and_ncu_messages():
    rows = occupancy._rows(NCU_OUT)
    assert [r["ID"] for r in rows] == ["0", "1"]
    assert rows[0]["launch__grid_size"] == "132" and rows[1]["gpu__time_duration.sum"] == "1,000"


def test_kernel_names_lose_arguments_and_templates():
    rows = occupancy._rows(NCU_OUT)
    assert occupancy._short(rows[0]["Kernel Name"]) == "kernel_cutlass_flash_fwd_0"
    assert occupancy._short(rows[1]["Kernel Name"]) == "void at::native::vectorized_elementwise_kernel"


def test_case_names_are_unique():
    names = [c.name for c in occupancy.CASES]
    assert len(set(names)) == len(names)
