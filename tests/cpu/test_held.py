"""The held section's host side (`cute_flash.tools.held`) without a GPU: nvidia-smi's CSV parsed with
its unparsable lines left out, a window's medians, and the table's ratios on hand-made rows."""
import datetime

from cute_flash.tools.held import Held, SmiSample, Window, format_held, parse_smi


def _epoch(text):
    return datetime.datetime.strptime(text, "%Y/%m/%d %H:%M:%S.%f").timestamp()


def test_parse_smi_keeps_whole_lines_only():
    lines = ["2026/12/04 08:36:40.459, 1620, 207.92\n",
             "2026/12/04 08:36:40.559, [N/A], 269.92\n",  # a field nvidia-smi could not read
             "2026/12/04 08:36:40.659, 1635, 328.41\n",
             "2026/12/04 08:36:40.7"]  # cut off when the logger was stopped
    samples = parse_smi(lines)
    assert samples == [SmiSample(_epoch("2026/12/04 08:36:40.459"), 1620.0, 207.92),
                       SmiSample(_epoch("2026/12/04 08:36:40.659"), 1635.0, 328.41)]


def test_window_medians_and_empty_window():
    samples = [SmiSample(10.0, 1900.0, 300.0), SmiSample(11.0, 1600.0, 690.0), SmiSample(11.1, 1500.0, 700.0),
               SmiSample(11.2, 1650.0, 680.0), SmiSample(13.0, 1980.0, 100.0)]
    assert Window.of(samples, 10.5, 12.0) == Window(1600.0, 690.0)
    assert Window.of(samples, 20.0, 21.0) == Window(None, None)


def test_held_is_the_median_chunk():
    run = Held("ours", "d 128, 8k, 2 x 16", 789.0, (690.0, 650.0, 700.0, 680.0), 0.0, 1.0)
    assert run.held == 685.0


def _row(name, shape, held, clock=1620.0):
    return dict(name=name, shape=shape, first_tflops=held * 1.1, held_tflops=held, chunk_min=held - 10,
                chunk_max=held + 10, sm_mhz=clock, power_w=None if clock is None else 690.0)


def test_format_held_ratios():
    rows = [_row("ours", "8k", 680.0), _row("ours", "16k", 700.0), _row("CUDNN", "8k", 544.0),
            _row("FA4", "8k", 640.0, clock=None), _row("cuBLAS GEMM", "gemm", 625.0)]
    lines = format_held(rows).splitlines()
    assert "| ours | 8k | 748 | 680 | 670-690 | 1620 | 690 |" in lines
    assert "| FA4 | 8k | 704 | 640 | 630-650 | - | - |" in lines
    assert "ours 8k held / best peer held 1.062, / cuBLAS GEMM held 1.088" in lines  # 680/640, 680/625
    assert "ours 16k held / cuBLAS GEMM held 1.120" in lines  # no peer at 16k


def test_format_held_names_the_hold_it_was_given():
    assert format_held([_row("ours", "8k", 680.0)], 2.0).startswith("Held 2 s after 1 s idle")
    assert format_held([_row("ours", "8k", 680.0)]).startswith("Held 4 s after 1 s idle")


def test_format_held_without_gemm_or_peers():
    lines = format_held([_row("ours", "8k", 680.0)]).splitlines()
    assert not any(line.startswith("ours 8k held") for line in lines)
