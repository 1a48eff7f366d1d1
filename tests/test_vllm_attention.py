"""streaming and fot inside vLLM's attention (`lcx.integrations.vllm.attention`), driven the way vLLM
drives it: every scheduled token of every request flattened into one forward, prompts cut anywhere by
chunked prefill, generated tokens one per step, requests interleaved.  The logits of every step must
equal lcx's own path (`lcx.generate`).  tests/serve/ checks the real server."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

import lcx
from lcx.errors import LcxError
from lcx.integrations.vllm.attention import Seq, ServeContext
from lcx.plugins.focusllm.served import FocusServed
from lcx.plugins.fot.served import FoTServed
from lcx.plugins.streaming.served import StreamingServed
from tests.conftest import tiny_model

OPTS = dict(sinks=4, window=24, chunk=16)
FOT = dict(local=24, memory_layers="all", k=4, sinks=0, positions="first", gate="off")  # FoT's own; cases vary one


class FakeEngine:
    """One HF model called like vLLM's Transformers backend: one flattened sequence per step."""

    def __init__(self, model, served, prompt_lengths: bool = True, states: dict | None = None) -> None:
        self.prompt_lengths = prompt_lengths  # what the PromptLengths logits processor tells the worker
        self.states = states or {}  # request key -> the middleware's state id (its vllm_xargs)
        self.model, self.served, self.seqs = model, served, []
        ALL_ATTENTION_FUNCTIONS["lcx_test_served"] = self._attention
        model.config._attn_implementation = "lcx_test_served"
        for layer in model.model.layers:
            layer.self_attn.config._attn_implementation = "lcx_test_served"

    def _attention(self, module, query, key, value, attention_mask, **kwargs):
        if module.layer_idx == 0:
            self.served.begin_step()
        return self.served.attend(module, query, key, value, self.seqs), None

    def seq(self, key: int, toks: list[int], pos: int, plen: int) -> Seq:
        return Seq(key, pos, len(toks), plen if self.prompt_lengths else None, self.states.get(key))

    def step(self, work: list[tuple[int, list[int], int, int]]) -> torch.Tensor:
        """work: (request key, tokens, position of the first, prompt length); returns each request's last
        logits row."""
        self.seqs = [self.seq(key, toks, pos, plen) for key, toks, pos, plen in work]
        ids = torch.tensor([[t for _, toks, _, _ in work for t in toks]])
        pos = torch.tensor([[p0 + i for _, toks, p0, _ in work for i in range(len(toks))]])
        with torch.no_grad():
            logits = self.model(input_ids=ids, position_ids=pos, use_cache=False).logits[0]
        ends = torch.tensor([len(toks) for _, toks, _, _ in work]).cumsum(0) - 1
        return logits[ends]


def _hf(model, prompt: list[int], new: int, method: str = "streaming", opts=None,
        memory=None) -> tuple[list[int], torch.Tensor]:
    """lcx's own path (what `lcx generate [--memory PATH]` runs): greedy tokens and the logits of each step."""
    from lcx.generation import make_plan, prefill

    model.generation_config.eos_token_id = None  # always `new` tokens
    with lcx.attach(model, [method], **(OPTS if opts is None else opts)) as run:
        if memory is not None:
            run.method("fot").load(memory, model)
        plan = make_plan(run, torch.tensor([prompt]), None, new)
        out = run.model.generate(input_ids=plan.input_ids, attention_mask=plan.attention_mask,
                                 past_key_values=prefill(run, plan), max_new_tokens=new, do_sample=False,
                                 output_logits=True, return_dict_in_generate=True)
    return out.sequences[0, plan.input_ids.shape[1]:].tolist(), torch.stack([x[0] for x in out.logits])


class CachingEngine(FakeEngine):
    """A FakeEngine with vLLM's prefix cache: it keeps every token's keys/values per request and layer (what
    lcx's attention writes into vLLM's paged cache) and a request in ``donors`` starts at a later position,
    its earlier tokens' keys/values those of the donor request that computed them (``Seq.cached``)."""

    def __init__(self, model, served, donors: dict[int, int]) -> None:
        super().__init__(model, served)
        self.donors, self.kv = donors, {}  # key -> layer -> position -> (k, v) (Hkv, D)

    def _attention(self, module, query, key, value, attention_mask, **kwargs):
        at = 0
        for s in self.seqs:
            held = self.kv.setdefault(s.key, {}).setdefault(int(module.layer_idx), {})
            for i in range(s.length):
                held[s.start + i] = (key[0, :, at + i].clone(), value[0, :, at + i].clone())
            at += s.length
        return super()._attention(module, query, key, value, attention_mask, **kwargs)

    def seq(self, key, toks, pos, plen):
        def cached(module):
            held = self.kv[self.donors.get(key, key)][int(module.layer_idx)]
            return tuple(torch.stack([held[p][j] for p in range(pos)], 1) for j in (0, 1))

        s = super().seq(key, toks, pos, plen)
        s.cached = cached
        return s


