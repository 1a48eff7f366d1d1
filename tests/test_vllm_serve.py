"""`lcx serve` on SmolLM2-135M, for real (vLLM on CPU): same tokens as lcx's Hugging Face path,
several LoRA adapters at once, concurrent requests kept apart, bad requests answered with 4xx.

Servers, one per test (or per test class), each stopped when its tests end: the model with YaRN x4 (`rope`) and
two q/k LoRA adapters (the shape an smt adapter has: the two methods combined, so that one pair of 2x-window
generations checks both), the model behind `vanilla`'s truncating middleware, `streaming`, `fot` (with a
document memory and a LoRA adapter) and `focusllm` inside vLLM's attention, and plain `vllm serve` with the
plugin.  Each 2x-window parity costs a 16K-token generation on both sides (~1-2 min each on 2 cores): the
servers are few, and the prompts that check isolation are short.
"""

from __future__ import annotations

import json
import os
import random
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
import torch

from lcx.evals.passkey import build_prompt_ids
from lcx.integrations.vllm import ServerProcess

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

MODEL = "smollm2-135m"
WINDOW = 8192
LONG = 2 * WINDOW  # the parity length: 2x the model's window
NEW = 8


def _adapter(out: Path, seed: int, scale: float = 0.05) -> Path:
    """A q/k LoRA adapter (rank 8) with random B: what `lcx train --method smt` writes, untrained."""
    from lcx.adapters.peft_bridge import random_adapter
    from lcx.models import load_model

    return random_adapter(load_model(MODEL)[0], out, seed, scale=scale)


def start_server(args: list[str], tmp: Path) -> ServerProcess:
    return ServerProcess(MODEL, [*args, "--export-dir", str(tmp / "export")], tmp / "serve.log")


#: The rope method the LoRA server applies under its adapters (and plain `vllm serve`'s sidecar names).
ROPE = {"rope": {"type": "yarn", "factor": 4}}
ROPE_ARGS = [x for k, v in ROPE["rope"].items() for x in ("-o", f"rope.{k}={v}")]


@pytest.fixture(scope="module")
def tok():
    from transformers import AutoTokenizer

    from lcx.models import resolve_model_path

    return AutoTokenizer.from_pretrained(str(resolve_model_path(MODEL)))


@pytest.fixture(scope="module")
def adapters(tmp_path_factory):
    d = tmp_path_factory.mktemp("adapters")
    # a2 changes short answers (scale 0.5): it sits in vLLM's last LoRA slot, which vLLM's CPU ops gave
    # base-model tokens batched with adapter requests (lcx.integrations.vllm_lora)
    return {"a1": _adapter(d / "a1", 1), "a2": _adapter(d / "a2", 2, scale=0.5)}


#: Open HF sessions by (methods, options, adapter, memory), most recently used last: loading the model
#: per reference would cost a load each; a few are kept (each holds a copy of the model).
_SESSIONS: OrderedDict[tuple, Any] = OrderedDict()
_KEEP_SESSIONS = 3


@pytest.fixture(scope="module", autouse=True)
def _close_sessions():
    yield
    while _SESSIONS:
        _SESSIONS.popitem()[1].close()


def hf_tokens(ids: torch.Tensor, methods=(), options=None, adapter=None, max_new_tokens: int = NEW,
              memory=None) -> list[int]:
    """The lcx Hugging Face path: what `lcx generate --greedy [--memory PATH]` produces.  A session is
    reused across prompts as `lcx eval` does (each generation starts a fresh plan and memory); with a
    document memory it is reloaded before every prompt, since fot's multi-document mode keeps what a
    prompt adds."""
    from lcx.generation import generate
    from lcx.session import open_session

    key = (tuple(methods), json.dumps(options or {}, sort_keys=True), str(adapter), str(memory))
    s = _SESSIONS.pop(key, None) or open_session(MODEL, list(methods), options or {}, adapter)
    _SESSIONS[key] = s
    while len(_SESSIONS) > _KEEP_SESSIONS:
        _SESSIONS.popitem(last=False)[1].close()
    if memory is not None:
        s.run.method("fot").load(memory, s.model)
    return generate(s.run, ids[None], max_new_tokens=max_new_tokens, do_sample=False)[0].tolist()


