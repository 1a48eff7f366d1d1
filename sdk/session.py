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
        top = method if dot else key
        if top in out and isinstance(out[top], dict) != bool(dot):  # a value one time, a method's options another
            raise LcxError(f"option {pair!r}: {top!r} is given both as an option and as a method's options "
                           f"(METHOD.KEY=VALUE); give one of them")
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
    require_tokenizer: bool = True,
    device: str | None = None,
    dtype: Any = None,
) -> Session:
    from lcx.models import load_model

    hf_model, tok = load_model(model, trust_remote_code=trust_remote_code, require_tokenizer=require_tokenizer,
                               device=device, dtype=dtype)
    sidecar = None
    if adapter:
        hf_model, sidecar, methods, options = apply_adapter(hf_model, adapter, list(methods), options or {})
    run = attach(hf_model, list(methods), **(options or {}))
    return Session(hf_model, tok, run, model, sidecar)


def apply_adapter(model: Any, adapter: str | Path, methods: list[str],
                  options: dict[str, Any]) -> tuple[Any, dict, list[str], dict[str, Any]]:
    """Load ``adapter`` onto ``model`` (a PeftModel around it; ``.unload()`` gives the bare model back) and
    settle the methods to attach: with none named, the adapter's own methods with its trained options under
    the given ones; options its training fixed must agree with it."""
    from lcx.adapters.peft_bridge import load_adapter

    peft_model, sidecar = load_adapter(model, adapter)
    try:
        trained = trained_methods(sidecar)
        if not methods:  # default to the methods (and options) the adapter was trained with
            methods = list(trained)
            options = merge_options(trained, options, methods)
        else:  # the named methods with the user's options, but what the adapter's training fixed stays fixed
            options = merge_options({m: _fixed(m, trained) for m in methods}, options, methods)
        check_adapter_methods(trained, options, methods, adapter)
    except BaseException:
        peft_model.unload()  # a refused adapter leaves the caller's model as it was
        raise
    _note_dtype(sidecar, model, adapter)
    return peft_model, sidecar, methods, options


def _note_dtype(sidecar: dict[str, Any], model: Any, adapter) -> None:
    """Say so (once, on stderr) when an adapter trained over base weights of one dtype is used over another's:
    it runs, but its outputs differ from what its training saw by the rounding."""
    import sys

    from lcx.models import dtype_name, model_dtype

    trained = (sidecar.get("training") or {}).get("dtype", "float32")  # adapters from before dtypes were float32
    now = dtype_name(model_dtype(model))
    if trained != now:
        print(f"note: adapter {str(adapter)!r} was trained over {trained} weights and is used over {now} ones "
              f"(pass --dtype {trained} to use it as trained)", file=sys.stderr)


