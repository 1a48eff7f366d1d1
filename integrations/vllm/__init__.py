"""Serve lcx methods through vLLM's OpenAI-compatible server.

One module per job:

    export       ``lcx export --for vllm``: a folder plain vLLM loads, and the checks made before serving
    plugin       the vLLM general plugin (``lcx.integrations.vllm:register``, run in every vLLM process)
    server       ``lcx serve``: the ``vllm serve`` process, its environment, readiness and shutdown
    middleware   lcx's request middleware in the API server: per-request options, prompt rewriting,
                 per-request state computed on lcx's own path
    attention    the worker side of a method served inside vLLM's attention (``ServedAttention``: a method's
                 served form subclasses it, in the method's own plugin)
    paged_cache  reading keys and values back from vLLM's paged KV cache
    connector    lcx's KV connector: a method's fixed prefix of keys/values loaded into vLLM's own cache
    lora         multi-LoRA ops for vLLM's CPU backend

Which methods can be served, and how, is declared by each method (``Method.serving``): "base" methods serve
as the plain model plus their adapter, "config" methods rewrite config.json, "prompt" methods rewrite each
prompt's tokens in the middleware, "attention" methods answer vLLM's attention through the served class
their plugin names (``Method.served_attention``).  This package never asks for a method by name.
"""

from __future__ import annotations

from lcx.integrations.vllm.export import Export, check_export_dir, export_for_vllm, servable_methods
from lcx.integrations.vllm.plugin import register
from lcx.integrations.vllm.server import (
    KV_CONNECTOR,
    ServerProcess,
    api_keys,
    check_port_free,
    die_with_parent,
    kv_cache_args,
    served_methods,
    signal_group,
    start,
    stop,
    vllm_cli,
    vllm_command,
    vllm_env,
    wait_ready,
)

__all__ = [
    "Export", "KV_CONNECTOR", "ServerProcess", "api_keys", "check_export_dir", "check_port_free", "die_with_parent",
    "export_for_vllm", "kv_cache_args", "register", "servable_methods", "served_methods", "signal_group", "start",
    "stop", "vllm_cli", "vllm_command", "vllm_env", "wait_ready",
]
