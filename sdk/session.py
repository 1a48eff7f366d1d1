"""Load a model, optionally an adapter, and attach methods: what every command starts with."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from lcx.composition import Run, attach
from lcx.errors import LcxError


def parse_options(pairs: tuple[str, ...] | list[str]) -> dict[str, Any]:
    """``["window=1024", "streaming.sinks=4"]`` -> ``{"window": "1024", "streaming": {"sinks": "4"}}``."""
    out: dict[str, Any] = {}
    for pair in pairs:
        key, eq, value = pair.partition("=")
        if not eq or not key:
            raise LcxError(f"option {pair!r} is not KEY=VALUE; e.g. -o window=1024 or -o streaming.window=1024")
        method, dot, name = key.partition(".")
        if dot:
            out.setdefault(method, {})[name] = value
        else:
            out[key] = value
    return out


@dataclass
class Session:
    model: Any
    tokenizer: Any
    run: Run
    model_name: str
    adapter: dict | None = None

    def close(self) -> None:
        self.run.detach()


def open_session(
    model: str,
    methods: list[str] | tuple[str, ...] = (),
    options: dict[str, Any] | None = None,
    adapter: str | Path | None = None,
    trust_remote_code: bool = False,
) -> Session:
    from lcx.models import load_model

    hf_model, tok = load_model(model, trust_remote_code=trust_remote_code)
    sidecar = None
    if adapter:
        from lcx.adapters.peft_bridge import load_adapter

        hf_model, sidecar = load_adapter(hf_model, adapter)
        if not methods:  # default to the methods the adapter was trained with
            methods = [m["name"] for m in sidecar.get("methods", [])]
            opts = {m["name"]: m.get("options", {}) for m in sidecar.get("methods", [])}
            options = {**opts, **(options or {})}
    run = attach(hf_model, list(methods), **(options or {}))
    return Session(hf_model, tok, run, model, sidecar)


def read_text_file(path: str | Path) -> str:
    """Read a UTF-8 text file, with errors a shell user can act on."""
    p = Path(path)
    if not p.exists():
        raise LcxError(f"input file {str(p)!r} does not exist")
    if p.is_dir():
        raise LcxError(f"input {str(p)!r} is a folder; pass a text file")
    data = p.read_bytes()
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise LcxError(
            f"input file {str(p)!r} is not UTF-8 text (byte 0x{data[e.start]:02x} at offset {e.start}); "
            f"convert it first, e.g. `iconv -f latin1 -t utf-8 {p} > {p.stem}.utf8.txt`"
        ) from None
