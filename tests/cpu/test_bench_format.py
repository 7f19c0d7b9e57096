"""The decode bench's tables (`bench.format_decode`) on hand-made rows: ours over each peer and
over the better of CUDNN and flash-attn-4 (the issue's bar), a missing peer as "-", and the SM80
table only when the rows carry it; the dropout table (`bench.format_dropout`): overheads and
ours at p over the better peer at p; the split-count sweep's bookkeeping with its timer faked.
No GPU: the rows are written here."""
from cute_flash.tools.bench import format_decode, format_dropout


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


def _dropout_row(cudnn_p):
    return dict(d=64, seqlen=1024, causal=False, p=0.1, ours_fwd_p0=300.0, ours_fwd_p=200.0, ours_bwd_p0=240.0,
                ours_bwd_p=200.0, flash_fwd_p0=150.0, flash_fwd_p=100.0, flash_bwd_p0=120.0, flash_bwd_p=100.0,
                cudnn_fwd_p0=None if cudnn_p is None else 2 * cudnn_p, cudnn_fwd_p=cudnn_p,
                cudnn_bwd_p0=None if cudnn_p is None else 2 * cudnn_p, cudnn_bwd_p=cudnn_p)


def test_dropout_overheads_and_ours_over_the_better_peer():
    """Overhead = TFLOP/s at 0 / at p - 1; ours at p over max(FLASH, CUDNN) at p, CUDNN's
    column "-" where it refused the call."""
    text = format_dropout([_dropout_row(250.0), _dropout_row(None)])
    lines = text.splitlines()
    assert "| 64 | False | 1024 | 300 | 200 | +50.0% | +50.0% | +100.0% | 0.80 | 240 | 200 | +20.0% | +20.0% | " \
           "+100.0% | 0.80 |" in lines
    assert "| 64 | False | 1024 | 300 | 200 | +50.0% | +50.0% | - | 2.00 | 240 | 200 | +20.0% | +20.0% | - | 2.00 |" \
        in lines
    assert "cells <= 15%: 0/2; backward max +20.0%, cells <= 20%: 2/2" in text
    assert "fwd at p, ours / better peer at p: geometric mean 1.265; min 0.800; cells >= 1.0: 1/2" in text


def test_split_sweep_times_each_count_on_its_own_call(monkeypatch, capsys):
    """`tune --splits` (`bench.tune_decode_splits`) on the CPU with the timer faked: each count
    is timed on a call that asks for that count (0: the heuristic's), GB/s is the K / V bytes
    over the time, and the printed best is the fastest count."""
    import torch

    from cute_flash.tools import bench

    randn, full = torch.randn, torch.full
    monkeypatch.setattr(torch, "randn", lambda *shape, device=None, **kw: randn(*shape, **kw))
    monkeypatch.setattr(torch, "full", lambda *args, device=None, **kw: full(*args, **kw))
    ms_of_count = {0: 4.0, 1: 4.0, 2: 2.0, 3: 1.0, 5: 8.0}
    monkeypatch.setattr(bench, "graph_time_ms", lambda fn: ms_of_count[fn.keywords["num_splits"]])
    monkeypatch.setattr(bench, "sdpa", lambda *args, **kw: None)
    rows = bench.tune_decode_splits(batches=(9,), caches=(256,), counts=(1, 2, 3, 5))
    _, hk, d = bench.DECODE_HEADS
    nbytes = 2 * 9 * 256 * hk * d * 2
    gbs = {s: nbytes / ms / 1e6 for s, ms in ms_of_count.items()}
    assert rows == [{"batch": 9, "cache": 256, "gbs": gbs, "cudnn_gbs": None}]
    assert "best  3 splits" in capsys.readouterr().out


