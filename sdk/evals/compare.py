"""Run one suite over several method stacks and show them side by side (how a user picks a method).

A *stack* is ``"none"`` (the bare model), one method (``"streaming"``) or several
joined by ``+`` (``"rope+streaming"``), optionally with an adapter after ``@``
(``"focusllm@out/adapter"``; ``"@out/adapter"``: the methods it was trained with).
The model is loaded once; each stack's adapter is loaded onto it and removed again,
each stack attached, evaluated and detached in turn.
"""

from __future__ import annotations

from contextlib import contextmanager
from pathlib import Path
from typing import Any, Callable, Iterator

from lcx.composition import Run, attach
from lcx.errors import LcxError
from lcx.io import pyplot, save_figure, token_label, write_json  # noqa: F401  (write_json: re-exported for the CLI)

NONE = "none"


def parse_stack(stack: str) -> tuple[list[str], str | None]:
    """``"rope+streaming"`` -> (["rope", "streaming"], None); ``"focusllm@DIR"`` -> (["focusllm"], "DIR");
    ``"@DIR"`` -> ([], "DIR"): the adapter's own methods."""
    spec, at, adapter = stack.partition("@")
    if at and not adapter.strip():
        raise LcxError(f"stack {stack!r} names no adapter after '@'; e.g. focusllm@out/focusllm-adapter")
    names = [s.strip() for s in spec.split("+") if s.strip()]
    if not names and not at:
        raise LcxError(f"empty method stack {stack!r}; use e.g. vanilla, streaming or rope+streaming")
    return ([] if names == [NONE] else names), (adapter.strip() if at else None)


def options_for(methods: list[str], options: dict[str, Any]) -> dict[str, Any]:
    """Per-method options (``{"streaming": {...}}``) restricted to the methods of one stack."""
    flat = [k for k, v in options.items() if not isinstance(v, dict)]
    if flat:
        raise LcxError(f"options of a comparison name their method (each stack picks its own): "
                       f"-o METHOD.{flat[0]}=VALUE")
    return {m: options[m] for m in methods if m in options}


@contextmanager
def stack_model(model: Any, adapter: str | None, methods: list[str],
                options: dict[str, Any]) -> Iterator[tuple[Any, list[str], dict[str, Any]]]:
    """The model to attach a stack to (with its adapter loaded, and removed on exit) and the stack's methods
    and options (an adapter without named methods brings its own)."""
    if adapter is None:
        yield model, methods, options_for(methods, options)
        return
    from lcx.session import apply_adapter

    given = options_for(methods, options)  # refuses flat options
    if not methods:  # @DIR: every method's options, until the adapter names its methods
        given = options
    wrapped, _, methods, merged = apply_adapter(model, adapter, methods, given)
    try:
        yield wrapped, methods, options_for(methods, merged)
    finally:
        wrapped.unload()  # the LoRA layers out again, base weights untouched


def check_stacks(model: Any, stacks: list[str], options: dict[str, Any]) -> None:
    """Every stack attaches (its methods, options and adapter load) and every option is used by some stack,
    before the first stack runs: a typo in the last stack must not surface after hours of the first.  Their
    ``auto`` options are measured when each stack runs, not here."""
    from lcx import auto

    used: set[str] = set()
    for stack in stacks:
        methods, adapter = parse_stack(stack)
        try:
            with stack_model(model, adapter, methods, options) as (m, names, opts), auto.deferred(), \
                    attach(m, names, **opts) as run:
                used.update(x.name for x in run.methods)
        except LcxError as e:
            raise LcxError(f"stack {stack!r}: {e}") from None
    unused = [name for name in options if name not in used]
    if unused:
        raise LcxError(f"options for {', '.join(map(repr, unused))}, which no stack has (stacks: {', '.join(stacks)}); "
                       f"add the method to a stack (e.g. --stack {unused[0]}) or drop the option")


