"""`lcx eval passkey|ruler|ppl|compare|dictionary`: evaluation suites, each writing JSON and a plot."""

from __future__ import annotations

import hashlib
import os
import re
import sys
from collections import Counter
from pathlib import Path

import click

from lcx.cli.base import (
    CONTEXT, OUT_DIR, LcxGroup, RESUME_HELP, _echo_json, _float_list, _int_list, _open, _token_count,
    _device, _dtype, _with_limits, device_option, main, method_options, model_option, text_field_option,
)
from lcx.errors import LcxError
from lcx.evals import passkey, ppl, ruler  # their configs' defaults are the CLI's (the CLI loads the evals anyway)

DEPTHS_TEXT = ",".join(map(str, passkey.DEPTHS))


@main.group("eval", cls=LcxGroup, context_settings=CONTEXT)
def eval_grp() -> None:
    """Evaluation suites; each writes JSON and a plot."""


@eval_grp.command("passkey", context_settings=CONTEXT)
@model_option
@method_options
@click.option("--lengths", callback=_int_list, default="4096", show_default=True,
              help="Comma-separated prompt lengths in tokens; K suffix allowed (4K = 4096).")
@click.option("--depths", callback=_float_list, default=DEPTHS_TEXT, show_default=True,
              help="Comma-separated needle depths in [0, 1].")
@click.option("--samples", type=click.IntRange(1), default=passkey.PasskeyConfig.samples, show_default=True,
              help="Random keys per cell.")
@click.option("--haystack", "haystack", multiple=True, type=click.Path(exists=True, path_type=Path), metavar="PATH",
              help="Hide the needle in real text instead of the repeated filler: text files, folders of them or "
                   ".jsonl (e.g. ../shared/data/books); whole sentences from the start, so one length's prompts "
                   "share their text. Repeatable.")
@click.option("--seed", type=int, default=passkey.PasskeyConfig.seed, show_default=True,
              help="Draws the keys (same seed, same prompts).")
@click.option("--max-new-tokens", type=click.IntRange(1), default=passkey.PasskeyConfig.max_new_tokens,
              show_default=True, help="New tokens per answer; the key must be among them (a model that restates "
                                       "the question before answering needs more).")
@click.option("--out", type=OUT_DIR, default=Path("out/passkey"), show_default=True,
              help="Folder for passkey.json and passkey.png.")
@click.option("--resume", is_flag=True, help=RESUME_HELP)
@click.option("--json", "as_json", is_flag=True, help="Print the summary as JSON.")
def eval_passkey(model, methods, options, adapter, trust_remote_code, lengths, depths, samples, haystack, seed,
                 max_new_tokens, out, resume, as_json):
    """Passkey retrieval over a length x depth grid: a 5-digit key hidden in repeated filler (FoT, FocusLLM)
    or, with --haystack, in real text.

    Writes OUT/passkey.json (config, per-sample outputs, summary) and a heatmap OUT/passkey.png;
    every finished sample is also appended to OUT/passkey.samples.jsonl, so an interrupted grid
    continues with --resume.  The keys of a cell share the filler before their needle: methods whose
    memory allows it (fot, streaming) feed it once and start the cell's other keys from a copy, with
    the same answers (a sample's "seconds" then covers only what it fed).
    """
    cfg = passkey.PasskeyConfig(lengths=lengths, depths=depths, samples=samples, seed=seed,
                                haystack=_haystack(haystack), max_new_tokens=max_new_tokens)
    _run_grid(passkey, "passkey", cfg, model, methods, options, adapter, trust_remote_code, out, resume, as_json,
              lambda label, by: f"passkey accuracy ({label}): "
              + ", ".join(f"{n}: {a:.0%}" for n, a in by["accuracy_by_length"].items()))

HAYSTACK_HELP = ("Real text: text files, folders of them or .jsonl (e.g. ../shared/data/books); whole sentences from "
                 "the start, so one length's prompts share their text. Repeatable.")


