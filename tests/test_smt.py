"""smt: the decaying allocation, its probabilities, original positions, the losses, q/k-only training."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import lcx
from lcx.errors import LcxError
from lcx.plugins import smt
from lcx.train import TrainConfig, train
from tests.conftest import tiny_model
from tests.helpers import make_tiny_model_dir

W, B, T = 16, 8, 3  # window, sampled memory tokens, decay iterations of the table tests


# ---------------------------------------------------------------------- the allocation
# Memory of M tokens, windows W, 2W, then the rest (T = 3); weights = tokens x density (1, 1/4, 1/16);
# the B = 8 samples split in proportion.  Written out by hand for M = W ... 7W.
TABLE = {
    1 * W: [8.0],
    2 * W: [8 * 16 / 20, 8 * 4 / 20],
    3 * W: [8 * 16 / 24, 8 * 8 / 24],
    4 * W: [8 * 16 / 25, 8 * 8 / 25, 8 * 1 / 25],
    5 * W: [8 * 16 / 26, 8 * 8 / 26, 8 * 2 / 26],
    6 * W: [8 * 16 / 27, 8 * 8 / 27, 8 * 3 / 27],
    7 * W: [8 * 16 / 28, 8 * 8 / 28, 8 * 4 / 28],
}


@pytest.mark.parametrize("memory", sorted(TABLE))
def test_allocation_table_for_memories_of_w_to_7w(memory):
    got = smt.allocate(memory, B, W, T)
    spans = [(lo, min(hi, memory)) for lo, hi in [(0, 16), (16, 48), (48, memory)] if lo < memory]
    assert [(lo, hi) for lo, hi, _ in got] == spans
    assert [c for _, _, c in got] == pytest.approx(TABLE[memory])
    assert sum(c for _, _, c in got) == pytest.approx(B)


def test_full_windows_get_halving_shares_and_a_window_never_gives_more_than_it_holds():
    # T large enough that W, 2W, 4W are all full decaying windows: shares 1 : 1/2 : 1/4
    got = smt.allocate(7 * W, B, W, 5)
    assert [c / got[0][2] for *_, c in got] == pytest.approx([1, 0.5, 0.25])
    # 24 of 32: the nearest window's share (19.2) exceeds its 16 tokens, so it is taken whole, the rest moves on
    assert [c for *_, c in smt.allocate(2 * W, 24, W, T)] == pytest.approx([16, 8])
    assert [c for *_, c in smt.allocate(2 * W, 40, W, T)] == [16, 16]  # budget >= memory: everything


def test_every_position_has_a_probability_that_never_rises_with_distance():
    """Lemma 3.2, empirically: inclusion frequency > 0 everywhere, window means non-increasing,
    and each window's frequency matches its expected count / size."""
    memory, draws = 7 * W, 20000
    gen = torch.Generator().manual_seed(0)
    hits = torch.zeros(memory)
    for _ in range(draws):
        idx = smt.sample_memory(memory, B, W, T, "decay", gen)
        assert idx.numel() == B and bool((idx[1:] > idx[:-1]).all())  # exactly B, ascending, distinct
        hits[idx] += 1
    freq = (hits / draws).flip(0)  # by distance: 0 = nearest memory token
    assert bool((freq > 0).all())
    means = []
    for lo, hi, count in smt.allocate(memory, B, W, T):
        means.append(float(freq[lo:hi].mean()))
        assert means[-1] == pytest.approx(count / (hi - lo), rel=0.05)
    assert means == sorted(means, reverse=True) and means[0] > 4 * means[-1]


def test_short_memory_and_the_uniform_policy():
    gen = torch.Generator().manual_seed(0)
    # a memory shorter than W is one window: uniform over it
    assert smt.windows(10, W, T) == [(0, 10)] and smt.allocate(10, 4, W, T) == [(0, 10, 4.0)]
    assert smt.sample_memory(5, 8, W, T, "decay", gen).tolist() == [0, 1, 2, 3, 4]  # shorter than the sample: whole
    counts = torch.zeros(7 * W)
    for _ in range(4000):
        counts[smt.sample_memory(7 * W, B, W, T, "uniform", gen)] += 1
    assert float(counts[:W].mean()) == pytest.approx(float(counts[-W:].mean()), rel=0.15)  # no decay


def test_bad_policy_parameters():
    with pytest.raises(LcxError, match=r"decay_iters \(T\) must be >= 1, got 0; for uniform sampling use policy=uniform"):
        smt.windows(100, W, 0)
    with pytest.raises(LcxError, match="must be > 0, got 0"):
        smt.windows(100, 0, T)
    for opts, needle in [({"decay_iters": 0}, r"decay_iters \(T\) must be >= 1, got 0"),
                         ({"budget": 64, "target": 64}, "target must be in 0..budget-1"),
                         ({"beta": -1}, "beta must be >= 0"), ({"policy": "random"}, "must be one of decay, uniform")]:
        with pytest.raises(LcxError, match=needle):
            smt.SMT.from_options(**opts)


