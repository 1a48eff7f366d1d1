"""Option values a method measures on the model itself, once, and keeps beside the model.

A method whose best option depends on the model (fot's memory layers: the layers that copy from far context)
resolves ``auto`` by measuring it (:meth:`lcx.method.Method.resolve_auto`), and ``measured`` caches the answer
in ``lcx-auto.json`` in the model's folder (or under ``$LCX_HOME/auto`` when that folder is read-only).  An
entry is trusted only for the same model files, the same lcx version and the same measurement inputs, the dtype the
model computes in among them (each option keeps its latest ``KEPT`` sets of inputs); a damaged file or one from
another model or version is measured again, with a note saying why.
"""

from __future__ import annotations

import contextlib
import contextvars
import hashlib
import json
import os
import sys
from pathlib import Path
from typing import Any, Callable, Iterator

AUTO_FILE = "lcx-auto.json"
FORMAT = 1
#: Measurements of one key kept per model, for as many sets of inputs (one model run at several local windows).
KEPT = 8
#: Files whose bytes (small ones) or names and sizes (weights) identify a model for the cache.
_WEIGHT_SUFFIXES = (".safetensors", ".bin")

_said: set[tuple[str, str, str]] = set()  # (file, key, inputs) reported in this process: a value is announced once
_dtype: contextvars.ContextVar[str | None] = contextvars.ContextVar("lcx_auto_dtype", default=None)
_deferred: contextvars.ContextVar[bool] = contextvars.ContextVar("lcx_auto_deferred", default=False)


def note(message: str) -> None:
    """A one-line note to the user, on stderr (stdout stays for results and JSON)."""
    print(message, file=sys.stderr)


def resolve(methods: list[Any], folder: Path | None, load: Callable[[], tuple[Any, Any]],
            dtype: str | None = None) -> None:
    """Let each method measure its ``auto`` options (``Method.resolve_auto``) for the model in ``folder``, with
    nothing attached yet; ``load()`` gives ``(model, tokenizer)``, loaded at most once, computing in ``dtype``
    (a name, "bfloat16"), which every measurement's inputs then hold: one made in another dtype is not reused.
    Only a local folder holding a tokenizer can be measured and cached: elsewhere ``auto`` keeps its rule."""
    if folder is None or not has_tokenizer(folder) or _deferred.get():
        return
    loaded: list[tuple[Any, Any]] = []

    def once() -> tuple[Any, Any]:
        if not loaded:
            loaded.append(load())
        return loaded[0]

    token = _dtype.set(dtype)
    try:
        for m in methods:
            m.resolve_auto(folder, once)
    finally:
        _dtype.reset(token)


@contextlib.contextmanager
def deferred() -> Iterator[None]:
    """Within it, attaching measures no ``auto`` option (each keeps its rule): a dry attach that checks a method
    stack must not spend a first use's measurement (minutes on a real model) before the stack runs."""
    token = _deferred.set(True)
    try:
        yield
    finally:
        _deferred.reset(token)


def is_deferred() -> bool:
    """Inside :func:`deferred`: an ``auto`` option is still unmeasured, and what depends on it is checked later."""
    return _deferred.get()


def model_folder(model: Any) -> Path | None:
    """The local folder a loaded transformers model came from, or None (built in memory, or from a hub name)."""
    cfg = getattr(model, "config", None)
    name = getattr(cfg, "_name_or_path", "") or ""
    p = Path(name).expanduser() if name else None
    return p if p is not None and (p / "config.json").is_file() else None


def has_tokenizer(folder: Path) -> bool:
    return any((folder / f).is_file() for f in ("tokenizer.json", "tokenizer_config.json", "tokenizer.model"))


def identity(folder: Path) -> dict[str, Any]:
    """What a cache entry must match: config.json's bytes and the weight files' names and sizes."""
    files = sorted(f for f in folder.iterdir() if f.is_file() and f.suffix in _WEIGHT_SUFFIXES)
    return {"config_sha256": hashlib.sha256((folder / "config.json").read_bytes()).hexdigest(),
            "weights": {f.name: f.stat().st_size for f in files}}