def _tasks(ctx, param, value: str) -> list[str]:
    from lcx.evals.ruler import parse_tasks

    try:
        return parse_tasks(value)
    except LcxError as e:
        raise click.BadParameter(str(e)) from None


def ruler_options(compare: bool):
    """The options `eval ruler` and `eval compare` share, their help in the command's own terms."""
    own = "each task's own"
    new_tokens = f"passkey {passkey.PasskeyConfig.max_new_tokens}; ruler: {own}" if compare else own
    tasks = ("ruler: comma" if compare else "Comma") + "-separated tasks, `all`, or `niah` for every needle task: "

    def add(f):
        f = click.option("--max-new-tokens", type=click.IntRange(1), default=None,
                         help=f"New tokens per answer (default: {new_tokens}, enough for its answer).")(f)
        return click.option("--tasks", callback=_tasks, default="all", show_default=True,
                            help=tasks + ", ".join(ruler.TASKS) + ".")(f)
    return add


@eval_grp.command("ruler", context_settings=CONTEXT)
@model_option
@method_options
@ruler_options(compare=False)
@click.option("--lengths", callback=_int_list, default="4096", show_default=True,
              help="Comma-separated prompt lengths in tokens; K suffix allowed (4K = 4096).")
@click.option("--samples", type=click.IntRange(1), default=ruler.RulerConfig.samples, show_default=True,
              help="Samples per task and length.")
@click.option("--depths", callback=_float_list, default=DEPTHS_TEXT, show_default=True,
              help="Depths of the queried needle in [0, 1]: sample i takes the (i mod count)-th.")
@click.option("--haystack", "haystack", multiple=True, required=True, type=click.Path(exists=True, path_type=Path),
              metavar="PATH", help=HAYSTACK_HELP)
@click.option("--seed", type=int, default=ruler.RulerConfig.seed, show_default=True,
              help="Draws keys, values and lists (same seed, same prompts).")
@click.option("--out", type=OUT_DIR, default=Path("out/ruler"), show_default=True,
              help="Folder for ruler.json, ruler.png and the journal.")
@click.option("--resume", is_flag=True, help=RESUME_HELP)
@click.option("--json", "as_json", is_flag=True, help="Print the summary as JSON.")
def eval_ruler(model, methods, options, adapter, trust_remote_code, tasks, max_new_tokens, lengths, samples, depths,
               haystack, seed, out, resume, as_json):
    """RULER's synthetic tasks over real text: needles (single, multi-key, multi-value, multi-query), variable
    tracking, common- and frequent-words extraction, on a lengths x tasks grid.

    Prompts are raw text ending in the answer's first words (no chat template); a sample scores the share of
    the expected strings its output holds (RULER's scoring).  Writes OUT/ruler.json (config, per-sample
    prompts' answers and outputs, scores by task and length) and the heatmap OUT/ruler.png; finished samples
    go to OUT/ruler.samples.jsonl as they end, so an interrupted grid continues with --resume.

    \b
    Example:
      lcx eval ruler -m gemma3-270m --method fot --lengths 8K,16K --tasks niah,vt --haystack ../shared/data/books
    """
    cfg = ruler.RulerConfig(lengths=lengths, tasks=tasks, samples=samples, depths=depths, seed=seed,
                            haystack=_haystack(haystack) or "", max_new_tokens=max_new_tokens)
    _run_grid(ruler, "ruler", cfg, model, methods, options, adapter, trust_remote_code, out, resume, as_json,
              lambda label, by: f"RULER mean score ({label}): "
              + ", ".join(f"{n}: {a:.0%}" for n, a in by["score_by_length"].items()))