def test_shapes_tables_give_each_bar_its_ratio():
    """`bench_shapes.format_shapes` on hand-made rows: ours over the better of cuDNN and FA4 for
    MLA (forward, forward + backward, backward alone), sink over no sink (prefill and decode),
    packed queries over plain decode; a missing peer as "-"."""
    from cute_flash.tools.bench_shapes import format_shapes

    result = dict(
        mla=[dict(seqlen=4096, causal=True, batch=4, nheads=16, ours_fwd=500.0, cudnn_fwd=400.0, fa4_fwd=None,
                  ours_fwdbwd=300.0, cudnn_fwdbwd=350.0, fa4_fwdbwd=None, ours_bwd=200.0, cudnn_bwd=None,
                  fa4_bwd=250.0)],
        sinks=[dict(seqlen=4096, causal=True, batch=4, nheads=32, ours_fwd_ms=1.0, ours_sink_fwd_ms=1.02,
                    fa4_sink_fwd_ms=None, ours_fwdbwd_ms=3.0, ours_sink_fwdbwd_ms=3.3, fa4_sink_fwdbwd_ms=2.9)],
        varlen_decode=[dict(batch=64, cache=4096, new_tokens=500, packed_gbs=3600.0, decode_gbs=4000.0,
                            decode_ms=0.5, decode_sink_ms=0.51, packed_graph_gbs=3800.0, decode_graph_gbs=4000.0),
                       dict(batch=64, cache=8192, new_tokens=500, packed_gbs=3000.0, decode_gbs=4000.0,
                            decode_ms=0.5, packed_graph_gbs=None, decode_graph_gbs=None)])
    lines = format_shapes(result).splitlines()
    assert "| 4096 | True | 4x16 | 500 | 400 | - | 300 | 350 | - | 200 | - | 250 | 1.250 | 0.857 | 0.800 |" in lines
    assert "| 4096 | True | 4x32 | 1.000 | 1.020 | - | 1.020 | 3.000 | 3.300 | 2.900 | 1.100 |" in lines
    assert "| 64 | 4096 | 500 | 3600 | 4000 | 0.900 | 3800 | 4000 | 0.950 |" in lines
    assert "| 64 | 8192 | 500 | 3000 | 4000 | 0.750 | - | - | - |" in lines  # no graph: the call refused capture
    assert "| 64 | 4096 | 0.500 | 0.510 | 1.020 |" in lines


def test_packed_training_lengths_hold_the_tokens_and_their_mean():
    """`bench_train_varlen.exponential_lengths`: seeded, at least 1 each, summing to the tokens,
    a mean near the one drawn from (16k tokens: 32 draws at 512, 8 at 2048)."""
    from cute_flash.tools.bench_train_varlen import TOKENS, exponential_lengths

    for mean in (512, 2048):
        lengths = exponential_lengths(mean)
        assert lengths == exponential_lengths(mean) and min(lengths) >= 1 and sum(lengths) == TOKENS
        assert 0.5 * mean <= TOKENS / len(lengths) <= 2 * mean


def test_packed_training_table_gives_each_bar_its_ratio():
    """`format_train_varlen` on hand-made rows: ours over FA4 and over our dense call on equal
    lengths; the forward alone, ours over SM80 and the persistent schedule over one CTA a tile;
    a column that did not run shows '-'."""
    from cute_flash.tools.bench_train_varlen import format_train_varlen

    rows = [dict(d=128, mean=512, causal=True, sequences=31, longest=2900, ours=400.0, sm80=200.0, fa4=320.0,
                 dense_equal=500.0, ours_fwd=300.0, persistent_fwd=360.0, one_cta_fwd=320.0, sm80_fwd=250.0),
            dict(d=64, mean=2048, causal=False, sequences=8, longest=5000, ours=300.0, fa4=None, dense_equal=310.0,
                 ours_fwd=200.0)]
    lines = format_train_varlen(rows).splitlines()
    step = lines.index("The forward alone, TFLOP/s:")
    assert lines[step - 3] == "| 128 | True | 512 | 31 (2900) | 400 | 200 | 320 | 500 | 1.250 | 0.800 |"
    assert lines[step - 2] == "| 64 | False | 2048 | 8 (5000) | 300 | - | - | 310 | - | 0.968 |"
    assert lines[-2] == "| 128 | True | 512 | 300 | 250 | 320 | 360 | 1.200 | 1.125 |"
    assert lines[-1] == "| 64 | False | 2048 | 200 | - | - | - | - | - |"