class TestLoraServer:
    """YaRN x4 (`rope`) with two q/k LoRA adapters under it, prompts up to 2x the window: one server for the
    class, stopped when its tests end (not idle beside the other servers until the module ends).  Every
    answer is compared with lcx's path applying the same rope and adapter; the 2x-window passkey prompt is
    read by adapter a1."""

    LONG_KEY = 71234

    @pytest.fixture(scope="class")
    @classmethod
    def long_prompt(cls, adapters, tok):
        """The 2x-window passkey prompt and lcx's answer to it with rope and a1 (``lora_server`` asks for it:
        computed before the server starts, as every test here computes its references: a server starting
        alongside stalls the references' two-thread forwards about as much as it overlaps them)."""
        ids = build_prompt_ids(tok, LONG, 0.5, cls.LONG_KEY)
        return ids, hf_tokens(ids, ["rope"], ROPE, adapter=adapters["a1"])

    @pytest.fixture(scope="class")
    @classmethod
    def lora_server(cls, adapters, long_prompt, tmp_path_factory):
        s = start_server(["--method", "rope", *ROPE_ARGS, *(f"--adapter={n}={p}" for n, p in adapters.items())],
                         tmp_path_factory.mktemp("lora"))
        yield s
        assert s.close() == 0

    def test_ready_line_names_the_method_and_the_adapters(self, lora_server):
        r = lora_server.ready
        # the adapters' own sidecars name smt (what `lcx train --method smt` writes); rope sets the length
        assert r["methods"] == ["rope", "smt"] and r["adapters"] == ["a1", "a2"] and r["max_model_len"] == 4 * WINDOW

    def test_each_request_is_answered_by_the_adapter_it_names(self, lora_server, adapters, tok):
        ids = tok("One, two, three, four, five, six,", return_tensors="pt")["input_ids"][0]
        got = {name: lora_server.complete(name, ids.tolist(), 16) for name in (MODEL, "a1", "a2")}
        want = {MODEL: hf_tokens(ids, ["rope"], ROPE, max_new_tokens=16),
                **{n: hf_tokens(ids, ["rope"], ROPE, adapter=p, max_new_tokens=16) for n, p in adapters.items()}}
        assert got == want
        assert len({tuple(t) for t in got.values()}) == 3  # the names do route to different adapters

    def test_base_model_requests_batched_with_adapter_requests_get_no_adapter(self, lora_server, adapters, tok):
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

    def test_rope_and_adapter_at_twice_the_window_equal_the_hf_path(self, lora_server, long_prompt, tok):
        ids, want = long_prompt
        got = lora_server.complete("a1", ids.tolist(), NEW)
        assert got == want
        assert str(self.LONG_KEY) in tok.decode(got)  # YaRN x4 finds the key at 16K: a real answer

    @pytest.mark.parametrize("order_seed", [0, 1, 2])
    def test_concurrent_requests_each_get_their_own_passkey(self, lora_server, tok, order_seed):
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

    def test_bad_requests_get_4xx_and_the_server_keeps_serving(self, lora_server, tok):
        status, out = lora_server.post("/v1/completions", {"model": MODEL, "prompt": [100] * (4 * WINDOW + 100),
                                                           "max_tokens": 4})
        assert status == 400 and "maximum context length" in json.dumps(out)
        status, out = lora_server.post("/v1/completions", {"model": "no-such-adapter", "prompt": "hi", "max_tokens": 4})
        assert status == 404 and "no-such-adapter" in out["error"]["message"]
        status, out = lora_server.post("/v1/completions", {"model": MODEL, "prompt": "hi", "max_tokens": -3})
        assert 400 <= status < 500, out
        # per-request lcx options (lcx.integrations.vllm_requests): malformed or not applicable -> 400
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


def test_vanilla_server_truncates_as_the_hf_path_does_at_twice_the_window(tmp_path_factory, tok):
    """`vanilla` is served by lcx's request middleware: the 2x-window prompt reaches vLLM cut to its start
    and end, the same tokens lcx's plan feeds the model; the key sits in the kept start, so it is found."""
    ids = build_prompt_ids(tok, LONG, 0.1, 52817)
    text = tok.decode(ids)
    text_ids = tok(text, return_tensors="pt")["input_ids"][0]

    want = hf_tokens(ids, ["vanilla"])
    # a text that tokenizes back to the same ids needs no second reference
    want_text = want if torch.equal(text_ids, ids) else hf_tokens(text_ids, ["vanilla"])
    s = start_server(["--method", "vanilla"], tmp_path_factory.mktemp("vanilla"))
    try:
        assert s.ready["methods"] == ["vanilla"]
        got = s.complete(MODEL, ids.tolist(), NEW)
        as_text = s.complete(MODEL, text, NEW)  # a text prompt is tokenized by the middleware, then cut
        status, out = s.post("/v1/completions", {"model": MODEL, "prompt": text, "max_tokens": WINDOW})
    finally:
        assert s.close() == 0
    assert got == want
    assert "52817" in tok.decode(got)
    assert as_text == want_text
    assert status == 400 and f"max_new_tokens={WINDOW} leaves no room in a window of {WINDOW}" in out["error"]["message"]