def _run_grid(grid, stem: str, cfg, model, methods, options, adapter, trust, out: Path, resume: bool, as_json: bool,
              line) -> None:
    """One passkey or RULER grid (``grid``: its module) on one stack: journaled, written as OUT/STEM.json and
    .png; prints the JSON summary with --json, else ``line(label, summary)`` and the files written."""
    s = _open(model, methods, options, adapter, trust)
    try:
        journal = _journal(out / f"{stem}.samples.jsonl", model, s.run, adapter, cfg, resume)
        result = grid.evaluate(_grid_generator(s.run, progress=not as_json), s.tokenizer, cfg,
                               progress=not as_json, journal=journal)
        label = "+".join(m.name for m in s.run.methods) or "no method"
        result = {"model": model, **s.run.describe(), "methods_label": label,
                  "adapter": str(adapter) if adapter else None, **result}
        js, png = grid.write_result(result, out)
    finally:
        s.close()
    if as_json:
        _echo_json({"json": str(js), "plot": str(png), **result["summary"]})
    else:
        click.echo(line(label, result["summary"]))
        click.echo(f"wrote {js} and {png}")

def _haystack(paths: tuple[Path, ...]) -> str | None:
    if any("," in str(p) for p in paths):
        raise LcxError(f"--haystack {next(p for p in paths if ',' in str(p))}: a path with a comma cannot be "
                       "recorded; rename it")
    return ",".join(map(str, paths)) or None


def _grid_generator(run, progress: bool = False):
    """Greedy generation for a passkey or RULER grid: the text before a cell's first needle, the same for each
    of its samples, is fed once and its memory reused (methods that keep all per-prompt state in their cache; same tokens).
    ``progress``: a bar over each prompt's windows as they are read (a 128K prompt takes minutes).
    ``gen.request_options``: what the methods' per-request options (rope's factor, focusllm's chunk) came to
    for the last prompt, recorded with its sample."""
    from lcx.generation import PrefixReuse, generate

    def gen(ids, n, shared):
        out = generate(run, ids, max_new_tokens=n, reuse=gen.reuse, shared=shared, progress=progress)
        gen.request_options = {m.name: o for m in run.methods if (o := m.request_options())}
        return out

    gen.reuse, gen.request_options = PrefixReuse(), {}
    return gen


# what a journal written before lcx recorded its dtype or haystack ran with: float32, the filler
UNRECORDED = {"dtype": "float32", "config": {"haystack": None}}


def _journal(path: Path, model: str, run, adapter, cfg, resume: bool):
    """The journal of a passkey or RULER grid: its fingerprint is the run, the adapter's weights and the grid."""
    from dataclasses import asdict

    from lcx.adapters.peft_bridge import adapter_digest
    from lcx.io import Journal

    # the adapter by its weights as well as its path: a run retrained into the same folder is another run
    digest = adapter_digest(adapter) if adapter else None
    fingerprint = {"model": model, **run.describe(), "adapter": str(adapter) if adapter else None,
                   "adapter_sha256": digest, "config": asdict(cfg)}
    # an option a journal lacks matches at the value runs had before it was recorded; a journal written
    # before lcx recorded the adapter's digest is taken as this adapter's (said below)
    defaults = {"methods": [{"options": m.unrecorded_options()} for m in run.methods], "adapter_sha256": digest,
                **UNRECORDED}
    journal = Journal(path, fingerprint, resume=resume, defaults=defaults)
    if journal.reused:
        click.echo(f"resuming: {journal.reused} samples already in {path}", err=True)
        if digest and "adapter_sha256" not in (journal.head or {}):
            click.echo(f"note: {path} predates lcx recording the adapter's weights; its samples are taken as "
                       f"those of the adapter now in {adapter}", err=True)
    return journal


def _stem(names: list[str], adapter) -> str:
    """A stack's name in journal file names and --include rows: its methods (none), @ its adapter folder's name."""
    stem = "+".join(names) or "none"
    return re.sub(r"[^A-Za-z0-9_.+@-]", "_", stem + (f"@{Path(adapter).name}" if adapter else ""))


def _stack_methods(stack: str) -> tuple[list[str], str | None]:
    """A --stack's methods and adapter folder; an @DIR stack's methods are those its adapter brings."""
    from lcx.evals.compare import parse_stack

    names, adapter = parse_stack(stack)
    if adapter and not names:
        from lcx.adapters.peft_bridge import read_sidecar
        from lcx.session import trained_methods

        try:
            names = list(trained_methods(read_sidecar(adapter)))
        except LcxError as e:
            raise LcxError(f"stack {stack!r}: {e}") from None
    return names, adapter


