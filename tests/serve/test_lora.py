"""YaRN x4 (`rope`) with two q/k LoRA adapters under it (the shape an smt adapter has: the two methods combined,
so that one pair of generations past the window checks both), prompts up to 1.5x the window.  Every answer is compared
with lcx's path applying the same rope and adapter; the passkey prompt past the window is read by adapter a1."""

from __future__ import annotations

import json
import random
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from lcx.evals.passkey import build_prompt_ids

from .harness import MODEL, NEW, ROPE, ROPE_ARGS, SERVING, WINDOW, hf_tokens, server_starting, smt_adapter

pytestmark = SERVING

LONG_KEY = 71234
LONG_ANSWERED = WINDOW + WINDOW // 2  # at harness.LONG its key is missed (on both sides alike): no real answer
LONG_NEW = 12  # its answer names the key after a few words, one token per digit


@pytest.fixture(scope="module")
def adapters(tmp_path_factory):
    d = tmp_path_factory.mktemp("adapters")
    # a2 changes short answers (scale 0.5): it sits in vLLM's last LoRA slot, which vLLM's CPU ops gave
    # base-model tokens batched with adapter requests (lcx.integrations.vllm.lora)
    return {"a1": smt_adapter(d / "a1", 1), "a2": smt_adapter(d / "a2", 2, scale=0.5)}


@pytest.fixture(scope="module")
def started(adapters, tok, tmp_path_factory):
    """The server, and the passkey prompt past the window with lcx's answer to it (rope and a1), computed while
    the server starts."""
    ids = build_prompt_ids(tok, LONG_ANSWERED, 0.5, LONG_KEY)
    with server_starting(["--method", "rope", *ROPE_ARGS, *(f"--adapter={n}={p}" for n, p in adapters.items())],
                         tmp_path_factory.mktemp("lora")) as starting:
        want = hf_tokens(ids, ["rope"], ROPE, adapter=adapters["a1"], max_new_tokens=LONG_NEW)
        yield starting.wait_ready(), (ids, want)


@pytest.fixture(scope="module")
def lora_server(started):
    return started[0]


def test_ready_line_names_the_method_and_the_adapters(lora_server):
    r = lora_server.ready
    # the adapters' own sidecars name smt (what `lcx train --method smt` writes); rope sets the length
    assert r["methods"] == ["rope", "smt"] and r["adapters"] == ["a1", "a2"] and r["max_model_len"] == 4 * WINDOW


def test_each_request_is_answered_by_the_adapter_it_names(lora_server, adapters, tok):
    ids = tok("One, two, three, four, five, six,", return_tensors="pt")["input_ids"][0]
    got = {name: lora_server.complete(name, ids.tolist(), 16) for name in (MODEL, "a1", "a2")}
    want = {MODEL: hf_tokens(ids, ["rope"], ROPE, max_new_tokens=16),
            **{n: hf_tokens(ids, ["rope"], ROPE, adapter=p, max_new_tokens=16) for n, p in adapters.items()}}
    assert got == want
    assert len({tuple(t) for t in got.values()}) == 3  # the names do route to different adapters


def test_base_model_requests_batched_with_adapter_requests_get_no_adapter(lora_server, adapters, tok):
    """Both adapters loaded (a2 in the last slot) and requests of all three names in one batch: each gets
    its own model's tokens (vLLM 0.32's CPU LoRA ops gave the base-model requests a2's adapter)."""
    texts = ["One, two, three, four, five, six,", "The capital of France is", "Once upon a time, there was",
             "def fibonacci(n):", "The pass key is 12345. Remember it. The pass key is"]
    jobs = [(name, tok(t)["input_ids"]) for t in texts for name in (MODEL, "a1", "a2")]
    random.Random(6).shuffle(jobs)
    with ThreadPoolExecutor(len(jobs)) as pool:
        got = list(pool.map(lambda j: lora_server.complete(j[0], j[1], 8), jobs))
    paths = {MODEL: None, **adapters}
    want = [hf_tokens(torch.tensor(ids), ["rope"], ROPE, adapter=paths[name]) for name, ids in jobs]
    assert got == want


