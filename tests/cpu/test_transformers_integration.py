"""`cute_flash.integrations.transformers` on the CPU: every path of the attention function
(dense, padded, packed by position_ids, KV-cache generation) in real transformers models, with
the kernels replaced by `cute_flash.reference` (tests/helpers/reference_kernels.py), against
transformers' own attention. tests/gpu/test_transformers_gpu.py runs the same on the kernels."""
import pytest
import torch

transformers = pytest.importorskip("transformers")

from cute_flash.integrations import transformers as integration  # noqa: E402
from tests.helpers import models  # noqa: E402
from tests.helpers.reference_kernels import ReferenceKernels  # noqa: E402



@pytest.fixture
def ref_kernels(monkeypatch):
    """The integration's kernels replaced by the reference; registered under its name."""
    kernels = ReferenceKernels()
    monkeypatch.setattr(integration, "flash_attn_func", kernels.func)
    monkeypatch.setattr(integration, "flash_attn_varlen_func", kernels.varlen_func)
    integration.register()
    return kernels


def tokens(batch, seqlen, seed=1):
    return torch.randint(0, 97, (batch, seqlen), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("family", models.FAMILIES)
def test_dense_batch_matches_transformers_attention(ref_kernels, family):
    ids = tokens(2, 24)
    ours = models.model(family, integration.NAME)(ids).logits
    theirs = models.model(family, models.BASELINE[family])(ids).logits
    torch.testing.assert_close(ours, theirs, atol=2e-5, rtol=2e-5)
    assert set(ref_kernels.calls) == {"func"}


@pytest.mark.parametrize("family", models.FAMILIES)
@pytest.mark.parametrize("side", ["left", "right"])
def test_padded_batch_matches_transformers_attention_on_its_valid_rows(ref_kernels, family, side):
    ids = tokens(3, 20)
    mask = torch.ones(3, 20, dtype=torch.long)
    for row, pad in ((1, 5), (2, 11)):
        if side == "left":
            mask[row, :pad] = 0
        else:
            mask[row, 20 - pad:] = 0
    ours = models.model(family, integration.NAME)(ids, attention_mask=mask).logits
    theirs = models.model(family, models.BASELINE[family])(ids, attention_mask=mask).logits
    valid = mask.bool()
    torch.testing.assert_close(ours[valid], theirs[valid], atol=2e-5, rtol=2e-5)
    assert "varlen" in ref_kernels.calls


@pytest.mark.parametrize("family", ["llama", "mistral"])
def test_packed_batch_equals_its_sequences_run_one_by_one(ref_kernels, family):
    lengths = [7, 13, 4]
    seqs = [tokens(1, n, seed=i) for i, n in enumerate(lengths)]
    packed = torch.cat(seqs, dim=1)
    position_ids = torch.cat([torch.arange(n) for n in lengths]).unsqueeze(0)
    model = models.model(family, integration.NAME)
    logits = model(packed, position_ids=position_ids).logits
    assert ref_kernels.calls and set(ref_kernels.calls) == {"varlen"}
    alone = torch.cat([model(s).logits for s in seqs], dim=1)
    torch.testing.assert_close(logits, alone, atol=2e-5, rtol=2e-5)


def test_gradients_match_transformers_attention(ref_kernels):
    ids = tokens(2, 16)
    grads = []
    for impl in (integration.NAME, "sdpa"):
        model = models.model("llama", impl)
        model(ids, labels=ids).loss.backward()
        grads.append({n: p.grad for n, p in model.named_parameters()})
    for name, grad in grads[0].items():
        torch.testing.assert_close(grad, grads[1][name], atol=1e-5, rtol=1e-4, msg=name)


@pytest.mark.parametrize("family", ["llama", "mistral"])
def test_greedy_generation_gives_transformers_tokens(ref_kernels, family):
    ids = tokens(2, 6)
    mask = torch.ones_like(ids)
    mask[1, :2] = 0  # left padding, as generation pads
    settings = dict(attention_mask=mask, max_new_tokens=12, do_sample=False, pad_token_id=0)
    ours = models.model(family, integration.NAME).generate(ids, **settings)
    theirs = models.model(family, models.BASELINE[family]).generate(ids, **settings)
    assert torch.equal(ours, theirs)
    assert "varlen" in ref_kernels.calls


def test_sliding_window_reaches_the_kernel_as_flash_attn_takes_it(ref_kernels, monkeypatch):
    seen = []
    monkeypatch.setattr(integration, "flash_attn_func",
                        lambda *a, **kw: seen.append(kw["window_size"]) or ref_kernels.func(*a, **kw))
    models.model("mistral", integration.NAME)(tokens(1, 20))
    assert seen == [(7, 7)] * 2  # a window of 8 tokens: 7 to the left, causal cuts the right
    seen.clear()
    models.model("mistral", integration.NAME)(tokens(1, 8))  # the keys fit in the window: none
    assert seen == [(-1, -1)] * 2


def test_attention_sinks_reach_the_kernel_as_learnable_sink(ref_kernels, monkeypatch):
    seen = []
    monkeypatch.setattr(integration, "flash_attn_func",
                        lambda *a, **kw: seen.append(kw["learnable_sink"]) or ref_kernels.func(*a, **kw))
    model = models.model("gpt_oss", integration.NAME)
    model(tokens(1, 12))
    sinks = [layer.self_attn.sinks for layer in model.model.layers]
    assert len(seen) == len(sinks) and all(a is b for a, b in zip(seen, sinks))