def test_streaming_server_equals_the_hf_path_and_keeps_concurrent_requests_apart(tmp_path_factory, tok):
    """`streaming` runs inside vLLM's attention (lcx.integrations.vllm_attention): at 2x the window the
    served tokens equal lcx's streaming path; 8 concurrent requests, shuffled, those of 1,500 tokens longer than
    sinks + window (each evicting its own keys), passkeys in their recent windows, each get their own key
    (the per-request state is keyed and reset per request).  A 1,024-token recent window (not the default
    ~7.7K) makes the 2x-window prompt cheaper on both sides, and the 1,500-token prompts evict."""
    opts = {"sinks": 4, "chunk": 512, "window": 1024}
    ids = build_prompt_ids(tok, LONG, 0.5, 60413)
    rng = random.Random(3)
    keys = rng.sample(range(10000, 99999), 8)
    jobs = [(build_prompt_ids(tok, rng.choice([600, 1500]), rng.uniform(0.55, 0.9), k).tolist(), k) for k in keys]
    rng.shuffle(jobs)
    want = hf_tokens(ids, ["streaming"], {"streaming": opts})
    s = start_server(["--method", "streaming", *(x for k, v in opts.items() for x in ("-o", f"streaming.{k}={v}")),
                      "--max-model-len", str(LONG + 64)], tmp_path_factory.mktemp("streaming"))
    try:
        assert s.ready["methods"] == ["streaming"]
        got = s.complete(MODEL, ids.tolist(), NEW)
        with ThreadPoolExecutor(len(jobs)) as pool:
            answers = list(pool.map(lambda j: tok.decode(s.complete(MODEL, j[0], NEW)), jobs))
    finally:
        assert s.close() == 0
    assert "lcx: streaming answers vLLM's attention" in s.log_path.read_text()  # not vLLM's own attention
    assert got == want
    evicting = [len(j) > opts["sinks"] + opts["window"] for j, _ in jobs]
    assert any(evicting) and not all(evicting)  # both kinds were sent
    for (_, key), text in zip(jobs, answers):
        assert str(key) in text and not any(str(k) in text for k in keys if k != key), (key, text)


