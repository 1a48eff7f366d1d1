"""Per-request lcx options on the served API (`lcx.integrations.vllm.middleware`): refused with a 400
naming the fix when they cannot apply, stripped before vLLM when they restate the server's own.
An ASGI stand-in for vLLM's app keeps these tests fast; tests/serve/ checks the real server."""

from __future__ import annotations

import asyncio
import json
import os
from types import SimpleNamespace

import pytest

from lcx.adapters.peft_bridge import random_adapter
from lcx.integrations.vllm import middleware as vr
from lcx.integrations.vllm import Export, served_methods, vllm_command, vllm_env
from tests.conftest import tiny_model

SERVED = {"base": [{"name": "rope", "options": {"type": "yarn", "factor": 4.0}}],
          "a1": [{"name": "rope", "options": {"type": "yarn", "factor": 4.0}}, {"name": "smt", "options": {}}]}


def _call(body, method="POST", served=SERVED, monkeypatch=None, tokenizer=None, window=0, path="/v1/completions",
          model=None, app_status=200, headers=(), engine=None, middleware=None):
    """Run one request through the middleware; returns (status, JSON answer, what the app received or None).
    The app (vLLM's stand-in) answers ``app_status``."""
    got = {}

    async def app(scope, receive, send):
        body, more = b"", True
        while more:
            msg = await receive()
            body, more = body + msg["body"], msg.get("more_body", False)
        got["body"], got["headers"] = body, dict(scope["headers"])
        await send({"type": "http.response.start", "status": app_status, "headers": []})
        await send({"type": "http.response.body", "body": b"{}"})

    raw = body if isinstance(body, bytes) else json.dumps(body).encode()
    parts = [raw[:7], raw[7:]]  # a body in two messages, as servers deliver large ones
    messages = [{"type": "http.request", "body": p, "more_body": i == 0} for i, p in enumerate(parts)]

    async def receive():
        return messages.pop(0)

    sent = []

    async def send(message):
        sent.append(message)

    mw = middleware or vr.LcxRequestOptions(app)
    mw.app = app
    if middleware is None:
        mw.served, mw._tokenizer, mw.model = served, tokenizer, model or {"window": window}
    scope = {"type": "http", "method": method, "path": path,
             "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(raw)).encode()), *headers]}
    if engine is not None:  # vLLM's API server keeps its engine client on the app's state
        scope["app"] = SimpleNamespace(state=SimpleNamespace(engine_client=engine))
    asyncio.run(mw(scope, receive, send))
    status = sent[0]["status"]
    answer = json.loads(sent[1]["body"] or b"{}")
    return status, answer, got or None


def test_requests_without_lcx_options_pass_unchanged():
    body = {"model": "base", "prompt": "hi", "max_tokens": 3}
    status, _, got = _call(body)
    assert status == 200 and json.loads(got["body"]) == body
    assert _call(b"not json at all")[2]["body"] == b"not json at all"  # vLLM answers malformed JSON itself


def test_restating_the_servers_options_is_accepted_and_stripped_before_vllm():
    status, _, got = _call({"model": "a1", "prompt": "hi", "lcx": {"rope": {"factor": "4"}, "smt": {}}})
    assert status == 200
    assert _call({"model": "a1", "prompt": "hi", "lcx": {"rope": {"factor": 4}}})[0] == 200  # a JSON int
    assert json.loads(got["body"]) == {"model": "a1", "prompt": "hi"}
    assert got["headers"][b"content-length"] == str(len(got["body"])).encode()


@pytest.mark.parametrize("model, lcx, needle", [
    ("base", "rope", "'lcx' must map method names to their options"),
    ("base", {"rope": [1]}, "'lcx' must map method names to their options"),
    ("base", {"ropey": {}}, "unknown method 'ropey'; known: "),
    ("base", {"rope": {"factr": 4}}, "unknown option 'factr' for method 'rope'"),
    ("base", {"rope": {"factor": "four"}}, "rope"),
    ("base", {"smt": {}}, "model 'base' applies rope; options for 'smt' cannot apply to it"),
    ("base", {"rope": {"factor": 8}}, "rope.factor=8.0 differs from the server's rope.factor=4.0; rope's options are "
                                      "fixed when the server starts (start one with -o rope.factor=8.0,"),
    ("a1", {"smt": {"beta": 0}}, "smt.beta=0.0 differs from the server's smt.beta=1.0"),
    ("base", {"vanilla": {"window": 2.5}}, "option window=2.5 of method 'vanilla' must be a whole number"),
])
def test_options_that_cannot_apply_get_a_400_naming_the_fix(model, lcx, needle):
    status, answer, got = _call({"model": model, "prompt": "hi", "lcx": lcx})
    assert status == 400 and got is None  # vLLM never sees the request
    assert needle in answer["error"]["message"] and answer["error"]["param"] == "lcx"


def test_without_the_served_table_form_and_values_are_still_checked():
    assert _call({"model": "x", "lcx": {"rope": {"factor": 8}}}, served=None)[0] == 200
    assert _call({"model": "x", "lcx": {"rope": {"factr": 8}}}, served=None)[0] == 400


def test_get_requests_pass_untouched():
    status, _, got = _call({"lcx": "anything"}, method="GET")
    assert status == 200 and json.loads(got["body"]) == {"lcx": "anything"}


def test_lcx_serve_installs_the_check_with_each_served_names_methods(tmp_path):
    adapter = random_adapter(tiny_model("llama"), tmp_path / "a1", seed=1)  # an smt adapter
    exp = Export(out=tmp_path, model_dir=tmp_path / "model", adapters={"a1": adapter},
                 methods=[{"name": "rope", "options": {"type": "yarn", "factor": 4.0}}, {"name": "smt", "options": {}}])
    table = served_methods(exp, "base")
    assert [m["name"] for m in table["base"]] == ["rope"] and [m["name"] for m in table["a1"]] == ["rope", "smt"]
    assert json.loads(vllm_env(exp, 1.0, "base")[vr.SERVED_ENV]) == table
    cmd = vllm_command(exp, "127.0.0.1", 8000, "base", "float32", None)
    assert cmd[cmd.index("--middleware") + 1] == vr.MIDDLEWARE
    mod, name = vr.MIDDLEWARE.rsplit(".", 1)  # the path vLLM imports
    assert getattr(__import__(mod, fromlist=[name]), name) is vr.LcxRequestOptions


# ---------------------------------------------------------------------- prompt methods (vanilla) in the middleware
class _Chars:
    """A stand-in tokenizer: one token per character, a BOS of 1 when special tokens are added."""

    def encode(self, text, add_special_tokens=True):
        return ([1] if add_special_tokens else []) + [ord(c) for c in text]


VANILLA = {"v": [{"name": "vanilla", "options": {"window": 12, "head_fraction": 0.5}}], "plain": []}


@pytest.mark.parametrize("n, new, head_fraction", [(5, 2, 0.5), (40, 3, 0.5), (41, 1, 0.25), (33, 4, 1.0), (30, 5, 0.0)])
def test_served_truncation_is_the_tokens_the_hf_plan_feeds(n, new, head_fraction):
    import torch

    from lcx.registry import registry

    m = registry().get("vanilla").from_options(head_fraction=head_fraction)
    ids = torch.arange(100, 100 + n)[None]
    plan = m.lcx_plan(run=type("Run", (), {"window": 16})(), input_ids=ids, attention_mask=torch.ones_like(ids),
                      max_new_tokens=new)
    assert m.serve_prompt(ids[0].tolist(), new, 16) == plan.input_ids[0].tolist()
    assert len(m.serve_prompt(ids[0].tolist(), new, 16)) == min(n, 16 - new)


def test_completion_prompts_of_a_vanilla_model_are_truncated_before_vllm():
    text = "abcdefghijklmnopqrstuvwxyz"
    status, _, got = _call({"model": "v", "prompt": text, "max_tokens": 2}, served=VANILLA, tokenizer=_Chars())
    ids = [1] + [ord(c) for c in text]  # 27 tokens, a window of 12 - 2 new: 5 from the start, 5 from the end
    assert status == 200 and json.loads(got["body"])["prompt"] == ids[:5] + ids[-5:]
    assert got["headers"][b"content-length"] == str(len(got["body"])).encode()
    # batches, token prompts, add_special_tokens and vLLM's default max_tokens (16 > window 12 - prompt)
    body = {"model": "v", "prompt": [text, list(range(200, 220)), "short"], "max_tokens": 4, "add_special_tokens": False}
    out = json.loads(_call(body, served=VANILLA, tokenizer=_Chars())[2]["body"])["prompt"]
    assert out == [[ord(c) for c in "abcd"] + [ord(c) for c in "wxyz"], [*range(200, 204), *range(216, 220)], "short"]
    status, answer, got = _call({"model": "v", "prompt": text}, served=VANILLA, tokenizer=_Chars())
    assert status == 400 and got is None and "max_new_tokens=16 leaves no room in a window of 12 (vanilla keeps" in answer["error"]["message"]


def test_prompts_that_fit_other_models_and_chat_pass_unchanged():
    for body, path in [({"model": "v", "prompt": "short", "max_tokens": 2}, "/v1/completions"),
                       ({"model": "plain", "prompt": "x" * 50, "max_tokens": 2}, "/v1/completions"),
                       ({"model": "v", "messages": [{"role": "user", "content": "x" * 50}]}, "/v1/chat/completions")]:
        status, _, got = _call(body, served=VANILLA, tokenizer=_Chars(), path=path)
        assert status == 200 and json.loads(got["body"]) == body


@pytest.mark.parametrize("fields", [{"max_tokens": -1}, {"max_tokens": "2"}, {"max_tokens": 2.0}, {"max_tokens": True},
                                    {"prompt": [1.0, 2.0]}, {"prompt": []}, {"add_special_tokens": "false"}])
def test_a_request_the_rewrite_cannot_read_is_refused_not_passed_on(fields):
    """vLLM's own parsing accepts max_tokens "2", 2.0 or true, token ids 2.0 and add_special_tokens "false": such a
    request passed the middleware unread and reached the engine without the method's rewrite (a long prompt
    untruncated, focusllm's without its candidates).  Now a 400 saying what the rewrite needs."""
    body = {"model": "v", "prompt": "x" * 50, "max_tokens": 2, **fields}
    status, answer, got = _call(body, served=VANILLA, tokenizer=_Chars())
    assert status == 400 and got is None
    assert "vanilla rewrites each prompt before vLLM reads it" in answer["error"]["message"]


def test_vanilla_applies_to_every_served_name_when_named_and_to_its_adapter_when_trained_with(tmp_path):
    a1 = random_adapter(tiny_model("llama"), tmp_path / "a1", seed=1)  # an smt adapter
    a2 = random_adapter(tiny_model("llama"), tmp_path / "a2", seed=2, methods=[{"name": "vanilla", "options": {}}])
    vanilla = {"name": "vanilla", "options": {"head_fraction": 0.5, "window": 0}}
    exp = Export(out=tmp_path, model_dir=tmp_path / "model", adapters={"a1": a1, "a2": a2}, window=64,
                 methods=[vanilla, {"name": "smt", "options": {}}], named=["vanilla"])
    table = served_methods(exp, "base")
    assert {k: [m["name"] for m in v] for k, v in table.items()} == {"base": ["vanilla"], "a1": ["vanilla", "smt"],
                                                                     "a2": ["vanilla"]}
    exp.named = []
    table = served_methods(exp, "base")
    assert {k: [m["name"] for m in v] for k, v in table.items()} == {"base": [], "a1": ["smt"], "a2": ["vanilla"]}
    assert json.loads(vllm_env(exp, 1.0, "base")[vr.MODEL_ENV]) == {"tokenizer": str(tmp_path / "model"), "window": 64,
                                                                   "attention": None, "memory": None, "spool": None}


FOCUS = {"chunk": 16, "local": 24, "fragment": 8, "refresh": 0}  # tiny llama: window 128


def _focus_server(tmp_path):
    """A tiny focusllm server's middleware: (call(body, **kw), its spool folder, a 91-character prompt, the served
    table, the model entry)."""
    model = tiny_model("llama")
    model.save_pretrained(tmp_path / "model")
    spool = tmp_path / "spool"
    spool.mkdir()
    served = {"f": [{"name": "focusllm", "options": FOCUS}]}
    where = {"tokenizer": str(tmp_path / "model"), "window": 128, "spool": str(spool)}
    text = "".join(chr(ord("a") + i % 26) for i in range(90))
    return (lambda body, **kw: _call(body, served=served, tokenizer=_Chars(), model=where, **kw)), spool, text, served, where


def test_focusllm_prompts_reach_vllm_as_placeholders_and_local_tokens_with_spooled_candidates(tmp_path, monkeypatch):
    """The middleware computes a long prompt's candidates on lcx's own path (what `serve_request` returns:
    the served attention's test checks those against `lcx generate`), spools them under a random id and
    hands vLLM the rewritten ids with that id in vllm_xargs; a short prompt passes as it is; a request
    that names a state itself, or sends several prompts, gets a 400 and leaves nothing in the spool."""
    import torch
    from safetensors.torch import load_file

    import lcx

    call, spool, text, served, where = _focus_server(tmp_path)
    status, _, got = call({"model": "f", "prompt": text, "max_tokens": 4, "vllm_xargs": {"other": 1}})
    sent = json.loads(got["body"])
    assert status == 200 and sent["vllm_xargs"]["other"] == 1
    state = sent["vllm_xargs"][vr.STATE_ARG]
    assert [p.name for p in spool.iterdir()] == [f"{state}.safetensors"]
    with lcx.attach(tiny_model("llama"), ["focusllm"], focusllm=FOCUS) as run:
        ids, tensors = run.method("focusllm").serve_request(run, _Chars().encode(text), 4)
    assert sent["prompt"] == ids and len(ids) == 5 + FOCUS["local"]  # 91 tokens: 67 in memory, 5 chunks
    spooled = load_file(str(spool / f"{state}.safetensors"))
    assert spooled.keys() == tensors.keys() and all(torch.equal(spooled[k], tensors[k]) for k in tensors)
    status, _, got = call({"model": "f", "prompt": "short", "max_tokens": 4})
    assert status == 200 and json.loads(got["body"]) == {"model": "f", "prompt": "short", "max_tokens": 4}
    for body, needle in (({"model": "f", "prompt": "hi", "vllm_xargs": {vr.STATE_ARG: "0" * 32}}, "set by lcx's middleware"),
                         ({"model": "f", "prompt": "hi", "vllm_xargs": {vr.CHUNK_ARG: "0" * 32 + "-0"}}, "lcx_chunk is set by"),
                         ({"model": "f", "prompt": [text, text]}, "serves one prompt per request"),
                         ({"model": "f", "prompt": text, "max_tokens": 120}, "exceed the model's window")):
        status, answer, got = call(body)
        assert status == 400 and needle in answer["error"]["message"] and got is None, answer
    monkeypatch.setenv("LCX_MAX_INPUT_TOKENS", "80")  # lcx's limits hold: the middleware reads the whole prompt
    status, answer, got = call({"model": "f", "prompt": text, "max_tokens": 4})
    assert status == 400 and "the prompt has 91 tokens, over the limit of 80" in answer["error"]["message"]
    monkeypatch.delenv("LCX_MAX_INPUT_TOKENS")
    assert len(list(spool.iterdir())) == 1
    # vLLM refuses a rewritten request (say, a sampling parameter it rejects): its candidates are not left behind
    status, _, got = _call({"model": "f", "prompt": text, "max_tokens": 4}, served=served, tokenizer=_Chars(),
                           model=where, app_status=400)
    assert status == 400 and vr.STATE_ARG in json.loads(got["body"])["vllm_xargs"] and len(list(spool.iterdir())) == 1
    # a served name mapped to a focusllm adapter: the candidates are the adapter's (they differ from the base's)
    lora = random_adapter(tiny_model("llama"), tmp_path / "cand", seed=3, methods=[{"name": "focusllm", "options": {}}],
                          scale=0.5)
    served["cand"] = [{"name": "focusllm", "options": FOCUS, "adapter": str(lora)}]
    status, _, got = call({"model": "cand", "prompt": text, "max_tokens": 4})
    state = json.loads(got["body"])["vllm_xargs"][vr.STATE_ARG]
    from lcx.session import open_session

    session = open_session(str(tmp_path / "model"), ["focusllm"], {"focusllm": FOCUS}, lora, require_tokenizer=False)
    try:
        _, adapted = session.run.method("focusllm").serve_request(session.run, _Chars().encode(text), 4)
    finally:
        session.close()
    spooled = load_file(str(spool / f"{state}.safetensors"))
    assert all(torch.equal(spooled[k], adapted[k]) for k in adapted)
    assert not all(torch.equal(adapted[k], tensors[k]) for k in tensors)


class _ChunkEngine:
    """vLLM's engine client as lcx's KV connector leaves it for a chunk request: its last prompt position's
    keys/values per layer in the request's chunk file, here computed by a Hugging Face forward of the row."""

    def __init__(self, model, spool, save=True, fail=None, max_model_len=128):
        self.model, self.spool, self.save, self.fail, self.rows, self.salts = model, spool, save, fail, [], []
        self.model_config = SimpleNamespace(max_model_len=max_model_len)

    async def generate(self, prompt, params, request_id):
        import time

        import torch
        from safetensors.torch import save_file

        assert params.max_tokens == 1 and request_id.startswith("lcx-chunk-")
        self.rows.append(prompt["prompt_token_ids"])
        self.salts.append(prompt.get("cache_salt"))
        k = len(self.rows)
        if k == self.fail:
            raise ValueError("this row is longer than the maximum model length")

        def run():  # in another thread, as the engine runs in another process
            if self.fail:  # later rows end after the failed one: their files must not be left behind
                time.sleep(0.1 * k)
            if self.save:
                with torch.no_grad():
                    cache = self.model(input_ids=torch.tensor([prompt["prompt_token_ids"]]), use_cache=True).past_key_values
                save_file({f"{i}.{p}": t[0, :, -1].contiguous() for i, l in enumerate(cache.layers)
                           for p, t in (("k", l.keys), ("v", l.values))},
                          str(vr.chunk_file(self.spool, params.extra_args[vr.CHUNK_ARG])))

        await asyncio.to_thread(run)
        yield SimpleNamespace(finished=True)


def test_focusllm_chunk_forwards_run_on_the_engine_unless_an_adapter_needs_lcxs(tmp_path):
    """On vLLM's server the middleware hands each chunk's [chunk ; fragment] to the engine (lcx's KV connector
    saves its last position): the spooled candidates equal lcx's own, the chunk files are gone; a name served
    with a focusllm adapter computes them on lcx's path (the adapter is open at one position only); a row the
    engine refuses is a 400 that leaves no chunk file behind; rows over the engine's --max-model-len are computed on
    lcx's path; when the connector saved nothing (a cache it cannot read) the request is answered from lcx's own
    forwards, and so are the later ones."""
    import torch
    from safetensors.torch import load_file

    import lcx

    call, spool, text, served, where = _focus_server(tmp_path)
    engine = _ChunkEngine(tiny_model("llama").eval(), spool)
    status, _, got = call({"model": "f", "prompt": text, "max_tokens": 4}, engine=engine)
    sent = json.loads(got["body"])
    with lcx.attach(tiny_model("llama"), ["focusllm"], focusllm=FOCUS) as run:
        ids, tensors = run.method("focusllm").serve_request(run, _Chars().encode(text), 4)
    memory = _Chars().encode(text)[:-FOCUS["local"]]
    assert status == 200 and sent["prompt"] == ids and len(engine.rows) == 5
    assert engine.rows[0] == memory[:16] + _Chars().encode(text)[-FOCUS["fragment"]:]  # [chunk ; fragment]
    state = sent["vllm_xargs"][vr.STATE_ARG]
    assert [p.name for p in spool.iterdir()] == [f"{state}.safetensors"]  # the chunk files were read and deleted
    # vLLM's prefix cache: the chunk rows (plain prompts) may share blocks, the placeholders (the same ids in
    # every request, each request's own candidates) never do; a client's salt keeps its chunk rows its own
    assert sent["cache_salt"] == f"lcx-{state}" and engine.salts == [None] * 5
    status, _, got = call({"model": "f", "prompt": text, "max_tokens": 4, "cache_salt": "tenant-a"}, engine=engine)
    again = json.loads(got["body"])
    assert status == 200 and engine.salts[5:] == ["tenant-a"] * 5
    assert again["cache_salt"] == f"lcx-{again['vllm_xargs'][vr.STATE_ARG]}" != sent["cache_salt"]
    vr.state_file(spool, again["vllm_xargs"][vr.STATE_ARG]).unlink()
    del engine.rows[5:]
    spooled = load_file(str(spool / f"{state}.safetensors"))
    assert spooled.keys() == tensors.keys()
    assert all(torch.allclose(spooled[k], tensors[k], atol=1e-5) for k in tensors)

    lora = random_adapter(tiny_model("llama"), tmp_path / "cand", seed=3, methods=[{"name": "focusllm", "options": {}}],
                          scale=0.5)
    served["cand"] = [{"name": "focusllm", "options": FOCUS, "adapter": str(lora)}]
    assert call({"model": "cand", "prompt": text, "max_tokens": 4}, engine=engine)[0] == 200
    assert len(engine.rows) == 5  # not the engine's: lcx's own forwards

    status, answer, _ = call({"model": "f", "prompt": text, "max_tokens": 4},
                             engine=_ChunkEngine(tiny_model("llama").eval(), spool, fail=2))
    assert status == 400 and "engine failed focusllm's chunk forward: ValueError: this row" in answer["error"]["message"]
    assert len(list(spool.iterdir())) == 2 and not list(spool.glob("*.chunk.*"))  # the two spooled states only

    short = _ChunkEngine(None, spool, max_model_len=20)  # vLLM would refuse the 24-token rows: lcx computes them
    status, _, got = call({"model": "f", "prompt": text, "max_tokens": 4}, engine=short)
    spooled = load_file(str(spool / f"{json.loads(got['body'])['vllm_xargs'][vr.STATE_ARG]}.safetensors"))
    assert status == 200 and not short.rows and all(torch.equal(spooled[k], tensors[k]) for k in tensors)

    mw = vr.LcxRequestOptions(None)  # one middleware for two requests: the fallback is remembered
    mw.served, mw._tokenizer, mw.model = served, _Chars(), where
    silent = _ChunkEngine(None, spool, save=False)
    for _ in range(2):
        status, _, got = call({"model": "f", "prompt": text, "max_tokens": 4}, engine=silent, middleware=mw)
        state = json.loads(got["body"])["vllm_xargs"][vr.STATE_ARG]
        spooled = load_file(str(spool / f"{state}.safetensors"))
        assert status == 200 and all(torch.allclose(spooled[k], tensors[k], atol=1e-5) for k in tensors)
    assert len(silent.rows) == 5 and not mw.states().engine_saves  # the second request did not ask the engine


def test_focusllm_requests_that_would_break_the_engine_or_share_a_state_get_a_400(tmp_path):
    """A request whose candidates the middleware computes: a forged state id is refused on every path however
    its JSON spells the key (the worker would fail inside the engine's forward); n > 1, beam search and prompt
    truncation (several sequences sharing, or cutting, one state) and token ids outside the vocabulary (lcx's
    forward would fail: a 500) are refused before any forward; a one-element prompt list is one prompt; the
    limits' message names the request's max_tokens and the server's environment.  Nothing is spooled."""
    call, spool, text, *_ = _focus_server(tmp_path)
    forged = ('{"model": "f", "messages": [{"role": "user", "content": "hi"}], "vllm_xargs": {"lcx\\u005fstate": "'
              + "0" * 32 + '"}}').encode()
    assert vr.STATE_ARG.encode() not in forged and json.loads(forged)["vllm_xargs"] == {vr.STATE_ARG: "0" * 32}
    status, answer, got = call(forged, path="/v1/chat/completions")
    assert status == 400 and "set by lcx's middleware" in answer["error"]["message"] and got is None
    for extra, needle in (({"n": 2}, "n=2 is not supported"), ({"best_of": 3}, "best_of=3"),
                          ({"use_beam_search": True}, "use_beam_search=true"),
                          ({"truncate_prompt_tokens": 50}, "truncate_prompt_tokens=50"),
                          ({"prompt_logprobs": 1}, "prompt_logprobs is not supported"),
                          ({"prompt": [5] * 60 + [10 ** 6]}, "token id 1000000 is outside the model's vocabulary"),
                          ({"prompt": [-1] + [5] * 60}, "token id -1 is outside"),
                          ({"max_tokens": 9}, "max_tokens=9 is over the limit of 8 per request; raise it with the "
                                              "server's LCX_MAX_NEW_TOKENS")):
        os.environ["LCX_MAX_NEW_TOKENS"] = "8"
        try:
            status, answer, got = call({"model": "f", "prompt": text, "max_tokens": 4, **extra})
        finally:
            del os.environ["LCX_MAX_NEW_TOKENS"]
        assert status == 400 and needle in answer["error"]["message"] and got is None, (extra, answer)
    assert not list(spool.iterdir())
    for fine in ({"n": 1}, {"best_of": 1}, {"use_beam_search": False}, {"truncate_prompt_tokens": None}):
        status, _, got = call({"model": "f", "prompt": text, "max_tokens": 4, **fine})
        assert status == 200 and vr.STATE_ARG in json.loads(got["body"])["vllm_xargs"], fine
    status, _, got = call({"model": "f", "prompt": [text], "max_tokens": 4})
    sent = json.loads(got["body"])
    assert status == 200 and isinstance(sent["prompt"][0], int) and vr.STATE_ARG in sent["vllm_xargs"]


def test_requests_vllm_will_refuse_for_their_api_key_pass_through_untouched(tmp_path, monkeypatch):
    """lcx's middleware runs before vLLM's API-key check: with keys set (`lcx serve ... -- --api-key K`, or
    VLLM_API_KEY), a request without the key reaches vLLM as it came (which answers 401): no forward pass, no
    state, no 400 describing the server's methods; with the key it is served as usual."""
    call, spool, text, *_ = _focus_server(tmp_path)
    body = {"model": "f", "prompt": text, "max_tokens": 4, "lcx": {"rope": {}}}
    monkeypatch.setenv(vr.API_KEYS_ENV, json.dumps(["k1", "k2"]))
    status, _, got = call(body)
    assert status == 200 and json.loads(got["body"]) == body and not list(spool.iterdir())  # vLLM's to refuse
    status, answer, got = call(body, headers=[(b"authorization", b"Bearer k2")])
    assert status == 400 and "model 'f' applies focusllm" in answer["error"]["message"]
    monkeypatch.setenv(vr.API_KEYS_ENV, "[]")
    monkeypatch.setenv("VLLM_API_KEY", "k3")
    assert json.loads(call(body)[2]["body"]) == body
    status, _, got = call({"model": "f", "prompt": text, "max_tokens": 4}, headers=[(b"authorization", b"Bearer k3")])
    assert status == 200 and vr.STATE_ARG in json.loads(got["body"])["vllm_xargs"]


def test_lcx_serve_passes_its_api_keys_and_kv_cache_size_to_the_server(tmp_path, monkeypatch):
    from lcx.integrations.vllm import api_keys, kv_cache_args

    assert api_keys(["--api-key", "a", "b", "--port", "1", "--api-key=c"]) == ["a", "b", "c"]
    exp = Export(out=tmp_path, model_dir=tmp_path / "model")
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "7")
    assert vllm_env(exp)["VLLM_CPU_KVCACHE_SPACE"] == "7"  # no --kv-cache-gib: the exported value
    # --kv-cache-gib wins, as vLLM's flag in bytes: vLLM reads the variable as whole GiB (int("1.5") stops it)
    assert "VLLM_CPU_KVCACHE_SPACE" not in vllm_env(exp, 1.5)
    assert kv_cache_args(1.5) == ["--kv-cache-memory-bytes", str(3 * 2**29)] and kv_cache_args(None) == []
    monkeypatch.delenv("VLLM_CPU_KVCACHE_SPACE")
    env = vllm_env(exp, None, "lcx", ("--api-key", "s3"))
    assert env["VLLM_CPU_KVCACHE_SPACE"] == "2" and json.loads(env[vr.API_KEYS_ENV]) == ["s3"]


