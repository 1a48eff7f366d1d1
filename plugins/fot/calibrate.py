"""gate=auto: fot's gate calibrated on the model itself (issue 52).

A gate G lets a query head of a memory layer read memory only where its best memory key scores at least G above
its best local key (that difference is the head's *margin*).  A stricter gate leaves ordinary text closer to
truncation, and at some point shuts the heads that copy a far needle.  Calibration runs fot with its gate off on
passkey probes whose needle lies in memory (the repeated filler, keys of a fixed seed that no evaluation uses),
lets it answer, and records every (memory layer, query head) margin at the queries that wrote the key.  Only the
probes it answered count (a missed key says nothing about the heads that copy it).  The gate chosen is the largest
candidate that leaves every key token of those probes at least ``min_open`` open (layer, head) pairs: the answer
needs several heads, not one.  Where none does (a model with few memory heads), the gate is off, as the probes
were answered (results/models/README.md, "fot.gate=auto", has the measurements behind the rule).
"""

from __future__ import annotations

import random
from typing import Any

import torch

#: What a calibration measures with; part of its cache entry (another value: measured again).
GATE_PROBE = {"probe": "gate", "depths": [0.1, 0.25, 0.4], "keys": 1, "seed": 24680, "haystack": "filler",
              "gates": [-2.0, -1.0, 0.0, 1.0, 2.0, 3.0, 4.0], "min_open": 10, "counts": "answered probes",
              "none_fits": "off"}


def probe_margins(model: Any, tokenizer: Any, options: dict, length: int, depth: float,
                  key: int) -> tuple[torch.Tensor, list[int], bool]:
    """fot (``options``, its gate off) answering one probe, ``length`` tokens long with the needle at ``depth``:
    the (layers, heads, new tokens) margins at the queries that wrote its answer, the answer's tokens, and whether
    they are the key's own (then the margins are those at the key's tokens)."""
    import lcx
    from lcx.evals.passkey import prompt_and_needle
    from lcx.generation import generate

    ids, _ = prompt_and_needle(tokenizer, length, depth, key)
    answer = tokenizer(" " + str(key), add_special_tokens=False)["input_ids"]
    with lcx.attach(model, ["fot"], fot={**options, "gate": "off"}) as run:
        fot = run.method("fot")
        fot.record_margins = {}
        try:
            new = generate(run, ids[None], max_new_tokens=len(answer), min_new_tokens=len(answer))[0].tolist()
        finally:
            recorded, fot.record_margins = fot.record_margins, None
    if not recorded:
        return torch.empty(0, 0, len(new)), new, new == answer
    margins = torch.stack([torch.cat(blocks, dim=-1)[:, -len(new):] for _, blocks in sorted(recorded.items())])
    return margins, new, new == answer


def weakest_open(margins: torch.Tensor, gate: float) -> int:
    """Of one probe's answer tokens (``margins``: (layers, heads, tokens)), the fewest (layer, head) pairs whose
    margin reaches ``gate``; 0 where no margin was recorded."""
    return int((margins >= gate).sum((0, 1)).min()) if margins.numel() else 0


def choose_gate(margins: list[torch.Tensor], gates: list[float], min_open: int) -> float | None:
    """The largest of ``gates`` that leaves every answer token of every probe (``margins``: (layers, heads,
    tokens) each) at least ``min_open`` (layer, head) pairs whose margin reaches it; None where none does."""
    fits = [g for g in gates if all(weakest_open(m, g) >= min_open for m in margins if m.numel())]
    return max(fits) if fits and any(m.numel() for m in margins) else None


def calibrate_gate(model: Any, tokenizer: Any, options: dict, length: int, probe: dict = GATE_PROBE,
                   progress: bool = True) -> dict:
    """Calibrate fot's gate for ``model`` with ``options`` (its memory layers, heads and windows resolved) on
    ``probe``'s passkeys ``length`` tokens long: the chosen gate ("off": answered, but no candidate keeps enough
    pairs open; None: no probe answered) and, per probe, its answer and its weakest key token's open pairs at
    each gate."""
    from tqdm.auto import tqdm

    rng = random.Random(probe["seed"])
    keys = [rng.randint(10000, 99999) for _ in range(probe["keys"])]
    answered, rows = [], []
    for depth, key in tqdm([(d, k) for d in probe["depths"] for k in keys], desc="fot gate calibration",
                           unit="probe", disable=not progress):
        m, new, found = probe_margins(model, tokenizer, options, length, depth, key)
        if found:
            answered.append(m)
        rows.append({"depth": depth, "key": key, "output": tokenizer.decode(new, skip_special_tokens=True),
                     "answered": found,
                     "weakest_token_open_pairs": {str(g): weakest_open(m, g) for g in probe["gates"]}})
    gate = choose_gate(answered, probe["gates"], probe["min_open"]) if answered else None
    if gate is None and answered:
        gate = "off"  # it answered with no gate, and every gate shuts heads the answers read
    return {"gate": gate, "length": length, "answered": len(answered), "probes": rows}