def _served(engine: FakeEngine, prompts: dict[int, list[int]], forced: dict[int, list[int]],
            rng: random.Random, avoid_single: bool = False, decode_share: float = 0.7,
            starts: dict[int, int] | None = None) -> dict[int, torch.Tensor]:
    """Prefill every prompt in random pieces (several requests per step, in random order), then decode them,
    a random subset of the requests per step (vLLM's requests finish and join at different times), feeding
    the ``forced`` tokens (the HF path's answer); returns each request's logits per step.  ``starts``: where
    a request's prefill starts (the tokens before it found in vLLM's prefix cache: a ``CachingEngine``)."""
    done = {k: (starts or {}).get(k, 0) for k in prompts}
    out: dict[int, list[torch.Tensor]] = {k: [] for k in prompts}
    while any(done[k] < len(p) for k, p in prompts.items()):
        work = []
        for k, p in prompts.items():
            if done[k] < len(p) and rng.random() < 0.8:
                n = min(len(p) - done[k], rng.choice([2, 5, 16, 17, 40, 100]))
                if avoid_single and len(p) - done[k] - n == 1:  # without prompt lengths, a one-token prompt
                    n += 1                                          # piece reads as a generated token
                work.append((k, p[done[k]:done[k] + n], done[k], len(p)))
                done[k] += n
        if not work:
            continue
        rng.shuffle(work)
        for (k, toks, pos, _), row in zip(work, engine.step(work)):
            if pos + len(toks) == len(prompts[k]):
                out[k].append(row)
    fed = {k: 0 for k in prompts}
    while any(i < len(forced[k]) - 1 for k, i in fed.items()):
        work = [(k, [forced[k][i]], len(prompts[k]) + i, len(prompts[k])) for k, i in fed.items()
                if i < len(forced[k]) - 1 and rng.random() < decode_share]
        if not work:
            continue
        rng.shuffle(work)
        for (k, _, _, _), row in zip(work, engine.step(work)):
            out[k].append(row)
            fed[k] += 1
    return {k: torch.stack(v) for k, v in out.items()}


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_served_streaming_equals_lcx_streaming_over_any_prefill_split_and_interleaving(seed):
    """Logits of every step (prompt end, then each generated token) equal the HF path's; logits, not
    greedy tokens: a tiny random model has near-ties that a different batch shape can flip."""
    model = tiny_model("llama")
    rng = random.Random(seed)
    prompts = {100 + i: [rng.randrange(3, 120) for _ in range(rng.choice([3, 30, 90, 150]))] for i in range(4)}
    want = {k: _hf(model, p, 10) for k, p in prompts.items()}
    engine = FakeEngine(tiny_model("llama"), StreamingServed(**OPTS))
    got = _served(engine, prompts, {k: w[0] for k, w in want.items()}, rng)
    for k in prompts:
        torch.testing.assert_close(got[k], want[k][1], atol=1e-4, rtol=1e-4)
    # a finished request's first block is reused by a new one: the state starts afresh
    again = _served(engine, {100: prompts[101]}, {100: want[101][0]}, rng)
    torch.testing.assert_close(again[100], want[101][1], atol=1e-4, rtol=1e-4)


def test_without_the_sink_re_rotation_the_logits_differ():
    """The check above is not blind: served attention that leaves the sinks at their true positions is
    caught (on a prompt long enough for the sinks to have moved)."""
    model = tiny_model("llama")
    rng = random.Random(5)
    prompts = {1: [rng.randrange(3, 120) for _ in range(150)]}
    tokens, logits = _hf(model, prompts[1], 10)

    class NoRotation(StreamingServed):
        def inv_freq(self, module):
            return torch.zeros_like(super().inv_freq(module))  # a rotation by any shift changes nothing

    engine = FakeEngine(tiny_model("llama"), StreamingServed(**OPTS))
    torch.testing.assert_close(_served(engine, prompts, {1: tokens}, rng)[1], logits, atol=1e-4, rtol=1e-4)
    engine = FakeEngine(tiny_model("llama"), NoRotation(**OPTS))
    assert (_served(engine, prompts, {1: tokens}, rng)[1] - logits).abs().max() > 1e-3  # 10x the tolerance