def test_a_state_file_left_after_its_exchange_is_deleted_after_a_grace(tmp_path, monkeypatch):
    """The client may leave before vLLM schedules its request (vLLM aborts it): the worker then never reads nor
    deletes the candidates.  Every request that spooled a state schedules its file's deletion when its HTTP
    exchange ends, STATE_GRACE_S later (the worker has read it by then, or never will)."""
    call, spool, text, *_ = _focus_server(tmp_path)
    later = []
    monkeypatch.setattr(vr, "_unlink_later", later.append)
    status, _, got = call({"model": "f", "prompt": text, "max_tokens": 4})
    state = json.loads(got["body"])["vllm_xargs"][vr.STATE_ARG]
    assert status == 200 and later == [spool / f"{state}.safetensors"] and later[0].exists()
    monkeypatch.undo()

    async def run():
        monkeypatch.setattr(vr, "STATE_GRACE_S", 0.05)
        vr._unlink_later(later[0])
        assert later[0].exists()
        await asyncio.sleep(0.2)

    asyncio.run(run())
    assert not later[0].exists()


def test_bodies_that_crashed_the_middleware_are_answered_4xx_or_passed_to_vllm():
    """A non-string model (a TypeError on every vanilla completion), an integer option of nan or 1e400 (int() of
    them raised), JSON nested past Python's recursion limit: each was a 500 from the middleware."""
    status, answer, got = _call({"model": ["v"], "prompt": "x", "max_tokens": 2}, served=VANILLA, tokenizer=_Chars())
    assert status == 400 and got is None and "'model' must be the name of a served model" in answer["error"]["message"]
    assert answer["error"]["param"] == "model"
    for value in (b"NaN", b"1e400"):
        raw = b'{"model": "m", "prompt": "x", "lcx": {"fot": {"local": ' + value + b"}}}"
        status, answer, got = _call(raw)
        assert status == 400 and got is None and "must be a finite number" in answer["error"]["message"], value
    deep = b'{"model": "m", "lcx": ' + b"[" * 100000 + b"]" * 100000 + b"}"
    status, _, got = _call(deep)
    assert status == 200 and got["body"] == deep  # not JSON Python can read: vLLM answers it


