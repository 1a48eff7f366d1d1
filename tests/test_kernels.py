"""The attention beneath lcx's methods: a bf16 decode step on a CPU by matrix products equals torch's sdpa."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

import lcx
from lcx import kernels
from lcx.generation import generate
from tests.conftest import tiny_model

B, H, HKV, S, D = 2, 6, 2, 40, 16  # 3 query heads per KV head


def reference(query, key, value, mask, scaling):
    """torch's sdpa over the KV heads repeated for each query head."""
    rep = H // HKV
    k, v = key.repeat_interleave(rep, 1), value.repeat_interleave(rep, 1)
    return F.scaled_dot_product_attention(query, k, v, attn_mask=mask, scale=scaling).transpose(1, 2)


def masks(dtype):
    """Every mask kind transformers hands sdpa for one query token: none, bool per row, bool per head, additive."""
    g = torch.Generator().manual_seed(1)
    row = torch.rand(B, 1, 1, S, generator=g) > 0.3
    head = torch.rand(B, H, 1, S, generator=g) > 0.3
    row[..., -1] = head[..., -1] = True  # the query token sees itself
    additive = torch.zeros(B, 1, 1, S, dtype=dtype).masked_fill(~row, torch.finfo(dtype).min)
    return {"none": None, "bool-row": row, "bool-head": head, "additive": additive}


@pytest.mark.parametrize("kind", ["none", "bool-row", "bool-head", "additive"])
@pytest.mark.parametrize("scaling", [None, 0.3])
def test_short_query_attention_equals_sdpa(kind, scaling):
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(B, n, t, D, generator=g) for n, t in ((H, 1), (HKV, S), (HKV, S)))
    mask = masks(torch.float32)[kind]
    got = kernels.short_query_attention(q, k, v, mask, scaling)
    assert got.shape == (B, 1, H, D)
    torch.testing.assert_close(got, reference(q, k, v, mask, scaling), atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("kind", ["none", "bool-row", "additive"])
def test_short_query_attention_bf16_within_rounding(kind):
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(B, n, t, D, generator=g) for n, t in ((H, 1), (HKV, S), (HKV, S)))
    exact = reference(q, k, v, masks(torch.float32)[kind], None)
    low = [x.bfloat16() for x in (q, k, v)]
    mask = masks(torch.bfloat16)[kind]
    ours = (kernels.short_query_attention(*low, mask, None).float() - exact).abs().max()
    torch_sdpa = (reference(*low, mask, None).float() - exact).abs().max()
    assert ours <= 2 * torch_sdpa + 1e-3


def test_short_path_only_for_a_low_precision_decode_step_on_cpu():
    one = torch.zeros(1, H, 1, D, dtype=torch.bfloat16)
    assert kernels.takes_short_path(one, None, 0.0, {})
    assert kernels.takes_short_path(one.half(), torch.ones(1, 1, 1, S, dtype=torch.bool), 0.0, {})
    assert not kernels.takes_short_path(one.float(), None, 0.0, {})  # float32: torch's kernel is fine
    assert not kernels.takes_short_path(torch.zeros(1, H, 4, D, dtype=torch.bfloat16), None, 0.0, {})  # prefill
    assert not kernels.takes_short_path(one, None, 0.1, {})  # dropout
    assert not kernels.takes_short_path(one, None, 0.0, {"position_bias": torch.zeros(1)})


@pytest.mark.parametrize("methods", [[], ["streaming"]], ids=["bare", "streaming"])
def test_bf16_decode_through_lcx_as_close_as_torchs_kernel(methods, monkeypatch):
    """bf16 (a left-padded row for the bare model; streaming evicts, so its rows are of equal length): lcx's
    decode steps by the short path (counted) are as close to float32 as the same steps through torch's sdpa."""
    from transformers import LogitsProcessorList

    model = tiny_model("llama", num_attention_heads=4, num_key_value_heads=2, head_dim=16)
    ids = torch.randint(3, 250, (2, 48), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    if not methods:
        mask[1, :5] = 0
    opts = {"streaming": {"window": 16, "sinks": 4, "chunk": 16}} if methods else {}

    def steps(m) -> torch.Tensor:  # (new tokens, B, vocab) float32 logits
        seen = []
        keep = lambda _ids, scores: seen.append(scores.float().clone()) or scores  # noqa: E731
        with lcx.attach(m, methods, **opts) as run:
            generate(run, ids, attention_mask=mask, max_new_tokens=6, min_new_tokens=6, do_sample=False,
                     pad_token_id=0, logits_processor=LogitsProcessorList([keep]))
        return torch.stack(seen).nan_to_num(neginf=0.0)  # tokens generate rules out (min_new_tokens) are -inf

    exact = steps(model)
    bf16 = copy.deepcopy(model).bfloat16()
    calls, short = [], kernels.short_query_attention
    monkeypatch.setattr(kernels, "short_query_attention", lambda *a: calls.append(1) or short(*a))
    ours = steps(bf16)
    assert calls, "the decode steps did not take the short path"
    monkeypatch.setattr(kernels, "takes_short_path", lambda *a: False)
    theirs = steps(bf16)
    # compare while all three have picked the same tokens (a near-tie flips under rounding; after it the
    # logits answer different inputs)
    picks = torch.stack([exact.argmax(-1), ours.argmax(-1), theirs.argmax(-1)])  # (3, new, B)
    same = int((picks == picks[0]).all(0).all(-1).long().cumprod(0).sum()) + 1
    assert same >= 3
    ours_gap, theirs_gap = ((x[:same] - exact[:same]).abs().max() for x in (ours, theirs))
    assert ours_gap <= 2 * theirs_gap
