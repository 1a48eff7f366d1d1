"""What fot's memory heads read at a passkey prompt's last query (the one that gives the first answer token).

    .venv/bin/python results/fot/defaults/last_query.py run DEPTH [KEY=VALUE ...]   # one 16K prompt, fot's options
    .venv/bin/python results/fot/defaults/last_query.py run DEPTH passkey=65125 ...  # another key than the demo's
    .venv/bin/python results/fot/defaults/last_query.py summary                    # the runs' tables and JSON

SmolLM2-135M, float32, the filler passkey of `lcx demo` (seed 0's key, or ``passkey=``: the filler does not depend
on the key, so an eval's prompt is rebuilt from its key).  `run` wraps fot's memory attention
(lcx.plugins.fot.attention) to record, per memory layer and query head at the last prompt position: the best
local score, the best one past the 4 sinks (the window's own keys), the best score of a needle token among the
head's top-k memory keys, the softmax mass on the needle and on all memory (after the gate), plus the query
and the needle's stored keys, so runs at two depths can be cross-scored (their query against the other's
keys).  Writes last-query/DEPTH[-OPTIONS].pt; `summary` writes last-query/summary.json."""

from __future__ import annotations

import json
import random
import sys
from pathlib import Path

import torch

OUT = Path(__file__).parent / "last-query"
LENGTH, SINKS, G = 16384, 4, 3  # SmolLM2-135M: 9 query heads, 3 KV heads


