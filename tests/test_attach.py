"""The shared matrix: every tiny family x every installed method.

Invariants: attaching with no method, or a method on an
input shorter than its window, leaves logits unchanged; detaching restores the
model exactly; generate() works with batch > 1 and left padding.
"""

from __future__ import annotations

import logging

import pytest
import torch

import lcx
from lcx.adapters.families import FAMILIES
from lcx.generation import make_plan
from lcx.registry import registry
from tests.conftest import TINY_FAMILIES, tiny_model

#: Options that make each method exact on a short input. Static RoPE scaling (yarn/linear/ntk) changes
#: every position's rotation by design, so `rope` is checked with dynamic NTK, which only acts past the window.
EXACT_OPTIONS: dict[str, dict] = {
    "vanilla": {},
    "rope": {"type": "dynamic", "factor": 4.0},
    "streaming": {"chunk": 16},
    "fot": {"local": 64},  # inputs here are 48 tokens: one window, memory stays empty
    "focusllm": {"chunk": 32, "local": 64, "fragment": 8},  # 48-token inputs: all local, no candidates
    "smt": {},  # training-only: no inference stage, the model is untouched
}
ATOL = 1e-5


def methods_for(family: str) -> list[str]:
    """Installed methods the family supports (others are checked to raise clearly below)."""
    model = tiny_model(family)
    from lcx.adapters.families import capabilities

    caps = capabilities(model, FAMILIES[model.config.model_type])
    return [n for n, cls in sorted(registry().methods.items()) if cls.requires <= caps]


def _batch(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, 256, (2, 48), generator=g)
    mask = torch.ones_like(ids)
    mask[1, :9] = 0  # left padding on the second row
    ids[1, :9] = 0
    return ids, mask


def test_every_installed_method_is_in_the_matrix():
    assert set(registry().methods) <= set(EXACT_OPTIONS), "add the new method to EXACT_OPTIONS"


def test_no_method_equals_base(family):
    model = tiny_model(family)
    ids, mask = _batch()
    ref = model(ids, attention_mask=mask).logits
    with lcx.attach(model) as run:
        assert model.config._attn_implementation == "lcx"
        out = model(ids, attention_mask=mask).logits
        assert run.methods == []
    torch.testing.assert_close(out, ref, atol=ATOL, rtol=0)


@pytest.mark.parametrize("method", sorted(EXACT_OPTIONS))
def test_method_short_input_equals_base_and_detach_restores(family, method):
    model = tiny_model(family)
    if method not in methods_for(family):
        with pytest.raises(lcx.UnsupportedModelError, match=method):
            lcx.attach(model, [method])
        assert model.config._attn_implementation == "sdpa"
        return
    ids, mask = _batch()
    before_modules = dict(model.named_modules())
    before_state = {k: v.clone() for k, v in model.state_dict().items()}
    ref = model(ids, attention_mask=mask).logits

    with lcx.attach(model, [method], **EXACT_OPTIONS[method]) as run:
        out = model(ids, attention_mask=mask).logits
        torch.testing.assert_close(out, ref, atol=ATOL, rtol=0)
        # the method's own path (plan + memory + prefill) on a short input: same next-token logits
        new = lcx.generate(run, ids, mask, max_new_tokens=3)
        assert new.shape == (2, 3)

    assert model.config._attn_implementation == "sdpa"
    assert dict(model.named_modules()).keys() == before_modules.keys()
    assert all(model.get_submodule(n) is m for n, m in before_modules.items())
    for k, v in model.state_dict().items():
        assert torch.equal(v, before_state[k]), k
    torch.testing.assert_close(model(ids, attention_mask=mask).logits, ref, atol=0, rtol=0)


SUPPORTED = [(f, m) for f in sorted(TINY_FAMILIES) for m in methods_for(f)]


@pytest.mark.parametrize("family,method", SUPPORTED)
def test_generate_batch_left_padding_matches_unpadded(family, method):
    """Greedy tokens of a left-padded row equal those of the same row alone."""
    model = tiny_model(family)
    ids, mask = _batch(1)
    with lcx.attach(model, [method], **EXACT_OPTIONS[method]) as run:
        batched = lcx.generate(run, ids, mask, max_new_tokens=4)
        alone = lcx.generate(run, ids[1:, 9:], None, max_new_tokens=4)
    assert torch.equal(batched[1], alone[0])


