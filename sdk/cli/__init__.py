"""The `lcx` command line (entry point ``lcx.cli:main``).

Every command accepts a known model name (``smollm2-135m``, see ``lcx models
list``) or a local Hugging Face model folder.  Errors a user can fix print one
line starting with ``error:`` and exit with status 2.

One module per command group; importing them registers their commands on
``main`` (``base``: the root group, shared options and option parsers).  Plugins
add theirs (``lcx_register_commands``) the first time a group is asked for a
command it lacks or for its list (``base.LcxGroup``).
"""

from lcx.cli.base import main
from lcx.cli import catalog, models, generation, memory, evaluation, analysis, training, serving, demo  # noqa: F401, E402

__all__ = ["main"]