def compare(model: Any, stacks: list[str], options: dict[str, Any],
            evaluate: Callable[[Run, str | None], dict[str, Any]], log: Callable[[str], None] = print,
            on_stack_done: Callable[[dict[str, dict]], None] | None = None) -> dict[str, dict]:
    """Evaluate each stack in turn (``evaluate(run, adapter)``); ``on_stack_done(results so far)`` runs after
    each one, so a long comparison that is interrupted keeps the stacks it finished."""
    check_stacks(model, stacks, options)
    results: dict[str, dict] = {}
    for stack in stacks:
        methods, adapter = parse_stack(stack)
        log(f"[compare] {stack}")
        with stack_model(model, adapter, methods, options) as (m, names, opts), attach(m, names, **opts) as run:
            results[stack] = {**run.describe(), "adapter": adapter, **evaluate(run, adapter)}
        if on_stack_done is not None:
            on_stack_done(results)
    return results


def passkey_table(results: dict[str, dict]) -> tuple[list[str], list[list[str]]]:
    return _by_length_table(results, "accuracy_by_length", "accuracy")


def ruler_table(results: dict[str, dict]) -> tuple[list[str], list[list[str]]]:
    """Mean score over tasks at each length, then each task's mean over lengths."""
    header, rows = _by_length_table(results, "score_by_length", "score")
    tasks = next(iter(results.values()))["config"]["tasks"]
    for row, r in zip(rows, results.values()):
        by = r["summary"]["score_by_task"]
        row += [f"{sum(by[t].values()) / len(by[t]):.0%}" if by.get(t) else "-" for t in tasks]
    return header + tasks, rows


def _by_length_table(results: dict[str, dict], by_key: str, all_key: str) -> tuple[list[str], list[list[str]]]:
    lengths = next(iter(results.values()))["config"]["lengths"]
    header = ["stack", *map(token_label, lengths), "all"]
    rows = []
    for stack, r in results.items():
        by = r["summary"][by_key]
        rows.append([stack, *[f"{by[str(n)]:.0%}" for n in lengths], f"{r['summary'][all_key]:.0%}"])
    return header, rows


def ppl_table(results: dict[str, dict]) -> tuple[list[str], list[list[str]]]:
    contexts = next(iter(results.values()))["config"]["contexts"]
    header = ["stack", *[f"ppl@{token_label(n)}" for n in contexts], *[f"acc@{token_label(n)}" for n in contexts]]
    rows = []
    for stack, r in results.items():
        s = r["summary"]
        rows.append([stack, *[f"{s['ppl'][str(n)]:.2f}" for n in contexts],
                     *[f"{s['accuracy'][str(n)]:.3f}" for n in contexts]])
    return header, rows


def plot_by_length(results: dict[str, dict], path: Path, title: str, by_key: str = "accuracy_by_length",
                   ylabel: str = "passkey accuracy") -> Path:
    """One bar per stack at each length: ``summary[by_key][length]``."""
    lengths = next(iter(results.values()))["config"]["lengths"]
    width = 0.8 / max(len(results), 1)
    fig, ax = pyplot().subplots(figsize=(2 + 1.3 * len(lengths), 3.6))
    for i, (stack, r) in enumerate(results.items()):
        by = r["summary"][by_key]
        xs = [j + i * width for j in range(len(lengths))]
        ax.bar(xs, [by[str(n)] for n in lengths], width=width, label=stack)
    ax.set_xticks([j + width * (len(results) - 1) / 2 for j in range(len(lengths))],
                  [token_label(n) for n in lengths])
    ax.set_ylim(0, 1.05)
    ax.set_ylabel(ylabel)
    ax.set_xlabel("prompt length (tokens)")
    ax.legend(fontsize=8)
    ax.grid(axis="y", alpha=0.3)
    return save_figure(fig, path, title)


def write_markdown(header: list[str], rows: list[list[str]], path: Path, command: str) -> Path:
    lines = [f"`{command}`", "", "| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    path.write_text("\n".join(lines) + "\n")
    return path