@pytest.mark.parametrize("engine", [False, True])
def test_state_requests_that_arrive_together_reach_vllm_together(tmp_path, engine):
    """The middleware computes state requests one at a time; each is held until the ones that arrived before
    it finished are computed too, so vLLM does not run forwards beside the middleware's while a burst is being
    computed (BENCHMARKS.md, focusllm: 80.5 -> 57.7 s for 8 requests).  A request for another model is not held,
    and one that arrives after a burst was released does not hold it back.  When vLLM's engine runs the
    forwards (``RequestStates.uses_engine``) nothing is held: the engine shares the CPU with no one."""
    import threading
    import time
    import uuid

    events: list[tuple[str, str]] = []
    lock = threading.Lock()

    async def app(scope, receive, send):
        body, more = b"", True
        while more:
            msg = await receive()
            body, more = body + msg["body"], msg.get("more_body", False)
        events.append(("vllm", json.loads(body)["prompt"]))
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"{}"})

    mw = vr.LcxRequestOptions(app)
    mw.served, mw.model = {"f": [], "base": []}, {"spool": str(tmp_path)}
    mw._stateful, mw._prompt_methods = {"f": {"name": "focusllm", "options": {"refresh": 0}}}, {}

    def rewrite(data, engine=None):  # stands in for RequestStates.rewrite: one request at a time, 0.2 s each
        if data["model"] != "f":
            return False
        with lock:
            time.sleep(0.2)
            events.append(("computed", data["prompt"]))
        data["vllm_xargs"] = {vr.STATE_ARG: uuid.uuid4().hex}
        return True

    mw._rewrite = rewrite

    async def one(prompt, model="f", delay=0.0):
        await asyncio.sleep(delay)
        raw = json.dumps({"model": model, "prompt": prompt}).encode()
        messages = [{"type": "http.request", "body": raw, "more_body": False}]
        sent = []

        async def receive():
            return messages.pop(0)

        async def send(message):
            sent.append(message)

        scope = {"type": "http", "method": "POST", "path": "/v1/completions",
                 "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(raw)).encode())]}
        if engine:
            scope["app"] = SimpleNamespace(state=SimpleNamespace(engine_client=object()))
        await mw(scope, receive, send)
        assert sent[0]["status"] == 200

    async def burst():
        await asyncio.gather(one("a"), one("b"), one("c"), one("plain", model="base", delay=0.1), one("late", delay=0.7))

    asyncio.run(burst())
    order = events
    first_three = {("computed", p) for p in "abc"}
    burst_done = max(order.index(e) for e in first_three)
    assert order.index(("vllm", "plain")) < burst_done  # not a state request: never held
    if engine:  # the first reaches vLLM before the last is computed
        first = next(p for kind, p in order if kind == "computed")
        assert order.index(("vllm", first)) < burst_done, order
    for p in "abc" if not engine else "":  # each of the burst reaches vLLM after all three are computed
        assert order.index(("vllm", p)) > burst_done, order
    assert order.index(("vllm", "late")) > order.index(("computed", "late"))
    assert not mw._open
