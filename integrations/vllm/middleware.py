"""Per-request lcx options on the vLLM server: checked, and refused with a 400 when they cannot apply.

A request may carry lcx options next to the OpenAI fields (``extra_body={"lcx": {...}}`` with the
OpenAI client)::

    {"model": "a1", "prompt": "...", "lcx": {"rope": {"factor": 4}}}

Every method vLLM serves today changes the model or its adapter (``rope``: config.json, ``smt``: a
LoRA adapter), so its options are fixed when the server starts: a request may restate them (an
assertion that it talks to the server it expects), never change them.  Without this check vLLM
would drop the unknown field with a log warning, and a user asking for ``rope.factor=8`` would be
answered with factor 4 in silence.  Refused with 400 and a message naming the fix:

- ``lcx`` that is not ``{"method": {"option": value}}``;
- a method lcx does not know, an option the method does not have, a value of the wrong type;
- a method the requested model does not apply (e.g. ``smt`` options for the base model);
- a value different from the one the server applies.

Accepted options are removed from the body before vLLM reads it.  ``lcx serve`` installs the check
through vLLM's ``--middleware`` (an ASGI middleware class, no vLLM code patched) and tells it which
methods each served model name applies (environment variable ``LCX_SERVED_METHODS``, JSON
``{"name": [{"name": method, "options": {...}}]}``); without that variable, only the form, the
method names and the option values are checked.

The same middleware serves the methods that only rewrite the prompt (``Method.serving == "prompt"``:
``vanilla`` keeps the start and the end of a prompt longer than the window): for a model name that
applies one, each ``/v1/completions`` prompt is tokenized with the model's tokenizer (``add_special_tokens``
as the request says, vLLM's default otherwise), passed through the method's ``serve_prompt`` with the
request's ``max_tokens`` (vLLM's default 16 when absent), and handed to vLLM as token ids when it
changed — the tokens lcx's own path feeds the model.  Chat requests are served as they come (vLLM
refuses one past its length limit with a 400): truncating a templated conversation would cut its
turns in the middle.  ``LCX_SERVED_MODEL`` (JSON ``{"tokenizer": dir, "window": n}``) says where the
tokenizer is and the model's trained window.

Served attention methods that need a forward pass over the whole prompt first (``Method.serve_state``:
``focusllm``'s candidate tokens, one per memory chunk) get it here too: the middleware keeps the model on
lcx's own path (loaded on the first such request, one request at a time), and for each ``/v1/completions``
prompt runs the method's ``serve_request`` (a method served through lcx's KV connector without an adapter has
its forwards run by vLLM's engine: ``engine_forward``), writes the tensors it returns to the server's spool folder
(``LCX_SERVED_MODEL``'s ``spool``) under a random id, and hands vLLM the rewritten token ids with that id in
``vllm_xargs`` (``lcx_state``), which the served attention reads (``lcx.integrations.vllm.attention``) and
deletes when the request ends (here when vLLM refuses the rewritten request).  The whole prompt is read here,
so lcx's own request limits apply (``lcx.limits``: prompt tokens, RAM).  A request that sets ``lcx_state``
itself is refused (on such a server every JSON body is decoded to check it, whatever the path or the key's
spelling: the worker cannot answer a forged id but by failing the engine's forward).  One prompt per request:
a list of prompts gets a 400, and so do ``n`` > 1, ``best_of``, beam search and ``truncate_prompt_tokens``
(sequences sharing one state, or prompts cut after their placeholders were counted) and token ids outside
the vocabulary.  A state file that outlives its HTTP exchange (the client left before vLLM scheduled the
request) is deleted ``STATE_GRACE_S`` later.  Chat requests are read as they come.

vLLM checks API keys (``--api-key``, ``VLLM_API_KEY``) after this middleware; a request that check will refuse
passes through it untouched (``LcxRequestOptions.authorized``), so that it costs no forward pass here.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import os
import re
import sys
import threading
import uuid
from pathlib import Path
from typing import Any

from lcx.errors import LcxError

SERVED_ENV = "LCX_SERVED_METHODS"
MODEL_ENV = "LCX_SERVED_MODEL"
#: vLLM's ``max_tokens`` for a completion request that does not say.
DEFAULT_MAX_TOKENS = 16
FIELD = "lcx"
#: The request ``extra_args`` key that carries a request's state id (``lcx.integrations.vllm.attention``).
STATE_ARG = "lcx_state"
#: What such an id looks like (a random uuid4 hex, ``RequestStates.rewrite``): nothing else is turned into a file name.
STATE_ID = re.compile(r"[0-9a-f]{32}")


def state_file(spool: str | os.PathLike, state: Any) -> Path:
    """Where the tensors of the request state ``state`` are spooled; an id lcx did not make is refused
    (``RuntimeError``: it is read in vLLM's engine and worker processes)."""
    if not (isinstance(state, str) and STATE_ID.fullmatch(state)):
        raise RuntimeError(f"lcx: malformed request state id {str(state)[:80]!r}")
    return Path(spool) / f"{state}.safetensors"


#: The ``extra_args`` key of a chunk forward the middleware sends to the engine (``engine_forward``): lcx's KV
#: connector saves that request's last position's keys/values to ``chunk_file(spool, name)``.
CHUNK_ARG = "lcx_chunk"
CHUNK_NAME = re.compile(r"[0-9a-f]{32}-\d{1,6}")
#: Keys of ``vllm_xargs`` only the middleware sets: a request naming one is refused.
RESERVED_ARGS = (STATE_ARG, CHUNK_ARG)


def chunk_file(spool: str | os.PathLike, name: Any) -> Path:
    """Where the keys/values of the chunk forward ``name`` ("{state id}-{chunk}") are saved."""
    if not (isinstance(name, str) and CHUNK_NAME.fullmatch(name)):
        raise RuntimeError(f"lcx: malformed chunk request name {str(name)[:80]!r}")
    return Path(spool) / f"{name}.chunk.safetensors"


#: JSON list of the API keys given to ``vllm serve --api-key`` (set by ``lcx serve``; else VLLM_API_KEY counts).
API_KEYS_ENV = "LCX_SERVED_API_KEYS"
#: The import path vLLM's ``--middleware`` takes.
MIDDLEWARE = f"{__name__}.LcxRequestOptions"


def check_options(body: dict[str, Any], served: dict[str, list[dict[str, Any]]] | None) -> None:
    """Raise ``LcxError`` (the 400's message) when ``body[FIELD]`` cannot apply to ``body["model"]``."""
    from lcx.registry import registry

    opts = body.get(FIELD)
    example = '{"lcx": {"rope": {"factor": 4}}}'
    if not isinstance(opts, dict) or not all(isinstance(k, str) and isinstance(v, dict) for k, v in opts.items()):
        raise LcxError(f"'{FIELD}' must map method names to their options, e.g. {example}; got {json.dumps(opts)[:200]}")
    model = body.get("model")
    applied = None
    if served is not None and model in served:
        applied = {m["name"]: m.get("options") or {} for m in served[model]}
    reg = registry()
    for name, given in opts.items():
        if name not in reg.methods:
            raise LcxError(f"'{FIELD}': unknown method {name!r}; known: {', '.join(sorted(reg.methods))}")
        cls = reg.get(name)
        asked = cls.from_options(**given).to_options()  # unknown options and bad values: LcxError
        if applied is None:
            continue
        if name not in applied:
            which = ", ".join(applied) or "no lcx method"
            raise LcxError(f"'{FIELD}': model {model!r} applies {which}; options for {name!r} cannot apply to it "
                           f"(name the model that serves {name}, or start a server with --method {name})")
        have = cls.from_options(**applied[name]).to_options()
        for key in given:
            if asked[key] != have[key]:
                raise LcxError(f"'{FIELD}': {name}.{key}={asked[key]!r} differs from the server's {name}.{key}="
                               f"{have[key]!r}; {name}'s options are fixed when the server starts (start one with "
                               f"-o {name}.{key}={asked[key]}, or leave the option out)")


def served_from_env() -> dict[str, list[dict[str, Any]]] | None:
    raw = os.environ.get(SERVED_ENV)
    return json.loads(raw) if raw else None


def prompt_methods(served: dict[str, list[dict[str, Any]]] | None) -> dict[str, list]:
    """{served name: its prompt-rewriting method instances, in order} for the names that apply any."""
    from lcx.registry import registry

    reg, out = registry(), {}
    for name, methods in (served or {}).items():
        insts = [reg.get(m["name"]).from_options(**(m.get("options") or {})) for m in methods
                 if reg.get(m["name"]).serving == "prompt"]
        if insts:
            out[name] = insts
    return out


def state_methods(served: dict[str, list[dict[str, Any]]] | None) -> dict[str, dict[str, Any]]:
    """{served name: the spec of its method whose served attention reads middleware-computed state}."""
    from lcx.registry import registry

    reg = registry()
    return {name: m for name, methods in (served or {}).items() for m in methods if reg.get(m["name"]).serve_state}


def prefix_kv(spec: dict[str, Any] | None) -> bool:
    """Whether the served method ``spec`` (name and options) is served on vLLM's own model code, its
    middleware-computed keys/values loaded by lcx's KV connector (``Method.serves_prefix_kv``)."""
    from lcx.registry import registry

    if not spec or not registry().get(spec["name"]).serve_state:
        return False
    return registry().get(spec["name"]).from_options(**(spec.get("options") or {})).serves_prefix_kv()


class RequestStates:
    """Computes a ``serve_state`` method's per-request tensors on lcx's own path and spools them for vLLM's
    worker (see the module docstring)."""

    def __init__(self, model: dict[str, Any]) -> None:
        self.model = model
        self.spool = Path(model["spool"]) if model.get("spool") else None
        self._sessions: dict[str, Any] = {}
        self._prefix_kv: dict[str, bool] = {}  # ``prefix_kv`` per spec, computed once
        self._lock = threading.Lock()  # one lcx run, one request at a time
        self.engine_saves = True  # False once lcx's KV connector failed to save a chunk forward (``uses_engine``)

    def prefix_kv(self, spec: dict[str, Any]) -> bool:
        """``prefix_kv(spec)``, remembered per spec (it builds the method from its options)."""
        key = json.dumps(spec, sort_keys=True)
        if key not in self._prefix_kv:
            self._prefix_kv[key] = prefix_kv(spec)
        return self._prefix_kv[key]

    def uses_engine(self, spec: dict[str, Any], engine: Any) -> bool:
        """Whether ``spec``'s per-request forwards run on vLLM's engine (``engine_forward``): a method served
        through lcx's KV connector (``prefix_kv``) without an adapter, when the engine is at hand and its
        connector has not failed to save one."""
        return self.engine_saves and engine is not None and not spec.get("adapter") and self.prefix_kv(spec)

    def rewrite(self, body: dict[str, Any], spec: dict[str, Any], tokenizer: Any, engine: Any = None) -> bool:
        """``engine`` (vLLM's engine client and the event loop it runs on): a method served on vLLM's own model
        code without an adapter (``prefix_kv``) has its chunk forwards run there (``engine_forward``)."""
        from safetensors.torch import save_file

        from lcx.limits import check_request
        from lcx.session import open_session

        prompts, single, max_new = requested_prompts(body, spec["name"])
        if len(prompts) != 1:
            raise LcxError(f"{spec['name']} serves one prompt per request; send the {len(prompts)} prompts as "
                           f"separate requests")
        check_one_state(body, spec["name"])
        xargs = body.get("vllm_xargs") or {}
        if not isinstance(xargs, dict):
            raise LcxError(f"vllm_xargs must be an object, got {json.dumps(xargs)[:100]}")
        ids = prompt_ids(prompts[0], body, tokenizer)
        if self.spool is None:
            raise LcxError(f"{spec['name']} needs the server's spool folder (LCX_SERVED_MODEL has none): start "
                           f"the server with `lcx serve`")
        key = json.dumps(spec, sort_keys=True)  # method, options and the adapter the middleware applies
        with self._lock:
            session = self._sessions.get(key)
            if session is None:
                session = self._sessions[key] = open_session(
                    self.model["tokenizer"], [spec["name"]], {spec["name"]: spec.get("options") or {}},
                    spec.get("adapter"), require_tokenizer=False)
            vocab = session.run.model.get_input_embeddings().num_embeddings
            bad = next((t for t in ids if not 0 <= t < vocab), None)
            if bad is not None:  # lcx's forward would fail on it (a 500), before vLLM's own check
                raise LcxError(f"prompt token id {bad} is outside the model's vocabulary (0-{vocab - 1})")
            check_request(session.run, len(ids), max_new, served=True)  # lcx's limits: the whole prompt is read here
            state = uuid.uuid4().hex
            method = session.run.method(spec["name"])
            try:
                forward = (engine_forward(*engine, self.spool, state, salt=body.get("cache_salt"))
                           if self.uses_engine(spec, engine) else None)
                out = method.serve_request(session.run, ids, max_new, forward=forward)
            except EngineDeclined as e:
                if isinstance(e, EngineSavedNothing):
                    self.engine_saves = False
                    print(f"lcx: {e}; {spec['name']}'s forwards run on lcx's own path from now on", file=sys.stderr,
                          flush=True)
                out = method.serve_request(session.run, ids, max_new)
        if out is None:
            return False
        new_ids, tensors = out
        tmp = self.spool / f".{state}.tmp"
        try:
            save_file(tensors, str(tmp))
            tmp.rename(state_file(self.spool, state))  # the worker never sees a half-written file
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise
        body["prompt"] = new_ids
        body["vllm_xargs"] = {**xargs, STATE_ARG: state}
        if self.prefix_kv(spec):  # vLLM's prefix cache must not share its placeholders' blocks (the same token
            body["cache_salt"] = f"lcx-{state}"  # ids, another request's candidates): a salt no other request has
        return True


class EngineDeclined(LcxError):
    """A row longer than the engine's ``--max-model-len``: this request's forwards run on lcx's own path."""


class EngineSavedNothing(EngineDeclined):
    """vLLM's engine ran a chunk forward, and lcx's KV connector wrote no file for it: every later request's
    forwards run on lcx's own path too."""


def engine_forward(engine: Any, loop: asyncio.AbstractEventLoop, spool: Path, state: str,
                   salt: str | None = None) -> Any:
    """A ``serve_request`` ``forward`` that runs each chunk's [chunk ; fragment] through vLLM's engine (called from
    a worker thread; the engine's requests run on ``loop``): one-token requests, all submitted at once, whose
    last prompt position lcx's KV connector saves to ``chunk_file``; returns per chunk and layer its (keys,
    values).  The files are deleted once read, or, when a request fails, once every request has ended.

    The rows are plain prompts of the base model: vLLM's prefix cache shares their blocks with other requests'
    rows (a document's chunks, asked about again, are not computed again), within the client's ``salt``
    (its request's ``cache_salt``) if it sent one."""

    async def one(row: list[int], name: str) -> None:
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        params = SamplingParams(max_tokens=1, temperature=0.0, extra_args={CHUNK_ARG: name})
        prompt = TokensPrompt(prompt_token_ids=row, **({"cache_salt": salt} if salt else {}))
        async for _ in engine.generate(prompt, params, request_id=f"lcx-chunk-{name}"):
            pass

    def forward(rows: list[list[int]]) -> list[list[tuple[Any, Any]]]:
        from safetensors.torch import load_file

        limit = getattr(getattr(engine, "model_config", None), "max_model_len", None)
        if isinstance(limit, int) and max(map(len, rows)) > limit:  # vLLM would refuse the row: lcx's forwards
            raise EngineDeclined(f"a chunk forward of {max(map(len, rows))} tokens is over the engine's "
                                  f"--max-model-len ({limit})")
        names = [f"{state}-{j}" for j in range(len(rows))]
        futures = [asyncio.run_coroutine_threadsafe(one(row, name), loop) for row, name in zip(rows, names)]
        try:
            for f in futures:
                try:
                    f.result()
                except Exception as e:  # noqa: BLE001 -- vLLM refusing a row (its length limit): the request's 400
                    raise LcxError(f"vLLM's engine failed focusllm's chunk forward: {type(e).__name__}: {e}") from None
            out = []
            for name in names:
                path = chunk_file(spool, name)
                if not path.exists():
                    raise EngineSavedNothing(f"vLLM's engine ran chunk forward {name} and lcx's KV connector saved "
                                             f"nothing (see its lines in the server log; is it installed?)")
                kv = load_file(str(path))
                out.append([(kv[f"{i}.k"], kv[f"{i}.v"]) for i in range(len(kv) // 2)])
            return out
        finally:
            concurrent.futures.wait(futures)  # a failed one's siblings may still save: delete after them
            for name in names:
                chunk_file(spool, name).unlink(missing_ok=True)

    return forward


#: Request fields that would let vLLM run a prompt whose state the middleware computed otherwise than once,
#: whole: several sequences sharing one state file (the first to end deletes it), or the placeholders cut.
#: Each field's accepted values.
_ONE_STATE_FIELDS = {"n": (None, 1), "best_of": (None, 1), "use_beam_search": (None, False),
                     "truncate_prompt_tokens": (None,)}


def check_one_state(body: dict[str, Any], method: str) -> None:
    """Refuse what a request with middleware-computed state cannot ask for (``_ONE_STATE_FIELDS``)."""
    for field, fine in _ONE_STATE_FIELDS.items():
        value = body.get(field)
        if value not in fine:
            raise LcxError(f"{method} serves one sequence per request over its whole prompt; {field}={json.dumps(value)} "
                           f"is not supported (leave it out, or send separate requests)")
    if body.get("prompt_logprobs") is not None:  # vLLM would compute the placeholders (skipping the KV connector)
        raise LcxError(f"{method}: prompt_logprobs is not supported (vLLM reads the prompt rewritten to one "
                       f"placeholder per candidate and the local tokens, not the prompt sent); leave it out")


def _is_ids(p: Any) -> bool:
    return isinstance(p, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in p)


def requested_prompts(body: dict[str, Any], method: str) -> tuple[list, bool, int]:
    """A completion request's prompts (each a text or token ids), whether it sent a single prompt, and
    its ``max_tokens``, for ``method``'s rewrite.  Anything else is refused (``LcxError``, a 400): vLLM's
    own parsing accepts more (``max_tokens`` "16" or 16.0, token ids 1.0, ``add_special_tokens`` "false"), and
    such a request would reach the engine without the method's rewrite."""
    prompt, max_new = body.get("prompt"), body.get("max_tokens", DEFAULT_MAX_TOKENS)
    if max_new is None:
        max_new = DEFAULT_MAX_TOKENS
    single = isinstance(prompt, str) or _is_ids(prompt)
    prompts = [prompt] if single else prompt
    ok = isinstance(max_new, int) and not isinstance(max_new, bool) and max_new >= 1 and bool(prompt) and \
        isinstance(prompts, list) and all((isinstance(p, str) or _is_ids(p)) and p for p in prompts) and \
        isinstance(body.get("add_special_tokens", True), bool)
    if not ok:
        shown = {k: body.get(k) for k in ("max_tokens", "add_special_tokens") if k in body}
        raise LcxError(f"{method} rewrites each prompt before vLLM reads it and needs 'prompt' as a non-empty text or "
                       f"list of integer token ids (or a list of those), 'max_tokens' as an integer >= 1 and "
                       f"'add_special_tokens' as true or false; got prompt {json.dumps(prompt)[:80]}"
                       + (f", {json.dumps(shown)[:120]}" if shown else ""))
    return prompts, single, max_new


def prompt_ids(prompt: str | list[int], body: dict[str, Any], tokenizer: Any) -> list[int]:
    """One prompt's token ids, a text tokenized as vLLM would (``add_special_tokens`` of the request)."""
    if not isinstance(prompt, str):
        return list(prompt)
    return tokenizer.encode(prompt, add_special_tokens=body.get("add_special_tokens", True) is not False)


def rewrite_prompts(body: dict[str, Any], methods: list, tokenizer: Any, window: int) -> bool:
    """Apply ``methods``' ``serve_prompt`` to the completion request's prompt(s), in place; True if a prompt
    changed (it is then token ids).  Malformed prompts and token counts are refused (``requested_prompts``)."""
    prompts, single, max_new = requested_prompts(body, "+".join(m.name for m in methods))
    out, changed = [], False
    for p in prompts:
        ids = prompt_ids(p, body, tokenizer)
        new = ids
        for m in methods:
            try:
                new = m.serve_prompt(new, max_new, window)
            except (ValueError, LcxError) as e:
                raise LcxError(f"{m.name}: {e}") from None
        changed |= new != ids
        out.append(new if new != ids else p)
    if changed:
        body["prompt"] = out[0] if single else out
    return changed


class LcxRequestOptions:
    """ASGI middleware: checks the ``lcx`` field of JSON POST bodies (see the module docstring)."""

    def __init__(self, app: Any) -> None:
        self.app = app
        self.served = served_from_env()
        self.model = json.loads(os.environ.get(MODEL_ENV) or "{}")
        self._prompt_methods: dict[str, list] | None = None
        self._tokenizer: Any = None
        self._stateful: dict[str, dict[str, Any]] | None = None
        self._states: RequestStates | None = None
        self._auth: Any = None  # vLLM's API-key check, False without keys (``authorized``)
        self._open: set[int] = set()  # tickets of the state rewrites not finished yet (``_rewrite_held``)
        self._tickets = 0
        self._done: asyncio.Condition | None = None

    @property
    def rewriters(self) -> dict[str, list]:
        if self._prompt_methods is None:
            self._prompt_methods = prompt_methods(self.served)
        return self._prompt_methods

    @property
    def stateful(self) -> dict[str, dict[str, Any]]:
        if self._stateful is None:
            self._stateful = state_methods(self.served)
        return self._stateful

    def states(self) -> RequestStates:
        if self._states is None:
            self._states = RequestStates(self.model)
        return self._states

    def tokenizer(self) -> Any:
        if self._tokenizer is None:
            from transformers import AutoTokenizer

            self._tokenizer = AutoTokenizer.from_pretrained(self.model["tokenizer"])
        return self._tokenizer

    def _rewrite(self, data: dict[str, Any], engine: Any = None) -> bool:
        spec = self.stateful.get(data.get("model"))  # type: ignore[arg-type]
        if spec is not None:
            return self.states().rewrite(data, spec, self.tokenizer(), engine)
        methods = self.rewriters.get(data.get("model"))  # type: ignore[arg-type]
        if not methods:
            return False
        return rewrite_prompts(data, methods, self.tokenizer(), int(self.model.get("window") or 0))

    async def _rewrite_held(self, data: dict[str, Any], engine: Any = None) -> bool:
        """``_rewrite`` off the event loop.  A request whose state it computed is then held until every state
        request that arrived before it finished is computed too: requests that arrive together reach vLLM
        together, so vLLM's forwards do not share the CPU with the middleware's (one request at a time) while
        it computes the rest (benchmarks/focusllm.md).
        Not when the forwards run on vLLM's engine (``RequestStates.uses_engine``): it shares nothing with itself."""
        spec = self.stateful.get(data.get("model"))  # type: ignore[arg-type]
        if spec is None or self.states().uses_engine(spec, engine):
            return await asyncio.to_thread(self._rewrite, data, engine)
        if self._done is None:
            self._done = asyncio.Condition()
        ticket, self._tickets = self._tickets, self._tickets + 1
        self._open.add(ticket)
        try:
            changed = await asyncio.to_thread(self._rewrite, data, engine)
        finally:
            async with self._done:
                self._open.discard(ticket)
                self._done.notify_all()
        if changed and self._open:
            last = max(self._open)  # the burst so far; later arrivals are not waited for
            try:
                async with self._done:
                    await self._done.wait_for(lambda: not any(t <= last for t in self._open))
            except asyncio.CancelledError:  # the client left: nobody else deletes its state now
                state = (data.get("vllm_xargs") or {}).get(STATE_ARG)
                if state and self.states().spool is not None:
                    state_file(self.states().spool, state).unlink(missing_ok=True)
                raise
        return changed

    def authorized(self, scope: dict) -> bool:
        """Whether vLLM's own API-key check will let this request through (it runs after this middleware: a
        request it refuses must not cost a forward pass here, nor learn the server's methods from a 400)."""
        if self._auth is None:
            keys = json.loads(os.environ.get(API_KEYS_ENV) or "[]") or [os.environ.get("VLLM_API_KEY") or ""]
            keys = [k for k in keys if k]
            if keys:
                from vllm.entrypoints.serve.middleware.authenticate import AuthenticationMiddleware

                self._auth = AuthenticationMiddleware(None, tokens=keys)
            else:
                self._auth = False
        if not self._auth:
            return True
        from starlette.datastructures import Headers
        from vllm.entrypoints.serve.middleware.authenticate import GUARDED_PREFIX

        path = scope.get("path", "").removeprefix(scope.get("root_path", ""))
        return not path.startswith(GUARDED_PREFIX) or self._auth.verify_token(Headers(scope=scope))

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http" or scope["method"] != "POST" or not self.authorized(scope):
            return await self.app(scope, receive, send)  # vLLM answers an unauthorized request (401)
        chunks, more = [], True
        while more:
            message = await receive()
            if message["type"] != "http.request":  # the client went away: let the app see it
                return await self.app(scope, _replay([message], receive), send)
            chunks.append(message.get("body", b""))
            more = message.get("more_body", False)
        body = b"".join(chunks)
        spooled: Path | None = None  # the state file this request's rewrite wrote, if any
        rewrite = scope.get("path", "").endswith("/v1/completions") and bool(self.rewriters or self.stateful)
        # a server whose worker reads middleware-computed state checks every JSON body's vllm_xargs, on every
        # path: a forged state id (however its JSON spells the key) would fail inside the engine's forward
        if rewrite or self.stateful or f'"{FIELD}"'.encode() in body or any(a.encode() in body for a in RESERVED_ARGS):
            try:
                data = json.loads(body)
            except (ValueError, RecursionError):
                data = None  # not JSON (or nested past Python's recursion limit): vLLM answers that itself
            changed = False
            if isinstance(data, dict):
                bad_model = not isinstance(data.get("model"), (str, type(None)))
                try:
                    if bad_model:
                        raise LcxError(f"'model' must be the name of a served model (a string), got "
                                       f"{json.dumps(data['model'])[:80]}")
                    xargs = data.get("vllm_xargs")
                    reserved = [a for a in RESERVED_ARGS if isinstance(xargs, dict) and a in xargs]
                    if reserved:
                        raise LcxError(f"vllm_xargs.{reserved[0]} is set by lcx's middleware, not by requests; "
                                       f"leave it out")
                    if FIELD in data:
                        check_options(data, self.served)
                        data.pop(FIELD)
                        changed = True
                    if rewrite:  # tokenizing a long prompt takes a while: off the event loop
                        changed |= await self._rewrite_held(data, _engine(scope))
                except LcxError as e:
                    return await _send_error(send, str(e), "model" if bad_model else FIELD if FIELD in data else "prompt")
            if changed:
                body = json.dumps(data).encode()
                scope = {**scope, "headers": [(k, v) for k, v in scope["headers"] if k.lower() != b"content-length"]
                         + [(b"content-length", str(len(body)).encode())]}
                state = (data.get("vllm_xargs") or {}).get(STATE_ARG)
                if state is not None:  # vLLM refusing the request: its worker never reads (nor deletes) the state
                    spooled = state_file(self.states().spool, state)
                    send = _drop_state_on_error(send, spooled)
        try:
            await self.app(scope, _replay([{"type": "http.request", "body": body, "more_body": False}], receive), send)
        finally:
            if spooled is not None:  # finished, or aborted (the client left) possibly before the worker read it
                _unlink_later(spooled)


#: Seconds after its HTTP exchange ends that a request's state file, if still there, is deleted: the worker has
#: read it by then or never will (an aborted request is not scheduled again); the delay covers a step in flight.
STATE_GRACE_S = 600.0


def _engine(scope: dict) -> tuple[Any, asyncio.AbstractEventLoop] | None:
    """vLLM's engine client (its API server keeps it on the app's state) and the running loop; None elsewhere."""
    client = getattr(getattr(scope.get("app"), "state", None), "engine_client", None)
    return None if client is None else (client, asyncio.get_running_loop())


def _unlink_later(path: Path) -> None:
    try:
        asyncio.get_running_loop().call_later(STATE_GRACE_S, lambda: path.unlink(missing_ok=True))
    except RuntimeError:  # no loop (not under a server): nothing can still read it
        path.unlink(missing_ok=True)


def _drop_state_on_error(send: Any, path: Path) -> Any:
    async def watched(message: dict) -> None:
        if message["type"] == "http.response.start" and message.get("status", 200) >= 400:
            path.unlink(missing_ok=True)
        await send(message)

    return watched


def _replay(messages: list[dict], receive: Any) -> Any:
    async def again() -> dict:
        return messages.pop(0) if messages else await receive()

    return again


async def _send_error(send: Any, message: str, param: str = FIELD) -> None:
    """A 400 in the OpenAI error shape vLLM uses."""
    payload = json.dumps({"error": {"message": message, "type": "BadRequestError", "param": param, "code": 400}}).encode()
    await send({"type": "http.response.start", "status": 400,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(payload)).encode())]})
    await send({"type": "http.response.body", "body": payload})
