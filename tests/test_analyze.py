"""Attention statistics from chunked recomputation equal a brute-force computation."""

from __future__ import annotations

import pytest
import torch

from lcx.analyze import AttentionStats, analyze
from tests.conftest import tiny_model


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_chunked_stats_equal_brute_force(family):
    T = 96
    model = tiny_model(family, attn_implementation="eager")
    ids = torch.randint(3, 256, (T,), generator=torch.Generator().manual_seed(0)).tolist()
    got = analyze(model, [("doc", ids)], length=T, chunk=17, progress=False)

    with torch.no_grad():
        atts = model(torch.tensor([ids]), output_attentions=True).attentions  # per layer (1, H, T, T)
    ref = AttentionStats(T)
    for a in atts:
        H = a.shape[1]
        for h in range(H):  # brute force: every query row of every head, no chunking
            ref.add(a[0, h], torch.arange(T))
    want = ref.summary()
    for key in ("mass_per_bin", "cumulative_mass_by_distance", "mass_share_of_top_fraction"):
        for k, v in want[key].items():
            assert abs(got[key][k] - v) < 1e-5, (key, k, got[key][k], v)
    assert got["queries"] == want["queries"] == len(atts) * atts[0].shape[1] * T


def test_stats_on_a_hand_made_pattern():
    """Each query puts all its mass on itself: distance 0 holds everything, top-1 key holds 100%."""
    s = AttentionStats(8, bin_size=4)
    s.add(torch.eye(8), torch.arange(8))
    out = s.summary()
    assert out["cumulative_mass_by_distance"]["1"] == pytest.approx(1.0)
    assert out["mass_per_bin"] == {"0-4": pytest.approx(1.0), "4-8": pytest.approx(0.0)}
    assert out["mass_share_of_top_fraction"]["0.01"] == pytest.approx(1.0)


@pytest.mark.parametrize("family", ["llama", "gemma3_text"])
def test_retrieval_mass_equals_output_attentions(family):
    """The probe's per-head mass on the needle equals output_attentions of one full forward pass; in Gemma 3's
    sliding-window layers, whose cache keeps only the last keys, too (the needle lies outside their window)."""
    from lcx.analyze import retrieval_layers
    from lcx.evals.passkey import build_prompt_ids
    from tests.helpers import char_tokenizer

    tok = char_tokenizer()
    model = tiny_model(family, attn_implementation="eager", vocab_size=128)
    got = retrieval_layers(model, tok, length=300, depths=[0.3], keys=[48213], threshold=0.0, progress=False)

    ids = build_prompt_ids(tok, 300, 0.3, 48213).tolist()
    answer = tok(" 48213", add_special_tokens=False)["input_ids"]
    targets = sorted({i + j for i in range(len(ids) - len(answer) + 1) if ids[i:i + len(answer)] == answer
                      for j in range(len(answer))})
    assert len(targets) == 2 * len(answer)  # the needle states the key twice
    with torch.no_grad():
        atts = model(torch.tensor([ids + answer[:-1]]), output_attentions=True).attentions
    want = torch.stack([a[0, :, -len(answer):, targets].sum(-1).mean(-1) for a in atts])  # (layers, heads)
    assert torch.allclose(torch.tensor(got["mass_by_layer_head"]), want, atol=1e-4)
    assert got["suggested_memory_layers"] == ",".join(str(i) for i in range(len(atts)))  # threshold 0: all
    assert got["suggested_memory_heads"] == ",".join(f"{i}:{h}" for i in range(len(atts)) for h in range(want.shape[1]))
    top = want.flatten().sort().values
    cut = float(top[-2] + top[-1]) / 2  # only the head at the top is over it
    above = retrieval_layers(model, tok, length=300, depths=[0.3], keys=[48213], threshold=cut, progress=False)
    i, h = divmod(int(want.argmax()), want.shape[1])
    assert (above["suggested_memory_heads"], above["suggested_memory_layers"]) == (f"{i}:{h}", str(i))


def test_a_family_lcx_cannot_reach_is_refused_not_measured_as_zeros():
    """phi (no lcx map): the probes' attention hook never ran, and the analysis reported 0 queries as a result
    (0% of the mass in the first bin); attention methods were as silently inert."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from lcx import analyze
    from lcx.errors import UnsupportedModelError

    cfg = AutoConfig.for_model("phi", hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2,
                               vocab_size=128, max_position_embeddings=256)
    model = AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa").eval()
    with pytest.raises(UnsupportedModelError, match=r"attention-probe work inside the attention of each layer, which "
                                                    r"lcx cannot reach in model family 'phi' \(lcx has no map"):
        analyze.analyze(model, [("doc", list(range(3, 67)))], 64, progress=False)
    from lcx.composition import attached_run

    assert attached_run(model) is None  # nothing left attached
