"""lcx: long-context methods as plugins for any decoder-only Hugging Face model.

    import lcx
    from lcx.models import load_model
    model, tok = load_model("smollm2-135m")
    with lcx.attach(model, ["streaming"]) as run:
        new_tokens = lcx.generate(run, input_ids)

The public names below are imported lazily, so ``lcx models pull`` and other
light commands start without importing torch and transformers.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

_EXPORTS = {
    "LcxError": "lcx.errors", "ConflictError": "lcx.errors", "UnsupportedModelError": "lcx.errors",
    "hookimpl": "lcx.hookspecs", "Method": "lcx.method", "option": "lcx.method", "Plan": "lcx.plan",
    "Run": "lcx.composition", "attach": "lcx.composition", "attached_run": "lcx.composition", "generate": "lcx.generation",
}
__all__ = [*_EXPORTS, "__version__"]


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        value = getattr(importlib.import_module(_EXPORTS[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'lcx' has no attribute {name!r}")


if TYPE_CHECKING:  # for type checkers and IDEs
    from lcx.composition import Run, attach, attached_run
    from lcx.errors import ConflictError, LcxError, UnsupportedModelError
    from lcx.generation import generate
    from lcx.hookspecs import hookimpl
    from lcx.method import Method, option
    from lcx.plan import Plan
