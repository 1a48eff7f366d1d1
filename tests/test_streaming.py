"""streaming: sink keys are re-rotated exactly; the cache keeps sinks + window; long inputs work."""

from __future__ import annotations

import pytest
import torch

import lcx
from lcx.generation import make_plan, position_ids_from_mask, prefill
from lcx.adapters.rotary import rotate
from lcx.plugins.streaming import SinkWindowLayer
from tests.conftest import tiny_model


def test_rotate_keys_composes_like_rope():
    """Rotating a key rotated at position p by s equals rotating it at p + s (rotate-half RoPE)."""
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    model = tiny_model("llama")
    rot = model.model.rotary_emb
    k = torch.randn(1, 1, 5, 32)
    p = torch.arange(5)[None]
    cos, sin = rot(k, p)
    cos_s, sin_s = rot(k, p + 1000)
    _, k_p = apply_rotary_pos_emb(k, k, cos, sin)
    _, k_ps = apply_rotary_pos_emb(k, k, cos_s, sin_s)
    torch.testing.assert_close(rotate(k_p, 1000, rot.inv_freq), k_ps, atol=1e-4, rtol=1e-4)
    # per-position shifts: un-rotating every key to position 0 gives the raw key back
    torch.testing.assert_close(rotate(k_p, -p[0], rot.inv_freq), k, atol=1e-5, rtol=1e-5)


def test_partial_rotary_leaves_pass_through_dims():
    k = torch.randn(1, 1, 3, 32)
    inv = 1.0 / (10000 ** (torch.arange(0, 8, 2).float() / 8))  # 8 rotary dims of 32
    out = rotate(k, 77, inv)
    assert torch.equal(out[..., 8:], k[..., 8:])
    assert not torch.allclose(out[..., :8], k[..., :8])


def test_one_layer_streaming_equals_explicit_sink_window_computation():
    """With one layer, K/V depend only on token and position, so the streamed logits of the last
    token must equal the base model run on [sink tokens ; recent window ; last chunk] with the sinks
    placed right before the window (StreamingLLM's positions)."""
    model = tiny_model("llama", num_hidden_layers=1)
    sinks, window, chunk, N = 2, 20, 8, 64
    ids = torch.randint(3, 256, (1, N), generator=torch.Generator().manual_seed(0))
    with lcx.attach(model, ["streaming"], sinks=sinks, window=window, chunk=chunk) as run:
        plan = make_plan(run, ids, None, 1)
        cache = prefill(run, plan)
        s_last = plan.windows[-1][0]
        out = model(input_ids=ids[:, s_last:], position_ids=position_ids_from_mask(plan.attention_mask)[:, s_last:],
                    past_key_values=cache, use_cache=True).logits[0, -1]
        layer = cache.layers[0]
        assert isinstance(layer, SinkWindowLayer)
        assert layer.sink_k.shape[-2] == sinks and layer.keys.shape[-2] == window
    start = s_last - window
    keep = list(range(sinks)) + list(range(start, N))
    pos = list(range(start - sinks, start)) + list(range(start, N))
    ref = model(input_ids=ids[:, keep], position_ids=torch.tensor([pos])).logits[0, -1]
    torch.testing.assert_close(out, ref, atol=1e-4, rtol=1e-4)


def test_streaming_generates_far_beyond_the_window_with_bounded_cache():
    model = tiny_model("qwen3")  # window 128
    ids = torch.randint(3, 256, (2, 700))
    mask = torch.ones_like(ids)  # rows of equal length: a padded batch that evicts is refused (test below)
    with lcx.attach(model, ["streaming"], chunk=32) as run:
        new = lcx.generate(run, ids, mask, max_new_tokens=5)
        cache = run.memory
        assert new.shape == (2, 5)
        kept = cache.layers[0].sink_k.shape[-2] + cache.layers[0].keys.shape[-2]
        assert kept <= run.window
        assert cache.get_seq_length() == 700 + 4  # every token seen, absolute positions preserved


def test_no_room_for_a_recent_window_names_a_fix_that_works():
    """The message suggested chunk=window/4 whatever caused it, even the value already set (sinks=120)."""
    import pytest

    model = tiny_model("llama")  # window 128
    for opts, fix in (({"chunk": 200}, "use -o streaming.chunk=32 or less"),
                      ({"sinks": 120, "chunk": 32}, "use -o streaming.chunk=7 or less"),
                      ({"sinks": 127, "chunk": 8}, "lower -o streaming.sinks below 127")):
        with lcx.attach(model, ["streaming"], **opts) as run, pytest.raises(lcx.LcxError, match="leave no recent window") as e:
            lcx.generate(run, torch.randint(3, 200, (1, 300)), None, max_new_tokens=1)
        assert fix in str(e.value) and "-o streaming.window=N" in str(e.value), str(e.value)


def test_a_padded_batch_that_would_evict_is_refused():
    """A left-padded row's first positions are padding: once tokens are evicted it ran without sinks (its
    answer was the sinks=0 one).  Padded batches that never evict still run."""
    import pytest

    model = tiny_model("llama")
    ids = torch.randint(3, 200, (2, 120))
    mask = torch.ones_like(ids)
    mask[1, :80] = 0
    with lcx.attach(model, ["streaming"], sinks=4, window=16, chunk=8) as run:
        with pytest.raises(lcx.LcxError, match="left-padded batch of 120 \\+ 4 tokens evicts \\(it keeps 20\\)"):
            lcx.generate(run, ids, mask, max_new_tokens=4)
        short = torch.ones(2, 12, dtype=torch.long)
        short[1, :4] = 0
        assert lcx.generate(run, ids[:, -12:], short, max_new_tokens=4).shape == (2, 4)  # 16 tokens: none evicted
    with lcx.attach(model, ["streaming"], sinks=4, window=120, chunk=8) as run:
        assert lcx.generate(run, ids, mask, max_new_tokens=4).shape == (2, 4)  # 124 tokens, all kept


@pytest.mark.parametrize("family, sliding", [("gemma3_text", [True, False]), ("mistral", [True, True])])
def test_a_sliding_window_layer_keeps_only_its_window_and_answers_the_same(monkeypatch, family, sliding):
    """A sliding-window layer keeps the keys its band shows (window - 1 before each query), not streaming's whole
    recent window: the others were masked out anyway, so logits and tokens are those of the layer keeping them all
    (chunks longer than the band included).  Gemma 3 names the window per layer (layer 0 slides over 8 tokens,
    layer 1 attends fully); Mistral slides every layer over its config's window."""
    from lcx.adapters import families
    from lcx.generation import tail_logits

    model = tiny_model(family, sliding_window=8)
    ids = torch.randint(3, 256, (1, 200), generator=torch.Generator().manual_seed(0))

    def run_all():
        with lcx.attach(model, ["streaming"], sinks=4, window=40, chunk=16) as run:
            logits = tail_logits(run, ids, 40)
        with lcx.attach(model, ["streaming"], sinks=4, window=40, chunk=16) as run:
            tokens = lcx.generate(run, ids[:, :150], max_new_tokens=6)
            kept = [layer.keys.shape[-2] for layer in run.memory.layers]
        return logits, tokens, kept

    logits, tokens, kept = run_all()
    assert kept == [7 if s else 40 for s in sliding]
    monkeypatch.setattr(families, "sliding_windows", lambda model, family: [None] * 2)
    want_logits, want_tokens, want_kept = run_all()
    assert want_kept == [40, 40]
    torch.testing.assert_close(logits, want_logits, rtol=1e-5, atol=1e-5)
    assert torch.equal(tokens, want_tokens)