def test_rope_and_adapter_past_the_window_equal_the_hf_path(started, tok):
    lora_server, (ids, want) = started
    got = lora_server.complete("a1", ids.tolist(), LONG_NEW)
    assert got == want
    assert str(LONG_KEY) in tok.decode(got)  # YaRN x4 finds the key at 1.5x the window: a real answer


@pytest.mark.parametrize("order_seed", [0, 1])
def test_concurrent_requests_each_get_their_own_passkey(lora_server, tok, order_seed):
    """8 passkey prompts of 1K tokens, half of them naming a1, sent at once in a shuffled order: each answer
    is its own key, never another's.  The keys sit at depth 0.85-0.95, where YaRN x4 finds them at 1K
    (at depths 0.2-0.5 it answers "the pass key is ..." for either model)."""
    rng = random.Random(order_seed)
    keys = rng.sample(range(10000, 99999), 8)
    jobs = [(MODEL if i % 2 == 0 else "a1", build_prompt_ids(tok, 1024, rng.uniform(0.85, 0.95), k).tolist(), k)
            for i, k in enumerate(keys)]
    rng.shuffle(jobs)  # arrival order differs per round
    with ThreadPoolExecutor(len(jobs)) as pool:
        answers = list(pool.map(lambda j: tok.decode(lora_server.complete(j[0], j[1], NEW)), jobs))
    for (_, _, key), text in zip(jobs, answers):
        assert str(key) in text and not any(str(k) in text for k in keys if k != key), (key, text)


def test_bad_requests_get_4xx_and_the_server_keeps_serving(lora_server, tok):
    status, out = lora_server.post("/v1/completions", {"model": MODEL, "prompt": [100] * (4 * WINDOW + 100),
                                                       "max_tokens": 4})
    assert status == 400 and "maximum context length" in json.dumps(out)
    status, out = lora_server.post("/v1/completions", {"model": "no-such-adapter", "prompt": "hi", "max_tokens": 4})
    assert status == 404 and "no-such-adapter" in out["error"]["message"]
    status, out = lora_server.post("/v1/completions", {"model": MODEL, "prompt": "hi", "max_tokens": -3})
    assert 400 <= status < 500, out
    # per-request lcx options (lcx.integrations.vllm.middleware): malformed or not applicable -> 400
    status, out = lora_server.post("/v1/completions", {"model": MODEL, "prompt": "hi", "max_tokens": 4, "lcx": "fast"})
    assert status == 400 and "'lcx' must map method names to their options" in out["error"]["message"]
    status, out = lora_server.post("/v1/completions", {"model": MODEL, "prompt": "hi", "max_tokens": 4,
                                                       "lcx": {"streaming": {"window": 64}}})
    assert status == 400 and f"model '{MODEL}' applies rope; options for 'streaming'" in out["error"]["message"]
    status, out = lora_server.post("/v1/completions", {"model": MODEL, "prompt": "hi", "max_tokens": 4,
                                                       "lcx": {"rope": {"factor": 8}}})
    assert status == 400 and "rope.factor=8.0 differs from the server's rope.factor=4.0" in out["error"]["message"]
    status, out = lora_server.post("/v1/completions", {"model": "a1", "prompt": "hi", "max_tokens": 4,
                                                       "lcx": {"smt": {"beta": 0}}})
    assert status == 400 and "smt.beta=0.0 differs from the server's smt.beta=1.0" in out["error"]["message"]
    ids = tok("The capital of France is", return_tensors="pt")["input_ids"][0]
    assert len(lora_server.complete(MODEL, ids.tolist(), 4)) == 4
    assert lora_server.complete("a1", ids.tolist(), 4, lcx={"smt": {}}) == lora_server.complete("a1", ids.tolist(), 4)
