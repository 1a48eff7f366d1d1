"""fot's synthetic training task: ``lcx train --data task:dictionary`` (FoT's dictionary lookup).

Fresh seeded documents every step (``lcx.evals.dictionary.training_batch``): one document per ``--seq-len`` row;
``task:dictionary:512`` for 512-token documents back to back; ``task:dictionary:near=0.5`` for keys half of which
share 2 of 4 symbols with an earlier key.
"""

from __future__ import annotations

from lcx.data import Batches, Task
from lcx.errors import LcxError


def dictionary(args: list[str]) -> Batches:
    """The batches of ``task:dictionary[:N][:near=P]`` (``args``: the parts after the name)."""
    from lcx.evals.dictionary import training_batch

    doc, near = None, 0.0
    for arg in args:
        key, eq, value = arg.partition("=")
        if not eq and arg.isdigit() and int(arg) >= 20:
            doc = int(arg)
        elif key == "near" and _is_share(value):
            near = float(value)
        else:
            raise LcxError(f"task:dictionary: {arg!r} is neither a document length (a number of tokens >= 20, "
                           f"e.g. task:dictionary:512) nor near=SHARE in [0, 1] (e.g. task:dictionary:near=0.5)")
    return lambda rng, batch_size, seq_len: training_batch(rng, batch_size, seq_len, doc, near)


def _is_share(text: str) -> bool:
    try:
        return 0.0 <= float(text) <= 1.0
    except ValueError:
        return False


DICTIONARY = Task("dictionary", dictionary, "FoT's dictionary lookup; task:dictionary:N for N-token documents back "
                                            "to back in each row; :near=P for near-miss keys")