def _journal_stem(names: list[str], adapter, taken: dict[str, str]) -> str:
    """A stack's journal name (``_stem``), with a hash of its folder where an earlier stack's adapter folder has
    the same name (.../a/adapter, .../b/adapter); ``taken`` (name -> folder) records it."""
    stem = _stem(names, adapter)
    where = str(Path(adapter).resolve()) if adapter else ""
    if taken.setdefault(stem, where) != where:
        stem += "-" + hashlib.sha256(where.encode()).hexdigest()[:8]
        taken[stem] = where
    return stem


def _included(paths, model: str, want_dtype: str, cfg, grid, tok, taken: set[str], ours: list[Path]) -> dict[str, dict]:
    """--include: each finished journal's row, read from it (never generated or written); checked against this
    command's model, grid and dtype before any stack runs, so a mismatch costs nothing.  ``ours``: the journals
    this command's stacks write, which an included one must not be."""
    import json
    from dataclasses import asdict

    from lcx.io import Journal

    want_cfg = json.loads(json.dumps(asdict(cfg), default=str))
    rows: dict[str, dict] = {}
    ours = {p.resolve() for p in ours}
    for path in paths:
        if path.resolve() in ours:
            raise LcxError(f"--include {path}: a --stack of this command writes that journal; drop the --include "
                           f"(with --resume the stack reads its finished samples from it) or choose another --out")
        try:
            head = json.loads(path.read_text().split("\n", 1)[0])["fingerprint"]
            methods = [m["name"] for m in head["methods"]]
        except (ValueError, KeyError, TypeError):
            raise LcxError(f"--include {path}: not a passkey or RULER journal (its first line is no journal header); "
                           f"give a *.samples.jsonl written by lcx eval passkey, ruler or compare") from None
        dtype = head.get("dtype", UNRECORDED["dtype"])
        got_cfg = {**UNRECORDED["config"], **head.get("config", {})}
        wrong = [f"model {head.get('model')!r}, not {model!r}"] if head.get("model") != model else []
        wrong += [f"{k} {got_cfg[k]!r}, not {v!r}" if k in got_cfg else f"{k} not recorded"
                  for k, v in want_cfg.items() if k not in got_cfg or got_cfg[k] != v]
        wrong += [f"{k} {got_cfg[k]!r}, which this suite has not" for k in got_cfg if k not in want_cfg]
        wrong += [f"dtype {dtype}, not {want_dtype}"] if dtype != want_dtype else []
        if wrong:
            raise LcxError(f"--include {path}: it is another grid ({'; '.join(wrong)}); give this command the "
                           f"journal's own model, grid options and --dtype, or rerun that stack with --stack")
        name = base = _stem(methods, head.get("adapter"))
        n = 1
        while name in taken or name in rows:  # told apart by its folder, then by a count
            n += 1
            name = f"{base} ({path.parent.name}{f' {n - 1}' if n > 2 else ''})"
        journal = Journal(path, head, resume=True, read_only=True)

        def missing(*_, path=path, held=journal.reused):
            raise LcxError(f"--include {path}: it holds {held} of this grid's samples, not all; finish it first "
                           f"(its own command with --resume), then include it")

        rows[name] = {"methods": head["methods"], "dtype": dtype, "adapter": head.get("adapter"),
                      "included": str(path), **grid.evaluate(missing, tok, cfg, progress=False, journal=journal)}
    return rows


def _ppl_documents(data: tuple[str, ...], tokenizer, max_docs: int | None,
                   text_field: str = "text") -> list[tuple[str, list[int]]]:
    from lcx.data import iter_documents

    docs = []
    for d in iter_documents(data, text_field):
        if d["text"].strip():
            docs.append((d["source"], tokenizer(d["text"], add_special_tokens=False)["input_ids"]))
        if max_docs and len(docs) >= max_docs:
            break
    if not docs:
        raise LcxError(f"no non-empty document in {list(data)}")
    # a document is named by its file name, or by its whole path where two share a name (a/__init__.py and
    # b/__init__.py were one entry of the per-document results)
    names = Counter(Path(source).name for source, _ in docs)
    return [(Path(source).name if names[Path(source).name] == 1 else source, ids) for source, ids in docs]