def test_without_prompt_lengths_one_token_prompt_pieces_are_the_only_difference():
    """The fallback when the worker does not know where a prompt ends: exact unless vLLM leaves a
    one-token piece of a prompt for a later step."""
    model = tiny_model("llama")
    rng = random.Random(1)
    prompts = {100 + i: [rng.randrange(3, 120) for _ in range(rng.choice([30, 90, 150]))] for i in range(3)}
    want = {k: _hf(model, p, 6) for k, p in prompts.items()}
    engine = FakeEngine(tiny_model("llama"), StreamingServed(**OPTS), prompt_lengths=False)
    got = _served(engine, prompts, {k: w[0] for k, w in want.items()}, rng, avoid_single=True)
    for k in prompts:
        torch.testing.assert_close(got[k], want[k][1], atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("opts", [
    dict(FOT),  # chunk = local (FoT's windows), positions=first
    dict(FOT, chunk=8, positions="fixed", memory_layers="1"),  # sliding local context, one memory layer
    dict(FOT, chunk=10, positions="none", dense=True),
    dict(FOT, chunk=8, max_entries=30),  # a memory cap: the oldest entries go
    dict(FOT, gate=-1.0),  # weak memory matches left out
    dict(FOT, chunk=8, sinks=3),  # the prompt's first tokens kept beside the window, re-rotated
    dict(FOT, sinks=5, memory_layers="1"),  # sinks in layers without memory too
    dict(FOT, local=0, chunk=16, sinks=2),  # local = the model's window (128): its prompts of 150 reach memory
    dict(FOT, chunk=8, memory_heads="0:1,1:0"),  # one query head per layer reads memory
    dict(local=24, memory_layers="all", k=4),  # fot's defaults: sinks, chunks, keys at a fixed distance, a gate
    dict(local=24, memory_layers="all", k=4, gate=0.0, gate_sinks=False),  # the gate measured past the sinks
], ids=["first", "fixed-chunk8", "none-dense", "capped", "gated", "sinks-chunk8", "sinks", "window", "heads",
        "defaults", "gate-past-sinks"])
@pytest.mark.parametrize("seed", [0, 1])
def test_served_fot_equals_lcx_fot_over_any_prefill_split_and_interleaving(opts, seed):
    from lcx.registry import registry

    model = tiny_model("llama")
    rng = random.Random(seed)
    prompts = {7 + i: [rng.randrange(3, 120) for _ in range(rng.choice([5, 40, 100, 150]))] for i in range(4)}
    want = {k: _hf(model, p, 8, "fot", opts) for k, p in prompts.items()}
    served = FoTServed.from_method(registry().get("fot").from_options(**opts), ServeContext(window=128))
    engine = FakeEngine(tiny_model("llama"), served)
    got = _served(engine, prompts, {k: w[0] for k, w in want.items()}, rng)
    for k in prompts:
        torch.testing.assert_close(got[k], want[k][1], atol=1e-4, rtol=1e-4)
    # each request kept its own memory: entries = its tokens beyond the local window, in every memory layer
    layers = served.memory_layers
    for k, p in prompts.items():
        total = len(p) + 8 - 1  # the last generated token is never fed back
        for i, st in served.requests[k].layers.items():
            held = {len(s) for s in st.data["memory"].values()} if st.data["memory"] else {0}
            local = opts["local"] or model.config.max_position_embeddings
            entries = max(0, total - local - served.m.sinks)
            entries = min(entries, opts["max_entries"]) if opts.get("max_entries") else entries
            assert held == ({entries} if i in layers else {0}), (k, i, held)


def test_served_fot_requests_that_finish_hand_their_window_slot_to_the_next():
    """Windows live in one pool per layer, a slot per request (`_Rings`): requests that finish free their
    slot and later ones take it (its old rows must not leak in); with 7 requests, decode steps see scattered
    slots (read as a copy) as well as ranges (read in place, idle slots riding along)."""
    from lcx.registry import registry

    rng = random.Random(5)
    served = FoTServed(registry().get("fot").from_options(**FOT))
    engine = FakeEngine(tiny_model("llama"), served)
    for wave in range(3):
        prompts = {100 * wave + i: [rng.randrange(3, 120) for _ in range(rng.choice([10, 30, 60, 90]))]
                   for i in range(7 - 3 * wave)}
        want = {k: _hf(tiny_model("llama"), p, 6, "fot", FOT) for k, p in prompts.items()}
        got = _served(engine, prompts, {k: w[0] for k, w in want.items()}, rng, decode_share=0.3)
        for k in prompts:
            torch.testing.assert_close(got[k], want[k][1], atol=1e-4, rtol=1e-4)
            served.release(k)
    assert served.taken == 7 and sorted(served.free) == list(range(7))


@pytest.mark.parametrize("method", ["streaming", "fot", "fot-sinks"])
@pytest.mark.parametrize("seed", [0, 1])
def test_a_request_whose_prefix_vllm_cached_starts_from_the_cached_keys(method, seed):
    """vLLM's prefix cache (on for streaming and fot): a request whose first blocks another request computed
    is scheduled from a later position; the served attention rebuilds its state from those blocks' keys and
    values (``Seq.cached``, replayed through the method's updates) and its logits equal the HF path's on its
    own whole prompt.  The donor is still running, or finished, or the same request again (resumed after a
    preemption, its own blocks found again); a method that cannot rebuild (focusllm's topk) refuses."""
    from lcx.registry import registry

    rng = random.Random(seed)
    opts = OPTS if method == "streaming" else dict(FOT, sinks=3) if method == "fot-sinks" else FOT
    method = method.split("-")[0]
    shared = [rng.randrange(3, 120) for _ in range(96)]
    prompts = {1: shared + [rng.randrange(3, 120) for _ in range(54)],  # the donor
               2: shared + [rng.randrange(3, 120) for _ in range(30)],  # 96 cached tokens (6 blocks of 16)
               3: shared[:48] + [rng.randrange(3, 120) for _ in range(20)]}  # 3 blocks, mid-update
    want = {k: _hf(tiny_model("llama"), p, 6, method, opts) for k, p in prompts.items()}

    def new_served():
        return (StreamingServed(**OPTS) if method == "streaming"
                else FoTServed(registry().get("fot").from_options(**opts)))

    engine = CachingEngine(tiny_model("llama"), new_served(), donors={2: 1, 3: 1})
    first = _served(engine, {1: prompts[1]}, {1: want[1][0]}, rng)
    torch.testing.assert_close(first[1], want[1][1], atol=1e-4, rtol=1e-4)
    got = _served(engine, {2: prompts[2], 3: prompts[3]}, {k: want[k][0] for k in (2, 3)}, rng,
                  starts={2: 96, 3: 48})
    for k in (2, 3):
        torch.testing.assert_close(got[k], want[k][1], atol=1e-4, rtol=1e-4)
    # request 2 preempted and recomputed: vLLM finds its own first 64 tokens' blocks again (its state is ahead)
    again = _served(engine, {2: prompts[2]}, {2: want[2][0]}, rng, starts={2: 64})
    torch.testing.assert_close(again[2], want[2][1], atol=1e-4, rtol=1e-4)
    # not blind: the cached keys must be the donor's (a wrong donor's give other logits)
    wrong = CachingEngine(tiny_model("llama"), new_served(), donors={2: 3})
    _served(wrong, {3: prompts[3]}, {3: want[3][0]}, rng)
    bad = _served(wrong, {2: prompts[2]}, {2: want[2][0]}, rng, starts={2: 64})
    assert (bad[2] - want[2][1]).abs().max() > 1e-3


def test_a_served_attention_that_cannot_rebuild_from_the_cache_refuses_a_later_start():
    engine = FakeEngine(tiny_model("llama"), FocusServed("/nonexistent", 2))
    with pytest.raises(RuntimeError, match="continuing at position 16 .* prefix caching must be off"):
        engine.step([(1, [5] * 4, 16, 20)])


@pytest.mark.parametrize("dense", [False, True])
def test_served_fot_reads_a_shared_document_memory_and_never_writes_it(tmp_path, dense):
    """`lcx serve --memory`: every request reads the memory `lcx memory build` wrote, plus its own tokens on
    top, and answers as `lcx generate --memory` (memory loaded afresh) does; the shared memory is unchanged."""
    from lcx.adapters.peft_bridge import base_identity
    from lcx.plugins.fot.memory import load_memory, save_memory
    from lcx.registry import registry

    opts = dict(FOT, memory_layers="1", dense=dense)
    model = tiny_model("llama")
    rng = random.Random(3)
    with lcx.attach(model, ["fot"], **opts) as run:  # what `lcx memory build` does, on two documents
        fot = run.method("fot")
        for doc in range(2):
            fot.ingest(run, torch.tensor([[rng.randrange(3, 120) for _ in range(70)]]), doc)
        save_memory(fot.stores_for_saving(), tmp_path / "mem", {"model": base_identity(model)})
    prompts = {3 + i: [rng.randrange(3, 120) for _ in range(rng.choice([10, 40, 80]))] for i in range(3)}
    want = {k: _hf(tiny_model("llama"), p, 6, "fot", opts, memory=tmp_path / "mem") for k, p in prompts.items()}
    shared = load_memory(tmp_path / "mem")[0]
    before = {key: len(store) for key, store in shared.items()}
    served = FoTServed(registry().get("fot").from_options(**opts), shared)
    got = _served(FakeEngine(tiny_model("llama"), served), prompts, {k: w[0] for k, w in want.items()}, rng)
    for k in prompts:
        torch.testing.assert_close(got[k], want[k][1], atol=1e-4, rtol=1e-4)
    assert {key: len(store) for key, store in shared.items()} == before and min(before.values()) > 0
    without = FoTServed(registry().get("fot").from_options(**opts))  # the memory is used: answers differ without it
    alone = _served(FakeEngine(tiny_model("llama"), without), prompts, {k: w[0] for k, w in want.items()}, rng)
    assert any((alone[k] - want[k][1]).abs().max() > 1e-3 for k in prompts)


FOCUS = dict(chunk=16, local=24, fragment=8, refresh=0)  # tiny llama: window 128


@pytest.mark.parametrize("seed,topk", [(0, 0), (1, 0), (0, 2)])
def test_served_focusllm_equals_lcx_focusllm_over_any_prefill_split_and_interleaving(tmp_path, seed, topk):
    """focusllm served as lcx's middleware and attention do it: the prompt's candidates computed on lcx's
    own path (`serve_request`), the prompt rewritten to [placeholders ; local tokens], the candidates'
    keys/values stored in the placeholders' stead in every layer: the logits of every step equal `lcx
    generate`'s with refresh=0, for prompts with several chunks, one chunk, and none (short prompts are read
    as they are), and with ``topk`` (each query head's best candidates only); each request's candidate file
    is deleted when its state is released."""
    from safetensors.torch import save_file

    model = tiny_model("llama")
    rng = random.Random(seed)
    prompts = {11 + i: [rng.randrange(3, 120) for _ in range(n)] for i, n in enumerate([90, 70, 35, 20])}
    opts = {**FOCUS, "topk": topk}
    want = {k: _hf(model, p, 6, "focusllm", {"focusllm": opts}) for k, p in prompts.items()}
    if topk:  # the check can fail: with topk the first prompt's answer (4 candidates) is not all candidates'
        assert not torch.allclose(want[11][1], _hf(model, prompts[11], 6, "focusllm", {"focusllm": FOCUS})[1], atol=1e-3)
    served_prompts, states = {}, {}
    with lcx.attach(model, ["focusllm"], focusllm=opts) as run:
        for k, p in prompts.items():
            res = run.method("focusllm").serve_request(run, p, 6)
            if res is None:  # at most `local` tokens
                assert len(p) <= FOCUS["local"]
                served_prompts[k] = p
                continue
            served_prompts[k], tensors = res
            states[k] = f"{k:032x}"
            save_file(tensors, str(tmp_path / f"{states[k]}.safetensors"))
            n = len(served_prompts[k]) - FOCUS["local"]
            assert n == -(-(len(p) - FOCUS["local"]) // FOCUS["chunk"]) and tensors["0.k"].shape[1] == n
    served = FocusServed(tmp_path, topk)
    engine = FakeEngine(tiny_model("llama"), served, states=states)
    got = _served(engine, served_prompts, {k: w[0] for k, w in want.items()}, rng)
    for k in prompts:
        torch.testing.assert_close(got[k], want[k][1], atol=1e-4, rtol=1e-4)
    # a new request in a finished one's first block (vLLM reuses it before lcx sees the old one leave):
    # the finished one's file goes; a request recomputed from its start keeps its own
    k0 = next(k for k in states)
    old, new = tmp_path / f"{states[k0]}.safetensors", tmp_path / ("f" * 32 + ".safetensors")
    new.write_bytes(old.read_bytes())
    engine.states[k0] = "f" * 32
    again = _served(engine, {k0: served_prompts[k0]}, {k0: want[k0][0]}, rng)
    torch.testing.assert_close(again[k0], want[k0][1], atol=1e-4, rtol=1e-4)
    assert not old.exists() and new.exists()
    engine.step([(k0, served_prompts[k0][:5], 0, len(served_prompts[k0]))])  # preempted: recomputed from 0
    for k in list(served.requests):
        served.release(k)
    assert not list(tmp_path.iterdir())  # released requests leave no candidate files


def test_served_focusllm_refuses_malformed_state_ids_and_refresh(tmp_path):
    engine = FakeEngine(tiny_model("llama"), FocusServed(tmp_path), states={1: "../../etc/passwd"})
    with pytest.raises(RuntimeError, match="malformed request state id"):
        engine.step([(1, [5, 6, 7], 0, 3)])
    engine = FakeEngine(tiny_model("llama"), FocusServed(tmp_path), states={1: "a" * 32})
    with pytest.raises(RuntimeError, match="candidates of this request .* are gone"):
        engine.step([(1, [5, 6, 7], 0, 3)])
    with lcx.attach(tiny_model("llama"), ["focusllm"], focusllm={**FOCUS, "refresh": 1}) as run:
        with pytest.raises(LcxError, match="serve it with -o focusllm.refresh=0"):
            run.method("focusllm").serve_request(run, list(range(3, 90)), 4)


def test_a_request_continuing_without_state_is_an_error():
    engine = FakeEngine(tiny_model("llama"), StreamingServed(**OPTS))
    with pytest.raises(RuntimeError, match="no state for a request continuing at position 7"):
        engine.step([(9, [5, 6], 7, 20)])


def test_finished_requests_free_their_state_and_unscheduled_ones_keep_it(monkeypatch):
    """vLLM removes a request from its batch when it finishes and also when it merely is not scheduled
    this step: only the first may free the request's state (the load test's memory growth)."""
    from types import SimpleNamespace

    from lcx.integrations.vllm import attention as va

    served = StreamingServed(**OPTS)
    engine = FakeEngine(tiny_model("llama"), served)
    engine.step([(1, [5, 6, 7], 0, 3), (2, [8, 9], 0, 2), (3, [4, 4], 0, 2)])
    assert set(served.requests) == {1, 2, 3}
    params = lambda **kw: SimpleNamespace(**{"max_tokens": 4, "min_tokens": 0, "ignore_eos": False,  # noqa: E731
                                             "eos_token_id": 0, "all_stop_token_ids": {0, 7}, **kw})
    monkeypatch.setattr(va, "SERVED", served)
    monkeypatch.setattr(va, "ROW_KEYS", {0: 1, 1: 2, 2: 3})
    monkeypatch.setattr(va, "ROW_OUTPUTS", {0: (params(), [11, 12, 13, 14]),  # max_tokens reached
                                            1: (params(), [11, 12]),  # running, not scheduled this step
                                            2: (params(), [11, 7])})  # a stop token
    # vLLM lists a row in `removed` only when no new request took it over; else the row is in `added`
    va.release_finished(SimpleNamespace(removed=[2, 1], added=[(0, params(), [], [])], moved=[]))
    assert set(served.requests) == {2}
    assert va.ROW_KEYS == {}  # rows taken over or emptied are forgotten (a row keeps its key until then)
    # request 2 sits in row 3 (scheduled some passes ago); finished request 99 in row 5 is dropped by vLLM
    # condensing the batch, which moves request 2 into row 5 without listing row 5 as removed
    served.requests[99] = served.requests[2]
    va.ROW_KEYS.update({3: 2, 5: 99})
    va.ROW_OUTPUTS.update({3: (params(), [1]), 5: (params(), [1, 2, 3, 4])})
    va.release_finished(SimpleNamespace(removed=[], added=[], moved=[(3, 5, _unidirectional_move())]))
    assert va.ROW_KEYS == {5: 2} and set(served.requests) == {2}
    engine.step([(2, [10], 2, 2)])  # the unscheduled request continues from its state
    assert va.finished(params(ignore_eos=True, all_stop_token_ids=set()), [5, 0]) is False
    assert va.finished(params(min_tokens=3), [5, 0]) is False and va.finished(params(min_tokens=2), [5, 0])
    assert va.finished(params(max_tokens=None), [5, 6, 8, 9, 10]) is False


def _unidirectional_move():
    from vllm.v1.sample.logits_processor.interface import MoveDirectionality

    return MoveDirectionality.UNIDIRECTIONAL


def test_a_window_buffer_holds_what_cat_and_slicing_would_and_stays_small():
    """`Window` (the served local context of fot and streaming) against the torch.cat + slice it replaces, over
    random appends and front drops that force both in-place compaction and growth, with and without rows kept
    free before the window (streaming's sinks, written there by `with_front`); its buffer never exceeds the
    bound that the served classes' `request_bytes` assume."""
    from lcx.integrations.vllm.attention import WINDOW_SLACK, Window

    for front in (0, 4):
        rng = random.Random(front)
        ref, win = torch.zeros(3, 0, 4), Window(torch.zeros(3, 0, 4), front)
        for step in range(300):
            n = rng.choice([1, 1, 1, 7, 30])
            x = torch.randn(3, n, 4)
            win.append(x)
            ref = torch.cat([ref, x], dim=1)
            if front:
                sinks = torch.randn(3, rng.randint(0, front), 4)
                assert torch.equal(win.with_front(sinks), torch.cat([sinks, ref], dim=1)), step
                assert torch.equal(win.view(), ref), step  # the live rows are untouched
            drop = max(0, ref.shape[1] - 50)
            win.drop_front(drop)
            ref = ref[:, drop:]
            assert torch.equal(win.view(), ref), step
            assert win.buf.shape[1] <= front + int((50 + 30) * (1 + WINDOW_SLACK)) + 16


@pytest.mark.parametrize("cap", [0, 40])
def test_a_heads_store_answers_what_one_torch_store_per_head_answers(cap):
    """`HeadsStore` (a served fot request's memory in one layer, every KV head in one buffer) against the
    `torch` backend's stores, one per head, fed the same entries in pieces: the same top-k scores and values
    and the same dense keys, also after its FIFO cap drops the oldest; `memory_attention` gives the same
    output from either."""
    from lcx.plugins.fot.served import HeadsStore
    from lcx.plugins.fot.memory import make_store
    from lcx.plugins.fot.attention import _memory_scores, memory_attention

    torch.manual_seed(cap)
    heads, per_head = HeadsStore(cap), [make_store(kind="torch", max_entries=cap) for _ in range(3)]
    for n in (5, 1, 1, 30, 17):
        k, v = torch.randn(3, n, 8), torch.randn(3, n, 6)
        heads.add(k, v)
        for h, store in enumerate(per_head):
            store.add(k[h], v[h], torch.arange(n))
    assert len(heads) == len(per_head[0]) == (min(54, cap) if cap else 54)
    q = torch.randn(3, 7, 8)
    got, want = heads.search_heads(q, 4, False), _memory_scores(q, per_head, 4, False)
    torch.testing.assert_close(got[0], want[0])
    torch.testing.assert_close(got[1], want[1])
    query, key, value = torch.randn(1, 6, 5, 8), torch.randn(1, 3, 9, 8), torch.randn(1, 3, 9, 6)
    mask, shift, inv = torch.zeros(1, 1, 5, 9), torch.full((1, 5), -3.0, dtype=torch.float64), torch.rand(4)
    for dense in (False, True):  # (with a cap, the pool's rows are a ring: dense keys in another order)
        a = memory_attention(query, key, value, mask, {0: heads}, shift, inv, 0.3, 4, dense, 2)
        b = memory_attention(query, key, value, mask, {(0, h): s for h, s in enumerate(per_head)}, shift, inv, 0.3, 4,
                             dense, 2)
        torch.testing.assert_close(a, b)
        assert not torch.equal(a, memory_attention(query, key, value, mask, {0: HeadsStore()}, shift, inv, 0.3, 4,
                                                   dense, 2))


@pytest.mark.parametrize("queries", [8, 40])  # 16 queries in all: one product; 80: one head at a time
def test_a_heads_stores_bf16_search_picks_candidates_in_bf16_and_answers_what_per_head_stores_answer(monkeypatch,
                                                                                                     queries):
    """A bf16 model's served search picks its candidates in bf16 where it pays (``top_inner_products``, with
    bf16 taken as native: ``_fast_half`` patched), for every head in one product or one head at a time, and
    answers what the torch stores, one per head, answer under the same rule: float32 scores of the same entries
    as a float32 search."""
    import lcx.plugins.fot.memory as memory
    import lcx.plugins.fot.served as served
    from lcx.plugins.fot.attention import _memory_scores

    monkeypatch.setattr(memory, "_fast_half", lambda dtype, device: dtype == torch.bfloat16)
    torch.manual_seed(0)
    Hkv, N, D = 2, 8192, 16
    keys, values = torch.randn(Hkv, N, D), torch.randn(Hkv, N, 6).bfloat16()
    heads, per_head = served.HeadsStore(), [memory.make_store(kind="torch") for _ in range(Hkv)]
    heads.add(keys, values)
    for h, store in enumerate(per_head):
        store.add(keys[h], values[h], torch.arange(N))
    assert memory.takes_half_step(queries, N, 4, torch.bfloat16, keys.device)
    products, matmul = [], torch.Tensor.__matmul__
    monkeypatch.setattr(torch.Tensor, "__matmul__", lambda a, b: products.append((a.dtype, a.dim())) or matmul(a, b))
    q = torch.randn(Hkv, queries, D)
    got = heads.search_heads(q, 4, False, torch.bfloat16)
    half = [dim for dtype, dim in products if dtype == torch.bfloat16]
    assert half == ([3] if Hkv * queries <= served.SEARCH_BATCH else [2] * Hkv) and got[0].dtype == torch.float32
    want = _memory_scores(q, per_head, 4, False, torch.bfloat16)
    torch.testing.assert_close(got[0], want[0], rtol=0, atol=0)
    torch.testing.assert_close(got[1], want[1], rtol=0, atol=0)
    exact = heads.search_heads(q, 4, False)  # float32 throughout: the same entries (random keys leave wide gaps)
    torch.testing.assert_close(got[0], exact[0])
    torch.testing.assert_close(got[1], exact[1])


def test_a_third_party_served_form_equals_its_lcx_path(monkeypatch):
    """tests/thirdparty/lcx-band-method (a package outside lcx: a sliding window of `width` tokens) served through
    this module's machinery, the way vLLM drives it, gives the logits of its own lcx path (tests/serve has the
    real server); its window is narrower than the prompts, so the check would see a window read wrongly."""
    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parent / "thirdparty" / "lcx-band-method"))
    from lcx_band_method import Band
    from lcx_band_method.served import BandServed

    model = tiny_model("llama")
    rng = random.Random(7)
    prompts = {200 + i: [rng.randrange(3, 120) for _ in range(n)] for i, n in enumerate([5, 40, 90])}
    want = {k: _hf(model, p, 8, Band(width=12), {}) for k, p in prompts.items()}
    whole = {k: _hf(model, p, 8, "vanilla", {}) for k, p in prompts.items()}
    got = _served(FakeEngine(tiny_model("llama"), BandServed(12)), prompts, {k: w[0] for k, w in want.items()}, rng)
    for k in prompts:
        torch.testing.assert_close(got[k], want[k][1], atol=1e-4, rtol=1e-4)
    assert not torch.allclose(want[201][1], whole[201][1], atol=1e-3)  # the window changes what the model reads