def run(depth: float, opts: dict, key: int | None = None) -> None:
    import lcx.plugins.fot.attention as A
    from lcx.composition import attach
    from lcx.evals.passkey import NEEDLE, passkey_found, prompt_and_needle
    from lcx.generation import generate
    from lcx.models import load_model

    model, tok = load_model("smollm2-135m", dtype=torch.float32)
    key = key or random.Random(0).randint(10000, 99999)
    ids, start = prompt_and_needle(tok, LENGTH, depth, key)
    span = (start, start + len(tok(" " + NEEDLE.format(key=key) + " ", add_special_tokens=False)["input_ids"]))
    calls, cur = [], {}
    scores, joint = A._memory_scores, A.joint_softmax

    def recording_scores(qm, stores, k, dense, *rest):
        out = scores(qm, stores, k, dense, *rest)
        c = qm.shape[1] // G
        rows = [g * c + c - 1 for g in range(G)]  # each query head's last query of the block
        pos, nk = [], []
        for h, st in enumerate(stores):
            pos.append(st.positions[st.search(qm[h][rows], k)[1].cpu()])
            p = st.positions
            nk.append(st.keys[((p >= span[0]) & (p < span[1])).nonzero()[:, 0]].float().cpu())
        cur.update(pos=torch.stack(pos), q=qm[:, rows].detach().cpu(), nk=nk, rows=rows)
        return out

    def recording_joint(local, lv, mem, mv, dense, gate=None, gate_keys=None, **kw):
        rows = cur["rows"]
        l, m = local[:, rows], mem[:, rows]
        inn = (cur["pos"] >= span[0]) & (cur["pos"] < span[1])
        ref = l if gate_keys is None else l.masked_fill(~gate_keys, float("-inf"))
        read = m if gate is None else m.masked_fill(m < ref.amax(-1, keepdim=True) + gate, float("-inf"))
        j = torch.cat([l, read], -1).softmax(-1)[..., l.shape[-1]:]
        calls.append({"lmax": l.amax(-1), "lmax_window": l[..., SINKS:].amax(-1), "argmax": l.argmax(-1),
                      "needle": m.masked_fill(~inn, float("-inf")).amax(-1), "mass": (j * inn).sum(-1),
                      "memmass": j.sum(-1), "q": cur["q"], "nk": cur["nk"], "T": local.shape[1] // G})
        return joint(local, lv, mem, mv, dense, gate, gate_keys, **kw)  # after the copies above: it may spend local

    A._memory_scores, A.joint_softmax = recording_scores, recording_joint
    with attach(model, ["fot"], fot=opts) as r:
        new = generate(r, ids[None], max_new_tokens=8)
        layers = r.method("fot").layer_indices(r)
    text = tok.decode(new[0], skip_special_tokens=True)
    prefill = [c for c in calls if c["T"] > 1][-len(layers):]  # the last chunk: one block per memory layer
    OUT.mkdir(exist_ok=True)
    name = "-".join([f"depth{depth}", *([f"key{key}"] if key != random.Random(0).randint(10000, 99999) else []),
                     *(f"{k}={v}" for k, v in opts.items())])
    torch.save({"depth": depth, "opts": opts, "span": span, "tokens": int(ids.shape[0]), "key": key, "text": text,
                "found": passkey_found(key, text), "layers": layers, "last": prefill}, OUT / f"{name}.pt")
    print(f"{name}: {text!r} found={passkey_found(key, text)}")


def summary() -> None:
    runs = {p.stem: torch.load(p) for p in sorted(OUT.glob("*.pt"))}
    out = {}
    for name, d in runs.items():
        heads = {}
        for lay, r in zip(d["layers"], d["last"]):
            for qh in range(r["lmax"].numel()):
                h, g = divmod(qh, G)
                heads[f"{lay}:{qh}"] = {x: round(float(r[x][h, g]), 3) for x in
                                       ("lmax", "lmax_window", "needle", "mass", "memmass")} | {"argmax": int(r["argmax"][h, g])}
        out[name] = {"depth": d["depth"], "opts": d["opts"], "needle_span": list(d["span"]),
                     "tokens_back": d["tokens"] - d["span"][0], "answer": d["text"], "found": d["found"],
                     "needle_mass_sum": round(sum(v["mass"] for v in heads.values()), 3), "heads": heads}
    base = {n: d for n, d in runs.items() if not d["opts"]}
    if {"depth0.1", "depth0.3"} <= set(base):  # cross-scores: the depth-0.1 run's query against the 0.3 needle
        a, b = base["depth0.1"], base["depth0.3"]
        sc = a["last"][0]["q"].shape[-1] ** -0.5
        cross = {}
        for lay, ra, rb in zip(a["layers"], a["last"], b["last"]):
            for qh in range(ra["q"].shape[0] * ra["q"].shape[1]):
                h, g = divmod(qh, G)
                best = lambda q, k: round(float((k @ q * sc).max()), 3)  # noqa: E731
                qa, qb, ka, kb = ra["q"][h, g], rb["q"][h, g], ra["nk"][h], rb["nk"][h]
                cross[f"{lay}:{qh}"] = {"q0.1_k0.1": best(qa, ka), "q0.1_k0.3": best(qa, kb),
                                        "q0.3_k0.1": best(qb, ka), "q0.3_k0.3": best(qb, kb),
                                        "cos_q": round(float(torch.nn.functional.cosine_similarity(qa, qb, 0)), 3)}
        out["cross_scores_depth0.1_vs_0.3"] = cross
    (OUT / "summary.json").write_text(json.dumps(out, indent=1) + "\n")
    names = list(runs)
    print("head    " + " | ".join(f"{n} ({runs[n]['text'].strip()[:12]!r})" for n in names))
    print("        " + " | ".join("best  window needle mass" for _ in names))
    for hd in out[names[0]]["heads"]:
        cells = [out[n]["heads"][hd] for n in names]
        if any(c["mass"] > 0.05 for c in cells):
            print(f"{hd:7s} " + " | ".join(f"{c['lmax']:5.1f} {c['lmax_window']:6.1f} {c['needle']:6.1f} {c['mass']:4.2f}"
                                            for c in cells))


if __name__ == "__main__":
    if sys.argv[1:2] == ["run"]:
        opts = {}
        for kv in sys.argv[3:]:
            k, v = kv.split("=", 1)
            try:
                opts[k] = json.loads(v)
            except json.JSONDecodeError:
                opts[k] = v
        passkey = opts.pop("passkey", None)
        run(float(sys.argv[2]), opts, int(passkey) if passkey is not None else None)
    elif sys.argv[1:2] == ["summary"]:
        summary()
    else:
        sys.exit(__doc__)
