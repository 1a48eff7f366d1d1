"""The vLLM general plugin (entry point ``vllm.general_plugins``: ``lcx = "lcx.integrations.vllm:register"``):
vLLM loads it in every process it starts.  It registers the ``lcx`` config format and installs lcx's
worker-side pieces (the served attention, the CPU multi-LoRA ops)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from lcx.errors import LcxError
from lcx.integrations.vllm.export import servable_methods

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
    from lcx.integrations.vllm.attention import install

    install()  # a no-op unless `lcx serve` named an attention method (LCX_SERVED_MODEL)
    from lcx.integrations.vllm.lora import install as install_lora_ops

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


