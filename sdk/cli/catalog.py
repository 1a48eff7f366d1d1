"""`lcx methods` and `lcx plugins`: what is installed."""

from __future__ import annotations

import click

from lcx.cli.base import CONTEXT, _echo_json, main


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
            "requires": sorted(cls.requires), "served": cls.serving or None,
            "options": [{"name": f.name, "default": f.default, "help": f.metadata.get("help", "")} for f in cls.options()],
        })
    if as_json:
        return _echo_json(rows)
    for r in rows:
        click.echo(f"{r['name']:<12} {r['description']}")
        click.echo(f"{'':<12} stages: {', '.join(r['stages']) or '-'}   served: {r['served'] or 'no'}   "
                   f"plugin: {r['plugin']}")
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
