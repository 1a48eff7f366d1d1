"""fot: Focused Transformer (LongLLaMA) memory attention.  See method.py.

Besides the method, the plugin brings the training task ``task:dictionary`` (tasks.py) and the commands
``lcx memory build`` and ``lcx analyze distraction`` (commands.py)."""

from lcx.hookspecs import hookimpl
from lcx.plugins.fot.method import FoT
from lcx.plugins.fot.tasks import DICTIONARY

__all__ = ["FoT"]


@hookimpl
def lcx_register_methods(register):
    register(FoT)


@hookimpl
def lcx_register_tasks(register):
    register(DICTIONARY)


@hookimpl
def lcx_register_commands(cli):
    from lcx.plugins.fot.commands import analyze_distraction, memory_build

    cli.commands["memory"].add_command(memory_build)
    cli.commands["analyze"].add_command(analyze_distraction)