def test_fot_server_with_a_document_memory_equals_the_hf_path_for_concurrent_requests(tmp_path_factory, tok):
    """`fot` inside vLLM's attention, reading a document memory built by `lcx memory build` (loaded once by
    the server) plus a kNN memory of its own per request: the 2x-window passkey prompt and 8 concurrent
    prompts (longer than the 512-token local window: their own memory is in use), shuffled, are each answered
    with the tokens `lcx generate --memory` gives that prompt alone: no request reads another's memory or
    writes the shared one; the questions about the documents are answered otherwise without the memory.
    The same server serves a LoRA adapter (vLLM's LoRA under lcx's memory attention, what a
    crossbatch-trained fot adapter needs): on a short prompt its answer equals `lcx generate --adapter
    --memory`, and differs from the bare model's (the 2x-window parity of adapters is the LoRA server's)."""
    from lcx.adapters.peft_bridge import random_adapter
    from lcx.models import load_model
    from click.testing import CliRunner

    from lcx.cli import main

    tmp = tmp_path_factory.mktemp("fot")
    opts = {"local": 512, "k": 16}
    # q/k LoRA at scale 0.2 (the smt-shaped adapters above, at 0.05, happen not to change these answers)
    lora = random_adapter(load_model(MODEL)[0], tmp / "lora", 1, scale=0.2)
    counting = tok("One, two, three, four, five, six,")["input_ids"]
    docs = []
    for name, key in (("a", 61728), ("b", 94051)):  # two documents, each with its own passkey
        docs.append(tmp / f"{name}.txt")
        docs[-1].write_text(tok.decode(build_prompt_ids(tok, 1500, 0.5, key)))
    r = CliRunner().invoke(main, ["memory", "build", "-m", MODEL, *(x for k, v in opts.items() for x in ("-o", f"{k}={v}")),
                                  "--out", str(tmp / "mem"), *map(str, docs)])
    assert r.exit_code == 0, r.output
    mem = tmp / "mem"
    ids = build_prompt_ids(tok, LONG, 0.5, 38127)
    rng = random.Random(4)
    jobs = [build_prompt_ids(tok, rng.choice([800, 1600]), rng.uniform(0.1, 0.9), k).tolist()
            for k in rng.sample(range(10000, 99999), 6)]
    question = tok("What is the pass key? The pass key is")["input_ids"]
    jobs += [question] * 2  # read from the documents
    rng.shuffle(jobs)

    fot = (["fot"], {"fot": opts})
    want = {"long": hf_tokens(ids, *fot, memory=mem),
            "short": {MODEL: hf_tokens(torch.tensor(counting), *fot, memory=mem, max_new_tokens=16),
                      "lora": hf_tokens(torch.tensor(counting), *fot, adapter=lora, memory=mem, max_new_tokens=16)},
            "jobs": [hf_tokens(torch.tensor(j), *fot, memory=mem) for j in jobs],
            "without memory": hf_tokens(torch.tensor(question), *fot)}
    s = start_server(["--method", "fot", *(x for k, v in opts.items() for x in ("-o", f"fot.{k}={v}")),
                      "--memory", str(mem), "--adapter", f"lora={lora}", "--max-model-len", str(LONG + 64)], tmp)
    try:
        got = s.complete(MODEL, ids.tolist(), NEW)
        short = {name: s.complete(name, counting, 16) for name in (MODEL, "lora")}
        with ThreadPoolExecutor(len(jobs)) as pool:
            answers = list(pool.map(lambda j: s.complete(MODEL, j, NEW), jobs))
    finally:
        assert s.close() == 0
    assert "lcx: fot answers vLLM's attention" in s.log_path.read_text()
    assert got == want["long"]
    assert short == want["short"]
    assert short["lora"] != short[MODEL]  # the adapter is applied
    assert sum(len(j) > opts["local"] for j in jobs) == 6  # their own memory is in use
    assert answers == want["jobs"]
    assert answers[jobs.index(question)] != want["without memory"]  # the memory was read


def test_focusllm_server_equals_the_hf_path_and_keeps_concurrent_requests_apart(tmp_path_factory, tok):
    """`focusllm` with its prompt's candidates (refresh=0): lcx's middleware computes them on lcx's own path
    and vLLM reads [placeholders ; local tokens] with the candidates' keys/values in the placeholders' stead
    (lcx.integrations.vllm_attention.FocusServed).  At 2x the window the served tokens equal `lcx generate
    --method focusllm -o focusllm.refresh=0`; 8 concurrent prompts, shuffled, each with its own key (one chunk
    of candidates, or short enough to be read as it is), get the tokens that prompt gets alone; every
    candidate file is gone after its request; a request over lcx's limits (the middleware reads the whole
    prompt) gets a 400 and the server serves on.
    A focusllm adapter (its candidate projections) is applied by the middleware: the name it is served under
    answers as `lcx generate --adapter` does, and otherwise than the base model."""
    from lcx.adapters.peft_bridge import random_adapter
    from lcx.models import load_model

    opts = {"refresh": 0}  # chunk 2048, local 2048, fragment 512
    focus = (["focusllm"], {"focusllm": opts})
    tmp = tmp_path_factory.mktemp("focusllm")
    lora = random_adapter(load_model(MODEL)[0], tmp / "cand", 2, scale=0.5, roles=("q", "k", "v", "o"),
                          methods=[{"name": "focusllm", "options": {}}])
    mid = build_prompt_ids(tok, 4500, 0.3, 51846)  # two chunks of candidates (2,048 + 404 tokens)
    ids = build_prompt_ids(tok, LONG, 0.95, 27094)  # the key among the local tokens: read, not summarised
    rng = random.Random(5)
    keys = rng.sample(range(10000, 99999), 8)
    jobs = [(build_prompt_ids(tok, rng.choice([1500, 3000]), 0.9, k).tolist(), k) for k in keys]  # 0 or 1 chunk
    rng.shuffle(jobs)

    want = {"adapted": {MODEL: hf_tokens(mid, *focus), "cand": hf_tokens(mid, *focus, adapter=lora)},
            "long": hf_tokens(ids, *focus), "jobs": [hf_tokens(torch.tensor(j), *focus) for j, _ in jobs]}
    s = start_server(["--method", "focusllm", *(x for k, v in opts.items() for x in ("-o", f"focusllm.{k}={v}")),
                      f"--adapter=cand={lora}"], tmp)
    try:
        assert s.ready["methods"] == ["focusllm"] and s.ready["adapters"] == ["cand"]
        adapted = {name: s.complete(name, mid.tolist(), NEW) for name in (MODEL, "cand")}
        got = s.complete(MODEL, ids.tolist(), NEW)
        with ThreadPoolExecutor(len(jobs)) as pool:
            answers = list(pool.map(lambda j: s.complete(MODEL, j[0], NEW), jobs))
        status, bad = s.post("/v1/completions", {"model": MODEL, "prompt": ids.tolist(), "max_tokens": WINDOW})
        # finished requests are released when they leave vLLM's batch, at its next step: one more request
        assert len(s.complete(MODEL, tok("One, two, three,")["input_ids"], 2)) == 2
        left = list((tmp / "export" / "request-state").glob("*.safetensors"))
    finally:
        assert s.close() == 0
    assert "lcx: focusllm answers vLLM's attention" in s.log_path.read_text()
    assert not left  # each request's candidate file was deleted with its state
    assert status == 400 and f"max_tokens={WINDOW:,} is over the limit" in bad["error"]["message"], bad
    assert got == want["long"]
    assert "27094" in tok.decode(got)
    assert answers == want["jobs"]
    texts = [tok.decode(a) for a in answers]
    assert not any(str(k) in text for (_, key), text in zip(jobs, texts) for k in keys if k != key)
    assert sum(str(key) in text for (_, key), text in zip(jobs, texts)) >= 4  # real answers (5 of 8 when written)
    assert adapted == want["adapted"]
    assert adapted["cand"] != adapted[MODEL]


