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
"""

from __future__ import annotations

import json
import os
from typing import Any

from lcx.errors import LcxError

SERVED_ENV = "LCX_SERVED_METHODS"
FIELD = "lcx"
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


class LcxRequestOptions:
    """ASGI middleware: checks the ``lcx`` field of JSON POST bodies (see the module docstring)."""

    def __init__(self, app: Any) -> None:
        self.app = app
        self.served = served_from_env()

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http" or scope["method"] != "POST":
            return await self.app(scope, receive, send)
        chunks, more = [], True
        while more:
            message = await receive()
            if message["type"] != "http.request":  # the client went away: let the app see it
                return await self.app(scope, _replay([message], receive), send)
            chunks.append(message.get("body", b""))
            more = message.get("more_body", False)
        body = b"".join(chunks)
        if f'"{FIELD}"'.encode() in body:
            try:
                data = json.loads(body)
            except ValueError:
                data = None  # not JSON: vLLM answers that itself
            if isinstance(data, dict) and FIELD in data:
                try:
                    check_options(data, self.served)
                except LcxError as e:
                    return await _send_error(send, str(e))
                data.pop(FIELD)
                body = json.dumps(data).encode()
                scope = {**scope, "headers": [(k, v) for k, v in scope["headers"] if k.lower() != b"content-length"]
                         + [(b"content-length", str(len(body)).encode())]}
        await self.app(scope, _replay([{"type": "http.request", "body": body, "more_body": False}], receive), send)


def _replay(messages: list[dict], receive: Any) -> Any:
    async def again() -> dict:
        return messages.pop(0) if messages else await receive()

    return again


async def _send_error(send: Any, message: str) -> None:
    """A 400 in the OpenAI error shape vLLM uses."""
    payload = json.dumps({"error": {"message": message, "type": "BadRequestError", "param": FIELD, "code": 400}}).encode()
    await send({"type": "http.response.start", "status": 400,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(payload)).encode())]})
    await send({"type": "http.response.body", "body": payload})