def test_options_for_a_configured_method_are_refused_not_dropped(llama):
    from lcx.plugins.streaming import Streaming

    for options in ({"sinks": 8}, {"streaming": {"sinks": 8}}):
        with pytest.raises(lcx.LcxError, match=r"options sinks=8 for Streaming\(sinks=4, window=32, chunk=512\), a configured"):
            lcx.attach(llama, [Streaming(window=32)], **options)
    with lcx.attach(llama, [Streaming(window=32, sinks=8)]) as run:
        assert run.methods[0].sinks == 8


def test_attach_is_a_plain_call_too(llama):
    run = lcx.attach(llama, ["vanilla"])
    assert lcx.attached_run(llama) is run
    run.detach()
    run.detach()  # idempotent
    assert lcx.attached_run(llama) is None
    assert llama.config._attn_implementation == "sdpa"


def test_attach_twice_is_refused(llama):
    with lcx.attach(llama, ["vanilla"]):
        with pytest.raises(lcx.LcxError, match="already has lcx methods attached"):
            lcx.attach(llama, ["streaming"])


def test_incompatible_methods_are_refused_naming_both_and_the_stage(llama):
    with pytest.raises(lcx.ConflictError) as e:
        lcx.attach(llama, ["vanilla", "streaming"])
    msg = str(e.value)
    assert "'streaming'" in msg and "'vanilla'" in msg and "chunking" in msg
    assert llama.config._attn_implementation == "sdpa"  # nothing left behind


def test_compatible_methods_compose(llama):
    with lcx.attach(llama, ["rope", "streaming"], rope={"type": "yarn"}, chunk=16) as run:
        assert [m.name for m in run.methods] == ["rope", "streaming"]
        assert lcx.generate(run, torch.randint(3, 256, (1, 40)), max_new_tokens=2).shape == (1, 2)


def test_options_routing_and_errors(llama):
    with lcx.attach(llama, ["streaming"], sinks=2, window=32) as run:
        assert run.method("streaming").sinks == 2
    with pytest.raises(lcx.LcxError, match="belongs to none of the selected methods"):
        lcx.attach(llama, ["vanilla"], sinks=2)
    with pytest.raises(lcx.LcxError, match="unknown option 'nosuch'"):
        lcx.attach(llama, ["vanilla"], vanilla={"nosuch": 1})
    with pytest.raises(lcx.LcxError, match="unknown method 'nosuch'"):
        lcx.attach(llama, ["nosuch"])
    with pytest.raises(lcx.LcxError, match="head_fraction"):
        lcx.attach(llama, ["vanilla"], head_fraction="2")
    assert llama.config._attn_implementation == "sdpa"


def test_unsupported_family_names_what_is_missing_and_what_works():
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.for_model("gptj", n_embd=64, n_layer=1, n_head=2, vocab_size=64, rotary_dim=16)
    model = AutoModelForCausalLM.from_config(cfg)
    with pytest.raises(lcx.UnsupportedModelError) as e:
        lcx.attach(model, ["streaming"])
    assert "gptj" in str(e.value) and "AttentionInterface" in str(e.value) and "vanilla" in str(e.value)
    with lcx.attach(model, ["vanilla"]) as run:  # needs nothing from the family
        assert run.methods[0].name == "vanilla"


@pytest.mark.parametrize("family, overrides, windows", [
    ("gemma3_text", dict(sliding_window=8), [8, None]),  # per layer type, named on the modules
    ("qwen2", dict(sliding_window=8), [None, None]),  # use_sliding_window off: every layer attends fully
    ("mistral", dict(sliding_window=8), [8, 8]),  # the config's window slides every layer
    ("mistral", dict(sliding_window=8, layer_types=["full_attention"] * 2), [8, 8]),  # Mistral's masks ignore these
    ("mistral", {}, [None, None]),
    ("phi3", dict(sliding_window=8), [8, 8]),
    ("llama", dict(sliding_window=8), [None, None]),  # a stray config field: Llama's masks never slide
])
def test_sliding_windows_are_where_the_model_masks_slide(family, overrides, windows):
    from lcx.adapters import families

    model = tiny_model(family, **overrides)
    assert families.sliding_windows(model, families.family_of(model)) == windows


