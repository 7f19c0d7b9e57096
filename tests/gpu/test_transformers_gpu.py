"""transformers models on the kernels through `cute_flash.integrations.transformers` (bf16,
random weights): logits and gradients against transformers' own attention within bf16 noise, a
packed batch against its sequences run one by one, and greedy generation with the KV cache.
tests/cpu/test_transformers_integration.py checks the same paths on the CPU with the reference."""
import pytest
import torch

from cute_flash.integrations import transformers as integration
from tests.helpers import models

pytestmark = [pytest.mark.gpu, pytest.mark.lowp_gemm]  # bf16 models: not under racecheck
transformers = pytest.importorskip("transformers")

DTYPE = torch.bfloat16


@pytest.fixture(autouse=True)
def registered(kernels):
    """The integration registered; `kernels` (tests/conftest.py) records which attention kernels ran."""
    integration.register()
    return kernels


def model(family, impl, seed=0):
    return models.model(family, impl, dtype=DTYPE, device="cuda", seed=seed)


def tokens(batch, seqlen, seed=1):
    return torch.randint(0, 97, (batch, seqlen), generator=torch.Generator().manual_seed(seed)).cuda()


def assert_logits_close(ours, theirs):
    """Within bf16 noise: the attention outputs differ by rounding, which the layers after them
    carry on; the bound is a small share of the logits' own spread."""
    scale = theirs.float().abs().max().item()
    err = (ours.float() - theirs.float()).abs().max().item()
    assert err <= 0.02 * scale + 1e-3, (err, scale)


@pytest.mark.parametrize("family", models.FAMILIES)
def test_dense_and_padded_batches_match_transformers_attention(registered, family):
    ids = tokens(3, 200)
    mask = torch.ones_like(ids)
    mask[1, :37] = 0
    mask[2, 150:] = 0
    for attention_mask in (None, mask):
        ours = model(family, integration.NAME)(ids, attention_mask=attention_mask).logits
        theirs = model(family, models.BASELINE[family])(ids, attention_mask=attention_mask).logits
        valid = torch.ones_like(ids, dtype=torch.bool) if attention_mask is None else mask.bool()
        assert_logits_close(ours[valid], theirs[valid])
    assert "sm90_fwd" in registered or "sm80_fwd" in registered


@pytest.mark.parametrize("family", ["llama", "mistral"])
def test_packed_batch_equals_its_sequences_run_one_by_one(family):
    lengths = [70, 130, 45, 256]
    seqs = [tokens(1, n, seed=i) for i, n in enumerate(lengths)]
    position_ids = torch.cat([torch.arange(n) for n in lengths]).unsqueeze(0).cuda()
    lm = model(family, integration.NAME)
    packed = lm(torch.cat(seqs, dim=1), position_ids=position_ids).logits
    alone = torch.cat([lm(s).logits for s in seqs], dim=1)
    assert_logits_close(packed, alone)


@pytest.mark.parametrize("family", models.FAMILIES)
def test_gradients_match_transformers_attention(registered, family):
    ids = tokens(2, 160)
    grads = []
    for impl in (integration.NAME, models.BASELINE[family]):
        lm = model(family, impl)
        lm(ids, labels=ids).loss.backward()
        grads.append({n: p.grad.float() for n, p in lm.named_parameters() if p.grad is not None})
    assert grads[0].keys() == grads[1].keys()
    for name, grad in grads[0].items():
        ref = grads[1][name]
        err = (grad - ref).abs().max().item()
        assert err <= 0.05 * ref.abs().max().item() + 1e-4, (name, err)
    assert {"sm90_bwd", "sm80_bwd"} & registered


@pytest.mark.parametrize("family", ["llama", "mistral", "gemma2"])
def test_greedy_generation_takes_transformers_best_tokens(family):
    """Each token our model generates (KV cache, left padding) is, by transformers' own attention
    on the same prefix, the best token or within bf16 noise of it (random weights leave some
    near-ties, which either may break its own way)."""
    ids = tokens(2, 24)
    mask = torch.ones_like(ids)
    mask[1, :5] = 0
    out = model(family, integration.NAME).generate(ids, attention_mask=mask, max_new_tokens=16, do_sample=False,
                                                  pad_token_id=0)
    full_mask = torch.cat([mask, torch.ones_like(out[:, ids.shape[1]:])], dim=1)
    logits = model(family, models.BASELINE[family])(out, attention_mask=full_mask).logits.float()
    steps = logits[:, ids.shape[1] - 1:-1]  # the logits each generated token was chosen from
    chosen = steps.gather(-1, out[:, ids.shape[1]:, None]).squeeze(-1)
    best = steps.max(-1).values
    assert (best - chosen <= 0.02 * best.abs().clamp(min=1.0)).all(), (best - chosen)
