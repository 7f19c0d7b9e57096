"""The decode bench's tables (`bench.format_decode`) on hand-made rows: ours over each peer and
over the better of CUDNN and flash-attn-4 (the issue's bar), a missing peer as "-", and the SM80
table only when the rows carry it. No GPU: the rows are written here."""
from cute_flash.bench import format_decode


def _row(batch, ours, cudnn, fa4, sm80=None):
    row = dict(batch=batch, cache=1024, ours_gbs=ours, ours_graph_gbs=ours / 2, flash_gbs=100.0,
               flash_graph_gbs=50.0, cudnn_gbs=cudnn, cudnn_graph_gbs=cudnn / 2, fa4_gbs=fa4,
               fa4_graph_gbs=None if fa4 is None else fa4 / 2)
    if sm80 is not None:
        row.update(sm80_gbs=sm80, sm80_graph_gbs=sm80 / 2)
    return row


def test_best_peer_is_the_better_of_cudnn_and_fa4():
    rows = [_row(1, 900.0, 1000.0, 800.0), _row(8, 1200.0, 1000.0, 1100.0), _row(32, 500.0, 400.0, None)]
    text = format_decode(rows, 4000.0)
    lines = text.splitlines()
    eager = [ln for ln in lines if ln.startswith("| 1 | 1024 | 900 |")]
    assert eager and eager[0].endswith("| 9.00 | 0.90 | 1.12 | 0.90 |")  # vs FLASH, CUDNN, FA4, best (CUDNN)
    assert any(ln.startswith("| 8 | 1024 | 1200 |") and ln.endswith("| 1.09 |") for ln in lines)  # best: FA4 1100
    assert any(ln.startswith("| 32 | 1024 | 500 |") and "| - |" in ln and ln.endswith("| 1.25 |") for ln in lines)
    # the same ratios under graphs (every column halved), and the summary of each table
    assert text.count("ours / best peer: min 0.90, cells >= 1.00: 2/3") == 2
    assert "SM80" not in text


def test_sm80_table_on_hopper_rows():
    text = format_decode([_row(1, 900.0, 1000.0, 800.0, sm80=750.0)], 4000.0)
    assert "| 1 | 1024 | 750 | 1.20 | 375 | 1.20 |" in text