def test_vanilla_truncates_middle_keeping_both_ends(llama):
    ids = torch.arange(3, 203)[None]  # 200 tokens > window 128
    with lcx.attach(llama, ["vanilla"]) as run:
        plan = make_plan(run, ids, None, 8)
    kept = plan.input_ids[0]
    assert kept.numel() == 128 - 8 and plan.dropped == 200 - 120
    assert torch.equal(kept[:60], ids[0, :60]) and torch.equal(kept[60:], ids[0, -60:])


def test_empty_input_is_a_clear_error(llama):
    with lcx.attach(llama, ["vanilla"]) as run, pytest.raises(lcx.LcxError, match="empty input"):
        lcx.generate(run, torch.zeros((1, 0), dtype=torch.long))


def test_one_dimensional_input_names_the_fix(llama):
    with lcx.attach(llama, []) as run, pytest.raises(lcx.LcxError, match=r"shape \(5,\); for one prompt pass ids\[None\]"):
        lcx.generate(run, torch.arange(5))


@pytest.fixture
def reminders():
    """What transformers' past-window logger says during a test (its once-a-process cache cleared first)."""
    logging.Logger.warning_once.cache_clear()
    heard: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: heard.append(record.getMessage())
    logger = logging.getLogger("transformers.generation.stopping_criteria")
    logger.addHandler(handler)
    yield heard
    logger.removeHandler(handler)


def test_a_method_past_the_window_is_not_told_it_exceeded_the_maximum_length(llama, reminders):
    ids = torch.randint(0, 200, (1, 140))  # past the tiny model's 128 positions
    with lcx.attach(llama, ["streaming"], window=32):
        lcx.generate(lcx.attached_run(llama), ids, max_new_tokens=2)
    assert not [m for m in reminders if "maximum length" in m]
    with lcx.attach(llama, []) as run:  # the bare model past its window still hears it
        lcx.generate(run, ids, max_new_tokens=2)
    assert [m for m in reminders if "predefined maximum length (128)" in m]


def test_a_method_that_does_not_read_past_the_window_leaves_the_reminder(llama, reminders):
    with lcx.attach(llama, ["smt"]) as run:  # training only: the model reads as it always does
        lcx.generate(run, torch.randint(0, 200, (1, 140)), max_new_tokens=2)
    assert [m for m in reminders if "predefined maximum length (128)" in m]


def test_the_reminder_is_heard_again_after_a_method_s_generation_fails(llama, reminders, monkeypatch):
    ids = torch.randint(0, 200, (1, 140))
    with lcx.attach(llama, ["streaming"], window=32):
        def fail(**kwargs):
            raise RuntimeError("generation failed")
        monkeypatch.setattr(llama, "generate", fail)
        with pytest.raises(RuntimeError, match="generation failed"):
            lcx.generate(lcx.attached_run(llama), ids, max_new_tokens=2)
        monkeypatch.undo()
    with lcx.attach(llama, []) as run:
        lcx.generate(run, ids, max_new_tokens=2)
    assert [m for m in reminders if "predefined maximum length (128)" in m]


def test_a_method_s_mute_does_not_reach_another_thread(reminders):
    import threading

    from lcx.generation import _past_window_reminder_muted

    inside, done = threading.Event(), threading.Event()

    def method_generating():
        with _past_window_reminder_muted(True):
            inside.set()
            done.wait(10)

    worker = threading.Thread(target=method_generating)
    worker.start()
    try:
        assert inside.wait(10)
        logging.getLogger("transformers.generation.stopping_criteria").warning_once(
            "will exceed the model's predefined maximum length (8)")
        assert reminders == ["will exceed the model's predefined maximum length (8)"]
    finally:
        done.set()
        worker.join()
