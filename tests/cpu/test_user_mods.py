"""Python-written score / mask mods (kernels/common/user_mods.py) on the CPU: the digest a compile
key holds, the launchers' plumbing (config, aux tensors, scales) and the API's refusals."""
import operator

import cutlass
import cutlass.cute as cute
import pytest
import torch

from cute_flash.kernels.common.constants import LOG2E
from cute_flash.kernels.common.user_mods import UserMod, code_digest
from tests.helpers.interface import call, with_


@cute.jit
def rel_bias(score, b_idx, h_idx, q_idx, kv_idx, seqlen_info, aux_tensors):
    return score + (q_idx - kv_idx).to(cutlass.Float32) * 0.01


@cute.jit
def causal(b_idx, h_idx, q_idx, kv_idx, seqlen_info, aux_tensors):
    return operator.ge(q_idx, kv_idx)


def windowed(width):
    @cute.jit
    def window(b_idx, h_idx, q_idx, kv_idx, seqlen_info, aux_tensors):
        return operator.le(q_idx - kv_idx, width)
    return window


def test_digest_follows_the_code_and_what_it_captures():
    """The same mod gives the same digest (a UserMod equal and hashed alike whatever function object
    holds it); a captured value or other code gives another."""
    assert code_digest(windowed(64)) == code_digest(windowed(64)) != code_digest(windowed(128))
    assert code_digest(rel_bias) != code_digest(causal)
    a, b = UserMod.of(windowed(64)), UserMod.of(windowed(64))
    assert a == b and hash(a) == hash(b) and a.fn is not b.fn and "fn" not in repr(a)


def test_digest_survives_the_dsl_tracing_the_mod(tmp_path):
    """The DSL swaps a jit function's code for its rewrite when it first traces it: the digest,
    kept from before, does not move (else the compile cache would miss in the same process)."""
    from cute_flash.compile.registry import build
    from cute_flash.kernels.common.user_mods import UserMods
    from cute_flash.kernels.sm80.fwd import FwdConfig
    from layouts.traits import choose_fwd_traits

    @cute.jit
    def shifted(score, b_idx, h_idx, q_idx, kv_idx, seqlen_info, aux_tensors):
        return score * 0.5

    before = code_digest(shifted)
    build(FwdConfig(choose_fwd_traits(64, "bf16", 80), mods=UserMods(UserMod.of(shifted))), 80)
    assert code_digest(shifted) == before


@pytest.mark.parametrize("path", ["sm80", "sm90"])
def test_launchers_pass_the_mods_aux_tensors_and_scales(recorder, monkeypatch, path):
    """A score_mod's kernel gets the softmax scale as the score premultiplier and log2(e) as the
    exponent's; a mask_mod alone keeps the usual scales; the aux tensors go as a list; the config
    carries the mods (digests and aux kinds), on either path, dense and packed."""
    from cute_flash.launch.dense import flash_fwd, flash_fwd_varlen

    if path == "sm90":
        monkeypatch.delenv("CUTE_FLASH_ARCH_PATH")
    q = torch.randn(2, 70, 4, 64, dtype=torch.bfloat16)
    table = torch.randn(4, 300)
    flash_fwd(q, q, q, softmax_scale=0.5, mods=(rel_bias, causal, [table]))
    flash_fwd(q, q, q, softmax_scale=0.5, mods=(None, causal, None))
    cu = torch.tensor([0, 70, 140], dtype=torch.int32)
    flash_fwd_varlen(q.flatten(0, 1), q.flatten(0, 1), q.flatten(0, 1), cu_seqlens_q=cu, cu_seqlens_k=cu,
                     max_seqlen_q=70, max_seqlen_k=70, softmax_scale=0.5, mods=(rel_bias, None, None))
    both, mask_only, packed = recorder.launches
    assert both.config.mods.score_mod == UserMod.of(rel_bias) and both.config.mods.mask_mod == UserMod.of(causal)
    assert both.config.mods.aux == (("float32", 2),) and both["aux_tensors"] == [table]
    assert both["scale_log2"] == LOG2E and both["score_premul"] == 0.5
    assert mask_only.config.mods.score_mod is None and mask_only["aux_tensors"] is None
    assert mask_only["scale_log2"] == pytest.approx(0.5 * LOG2E)
    assert packed.config.mods.score_mod is not None and packed["score_premul"] == 0.5
    if path == "sm90":
        assert not both.config.speculative_max


@pytest.mark.parametrize("over, error", [
    (dict(score_mod=3), "score_mod must be a callable"),
    (dict(aux_tensors=[torch.zeros(2)]), "read by a score_mod or mask_mod"),
    (dict(mask_mod=causal, aux_tensors=torch.zeros(2)), "list of tensors"),
    (dict(score_mod=rel_bias, softcap=5.0), "do not compose with a score_mod"),
    (dict(mask_mod=causal, return_attn_probs=True), "return_attn_probs"),
])
@pytest.mark.parametrize("name", ["func", "varlen"])
def test_bad_mods_are_refused(gpu_free, name, over, error):
    with pytest.raises((TypeError, ValueError), match=error):
        call(name, **with_(name, **over))
    assert not gpu_free.calls


@pytest.mark.parametrize("name", ["func", "varlen"])
def test_mods_reach_the_launcher_and_refuse_gradients(gpu_free, name):
    """Forward only for now: a call with mods on tensors that require grad is refused, not run
    without them; without grad the launcher gets (score_mod, mask_mod, aux_tensors)."""
    table = torch.zeros(3)
    call(name, **with_(name, score_mod=rel_bias, mask_mod=causal, aux_tensors=[table]))
    (_, _, kw), = gpu_free.calls
    assert kw["mods"] == (rel_bias, causal, [table])
    args = with_(name, mask_mod=causal)
    args["q"] = args["q"].clone().requires_grad_()
    with pytest.raises(NotImplementedError, match="backward of a score_mod"):
        call(name, **args)