# ---------------------------------------------------------------------- the sampling stage on a model
def _run(**opts):
    model = tiny_model("llama")  # window 128
    return lcx.attach(model, ["smt"], **{"smt": {"budget": 32, "window": 8, "decay_iters": 3, **opts}})


def _batch(n=96, rows=2, seed=0):
    ids = torch.randint(3, 256, (rows, n), generator=torch.Generator().manual_seed(seed))
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids.clone()}


def test_sampled_rows_keep_their_original_tokens_positions_and_put_the_loss_on_the_target():
    run = _run()
    batch = _batch()
    out = run.hook.lcx_sample(run=run, batch=batch, step=0)
    ids, pos, labels = out["input_ids"], out["position_ids"], out["labels"]
    assert ids.shape == (2, 32) and bool((pos[:, 1:] > pos[:, :-1]).all())
    assert torch.equal(ids, batch["input_ids"].gather(1, pos))  # every token at its ORIGINAL position
    assert pos[:, -16:].tolist() == [list(range(80, 96))] * 2  # the target: the last budget // 2 tokens
    assert bool((labels[:, :17] == -100).all()) and torch.equal(labels[:, 17:], ids[:, 17:])
    assert not torch.equal(pos[0], pos[1])  # rows sample independently
    again = run.hook.lcx_sample(run=run, batch=batch, step=0)
    assert torch.equal(again["position_ids"], pos)  # a pure function of (seed, step, rank): resume is exact
    run.detach()


def test_the_sparse_forward_equals_the_full_sequence_with_the_unsampled_memory_masked():
    """Original positions, causal order, no packed-sequence split: the SMT loss equals the next-token loss of
    the target computed over the whole window with every unsampled memory token masked out."""
    run = _run(beta=0)
    batch = _batch(rows=1)
    out = run.hook.lcx_sample(run=run, batch=batch, step=0)
    run.model.train()  # as in training: no cache, where transformers looks for packed sequences
    terms = run.hook.lcx_loss(run=run, model=run.model, batch=out)[0]
    run.model.eval()
    assert list(terms) == ["smt"]  # beta = 0: the SMT loss alone
    keep = torch.zeros(1, 96, dtype=torch.long)
    keep[0, out["position_ids"][0]] = 1
    with torch.no_grad():
        full = run.model(input_ids=batch["input_ids"], attention_mask=keep, position_ids=torch.arange(96)[None]).logits
    ref = torch.nn.functional.cross_entropy(full[0, 80:95], batch["input_ids"][0, 81:96])  # target[1:] from target
    assert float(terms["smt"].detach()) == pytest.approx(float(ref), rel=1e-5)
    run.detach()


def test_mixed_training_adds_beta_times_the_ordinary_loss_on_a_contiguous_window():
    run = _run(beta=0.5)
    out = run.hook.lcx_sample(run=run, batch=_batch(), step=0)
    terms = run.hook.lcx_loss(run=run, model=run.model, batch=out)[0]
    plain = out["smt_plain"]
    assert plain.shape == (2, 32) and torch.equal(plain, _batch()["input_ids"][:, -32:])
    with torch.no_grad():
        ref = run.model(input_ids=plain, labels=plain).loss
    assert set(terms) == {"smt", "lm"} and float(terms["lm"].detach()) == pytest.approx(0.5 * float(ref), rel=1e-5)
    run.detach()


def test_progressive_extension_grows_the_position_range_with_the_step():
    assert [smt.position_range(s, 96, 40, 10, 16) for s in (0, 9, 10, 25, 100)] == [40, 40, 56, 72, 96]
    assert smt.position_range(5, 96, 40, 0, 16) == 96  # not growing: the whole window
    run = _run(grow_every=10, grow_by=16, start=40)
    for step, top in [(0, 39), (10, 55), (30, 87)]:
        out = run.hook.lcx_sample(run=run, batch=_batch(), step=step)
        assert int(out["position_ids"].max()) == top and out["smt_range"] == top + 1
    run.detach()


def test_inputs_the_model_cannot_fit_are_refused():
    run = _run(budget=256)
    with pytest.raises(LcxError, match=r"smt budget=256 tokens per row exceeds the model's window \(128\)"):
        run.hook.lcx_sample(run=run, batch=_batch(), step=0)
    run.detach()
    run = _run(target=20)
    with pytest.raises(LcxError, match="training windows of 16 tokens leave no memory before smt's target of 20"):
        run.hook.lcx_sample(run=run, batch=_batch(n=16), step=0)
    run.detach()


# ---------------------------------------------------------------------- training: q/k only, with rope, then inference
TEXT = "".join(f"line {i}: the quick brown fox number {i * 7 % 13} jumps. " for i in range(200))


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    return make_tiny_model_dir(tmp_path_factory.mktemp("tiny") / "llama", max_position_embeddings=64)