@pytest.mark.parametrize("method", ["streaming", "fot", "fot-sinks"])
@pytest.mark.parametrize("family, overrides, seed", [("gemma3_text", {}, 3), ("mistral", {"sliding_window": 64}, 5)])
def test_served_attention_keeps_each_sliding_layers_band_as_lcx_does(method, family, overrides, seed):
    """Gemma 3 keeps one RoPE table per layer type (``sliding_attention_inv_freq``, ``full_attention_inv_freq``,
    different bases) and a band on its sliding-window layers: the served form re-rotates each layer's keys with
    its own layer's table and keeps each sliding layer's band, as lcx's path does.  Mistral names no window on its
    attention modules: its config's ``sliding_window`` slides every layer, and the served form keeps that band too."""
    from lcx.registry import registry

    model = tiny_model(family, **overrides)
    rng = random.Random(seed)
    prompts = {7 + i: [rng.randrange(3, 120) for _ in range(rng.choice([40, 100, 150]))] for i in range(3)}
    # windows past the 64-token band of the sliding layers, so the band decides what they read
    opts = dict(OPTS, window=80) if method == "streaming" else dict(FOT, local=100, chunk=16, memory_layers="1")
    if method == "fot-sinks":  # sinks re-rotated with each layer's table; the band hides them in sliding layers
        opts, method = dict(opts, sinks=4), "fot"
    want = {k: _hf(model, p, 6, method, opts) for k, p in prompts.items()}
    served = StreamingServed(**opts) if method == "streaming" else FoTServed(registry().get("fot").from_options(**opts))
    engine = FakeEngine(tiny_model(family, **overrides), served)
    got = _served(engine, prompts, {k: w[0] for k, w in want.items()}, rng)
    for k in prompts:
        torch.testing.assert_close(got[k], want[k][1], atol=1e-4, rtol=1e-4)