def test_mods_table_gives_ours_over_each_peer():
    """`format_mods` on hand-made rows: ours over FlexAttention and over flash-attn-4 for each
    pass, the causal mod's row with the built-in flag's rate and ours without the block mask's
    lists; a peer that did not run shows '-'."""
    from cute_flash.tools.bench_mods import format_mods

    rows = [dict(variant="prefix_lm", d=128, seqlen=4096, ours_fwd=500.0, flex_fwd=250.0, fa4_fwd=None,
                 ours_fwdbwd=300.0, flex_fwdbwd=200.0),
            dict(variant="causal_mod", d=64, seqlen=16384, ours_fwd=400.0, nolists_fwd=380.0, sm80_fwd=200.0,
                 flex_fwd=200.0, fa4_fwd=500.0, causal_flag_fwd=420.0)]
    lines = format_mods(rows).splitlines()
    assert "| prefix_lm | 128 | 4096 | 500 | - | - | 250 | - | - | 2.00 | - |" in lines
    assert "| causal_mod | 64 | 16384 | 400 | 380 | 200 | 200 | 500 | 420 | 2.00 | 0.80 |" in lines
    assert "| prefix_lm | 128 | 4096 | 300 | - | - | 200 | - | - | 1.50 | - |" in lines  # forward + backward


def test_mods_bench_names_its_variants_and_refuses_others(monkeypatch):
    """`VARIANTS` (what `--mods` picks from) are `_specs`' names in its order (its tensors left on
    the CPU here), and a name not among them is refused before anything runs."""
    import pytest
    import torch

    from cute_flash.tools import bench_mods

    monkeypatch.setattr(torch.Tensor, "cuda", lambda self, *args, **kwargs: self)
    assert tuple(name for name, _ in bench_mods._specs(1, 256, 2)) == bench_mods.VARIANTS
    with pytest.raises(ValueError, match="no variant \\['sofcap'\\]"):
        bench_mods.run_mods(names=("softcap", "sofcap"))


# The step split's kernel roles, on kernel names as the DSL gives them (ours read off compiled PTX; flash-attn-4's
# built the same way from its modules and classes) and torch's own.
STEP_KERNELS = {
    "kernel_cutlass_kernel_cute_flashkernelssm90fwdFlashFwdSm90_object_at__Sm90Tensorstma_mQ": "forward",
    "kernel_cutlass_kernel_cute_flashkernelssm90bwdFlashBwdSm90_object_at__Sm90BwdTensorstma_mQ": "backward",
    "kernel_cutlass_kernel_cute_flashkernelssm80bwd_preprocessDotDoO_object_at__tensorptrbf16": "preprocess",
    "kernel_cutlass_kernel_cute_flashkernelssm80dq_convertDQConvert_object_at__tensorptrf32": "dq_convert",
    "kernel_cutlass_kernel_cute_flashkernelscommonvarlen_orderVarlenOrder_object_at__tensorptri32": "other",
    "kernel_cutlass_kernel_flash_attncuteflash_fwd_sm90FlashAttentionForwardSm90_object_at_": "forward",
    "kernel_cutlass_kernel_flash_attncuteflash_bwd_sm90FlashAttentionBackwardSm90_object_at_": "backward",
    "kernel_cutlass_kernel_flash_attncuteflash_bwd_preprocessFlashAttentionBackwardPreprocess_": "preprocess",
    "kernel_cutlass_kernel_flash_attncuteflash_bwd_postprocessFlashAttentionBackwardPostprocess_": "dq_convert",
    "void at::native::vectorized_elementwise_kernel<4, at::native::FillFunctor<float>>": "other",
}


def test_step_split_roles_and_table():
    from cute_flash.tools.bench_step_split import format_step_split, role_of

    assert {name: role_of(name) for name in STEP_KERNELS} == STEP_KERNELS
    kernels = {name: ms for name, ms in zip(STEP_KERNELS, (0.5, 1.25, 0.125, 0.0625, 0.03125, 0, 0, 0, 0, 0.25))}
    row = dict(d=128, mean=2048, causal=True, layout="packed_exp", library="ours", sequences=10, longest=3811,
               step_ms=2.5, tflops=300.0, launches=11, kernels=kernels)
    lines = format_step_split([row]).splitlines()
    header, rule = lines[2], lines[3]
    assert header.count("|") == rule.count("|") == 15  # 14 columns
    line = [ln for ln in lines if ln.startswith("| 128 |")]
    # forward, backward, preprocess, dq_convert, other (the list kernel and torch's fill), their sum
    assert line == ["| 128 | True | packed_exp | 10 (3811) | ours | 2.500 | 300 | 0.500 | 1.250 | 0.125 | 0.062 "
                    "| 0.281 | 2.219 | 11 |"]