def test_training_changes_only_q_and_k_and_works_on_top_of_rope_and_under_streaming_and_fot(model_dir, tmp_path):
    corpus = tmp_path / "c.txt"
    corpus.write_text(TEXT)
    cfg = TrainConfig(model=str(model_dir), data=[str(corpus)], out=str(tmp_path / "run"), methods=["smt", "rope"],
                      options={"smt": {"budget": 32, "window": 8}, "rope": {"type": "yarn"}},
                      seq_len=256, steps=3, batch_size=2, lr=1e-2, save_every=0, seed=1)
    out = train(cfg, progress=False)
    metrics = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert all({"loss/smt", "loss/lm"} <= set(m) for m in metrics)
    weights = load_file(str(out / "adapter_model.safetensors"))
    assert weights and all(("q_proj.lora_" in k or "k_proj.lora_" in k) for k in weights), sorted(weights)
    assert any(float(v.abs().sum()) > 0 for k, v in weights.items() if "lora_B" in k)  # it trained
    sidecar = json.loads((out / "lcx.json").read_text())
    assert [m["name"] for m in sidecar["methods"]] == ["smt", "rope"]
    assert sidecar["methods"][1]["options"]["factor"] == 4.0  # factor=auto, fixed by --seq-len 256 / the window 64

    from lcx.generation import generate
    from lcx.session import open_session

    for methods, opts in [(["rope", "streaming"], {"streaming": {"window": 32, "sinks": 4}}),
                          (["rope", "fot"], {"fot": {"local": 32, "memory_layers": "1", "k": 4}})]:
        s = open_session(str(model_dir), methods, opts, adapter=str(out))
        ids = s.tokenizer(TEXT[:150], return_tensors="pt").input_ids
        new = generate(s.run, ids, max_new_tokens=4)
        assert new.shape[-1] >= 4
        s.close()


def test_full_q_and_k_training_saves_them_whole_through_peft_and_changes_nothing_else(model_dir, tmp_path):
    """--full q_proj,k_proj: PEFT's modules_to_save carries the whole q/k matrices; the inert LoRA that
    hosts the config (PEFT needs one target) stays B = 0 and frozen, so merged, only q/k differ."""
    from transformers import AutoModelForCausalLM

    from lcx.adapters.peft_bridge import load_adapter

    corpus = tmp_path / "c.txt"
    corpus.write_text(TEXT)
    cfg = TrainConfig(model=str(model_dir), data=[str(corpus)], out=str(tmp_path / "run"), methods=["smt"],
                      options={"smt": {"budget": 32, "window": 8}}, full=["q_proj", "k_proj"],
                      seq_len=256, steps=3, batch_size=2, lr=1e-2, save_every=0, seed=1)
    out = train(cfg, progress=False)
    weights = load_file(str(out / "adapter_model.safetensors"))
    whole = [k for k in weights if "lora_" not in k]
    assert whole and all(k.endswith(("q_proj.weight", "k_proj.weight")) for k in whole), sorted(weights)
    host = [v for k, v in weights.items() if "lora_B" in k]
    assert len(host) == 1 and not host[0].any()

    base = AutoModelForCausalLM.from_pretrained(str(model_dir)).state_dict()
    merged = load_adapter(AutoModelForCausalLM.from_pretrained(str(model_dir)), out)[0].merge_and_unload().state_dict()
    changed = {k for k in base if not torch.equal(base[k], merged[k])}
    assert changed and all(k.endswith(("q_proj.weight", "k_proj.weight")) for k in changed), sorted(changed)
    assert len(changed) == len(whole)  # every layer's q and k trained


def test_progressive_training_resumes_exactly(model_dir, tmp_path):
    corpus = tmp_path / "c.txt"
    corpus.write_text(TEXT)

    def cfg(out, **kw):
        return TrainConfig(model=str(model_dir), data=[str(corpus)], out=str(out), methods=["smt"],
                           options={"smt": {"budget": 32, "window": 8, "grow_every": 2, "grow_by": 64, "start": 64}},
                           seq_len=256, steps=4, batch_size=2, lr=1e-2, seed=2, **kw)

    whole = train(cfg(tmp_path / "whole", save_every=0), progress=False)
    train(cfg(tmp_path / "part", save_every=1), progress=False, stop_after=3)
    part = train(cfg(tmp_path / "part", save_every=1), resume=True, progress=False)
    a, b = load_file(str(whole / "adapter_model.safetensors")), load_file(str(part / "adapter_model.safetensors"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_smt_needs_rotary_positions():
    """SMT feeds tokens at their original positions, past the trained window: a family with an absolute
    position table (gpt2) is refused at attach, naming what it lacks (it failed with a bare IndexError in the loss)."""
    from tests.conftest import tiny_model

    with pytest.raises(lcx.LcxError, match="'smt' needs .*gpt2"):
        lcx.attach(tiny_model("gpt2"), ["smt"])
