"""`lcx generate`: one long prompt through a stack of methods."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import click

from lcx.cli.base import CONTEXT, _echo_json, _open, main, method_options, model_option
from lcx.errors import LcxError


@main.command("generate", context_settings=CONTEXT)
@model_option
@method_options
@click.option("--input", "input_file", type=click.Path(path_type=Path), default=None,
              help="UTF-8 text file put before the prompt (the long document).")
@click.option("--prompt", "-p", default="", help="Text after the document (the question).")
@click.option("--max-new-tokens", "-n", type=click.IntRange(1), default=64, show_default=True,
              help="Tokens to generate.")
@click.option("--sample/--greedy", default=False, show_default=True, help="Sample instead of greedy decoding.")
@click.option("--temperature", type=click.FloatRange(min=0.0, min_open=True), default=None,
              help="Sampling temperature (with --sample; default 0.7).")
@click.option("--seed", type=int, default=0, show_default=True, help="Random seed of sampling.")
@click.option("--memory", "memory_dir", type=click.Path(path_type=Path), default=None,
              help="A memory built by `lcx memory build` (fot, multi-document mode).")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object instead of streaming text.")
def generate_cmd(model, methods, options, adapter, trust_remote_code, input_file, prompt, max_new_tokens,
                 sample, temperature, seed, memory_dir, as_json) -> None:
    """Generate a continuation of a (long) document + prompt through the chosen methods.

    \b
    Example:
      lcx generate -m smollm2-135m --method streaming --input ../shared/data/books/wells_invisible_man.txt \\
          --prompt "Summary of the story so far:" -n 64
    """
    import time

    import torch
    from transformers import TextStreamer

    from lcx.generation import generate
    from lcx.session import read_text_file

    if temperature is not None and not sample:
        raise LcxError(f"--temperature {temperature} applies to sampling; add --sample (greedy decoding has no "
                       f"temperature)")
    text = (read_text_file(input_file) if input_file else "")
    if input_file is not None and not text.strip() and not prompt.strip():
        raise LcxError(f"empty input: file {str(input_file)!r} is empty (or only whitespace); put the document in it or pass --prompt TEXT")
    text = (text + ("\n" if text and prompt else "") + prompt)
    if not text.strip():
        raise LcxError("empty input: give --input FILE and/or --prompt TEXT with some text")
    s = _open(model, methods, options, adapter, trust_remote_code)
    try:
        if memory_dir is not None:
            reader = _memory_reader(s.run, memory_dir)
            meta = reader.load_memory(memory_dir, s.model)
            _note_memory_adapter(memory_dir, meta, adapter)
            note = reader.memory_built_note(memory_dir, meta)
            if note:
                click.echo(note, err=True)
            built = meta.get("dtype", "float32")  # memories from before dtypes were float32
            if built != s.run.dtype:
                click.echo(f"note: memory {str(memory_dir)!r} was built in {built} and is read in {s.run.dtype} (its "
                           f"keys were rounded otherwise; --dtype {built} reads it as built)", err=True)
        ids = s.tokenizer(text, return_tensors="pt")["input_ids"]
        torch.manual_seed(seed)
        kwargs: dict[str, Any] = {"do_sample": sample}
        if sample:
            kwargs["temperature"] = 0.7 if temperature is None else temperature
        if not as_json:
            kwargs["streamer"] = TextStreamer(s.tokenizer, skip_prompt=True, skip_special_tokens=True)
        t0 = time.perf_counter()
        new = generate(s.run, ids, max_new_tokens=max_new_tokens, progress=not as_json, **kwargs)
        dt = time.perf_counter() - t0
        plan = s.run.plan
        if as_json:
            _echo_json({
                "model": model, **s.run.describe(), "prompt_tokens": int(ids.shape[1]),
                "request_options": {m.name: m.request_options() for m in s.run.methods if m.request_options()},
                "dropped_tokens": getattr(plan, "dropped", 0), "new_tokens": int(new.shape[1]),
                "text": s.tokenizer.decode(new[0], skip_special_tokens=True), "seconds": round(dt, 3),
            })
    finally:
        s.close()


def _memory_reader(run: Any, memory_dir: Path) -> Any:
    """The run's method that reads document memories (``Method.reads_memory``); refused when it has none."""
    reader = next((m for m in run.methods if m.reads_memory), None)
    if reader is not None:
        return reader
    from lcx.registry import registry

    readers = sorted(name for name, cls in registry().methods.items() if cls.reads_memory)
    if not readers:
        raise LcxError(f"--memory {str(memory_dir)!r} needs a method that reads document memories, and no installed "
                       f"method does (`lcx methods` lists them); drop --memory")
    fix = f"add --method {readers[0]}" if len(readers) == 1 else "add one of them with --method NAME"
    raise LcxError(f"--memory {str(memory_dir)!r} needs a method that reads document memories ({', '.join(readers)}); "
                   f"{fix}")


def _note_memory_adapter(memory_dir: Path, meta: dict[str, Any], adapter: Path | None) -> None:
    """Say so when a memory is read with another adapter than it was built with: its keys and values came
    from other projections than the ones now attending to them (allowed: `lcx serve --memory` shares one memory
    across its adapters on purpose)."""
    from lcx.adapters.peft_bridge import adapter_digest

    built = meta.get("adapter") or None
    if (built or {}).get("sha256") == (adapter_digest(adapter) if adapter else None):
        return
    what = f"with the adapter then in {built['path']}" if built else "by the model without an adapter"
    now = f"read with the adapter in {adapter}" if adapter else "read without an adapter"
    fix = f"--adapter {adapter}" if adapter else "no --adapter"
    click.echo(f"note: memory {str(memory_dir)!r} was built {what}, and is {now}: its keys come from other "
               f"projections (rebuild it with `lcx memory build {fix}` to match)", err=True)