@eval_grp.command("ppl", context_settings=CONTEXT)
@model_option
@method_options
@click.option("--data", "-d", multiple=True, required=True, metavar="PATH", help="Documents: files, folders, .jsonl.")
@text_field_option
@click.option("--max-docs", type=click.IntRange(1), default=None, help="Use at most this many documents.")
@click.option("--contexts", callback=_int_list, default="2K,4K,8K,16K", show_default=True,
              help="Context lengths N before the scored tokens; K suffix allowed.")
@click.option("--target", type=click.IntRange(1), default=ppl.PplConfig.target, show_default=True,
              help="Scored tokens after the context.")
@click.option("--samples", type=click.IntRange(1), default=ppl.PplConfig.samples, show_default=True,
              help="Scored spans per document.")
@click.option("--room", callback=_token_count, default=None, metavar="N",
              help="Tokens before the first scored span (default: the largest of --contexts); K suffix allowed. "
                   "Runs asking for different --contexts score the same text only with the same --room.")
@click.option("--out", type=OUT_DIR, default=Path("out/ppl"), show_default=True,
              help="Folder for ppl.json and ppl.png.")
@click.option("--json", "as_json", is_flag=True, help="Print the summary as JSON.")
def eval_ppl(model, methods, options, adapter, trust_remote_code, data, text_field, max_docs, contexts, target, samples,
             room, out, as_json):
    """Perplexity and next-token accuracy of the last TARGET tokens given N tokens of context.

    Writes OUT/ppl.json and OUT/ppl.png.  The same scored spans serve every N.
    """
    from lcx.data import special_prefix
    from lcx.generation import score_tail

    s = _open(model, methods, options, adapter, trust_remote_code)
    try:
        docs = _ppl_documents(data, s.tokenizer, max_docs, text_field)
        cfg = ppl.PplConfig(contexts=contexts, target=target, samples=samples, room=room)
        label = "+".join(m.name for m in s.run.methods) or "none"
        result = {"model": model, **s.run.describe(), "methods_label": label, "data": list(data),
                  "adapter": str(adapter) if adapter else None,
                  **ppl.evaluate(lambda ids, n: score_tail(s.run, ids, n), docs, cfg, progress=not as_json,
                                 prefix=special_prefix(s.tokenizer))}
    finally:
        s.close()
    js = ppl.write_json(result, out / "ppl.json")
    png = ppl.plot({label: result}, out / "ppl.png", f"{model}: perplexity vs context")
    if as_json:
        _echo_json({"json": str(js), "plot": str(png), **result["summary"]})
    else:
        for n in result["summary"]["ppl"]:
            click.echo(f"N={n:>6}: ppl {result['summary']['ppl'][n]:8.3f}  acc {result['summary']['accuracy'][n]:.3f}")
        short = result["summary"]["documents_too_short"]
        click.echo(f"scored {result['summary']['documents_scored']} document(s)"
                   + (f"; {len(short)} shorter than {'--room' if room else 'the longest context'} + target were left out: "
                      f"{', '.join(short[:3])}{' ...' if len(short) > 3 else ''}" if short else ""))
        click.echo(f"wrote {js} and {png}")


@eval_grp.command("compare", context_settings=CONTEXT)
@click.argument("suite", type=click.Choice(["passkey", "ruler", "ppl"]))
@model_option
@click.option("--stack", "stacks", multiple=True, metavar="METHODS",
              help="A method stack: none, a method, or methods joined by + (rope+streaming); add @DIR to load "
                   "an adapter for this stack only (focusllm@out/adapter; @out/adapter: its trained methods). "
                   "Repeat per stack.")