def trained_methods(sidecar: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """{method: its options} an adapter's sidecar says it was trained with (an option it lacks: the value
    it had when the sidecar was written, see ``Method.unrecorded_options``), less those only inference reads."""
    from lcx.registry import registry

    reg = registry()
    out = {}
    for m in adapter_methods(sidecar):
        known = reg.get(m["name"]) if m["name"] in reg.methods else None
        before = {k: v for k, v in known.before_options().items() if k not in known.inference_only} if known else {}
        out[m["name"]] = {**before, **m["options"]}
    return out


def adapter_methods(sidecar: dict[str, Any]) -> list[dict[str, Any]]:
    """The methods an adapter's sidecar records (``[{"name", "options"}]``), each without the options its
    training never reads (``Method.inference_only``, e.g. focusllm's chunk) unless ``lcx train`` was given them:
    the others take today's default or the user's value, not the default the sidecar happened to record."""
    from lcx.registry import registry

    reg = registry()
    given = (sidecar.get("training") or {}).get("options") or {}  # as parse_options left them: per method or flat
    flat = {k for k, v in given.items() if not isinstance(v, dict)}
    out = []
    for m in sidecar.get("methods", []):
        own = given.get(m["name"]) if isinstance(given.get(m["name"]), dict) else {}
        skip = set(reg.get(m["name"]).inference_only) - set(own) - flat if m["name"] in reg.methods else set()
        out.append({**m, "options": {k: v for k, v in (m.get("options") or {}).items() if k not in skip}})
    return out


def check_adapter_methods(trained: dict[str, dict], options: dict[str, Any], methods: list[str], adapter) -> None:
    """Refuse using an adapter trained with ``trained`` ({method: options}) under ``methods`` with ``options``
    where it would not act as trained (``lcx generate`` and ``lcx serve`` alike)."""
    _check_trained_options(trained, options, methods, adapter)
    _check_gated(trained, methods, adapter)


def _check_gated(trained: dict[str, dict], methods: list[str], adapter) -> None:
    """Refuse an adapter whose LoRA the named methods would read otherwise than its training did: one trained
    with a method that gates its LoRA per token (``Method.lora_gated``: focusllm's candidate positions) used
    without that method (it would act on every token), or another adapter under such a method (it would act
    at the gated positions only)."""
    from lcx.registry import registry

    reg = registry()
    for m in sorted(set(trained) | set(methods)):
        if m in reg.methods and reg.get(m).lora_gated and (m in trained) != (m in methods):
            if m in trained:
                raise LcxError(f"adapter {str(adapter)!r} was trained with {m}, which reads its LoRA at some positions "
                               f"only; without {m} (methods: {', '.join(methods) or 'none'}) it would act on every "
                               f"token: add --method {m}")
            raise LcxError(f"{m} reads a LoRA adapter at its own positions only, and adapter {str(adapter)!r} was "
                           f"trained with {', '.join(trained) or 'no method'}, not {m}: it would not act as trained; "
                           f"use an adapter trained with {m} (lcx train --method {m}) or drop --adapter")


def _fixed(method: str, trained: dict[str, dict]) -> dict[str, Any]:
    """The options of ``method`` its training fixed (``fixed_by_training``, e.g. fot's positions mode), as trained."""
    from lcx.registry import registry

    reg = registry()
    if method not in trained or method not in reg.methods:
        return {}
    return {k: trained[method][k] for k in getattr(reg.get(method), "fixed_by_training", ()) if k in trained[method]}


def merge_options(trained: dict[str, dict], given: dict[str, Any], methods: list[str]) -> dict[str, Any]:
    """Options per method: ``trained`` (e.g. an adapter's), overridden key by key by ``given`` (the
    user's; a flat option goes to the method that has it, as ``attach`` routes it)."""
    from lcx.composition import split_options

    merged = {m: dict(trained.get(m, {})) for m in methods}
    for m, opts in split_options(methods, given).items():
        merged.setdefault(m, {}).update(opts)
    return merged


def _check_trained_options(trained: dict[str, dict], given: dict[str, Any], methods: list[str], adapter) -> None:
    """Refuse options a method's training fixed (e.g. fot's positions mode) when they differ from the adapter's."""
    per_method = merge_options({}, given, methods)
    for m in methods:
        mine = per_method.get(m, {})
        for key, value in _fixed(m, trained).items():
            if key in mine and str(mine[key]) != str(value):
                raise LcxError(f"adapter {str(adapter)!r} was trained with {m} {key}={value}; "
                               f"{key}={mine[key]} is incompatible with it (drop -o {key} or retrain)")


def read_text_file(path: str | Path) -> str:
    """Read a UTF-8 text file, with errors a shell user can act on."""
    p = Path(path)
    if not p.exists():
        raise LcxError(f"input file {str(p)!r} does not exist")
    if p.is_dir():
        raise LcxError(f"input {str(p)!r} is a folder; pass a text file")
    data = p.read_bytes()
    try:
        return data.decode("utf-8-sig")  # a byte-order mark (Windows editors) is not part of the prompt
    except UnicodeDecodeError as e:
        raise LcxError(
            f"input file {str(p)!r} is not UTF-8 text (byte 0x{data[e.start]:02x} at offset {e.start}); "
            f"convert it first, e.g. `iconv -f latin1 -t utf-8 {p} > {p.stem}.utf8.txt`"
        ) from None
