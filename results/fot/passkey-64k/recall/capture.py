"""Capture what fot's memory search sees on one passkey prompt: every memory layer's stored keys (per KV
head), their positions, and the memory-relative queries of the prompt's last chunk (the question).

    OMP_NUM_THREADS=2 .venv/bin/python results/fot/passkey-64k/recall/capture.py --out /tmp/pk64-keys

Runs fot with exact search (backend=torch: the configuration that finds this key) and writes
``keys.safetensors`` (layer.head.keys / .positions / .queries) plus ``meta.json`` (needle token span).
``recall.py`` then compares approximate indexes against exact search on these tensors.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
from safetensors.torch import save_file

import lcx.plugins.fot.method as fot_method
from lcx.adapters.rotary import rotate
from lcx.evals.passkey import NEEDLE, build_prompt_ids
from lcx.generation import generate
from lcx.session import open_session

LAYERS = "6,7,8,14,15,17,18,19,20,21,22,23"  # results/fot/run.sh's memory layers


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--length", type=int, default=65536)
    ap.add_argument("--depth", type=float, default=0.1)
    ap.add_argument("--key", type=int, default=60494, help="the 64K journal's first sample (depth 0.1, seed 0)")
    ap.add_argument("--out", type=Path, required=True)
    a = ap.parse_args()

    opts = {"local": 1024, "chunk": 256, "memory_layers": LAYERS, "backend": "torch",
            # fot's defaults before issue 52 (these results were made with them)
            "sinks": 0, "positions": "first", "fixed_distance": 0, "gate": "off"}
    s = open_session("smollm2-135m", ["fot"], {"fot": opts})
    ids = build_prompt_ids(s.tokenizer, a.length, a.depth, a.key)
    seen: dict[int, tuple] = {}  # id(memory dict) -> (call order, memory, q_rel of its last call)
    inner = fot_method.memory_attention

    def recording(query, key, value, mask, memory, q_shift, inv_freq, *rest):
        q_rel = rotate(query, q_shift[:, None, :], inv_freq) if inv_freq is not None else query
        seen[id(memory)] = (seen.get(id(memory), (len(seen),))[0], memory, q_rel.detach().clone())
        return inner(query, key, value, mask, memory, q_shift, inv_freq, *rest)

    fot_method.memory_attention = recording
    new = generate(s.run, ids[None], max_new_tokens=1, do_sample=False)
    answer = s.tokenizer.decode(new[0])
    tensors: dict[str, torch.Tensor] = {}
    layers = [int(x) for x in LAYERS.split(",")]
    for order, memory, q_rel in sorted(seen.values(), key=lambda t: t[0]):
        layer = layers[order]
        H, Hkv = q_rel.shape[1], len(memory)
        G = H // Hkv
        for (_, h), store in memory.items():
            tensors[f"{layer}.{h}.keys"] = store.keys.contiguous()
            tensors[f"{layer}.{h}.positions"] = store.positions.contiguous()
            tensors[f"{layer}.{h}.queries"] = q_rel[0, h * G:(h + 1) * G].float().contiguous()  # (G, T, D)
    a.out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(a.out / "keys.safetensors"))
    tok = s.tokenizer
    needle = tok(" " + NEEDLE.format(key=a.key) + " ", add_special_tokens=False)["input_ids"]
    row = ids.tolist()
    start = next(i for i in range(len(row)) if row[i:i + len(needle)] == needle)
    meta = {"length": a.length, "depth": a.depth, "key": a.key, "tokens": len(row), "needle": [start, start + len(needle)],
            "first_new_token": answer, "last_chunk_tokens": int(q_rel.shape[2]), "layers": layers}
    (a.out / "meta.json").write_text(json.dumps(meta, indent=1))
    print(json.dumps(meta))


if __name__ == "__main__":
    main()