def test_plain_vllm_serve_applies_the_sidecar_through_the_plugin(tmp_path, tok):
    """`vllm serve DIR --config-format lcx` (vLLM's own CLI, lcx only as its installed plugin) on the model's
    own files plus an lcx.json naming rope: it answers as lcx's rope method does, not as the bare model."""
    import socket
    import subprocess
    import sys
    import urllib.request

    from lcx.integrations.vllm import stop, wait_ready
    from lcx.models import resolve_model_path

    d = tmp_path / "model"
    d.mkdir()
    for f in resolve_model_path(MODEL).iterdir():
        (d / f.name).symlink_to(f.resolve())
    rope = ROPE["rope"]
    (d / "lcx.json").write_text(json.dumps({"methods": [{"name": "rope", "options": rope}]}))
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "2", "VLLM_CPU_NUM_OF_RESERVED_CPU": "0",
           "VLLM_ALLOW_LONG_MAX_MODEL_LEN": "1"}
    with open(tmp_path / "vllm.log", "w") as log:
        proc = subprocess.Popen([sys.executable, "-m", "lcx.integrations.vllm", "serve", str(d), "--config-format", "lcx",
                                 "--port", str(port), "--dtype", "float32", "--enforce-eager", "--served-model-name", "m",
                                 "--max-model-len", str(4 * WINDOW)],
                                env=env, stdout=log, stderr=log, start_new_session=True)
        try:
            wait_ready(f"http://127.0.0.1:{port}/v1/models", proc, 900)
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/models") as r:
                assert json.loads(r.read())["data"][0]["max_model_len"] == 4 * WINDOW
            # 1,000 tokens of lcx's own source: an open continuation, which YaRN's changes show in (the bare
            # model answers a short passkey prompt the same way)
            text = (Path(__file__).resolve().parents[1] / "sdk" / "composition.py").read_text()
            ids = tok(text, return_tensors="pt")["input_ids"][0, :1000]
            req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", headers={"content-type": "application/json"},
                                         data=json.dumps({"model": "m", "prompt": ids.tolist(), "max_tokens": NEW,
                                                          "temperature": 0, "return_token_ids": True}).encode())
            with urllib.request.urlopen(req, timeout=900) as r:
                got = json.loads(r.read())["choices"][0]["token_ids"]
        finally:
            stop(proc)
    assert got == hf_tokens(ids, ["rope"], ROPE)
    assert got != hf_tokens(ids)  # the bare model answers otherwise: the sidecar was applied