@click.option("--include", "includes", multiple=True, metavar="JOURNAL",
              type=click.Path(exists=True, dir_okay=False, path_type=Path),
              help="passkey, ruler: add a finished run as a row, its samples read from its journal (eval "
                   "passkey|ruler's OUT/SUITE.samples.jsonl, or another compare's OUT/compare-SUITE.STACK.samples.jsonl), "
                   "not generated again. Its model, grid and dtype must be this command's; the row keeps its own "
                   "options (-o does not apply to it) and is named by its methods, with its folder where a stack has "
                   "that name. Repeatable; with it --stack is optional.")
@click.option("--option", "-o", "options", multiple=True, metavar="METHOD.KEY=VALUE",
              help="Per-method option, applied in every stack that has the method.")
@click.option("--lengths", callback=_int_list, default="4096", show_default=True,
              help="passkey, ruler: prompt lengths.")
@click.option("--depths", callback=_float_list, default=DEPTHS_TEXT, show_default=True,
              help="passkey, ruler: needle depths.")
@click.option("--samples", type=click.IntRange(1), default=None,
              help=f"Keys per cell (passkey, default {passkey.PasskeyConfig.samples}), samples per task and length "
                   f"(ruler, default {ruler.RulerConfig.samples}) or spans per document "
                   f"(ppl, default {ppl.PplConfig.samples}).")
@click.option("--seed", type=int, default=passkey.PasskeyConfig.seed, show_default=True,
              help="passkey, ruler: draws the keys (same seed, same prompts).")
@click.option("--haystack", "haystack", multiple=True, type=click.Path(exists=True, path_type=Path), metavar="PATH",
              help="passkey: hide the needle in real text instead of the repeated filler; ruler (required): the "
                   "text of every task. " + HAYSTACK_HELP)
@ruler_options(compare=True)
@click.option("--data", "-d", multiple=True, metavar="PATH", help="ppl: documents.")
@text_field_option
@click.option("--max-docs", type=click.IntRange(1), default=None, help="ppl: at most this many documents.")
@click.option("--contexts", callback=_int_list, default="2K,4K,8K,16K", show_default=True, help="ppl: context lengths.")
@click.option("--target", type=click.IntRange(1), default=ppl.PplConfig.target, show_default=True,
              help="ppl: scored tokens.")
@click.option("--room", callback=_token_count, default=None, metavar="N",
              help="ppl: tokens before the first scored span (default: the largest of --contexts).")
@click.option("--out", type=OUT_DIR, default=Path("out/compare"), show_default=True,
              help="Folder for compare-SUITE.json, .md and .png (and the passkey journals).")
