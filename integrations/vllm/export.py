"""``lcx export --for vllm``: a folder plain vLLM loads (config rewritten by the methods, weights linked,
adapters checked against vLLM's LoRA loader), and the checks ``lcx serve`` makes before a server starts.

    OUT/model/            the base model as vLLM should see it: config.json rewritten by the methods
                          that change it (``rope`` bakes its stretched rope parameters in), weights
                          linked from the source folder, tokenizer files copied, lcx.json sidecar
    OUT/adapters/NAME/    each lcx (PEFT LoRA) adapter, checked against what vLLM's LoRA loader
                          accepts and against the base model it was trained for
    OUT/lcx-export.json   what was exported: methods, adapters, the longest servable prompt
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from lcx import auto
from lcx.adapters import families
from lcx.errors import LcxError
from lcx.integrations.vllm.middleware import prefix_kv

#: Ranks vLLM 0.32 accepts for ``--max-lora-rank``.
VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)
MANIFEST = "lcx-export.json"
#: Files copied (not linked) from the model folder: small, and vLLM may read them from OUT/model.
_SMALL_SUFFIXES = (".json", ".txt", ".model", ".jinja", ".tiktoken")
#: adapter_config.json fields vLLM's LoRA loader refuses when set.
_REFUSED = {
    "use_dora": "DoRA",
    "modules_to_save": "modules_to_save (fully trained modules)",
    "target_parameters": "target_parameters (LoRA on raw parameters)",
    "lora_bias": "LoRA biases",
}


@dataclass
class Export:
    """What ``export_for_vllm`` wrote (also saved as ``OUT/lcx-export.json``)."""

    out: Path
    model_dir: Path
    adapters: dict[str, Path] = field(default_factory=dict)
    methods: list[dict[str, Any]] = field(default_factory=list)
    max_model_len: int = 0
    window: int = 0
    max_lora_rank: int = 0
    #: The methods named with --method (they apply to every served name; the adapters' own methods
    #: apply to the adapter's name only).
    named: list[str] = field(default_factory=list)
    #: A document memory (``lcx memory build``) the served fot reads, or None.
    memory: str | None = None
    #: Requests served at once (vLLM's --max-num-seqs) so that the attention method's per-request state
    #: fits --state-gib; 0 = vLLM's default (no lcx state).
    max_concurrent: int = 0
    #: Adapters that lcx's request middleware applies, not vLLM (focusllm's candidate projections: vLLM's
    #: LoRA would apply them to every token): each name is served as a name of the base model.
    middleware_adapters: dict[str, Path] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        return {"model_dir": str(self.model_dir), "adapters": {k: str(v) for k, v in self.adapters.items()},
                "methods": self.methods, "named": self.named, "max_model_len": self.max_model_len,
                "window": self.window, "max_lora_rank": self.max_lora_rank, "memory": self.memory,
                "max_concurrent": self.max_concurrent,
                "middleware_adapters": {k: str(v) for k, v in self.middleware_adapters.items()}}


# ---------------------------------------------------------------------- export
def servable_methods(methods: list[str], options: dict[str, Any], adapters: dict[str, Path],
                     length: tuple[int, int] | None = None) -> list:
    """Method instances to export: those named plus those the adapters were trained with (their
    options, overridden by the user's).  Refuses methods vLLM cannot serve yet, and adapters whose
    config-changing methods disagree (all adapters of a server share one base model).  ``length``:
    (the model's window, --max-model-len), which fixes options that follow a request's length."""
    from lcx.adapters.peft_bridge import read_sidecar
    from lcx.composition import resolve_methods
    from lcx.registry import registry
    from lcx.session import check_adapter_methods, trained_methods

    reg = registry()
    twice = next((m for i, m in enumerate(methods) if m in methods[:i]), None)
    if twice is not None:  # attach refuses it too; a config method would be applied twice (rope: factor squared)
        raise LcxError(f"method {twice!r} is named twice; name each method once")
    names, source = list(methods), {m: "--method" for m in methods}
    per_adapter = {name: trained_methods(read_sidecar(path)) for name, path in adapters.items()}
    trained: dict[str, dict[str, Any]] = {}
    trained_by: dict[str, str] = {}  # method -> the adapter whose options are in `trained`
    for name, methods_of in per_adapter.items():
        for method, opts in methods_of.items():
            cls = reg.get(method)
            if method in trained and cls.serving == "config" and \
                    cls.from_options(**opts).to_options() != cls.from_options(**trained[method]).to_options():
                raise LcxError(f"adapters {trained_by[method]!r} and {name!r} were trained with different "
                               f"{method} options; serve them from two servers")
            trained.setdefault(method, opts)
            trained_by.setdefault(method, name)
            if method not in source:
                names.append(method)
                source[method] = name
    merged: dict[str, Any] = {n: dict(o) for n, o in trained.items()}
    for key, value in options.items():  # the user's options win over the adapters'
        if isinstance(value, dict):
            merged.setdefault(key, {}).update(value)
        else:
            merged[key] = value
    for name, path in adapters.items():  # what lcx generate refuses for an adapter, lcx serve refuses too
        check_adapter_methods(per_adapter[name], merged, names, path)
    for n in names:
        if not reg.get(n).serving:
            raise LcxError(
                f"method {n!r} ({source[n]}) cannot be served through vLLM yet"
                + (f" ({reg.get(n).not_served_because})" if reg.get(n).not_served_because else "")
                + f"; serve the methods {_servable_names(reg)} or use `lcx generate --method {n}`")
    insts = resolve_methods(names, merged)
    for m in insts:
        if length is not None:
            m.fix_length(*length)
        m.check_serving()
    return insts


def _servable_names(reg) -> str:
    return ", ".join(sorted(n for n, c in reg.methods.items() if c.serving)) or "(none)"


def served_state_budget(insts: list, config: dict[str, Any], window: int, max_model_len: int, state_gib: float,
                        memory: str | Path | None) -> int:
    """How many requests the server may run at once so that an attention method's per-request state (held
    outside vLLM's KV cache), with room for one request's step (``step_bytes``), a step's outputs and a replayed
    prefix (``prefix_cache``), stays within ``state_gib``;
    0 without one.  Also refuses a request size whose own memory entries would exceed lcx's memory-entry cap
    (``LCX_MAX_MEMORY_ENTRIES``)."""
    from lcx.integrations.vllm.attention import batched_tokens, kv_bytes, output_bytes, served_class
    from lcx.limits import Limits

    method = next((m for m in insts if m.serving == "attention"), None)
    spec = None if method is None else {"name": method.name, "options": method.to_options()}
    if spec is None or prefix_kv(spec):  # none, or all of it in vLLM's own KV cache
        return 0
    if state_gib <= 0:
        raise LcxError(f"--state-gib must be > 0, got {state_gib}")
    served = served_class(spec)
    cap = Limits.from_env().max_memory_entries
    entries = served.memory_entries(method, max_model_len, memory)
    if entries > cap:
        held = f" ({entries - max_model_len:,} of the document memory + up to --max-model-len {max_model_len:,} of its own)" \
            if memory is not None else ""
        raise LcxError(f"{method.name}: a request's memory could hold {entries:,} entries per layer and KV head{held}, "
                       f"over the limit of {cap:,}; lower --max-model-len or raise LCX_MAX_MEMORY_ENTRIES")
    per_request = served.request_bytes(method, config, window, max_model_len)
    step = served.step_bytes(method, config, window, max_model_len, memory) \
        + output_bytes(config, batched_tokens(max_model_len)) \
        + (3 * max_model_len * kv_bytes(config) if served.prefix_cache else 0)  # a layer's cached prefix, replayed:
    # gathered by an int64 index as large as the keys, then made contiguous per KV head (paged_cache.read_many)
    n = int((state_gib * 2**30 - step) // per_request)
    if n < 1:
        passing = f" and up to {step / 2**30:.2f} GiB more for a moment in a step" if step else ""
        raise LcxError(f"{method.name}: one request of up to {max_model_len:,} tokens holds up to "
                       f"{per_request / 2**30:.2f} GiB of state{passing}, over --state-gib {state_gib:g}; raise "
                       f"--state-gib or lower --max-model-len")
    return n


def check_memory_for_serving(path: Path, model_dir: Path, methods: list[Any],
                             log: Callable[[str], None] = lambda s: None) -> None:
    """A memory for ``lcx serve --memory``: built by `lcx memory build` for this model, and accepted by the served
    method that reads document memories (``Method.reads_memory``; ``methods``: the served method instances);
    ``log`` gets a note when it was built under other options (``Method.memory_built_note``)."""
    from lcx.registry import registry

    reader = next((m for m in methods if m.reads_memory), None)
    if reader is None:
        readers = sorted(n for n, c in registry().methods.items() if c.reads_memory)
        raise LcxError(f"--memory {str(path)!r} needs a method that reads document memories "
                       f"({', '.join(readers) or 'none installed'}); add --method {readers[0] if readers else 'NAME'}")
    config = json.loads((model_dir / "config.json").read_text())
    model = {key: config.get(key) for key in ("model_type", "num_hidden_layers", "hidden_size", "layer_types")}
    model["embedding_sha256"] = (embedding_fingerprint(model_dir) or {}).get("embedding_sha256")
    try:  # whole files before vLLM starts (its worker would fail on them after the engine start)
        meta = reader.check_memory(path, model)
    except LcxError as e:
        raise LcxError(f"--memory: {e}") from None
    note = reader.memory_built_note(path, meta, families.json_window(config))
    if note:
        log(note)


def check_adapter_for_vllm(path: Path, model_dir: Path) -> dict[str, Any]:
    """Refuse what vLLM's LoRA loader refuses, and adapters trained for another base model.
    Returns the adapter's PEFT config."""
    from lcx.adapters.peft_bridge import ADAPTER_WEIGHTS, read_sidecar, same_embeddings

    sidecar = read_sidecar(path)
    cfg_path = path / "adapter_config.json"
    try:
        cfg = json.loads(cfg_path.read_text())
    except FileNotFoundError:
        raise LcxError(f"{str(path)!r} has no adapter_config.json; pass the folder `lcx train` wrote") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise LcxError(f"{str(cfg_path)!r} is corrupted ({e}); re-save the adapter") from None
    if not (path / ADAPTER_WEIGHTS).is_file():
        raise LcxError(f"{str(path)!r} has no {ADAPTER_WEIGHTS}; lcx serves safetensors adapters only")
    if sidecar.get("full_model"):
        raise LcxError(f"{str(path)!r} is a fully trained model, not an adapter; serve it as the model (-m {path})")
    if cfg.get("peft_type") != "LORA":
        raise LcxError(f"adapter {str(path)!r} is a {cfg.get('peft_type')} adapter; vLLM serves LoRA adapters only")
    for key, what in _REFUSED.items():
        if cfg.get(key):
            raise LcxError(f"adapter {str(path)!r} uses {what} ({key}={cfg[key]!r}), which vLLM's LoRA loader "
                           f"refuses; train it as plain LoRA (no --full) to serve it")
    if cfg.get("bias", "none") != "none":
        raise LcxError(f"adapter {str(path)!r} trains biases (bias={cfg['bias']!r}), which vLLM's LoRA loader refuses")
    if int(cfg.get("r", 0)) > VLLM_LORA_RANKS[-1]:
        raise LcxError(f"adapter {str(path)!r} has rank {cfg['r']}; vLLM serves ranks up to {VLLM_LORA_RANKS[-1]}")
    want = sidecar.get("base_model") or {}
    if want.get("embedding_sha256"):
        have = embedding_fingerprint(model_dir)
        if have is not None and not same_embeddings(want, have):
            raise LcxError(f"adapter {str(path)!r} was trained for another base model (input embeddings differ; "
                           f"adapter base {want.get('name_or_path')!r}); "
                           f"serve it with that model")
    return cfg


def embedding_fingerprint(model_dir: Path) -> dict[str, str] | None:
    """The PEFT bridge's embedding fingerprint (``embedding_hashes``), read from the safetensors files without
    loading the model."""
    import torch
    from safetensors import safe_open
    from transformers import AutoConfig, AutoModelForCausalLM

    from lcx.adapters.peft_bridge import embedding_hashes

    config = AutoConfig.from_pretrained(str(model_dir), local_files_only=True)
    with torch.device("meta"):
        meta = AutoModelForCausalLM.from_config(config)
    emb = meta.get_input_embeddings().weight
    name = next((n for n, p in meta.named_parameters() if p is emb), None)
    if name is None:
        return None
    for f in sorted(model_dir.glob("*.safetensors")):
        with safe_open(str(f), framework="pt") as st:
            keys = set(st.keys())
            key = next((k for k in (name, name.removeprefix("model."), f"model.{name}") if k in keys), None)
            if key is not None:
                return embedding_hashes(st.get_slice(key)[:16])
    return None


def check_export_dir(out: Path, replacing: str) -> None:
    """An export replaces its folder whole: one holding anything but an earlier export (its ``MANIFEST``) is
    refused, and kept as it was."""
    if out.is_dir() and any(out.iterdir()) and not (out / MANIFEST).is_file():
        raise LcxError(f"{str(out)!r} is not empty and holds no lcx export ({MANIFEST}); {replacing}, so name a new "
                       f"or empty folder")


def export_for_vllm(model: str, methods: list[str] | tuple[str, ...] = (), options: dict[str, Any] | None = None,
                    adapters: dict[str, Path] | None = None, out: str | Path = "out/vllm",
                    max_model_len: int | None = None, overwrite: bool = False,
                    log: Callable[[str], None] = lambda s: None, memory: str | Path | None = None,
                    state_gib: float = 2.0, dtype: str | None = None) -> Export:
    """Write a folder vLLM serves without lcx code (see the module docstring).  ``dtype``: what the engine will
    compute in (default: what ``lcx generate`` loads in), the dtype the methods' ``auto`` options are measured in."""
    from lcx.models import dtype_name, load_model, resolve_dtype, resolve_model_path

    out = Path(out)
    adapters = {k: Path(v) for k, v in (adapters or {}).items()}
    for name in adapters:
        if not name or "/" in name or name.startswith("."):
            raise LcxError(f"adapter name {name!r} is not usable as a served model name; use NAME=DIR with a plain name")
    if max_model_len is not None and max_model_len <= 0:
        raise LcxError(f"--max-model-len must be > 0, got {max_model_len}")
    src = resolve_model_path(model)
    config = json.loads((src / "config.json").read_text())
    length = (families.json_window(config), max_model_len) if max_model_len else None
    insts = servable_methods(list(methods), options or {}, adapters, length)
    dtype = dtype_name(resolve_dtype(dtype))  # the served options are those lcx generate uses in that dtype
    auto.resolve(insts, src, lambda: load_model(src, dtype=dtype), dtype)
    _attention_spec([{"name": m.name, "options": m.to_options()} for m in insts])
    # with a method whose served state lcx's middleware computes (focusllm), the adapters are that state's
    # (lcx's path gates every LoRA to the candidate positions): the middleware applies them, not vLLM
    in_middleware = any(m.serving == "attention" and m.serve_state for m in insts)
    window = families.json_window(config)  # as lcx generate resolves local=0 (a stretched rope: its original)
    for m in insts:
        if m.serving == "config":
            config = m.vllm_config(config)
    derived = _derived_len(config)
    if max_model_len and max_model_len > derived:
        if _stretched(config):
            raise LcxError(f"--max-model-len {max_model_len} exceeds what the stretched rope covers ({derived}); "
                           f"raise the rope factor (-o rope.factor=...) or lower --max-model-len")
        # Plain RoPE: only the size of vLLM's rotary table; meaningful with an adapter trained that far (smt).
        log(f"note: serving up to {max_model_len} positions, beyond the model's trained window ({window}); "
            f"only a method trained for those positions (e.g. an smt adapter) makes them meaningful")
        config["max_position_embeddings"] = max_model_len
        derived = max_model_len
    checked = {name: check_adapter_for_vllm(path, src) for name, path in adapters.items()}
    if memory is not None:
        check_memory_for_serving(Path(memory), src, insts, log)
    max_concurrent = served_state_budget(insts, config, window, max_model_len or derived, state_gib, memory)

    if out.exists() and any(out.iterdir()):
        if not overwrite:
            raise LcxError(f"output folder {str(out)!r} exists and is not empty; pass --overwrite to replace it")
        check_export_dir(out, "--overwrite replaces an earlier export only")
    out.parent.mkdir(parents=True, exist_ok=True)
    # a fresh folder of our own (a fixed OUT.tmp was emptied first, even when it was a user's), gone on failure
    tmp = Path(tempfile.mkdtemp(dir=out.parent, prefix=f".{out.name}.", suffix=".tmp"))
    tmp.chmod(0o755)  # mkdtemp's 0700 would become the export's own mode
    try:
        mdir = tmp / "model"
        mdir.mkdir(parents=True)
        for f in sorted(src.iterdir()):
            if not f.is_file() or f.name in ("config.json", auto.AUTO_FILE):
                continue
            if f.suffix in _SMALL_SUFFIXES:
                shutil.copy2(f, mdir / f.name)
            else:  # weights: link, never copy
                os.symlink(f.resolve(), mdir / f.name)
        (mdir / "config.json").write_text(json.dumps(config, indent=2))
        described = [{"name": m.name, "options": m.to_options()} for m in insts]
        (mdir / "lcx.json").write_text(json.dumps({"format": 1, "methods": described, "source": str(src), "baked": True},
                                                  indent=2))
        final_adapters = {}
        for name, path in adapters.items():
            adir = tmp / "adapters" / name
            adir.mkdir(parents=True)
            for f in ("adapter_model.safetensors", "lcx.json"):
                shutil.copy2(path / f, adir / f)
            cfg = dict(checked[name])
            cfg["base_model_name_or_path"] = str((out / "model").resolve())
            (adir / "adapter_config.json").write_text(json.dumps(cfg, indent=2))
            final_adapters[name] = (out / "adapters" / name).resolve()
        rank = max((int(c.get("r", 0)) for c in checked.values()), default=0) if not in_middleware else 0
        exp = Export(out=out.resolve(), model_dir=(out / "model").resolve(), methods=described,
                     adapters={} if in_middleware else final_adapters,
                     middleware_adapters=final_adapters if in_middleware else {},
                     max_model_len=max_model_len or derived, window=window, named=list(methods),
                     memory=str(Path(memory).resolve()) if memory is not None else None, max_concurrent=max_concurrent,
                     max_lora_rank=next((r for r in VLLM_LORA_RANKS if r >= rank), 0) if rank else 0)
        (tmp / MANIFEST).write_text(json.dumps(exp.to_json(), indent=2))
        if out.exists():
            shutil.rmtree(out)
        os.replace(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return exp


def _stretched(config: dict) -> bool:
    params = config.get("rope_parameters") or {}
    params = params.get("full_attention", params)
    return params.get("rope_type", "default") != "default"


def _derived_len(config: dict) -> int:
    """The longest prompt vLLM derives from config.json (max positions x the rope factor)."""
    n = int(config.get("max_position_embeddings") or 0)
    params = config.get("rope_parameters") or {}
    params = params.get("full_attention", params)
    if params.get("rope_type", "default") in ("linear", "dynamic", "yarn"):
        return int(n * float(params.get("factor", 1.0)))
    return n


def attention_method(exp: Export) -> dict[str, Any] | None:
    """The method (name and options) the served model runs inside vLLM's attention, if any."""
    return _attention_spec(exp.methods)


def _attention_spec(methods: list[dict[str, Any]]) -> dict[str, Any] | None:
    """``attention_method`` of an export of ``methods`` (name and options each); refuses what the served
    attention cannot run."""
    from lcx.registry import registry

    reg = registry()
    found = [m for m in methods if reg.get(m["name"]).serving == "attention"]
    if len(found) > 1:
        raise LcxError(f"methods {', '.join(m['name'] for m in found)} each replace vLLM's attention; serve one")
    if found:  # an export's sidecar may be written by hand: its options are checked where they are read
        reg.get(found[0]["name"]).from_options(**found[0]["options"]).check_serving()
    return found[0] if found else None