def cache_file(folder: Path) -> Path:
    """``lcx-auto.json`` in the model's folder, or under ``$LCX_HOME/auto`` when the folder is not writable."""
    if os.access(folder, os.W_OK):
        return folder / AUTO_FILE
    from lcx.models import cache_dir

    return cache_dir() / "auto" / f"{hashlib.sha256(str(folder.resolve()).encode()).hexdigest()[:16]}.json"


def _version() -> str:
    from lcx import __version__

    return __version__


def _read(path: Path, ident: dict[str, Any], log: Callable[[str], None]) -> dict[str, Any]:
    """The entries of ``path`` when it is a sound file for this model and lcx version; else {} (with why)."""
    if not path.exists():
        return {}
    try:
        data = json.loads(path.read_text())
        entries = data["entries"]
        if data.get("format") != FORMAT or not isinstance(entries, dict):
            raise ValueError(f"format {data.get('format')!r}")
    except (OSError, ValueError, KeyError, TypeError) as e:
        log(f"note: {path} is damaged ({e}); measuring again")
        return {}
    if data.get("model") != ident:
        log(f"note: {path} was measured on other model files; measuring again")
        return {}
    if data.get("lcx") != _version():
        log(f"note: {path} was measured by lcx {data.get('lcx')}, this is {_version()}; measuring again")
        return {}
    return entries


def _write(path: Path, ident: dict[str, Any], entries: dict[str, Any]) -> None:
    from lcx.io import write_json  # atomic: a reader sees the old file or the new one

    write_json({"format": FORMAT, "lcx": _version(), "model": ident, "entries": entries}, path)


def _kept(entry: Any) -> list[dict[str, Any]]:
    """A key's cached measurements, latest first: the entry itself, then those of other inputs it keeps."""
    out = []
    for e in [entry, *((entry.get("earlier") or []) if isinstance(entry, dict) else [])]:
        if isinstance(e, dict) and "inputs" in e and "value" in e:
            out.append({"inputs": e["inputs"], "value": e["value"]})
    return out


def measured(folder: Path, key: str, inputs: dict[str, Any], measure: Callable[[], Any], describe: Callable[[Any], str],
             log: Callable[[str], None] = note, valid: Callable[[Any], bool] = lambda value: True) -> Any:
    """The value of ``key`` (e.g. ``"fot.memory_layers"``) for the model in ``folder``: cached when an entry with
    the same ``inputs`` and a ``valid`` value exists, else ``measure()``'d and cached.  ``describe(value)`` words
    the one line said the first time a process uses it ("fot: memory layers 6,7,8 chosen by retrieval analysis").
    Within ``resolve``, ``inputs`` gain the dtype the model computes in."""
    if _dtype.get() is not None:
        inputs = {**inputs, "dtype": _dtype.get()}
    path = cache_file(folder)
    ident = identity(folder)
    entries = _read(path, ident, log)
    kept = _kept(entries.get(key))
    entry = next((e for e in kept if e["inputs"] == inputs), None)
    if entry is not None and not valid(entry["value"]):
        log(f"note: {key} in {path} holds {entry['value']!r}, not a value lcx writes; measuring it again")
        entry = None
    if entry is not None:
        value, how = entry["value"], "cached in"
    else:
        log(f"{key}=auto: measuring it on this model, once (then cached in {path})")
        value, how = measure(), "measured now, cached in"
        entries = _read(path, ident, lambda line: None)  # read again: another process may have written meanwhile
        earlier = [e for e in _kept(entries.get(key)) if e["inputs"] != inputs][:KEPT - 1]
        entries[key] = {"inputs": inputs, "value": value, **({"earlier": earlier} if earlier else {})}
        try:
            _write(path, ident, entries)
        except OSError as e:  # measured all the same: the next process measures again
            log(f"note: could not cache {key} in {path} ({e})")
    said = (str(path), key, json.dumps(inputs, sort_keys=True, default=str))
    if said not in _said:
        _said.add(said)
        log(f"{describe(value)} ({how} {path})")
    return value