@click.option("--resume", is_flag=True, help="passkey, ruler: " + RESUME_HELP)
@device_option
@click.option("--json", "as_json", is_flag=True, help="Print the table as JSON.")
def eval_compare(suite, model, stacks, includes, options, lengths, depths, samples, seed, haystack, tasks,
                 max_new_tokens, data, text_field, max_docs, contexts, target, room, out, resume, as_json):
    """Run one suite over several method stacks; writes OUT/compare-SUITE.{json,md,png}.

    \b
    Examples:
      lcx eval compare passkey -m smollm2-135m --stack vanilla --stack streaming --stack rope+streaming \\
          --lengths 8K,16K --samples 3 -o rope.factor=2
      # the same grid, with fot's row from an earlier `lcx eval passkey ... --method fot --out out/fot`
      lcx eval compare passkey -m smollm2-135m --stack vanilla --include out/fot/passkey.samples.jsonl \\
          --lengths 8K,16K --samples 3
    """
    from lcx.data import special_prefix
    from lcx.evals import compare as cmp
    from lcx.generation import score_tail
    from lcx.models import dtype_name, load_model, model_dtype
    from lcx.session import parse_options

    if not stacks and not includes:
        raise LcxError("nothing to compare: give a --stack METHODS per stack (e.g. --stack none --stack fot)"
                       + (" or --include JOURNAL" if suite != "ppl" else ""))
    if includes and suite == "ppl":
        raise LcxError(f"--include {includes[0]}: ppl keeps no journal to include; rerun that stack with --stack")
    opts = parse_options(options)
    hf_model, tok = load_model(model, device=_device(), dtype=_dtype())
    if suite in ("passkey", "ruler"):
        if suite == "passkey":
            new = {"max_new_tokens": max_new_tokens} if max_new_tokens else {}
            cfg = passkey.PasskeyConfig(lengths=lengths, depths=depths, seed=seed, haystack=_haystack(haystack),
                                        samples=samples or passkey.PasskeyConfig.samples, **new)
        else:
            if not haystack:
                raise LcxError("ruler needs real text: give --haystack PATH (e.g. ../shared/data/books)")
            cfg = ruler.RulerConfig(lengths=lengths, tasks=tasks, samples=samples or ruler.RulerConfig.samples,
                                    depths=depths, seed=seed, haystack=_haystack(haystack) or "",
                                    max_new_tokens=max_new_tokens)
        grid = passkey if suite == "passkey" else ruler
        seen: dict[str, str] = {}  # the journals the stacks will write, in the order they run
        ours = [out / f"compare-{suite}.{_journal_stem(*_stack_methods(s), seen)}.samples.jsonl" for s in stacks]
        included = _included(includes, model, dtype_name(model_dtype(hf_model)), cfg, grid, tok, taken=set(stacks),
                             ours=ours)

        journals = iter(ours)  # compare evaluates each stack once, in the order given

        def ev(run, adapter):
            path = next(journals, None)
            if path is None:  # an error that says what broke, not a bare StopIteration
                raise RuntimeError(f"compare evaluated more stacks than the {len(ours)} it was given")
            journal = _journal(path, model, run, adapter, cfg, resume)
            return grid.evaluate(_grid_generator(run, progress=not as_json), tok, cfg, progress=not as_json,
                                 journal=journal)
    else:
        included = {}
        if not data:
            raise LcxError("ppl needs documents: give --data PATH (e.g. ../shared/data/books)")
        docs = _ppl_documents(data, tok, max_docs, text_field)
        cfg = ppl.PplConfig(contexts=contexts, target=target, samples=samples or ppl.PplConfig.samples, room=room)
        ev = lambda run, adapter: ppl.evaluate(lambda ids, n: score_tail(run, ids, n), docs, cfg,  # noqa: E731
                                               progress=not as_json, prefix=special_prefix(tok))
    command = "lcx " + " ".join(sys.argv[1:])
    partial = lambda done: cmp.write_json({"suite": suite, "model": model, "command": command,  # noqa: E731
                                           "unfinished": [s for s in stacks if s not in done],
                                           "stacks": {**done, **included}}, out / f"compare-{suite}.json")
    results = cmp.compare(hf_model, list(stacks), opts, ev, log=(lambda m: None) if as_json else click.echo,
                          on_stack_done=partial)
    results = {**results, **included}
    header, rows = {"passkey": cmp.passkey_table, "ruler": cmp.ruler_table, "ppl": cmp.ppl_table}[suite](results)
    js = partial(results)  # the final write: nothing unfinished
    md = cmp.write_markdown(header, rows, out / f"compare-{suite}.md", command)
    title = f"{model}: {suite} by method stack"
    png = (cmp.plot_by_length(results, out / "compare-passkey.png", title) if suite == "passkey"
           else cmp.plot_by_length(results, out / "compare-ruler.png", title, "score_by_length", "RULER mean score")
           if suite == "ruler" else ppl.plot(results, out / "compare-ppl.png", title))
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
@click.option("--seed", type=int, default=1234, show_default=True, help="Draws the dictionaries and queries.")
@click.option("--label", default=None, help="Name of this run in the plot (default: the methods, + adapter).")
@click.option("--out", type=OUT_DIR, default=Path("out/dictionary"), show_default=True,
              help="Folder for dictionary.json and dictionary.png.")
