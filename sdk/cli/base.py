"""The `lcx` command line: the root group, shared options and option parsers.

Every command accepts a known model name (``smollm2-135m``, see ``lcx models
list``) or a local Hugging Face model folder.  Errors a user can fix print one
line starting with ``error:`` and exit with status 2.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import click

from lcx.errors import LcxError

CONTEXT = dict(help_option_names=["-h", "--help"], max_content_width=100)
#: An --out folder: an existing file there is a usage error, not a traceback halfway through the work.
OUT_DIR = click.Path(path_type=Path, file_okay=False)


class LcxGroup(click.Group):
    """Turns LcxError, and click's usage errors in a command's arguments (a bad option value, an unknown
    option), into one ``error:`` line and exit status 2.  Asked for a command it lacks, or for its list, it first
    lets the plugins add theirs (``add_plugin_commands``)."""

    def get_command(self, ctx: click.Context, cmd_name: str) -> click.Command | None:
        command = super().get_command(ctx, cmd_name)
        plugins = command is None or any(g is self and n == cmd_name for g, n, _ in _PLUGIN_COMMANDS["added"])
        if plugins and add_plugin_commands():  # a plugin's command, from the registry now in use
            command = super().get_command(ctx, cmd_name)
        return command

    def list_commands(self, ctx: click.Context) -> list[str]:
        # `lcx --help` lists the core's commands without loading the plugins (seconds), and theirs once loaded
        if self is not main or _PLUGIN_COMMANDS["key"] is not None:
            add_plugin_commands()
        return super().list_commands(ctx)

    def invoke(self, ctx: click.Context) -> Any:
        try:
            return super().invoke(ctx)
        except LcxError as e:
            click.echo(f"error: {e}", err=True)
            ctx.exit(e.exit_code)
        except click.UsageError as e:
            if isinstance(e, getattr(click.exceptions, "NoArgsIsHelpError", ())):
                raise  # a group called bare: click prints its help
            where = e.ctx.command_path if e.ctx is not None else ctx.command_path
            click.echo(f"error: {e.format_message()} (see `{where} --help`)", err=True)
            ctx.exit(e.exit_code)
        except KeyboardInterrupt:
            click.echo("interrupted", err=True)
            ctx.exit(130)
        except OSError as e:  # a file or folder the machine refuses (permissions, a full disk, ...)
            if os.environ.get("LCX_DEBUG"):
                raise
            what = f"{e.strerror or e}" + (f": {e.filename!r}" if e.filename else "")
            click.echo(f"error: {what} (check the path, its permissions and the free space; LCX_DEBUG=1 shows "
                       f"where it happened)", err=True)
            ctx.exit(2)


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


# ---------------------------------------------------------------------- plugins' commands
#: The registry whose plugins' commands are on `lcx` (with its plugins' names), and what they changed:
#: (group, name, the command the name had before or None).
_PLUGIN_COMMANDS: dict[str, Any] = {"key": None, "added": []}


def add_plugin_commands() -> bool:
    """Let the registry's plugins add their commands to `lcx` (``lcx_register_commands``), once per registry and
    set of plugins; returns whether they were added now.  The commands of an earlier registry (a test's, one
    before ``reset_registry``) are taken off first."""
    from lcx.registry import registry

    reg = registry()
    key = (reg, tuple(name for name, _ in reg.pm.list_name_plugin()))
    if _PLUGIN_COMMANDS["key"] == key:
        return False
    for group, name, before in reversed(_PLUGIN_COMMANDS["added"]):
        if before is None:
            group.commands.pop(name, None)
        else:
            group.commands[name] = before
    groups = _groups(main)
    was = {id(g): dict(g.commands) for g in groups}
    _PLUGIN_COMMANDS.update(key=key, added=[])
    reg.add_commands(main)
    _PLUGIN_COMMANDS["added"] = [(g, name, was[id(g)].get(name)) for g in groups for name, cmd in g.commands.items()
                                 if was[id(g)].get(name) is not cmd]
    return True


def _groups(group: click.Group) -> list[click.Group]:
    """``group`` and every group below it."""
    return [group, *(g for c in group.commands.values() if isinstance(c, click.Group) for g in _groups(c))]


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
    return device_option(limit_options(f))


def text_field_option(f):
    return click.option("--text-field", default="text", show_default=True, metavar="NAME",
                        help="The field holding a document's text in .jsonl files (one JSON object per line).")(f)


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


def device_option(f):
    """``--device`` and ``--dtype``: where the model runs and in which precision; lcx's generation and memories
    follow the model."""
    f = dtype_option(f)
    return click.option("--device", default=None, expose_value=False, callback=_set_meta("lcx.device"),
                        metavar="DEVICE", help="Where the model runs: cpu (default), cuda, cuda:N (or LCX_DEVICE).")(f)


DTYPE_HELP = ("Precision of the model's weights and activations: auto (default, or LCX_DTYPE) is bfloat16 where the "
              "device runs it natively (a CPU with AMX or AVX512-BF16, a GPU of compute capability 8.0+) and "
              "float32 elsewhere; float32 is the reference the tests compare against.")


def dtype_option(f):
    """``--dtype auto|float32|bfloat16|float16``, read by ``_dtype()``."""
    from lcx.models import DTYPE_NAMES

    return click.option("--dtype", type=click.Choice(DTYPE_NAMES, case_sensitive=False), default=None,
                        expose_value=False, callback=_set_meta("lcx.dtype"), help=DTYPE_HELP)(f)


def _resolved_dtype(dtype: str | None) -> str:
    """``dtype`` (or LCX_DTYPE, or auto) resolved by lcx's rule for where the engine runs: a CUDA GPU if torch sees
    one, else the CPU (lcx serve, whose auto is vLLM's own CPU default here, and lcx train, whose runs resume by
    what they computed in)."""
    import torch

    from lcx.models import dtype_name, resolve_dtype

    return dtype_name(resolve_dtype(dtype, "cuda" if torch.cuda.is_available() else "cpu"))


def _set_meta(key: str):
    def callback(ctx, param, value):
        if value:  # kept on the command's context (not the environment: tests run many commands in one process)
            ctx.meta[key] = value
    return callback


def _device() -> str | None:
    """The command's --device, or None (``load_model`` then reads LCX_DEVICE, else cpu)."""
    ctx = click.get_current_context(silent=True)
    return ctx.meta.get("lcx.device") if ctx else None


def _dtype() -> str | None:
    """The command's --dtype, or None (``load_model`` then reads LCX_DTYPE, else auto)."""
    ctx = click.get_current_context(silent=True)
    return ctx.meta.get("lcx.dtype") if ctx else None


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

    return _with_limits(open_session(model, methods, parse_options(options), adapter, trust_remote_code=trust,
                                     device=_device(), dtype=_dtype()))


def _echo_json(obj: Any) -> None:
    click.echo(json.dumps(obj, indent=2, default=str))


# ---------------------------------------------------------------------- option parsers

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