def test_a_long_prompt_piece_is_read_in_blocks_of_queries_as_in_one(monkeypatch):
    """``sdpa`` (both its ways: as rows of their KV head and through SDPA's GQA) and focusllm's ``topk_sdpa`` read
    many queries in blocks under ``MASK_BLOCK_BYTES``: each answers what one masked softmax over every key answers,
    topk_sdpa also where a prompt piece holds fewer candidates than ``k`` (all of them read)."""
    from lcx.integrations.vllm import attention
    from lcx.integrations.vllm.attention import causal_tail, gqa_sdpa, rows_sdpa, sdpa
    from lcx.plugins.focusllm.attention import topk_keep
    from lcx.plugins.focusllm.served import topk_sdpa

    torch.manual_seed(0)
    H, Hkv, D, S = 6, 2, 8, 50
    keys, values = torch.randn(Hkv, S, D), torch.randn(Hkv, S, D)

    def reference(q, allowed, n=0, k=0):
        scores = q @ keys.repeat_interleave(H // Hkv, 0).transpose(1, 2) * D ** -0.5
        mask = torch.ones(H, q.shape[1], S, dtype=torch.bool) if allowed is None else allowed.expand(H, -1, -1).clone()
        if k:
            mask[..., :n] &= topk_keep(q.reshape(Hkv, H // Hkv, q.shape[1], D), keys[:, :n], k).reshape(H, -1, n)
        return scores.masked_fill(~mask, float("-inf")).softmax(-1) @ values.repeat_interleave(H // Hkv, 0)

    for nq in (1, 5, 40):
        q = torch.randn(H, nq, D)
        allowed = causal_tail(nq, S, q.device)
        assert nq == 1 or torch.equal(allowed, torch.ones(nq, S, dtype=torch.bool).tril(S - nq))
        for block in (64 << 20, 3 * 3 * S * 5):  # one block; blocks of 3 rows (rows), 9 (GQA), 1 (topk_sdpa)
            monkeypatch.setattr(attention, "MASK_BLOCK_BYTES", block)
            for read in (sdpa, rows_sdpa, gqa_sdpa):
                torch.testing.assert_close(read(q, keys, values, allowed, D ** -0.5), reference(q, allowed))
            torch.testing.assert_close(topk_sdpa(q, keys, values, allowed, 12, 3, D ** -0.5),
                                       reference(q, allowed, 12, 3))
            torch.testing.assert_close(topk_sdpa(q, keys, values, allowed, 12, 20, D ** -0.5),
                                       reference(q, allowed))


@pytest.mark.parametrize("way", ["rows_sdpa", "gqa_sdpa"])
def test_sdpa_holds_one_block_of_its_mask_at_a_time(monkeypatch, way):
    """A long prompt piece's mask in the query's dtype exists one block of queries at a time: what ``sdpa``
    holds at once, either way it reads, is within ``sdpa_bytes`` (and within 2x of it), far under the whole
    piece's mask."""
    from lcx.integrations.vllm import attention
    from lcx.integrations.vllm.attention import causal_tail, sdpa_bytes
    from tests.helpers import LiveTensors

    sdpa = getattr(attention, way)
    monkeypatch.setattr(attention, "MASK_BLOCK_BYTES", 3 * 2 * 1000 * 5)  # 3 queries a block as rows, 6 by GQA
    q, keys, values = torch.randn(2, 1000, 4), torch.randn(1, 1000, 4), torch.randn(1, 1000, 4)
    allowed = causal_tail(1000, 1000, q.device)
    live = LiveTensors([q, keys, values, allowed])
    with live:
        sdpa(q, keys, values, allowed, 0.5)
    assert live.peak <= sdpa_bytes(2, 1, 1000, 1000, 4) < 2 * live.peak
    assert sdpa_bytes(2, 1, 1000, 1000, 4) < 1000 * 1000 * 4 / 10


def test_a_topk_block_holds_what_topk_row_bytes_counts():
    """One block of focusllm's served topk read with 16 query heads over two KV heads holds at most
    ``topk_row_bytes`` a row and its output (no copy of the candidates per query head), within 2x."""
    from lcx.plugins.focusllm.served import _topk_block, topk_row_bytes
    from tests.helpers import LiveTensors

    H, Hkv, D, rows, S, n, k = 16, 2, 64, 64, 512, 400, 8
    q, keys, values = torch.randn(H, rows, D), torch.randn(Hkv, S, D), torch.randn(Hkv, S, D)
    live = LiveTensors([q, keys, values])
    with live:
        _topk_block(q, keys, values, None, n, k, D ** -0.5)
    bound = rows * topk_row_bytes(H, S, n, k, D) + H * rows * D * 4
    assert live.peak <= bound < 2 * live.peak


@pytest.mark.parametrize("family, method, opts, n, dims, block, over", [
    ("llama", "streaming", dict(sinks=4, chunk=512), 2048, (8, 2, 32), 64 << 20, 2),  # chunks read as rows
    ("gemma3_text", "streaming", dict(sinks=4, chunk=512), 2048, (8, 2, 32), 64 << 20, 2),  # a sliding layer
    # chunks read by GQA: a shorter last piece, read as rows, may hold up to twice their mask
    ("llama", "streaming", dict(sinks=4, chunk=1024), 2048, (8, 2, 32), 64 << 20, 3),
    ("gemma3_text", "streaming", dict(sinks=4, chunk=1024), 2048, (8, 2, 32), 1 << 20, 2),  # a chunk in 11 blocks
    ("llama", "focusllm", dict(chunk=64, local=256, fragment=16, refresh=0, topk=8), 2048, (8, 2, 32), 64 << 20, 2),
    # a prompt whose causal mask outweighs a block of queries
    ("llama", "focusllm", dict(chunk=64, local=256, fragment=16, refresh=0, topk=8), 12288, (2, 1, 8), 64 << 20, 2),
    # no more candidates than topk: the prompt is read by ``sdpa``, as rows (G x n = 2,048)
    ("llama", "focusllm", dict(chunk=64, local=256, fragment=16, refresh=0, topk=256), 512, (8, 2, 32), 64 << 20, 2),
    # fot's step is lcx's path's memory attention (``attention_bytes``), which also stacks the retrieved values
    ("llama", "fot", dict(local=256, chunk=256, memory_layers="all", k=32), 2048, (8, 2, 32), 64 << 20, 2.5),
    ("llama", "fot", dict(local=512, chunk=128, memory_layers="all", k=64, dense=True), 2048, (8, 2, 32), 64 << 20, 2),
])
def test_a_served_steps_estimate_bounds_what_its_prompt_allocates(tmp_path, monkeypatch, family, method, opts, n,
                                                                  dims, block, over):
    """What a served layer holds at once while it reads a whole prompt of ``n`` tokens in one step is within the
    served class's estimate (its step, one layer's state of the request, the step's outputs), and the estimate
    within ``over`` times it (float32: the estimates count float32 copies)."""
    from safetensors.torch import save_file

    from lcx.integrations.vllm import attention
    from lcx.integrations.vllm.attention import output_bytes, served_class
    from tests.helpers import LiveTensors

    monkeypatch.setattr(attention, "MASK_BLOCK_BYTES", block)
    heads, kv, dim = dims
    model = tiny_model(family, num_attention_heads=heads, num_key_value_heads=kv, head_dim=dim,
                       max_position_embeddings=n)
    config = model.config.to_dict()
    with lcx.attach(model, [method], **opts) as run:
        m = run.method(method)
    state = None
    if method == "focusllm":  # the middleware's candidates: one per chunk of a prompt beyond the local tokens
        state = "a" * 32
        save_file({f"{layer}.{x}": torch.randn(kv, n - m.local, dim) for layer in range(config["num_hidden_layers"])
                   for x in "kv"}, str(tmp_path / f"{state}.safetensors"))
    served = served_class({"name": method, "options": m.to_options()}).from_method(m, ServeContext(n, str(tmp_path)))
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        torch.manual_seed(0)
        q, k, v = torch.randn(1, heads, n, dim), torch.randn(1, kv, n, dim), torch.randn(1, kv, n, dim)
        live = LiveTensors([q, k, v])
        with torch.no_grad(), live:
            served.begin_step()
            served.attend(model.model.layers[0].self_attn, q, k, v, [Seq(1, 0, n, n, state)])
    finally:
        torch.set_num_threads(threads)
    cls = type(served)
    estimate = cls.step_bytes(m, config, n, n, None) + output_bytes(config, n) \
        + cls.request_bytes(m, config, n, n) // config["num_hidden_layers"]
    assert live.peak <= estimate < over * live.peak