@click.option("--json", "as_json", is_flag=True, help="Print the result as JSON (no table, no progress bars).")
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
                                  require_tokenizer=False, device=_device(), dtype=_dtype()))
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
    named = label is not None
    label = label or ("+".join(m["name"] for m in desc["methods"]) or "none") + (f" + {Path(adapter).name}" if adapter else "")
    result = {"model": model, **desc, "adapter": str(adapter) if adapter else None, "query_tokens": query_tokens,
              "results": per_size}
    path = out / "dictionary.json"
    same = ("model", "methods", "adapter", "query_tokens")  # a rerun of these replaces its earlier line
    with accumulated_runs(path) as runs:
        other = lambda name: name in runs and any(runs[name].get(k) != result.get(k) for k in same)  # noqa: E731
        if not named and other(label):  # the default label names another run (other options, model...): keep both
            base, k = label, 2
            while other(label):
                label, k = f"{base} #{k}", k + 1
            click.echo(f"note: {base!r} in {path} is a run with other settings; this one is {label!r} "
                       f"(name runs with --label)", err=True)
        runs[label] = result
        js = write_json({**result, "label": label, "command": "lcx " + " ".join(sys.argv[1:]), "runs": runs}, path)
        models = {Path(r["model"]).name for r in runs.values()}  # the runs may come from several models
        png = dictionary.plot(runs, out / "dictionary.png",
                              "dictionary lookup" + (f": {models.pop()}" if len(models) == 1 else ""))
    if as_json:
        _echo_json({"json": str(js), "plot": str(png), **{k: v["accuracy"] for k, v in per_size.items()}})
    else:
        click.echo(f"wrote {js} and {png}")


@eval_grp.command("lm-eval", context_settings=dict(CONTEXT, ignore_unknown_options=True, allow_extra_args=True,
                                                   help_option_names=[]))
@click.argument("args", nargs=-1, type=click.UNPROCESSED)
def eval_lm_eval(args):
    """lm-evaluation-harness's own command line with the `lcx` model registered: every argument goes to
    `lm_eval` unchanged.

    \b
    Example (RULER's needle task at 4K and 8K; a known model's folder is passed on as the `tokenizer` lm-eval's
    RULER tasks size prompts with):
      lcx eval lm-eval run --model lcx --tasks niah_single_1 \\
          --model_args model=smollm2-135m,method=fot --metadata '{"max_seq_lengths": [4096, 8192]}'
    In Python: `import lcx.integrations.lm_eval` before `lm_eval.simple_evaluate(model="lcx", ...)`.
    Runs offline (HF_HUB_OFFLINE=1, HF_DATASETS_OFFLINE=1) unless those are set: tasks that download data need
    them set to 0 and a network.
    """
    try:
        import lcx.integrations.lm_eval  # noqa: F401  (registers the model)
        from lm_eval.__main__ import cli_evaluate
    except ImportError as e:
        raise LcxError(f"lm-evaluation-harness is not installed ({e}); install lcx's dev extras: "
                       f"pip install -e '.[dev]'") from None
    for var in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE"):  # a hub lookup fails at once instead of waiting on a network
        os.environ.setdefault(var, "1")
    sys.argv = ["lm_eval", *_with_tokenizer(list(args))]
    cli_evaluate()


def _with_tokenizer(args: list[str]) -> list[str]:
    """lm-eval's synthetic tasks load ``tokenizer`` (else ``pretrained``, else ``model``) from the model args by
    name, which for a known lcx model means the hub: a pulled known model gets ``tokenizer=<its folder>``."""
    from lcx.known_models import KNOWN_MODELS
    from lcx.models import model_dir

    if "--model_args" not in args:
        return args
    start = args.index("--model_args") + 1
    end = next((i for i in range(start, len(args)) if args[i].startswith("--")), len(args))
    pairs = [p for a in args[start:end] for p in a.split(",")]
    if any(p.strip().startswith(("tokenizer=", "pretrained=")) for p in pairs):
        return args
    name = next((p.split("=", 1)[1].strip() for p in pairs if p.strip().startswith("model=")), None)
    if name not in KNOWN_MODELS or not model_dir(name).is_dir():
        return args
    return [*args[:end - 1], f"{args[end - 1]},tokenizer={model_dir(name)}", *args[end:]]
