"""How well do approximate kNN indexes find what exact search finds, on the keys fot really stores?

    .venv/bin/python results/fot/passkey-64k/recall/recall.py /tmp/pk64-keys [--json OUT]

Input: ``capture.py``'s tensors (per memory layer and KV head: stored keys, positions, the last chunk's
memory-relative queries).  Indexes are built as fot builds them: trained on the first ``ivf_train`` keys,
then the rest added.  Per index: recall@k over every query of the last chunk, and *needle recall*:
of the needle's entries exact search puts in a query's top-k, the share the index also returns, over the
question's queries (the last ``--question`` tokens), the entries that answer a passkey.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import faiss
import numpy as np
import torch
from safetensors.torch import load_file


def ivf_ip(keys: np.ndarray, nlist: int, nprobe: int, train: int):
    """fot's faiss-ivf: inner-product quantizer and lists (lcx.plugins.fot.memory.FaissStore)."""
    q = faiss.IndexFlatIP(keys.shape[1])
    index = faiss.IndexIVFFlat(q, keys.shape[1], nlist, faiss.METRIC_INNER_PRODUCT)
    index.train(keys[:train])
    index.add(keys)
    index.nprobe = nprobe
    return (lambda x, k: index.search(x, k)[1]), (q, index)


def ivf_l2_augmented(keys: np.ndarray, nlist: int, nprobe: int, train: int, margin: float = 1.0):
    """Maximum inner product as nearest neighbour (Bachrach et al. 2014): key k -> [k, sqrt(R^2 - |k|^2)],
    query q -> [q, 0], so |q' - k'|^2 = |q|^2 + R^2 - 2 q.k; R = margin x the largest training norm."""
    R2 = float((np.linalg.norm(keys[:train], axis=1).max() * margin) ** 2)
    aug = lambda x: np.hstack([x, np.sqrt(np.maximum(R2 - (x * x).sum(1, keepdims=True), 0))]).astype(np.float32)  # noqa: E731
    d = keys.shape[1] + 1
    q = faiss.IndexFlatL2(d)
    index = faiss.IndexIVFFlat(q, d, nlist, faiss.METRIC_L2)
    index.train(aug(keys[:train]))
    index.add(aug(keys))
    index.nprobe = nprobe
    zero = lambda x: np.hstack([x, np.zeros((x.shape[0], 1), np.float32)])  # noqa: E731
    return (lambda x, k: index.search(zero(x), k)[1]), (q, index)


def hnsw_ip(keys: np.ndarray, m: int, ef: int):
    index = faiss.IndexHNSWFlat(keys.shape[1], m, faiss.METRIC_INNER_PRODUCT)
    index.hnsw.efConstruction = 200
    index.add(keys)
    index.hnsw.efSearch = ef
    return (lambda x, k: index.search(x, k)[1]), (index,)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("capture", type=Path)
    ap.add_argument("-k", type=int, default=32)
    ap.add_argument("--nlist", type=int, default=1024)
    ap.add_argument("--train", type=int, default=32768, help="fot's ivf_train: keys the lists are trained on")
    ap.add_argument("--question", type=int, default=12, help="last tokens whose queries count for needle recall")
    ap.add_argument("--json", type=Path)
    a = ap.parse_args()
    t = load_file(str(a.capture / "keys.safetensors"))
    meta = json.loads((a.capture / "meta.json").read_text())
    n0, n1 = meta["needle"]
    variants = {
        "ivf-ip nprobe 8 (fot's default)": lambda x: ivf_ip(x, a.nlist, 8, a.train),
        "ivf-ip nprobe 64": lambda x: ivf_ip(x, a.nlist, 64, a.train),
        "ivf-l2-augmented nprobe 8": lambda x: ivf_l2_augmented(x, a.nlist, 8, a.train),
        "ivf-l2-augmented nprobe 32": lambda x: ivf_l2_augmented(x, a.nlist, 32, a.train),
        "ivf-l2-augmented nprobe 8, R x2": lambda x: ivf_l2_augmented(x, a.nlist, 8, a.train, margin=2.0),
        "hnsw-ip M 32 ef 128": lambda x: hnsw_ip(x, 32, 128),
    }
    stats = {name: {"hits": 0, "total": 0, "needle_hits": 0, "needle_total": 0, "build_s": 0.0, "search_s": 0.0}
             for name in variants}
    per_layer: dict[str, dict[str, float]] = {}
    heads = sorted({tuple(map(int, k.split(".")[:2])) for k in t})
    for layer, h in heads:
        keys = t[f"{layer}.{h}.keys"].float()
        pos = t[f"{layer}.{h}.positions"]
        qs = t[f"{layer}.{h}.queries"]  # (G, T, D)
        G, T, D = qs.shape
        flat = qs.reshape(-1, D)
        exact = (flat @ keys.T).topk(a.k, dim=-1).indices  # (G*T, k)
        question = torch.zeros(G, T, dtype=torch.bool)
        question[:, -a.question:] = True
        question = question.reshape(-1)
        is_needle = (pos >= n0) & (pos < n1)
        xk, xq = keys.numpy().astype(np.float32), flat.numpy().astype(np.float32)
        for name, make in variants.items():
            t0 = time.perf_counter()
            search, _keep = make(xk)
            t1 = time.perf_counter()
            got = torch.from_numpy(search(xq, a.k)).long()
            t2 = time.perf_counter()
            s = stats[name]
            s["build_s"] += t1 - t0
            s["search_s"] += t2 - t1
            hit = (exact[:, :, None] == got[:, None, :]).any(-1)  # (Q, k): exact entry also returned
            s["hits"] += int(hit.sum())
            s["total"] += hit.numel()
            needle = is_needle[exact] & question[:, None]
            s["needle_hits"] += int((hit & needle).sum())
            s["needle_total"] += int(needle.sum())
            per_layer.setdefault(f"{layer}.{h}", {})[name] = round(float((hit & needle).sum()) / max(int(needle.sum()), 1), 3) \
                if needle.any() else None
        print(f"layer {layer} head {h}: {len(keys)} keys, needle entries in exact top-{a.k} of the question: "
              f"{int((is_needle[exact] & question[:, None]).sum())}", flush=True)
    table = {name: {"recall@k": round(s["hits"] / s["total"], 4),
                    "needle_recall": round(s["needle_hits"] / max(s["needle_total"], 1), 4),
                    "needle_entries": s["needle_total"],
                    "build_s": round(s["build_s"], 1), "search_s": round(s["search_s"], 2)} for name, s in stats.items()}
    out = {"capture": meta, "k": a.k, "nlist": a.nlist, "train": a.train, "question_tokens": a.question,
           "indexes": table, "needle_recall_per_layer_head": per_layer}
    print(json.dumps(table, indent=1))
    if a.json:
        a.json.write_text(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    main()
