"""lcx: long-context methods as plugins for any decoder-only Hugging Face model.

    import lcx
    model, tok = lcx.load_model("smollm2-135m")
    with lcx.attach(model, ["streaming"]) as run:
        new_tokens = lcx.generate(run, input_ids)
"""

from lcx.errors import ConflictError, LcxError, UnsupportedModelError
from lcx.hookspecs import hookimpl
from lcx.method import Method, option
from lcx.plan import Plan
from lcx.attach import Run, attach, attached_run
from lcx.generate import generate

__version__ = "0.1.0"

__all__ = [
    "ConflictError", "LcxError", "UnsupportedModelError", "hookimpl", "Method", "option", "Plan",
    "Run", "attach", "attached_run", "generate", "__version__",
]
