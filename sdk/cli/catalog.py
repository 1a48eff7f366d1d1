"""`lcx methods` and `lcx plugins`: what is installed."""

from __future__ import annotations

import click

from lcx.cli.base import CONTEXT, _dtype, _echo_json, dtype_option, main


@main.command("methods", context_settings=CONTEXT)
@click.option("--verbose", "-v", is_flag=True, help="Also list each method's options with defaults and help.")
@click.option("--model", "-m", default=None, metavar="MODEL",
              help="Also show what each method's model-dependent options (auto) come to on MODEL (a known name or "
                   "a local folder): measured on it the first time, then read from beside it.")
@dtype_option
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
def methods_cmd(verbose: bool, model: str | None, as_json: bool) -> None:
    """List installed long-context methods and the stages they implement.

    \b
    Examples:
      lcx methods -v                    # every option, its default and what it does
      lcx methods -m smollm2-135m       # fot's memory layers, rope's factor, ... on that model
    """
    from lcx.registry import registry

    reg = registry()
    on, dtype = _resolved_on(model, sorted(reg.methods)) if model else ({}, None)
    rows = []
    for name, cls in sorted(reg.methods.items()):
        rows.append({
            "name": name, "plugin": reg.plugin_of(name), "stages": cls.stages(), "description": cls.description,
            "requires": sorted(cls.requires), "served": cls.serving or None,
            "options": [{"name": f.name, "default": f.default, "help": f.metadata.get("help", "")} for f in cls.options()],
            **({"on_model": on[name]} if model else {}),
        })
    if as_json:
        return _echo_json({"model": model, "dtype": dtype, "methods": rows} if model else rows)
    for r in rows:
        click.echo(f"{r['name']:<12} {r['description']}")
        click.echo(f"{'':<12} stages: {', '.join(r['stages']) or '-'}   served: {r['served'] or 'no'}   "
                   f"plugin: {r['plugin']}")
        for option, value in r.get("on_model", {}).items():
            click.echo(f"{'':<12} on {model} ({dtype}): {option}={value}")
        if verbose:
            for o in r["options"]:
                click.echo(f"{'':<14}{o['name']}={o['default']!r}  {o['help']}")


def _resolved_on(model: str, names: list[str]) -> tuple[dict[str, dict], str]:
    """Each method at its defaults, its ``auto`` options resolved on ``model`` in the command's dtype (loaded only
    if one is measured), and that dtype's name."""
    import json

    from lcx import auto
    from lcx.errors import LcxError
    from lcx.models import dtype_name, load_model, resolve_dtype, resolve_model_path
    from lcx.registry import registry

    folder = resolve_model_path(model)
    instances = [registry().methods[n]() for n in names]
    dtype = resolve_dtype(_dtype())  # --dtype, else what lcx generate loads the model in by default
    named = dtype_name(dtype)
    auto.resolve(instances, folder, lambda: load_model(str(folder), dtype=dtype), named)
    config = json.loads((folder / "config.json").read_text())
    out = {}
    for m in instances:
        try:
            out[m.name] = m.resolved(config)
        except LcxError as e:  # e.g. a window the config does not give: said, not fatal to the listing
            out[m.name] = {"error": str(e)}
    return out, named


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
