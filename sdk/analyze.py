"""Attention statistics (the SMT paper's "Pareto" analysis), without full attention matrices.

A probe is attached as an lcx method whose attention stage records statistics and
then lets the base implementation compute the layer as usual.  Attention
probabilities are recomputed for ``chunk`` queries at a time (B, H, chunk, S), so
memory stays linear in the input length.  Accumulated, over layers, heads and queries:

- mass by distance: attention mass at each query-key distance (cumulative curve);
- mass per 1024-token distance bin;
- mass by rank: for each query, the share of its mass held by its top ``f`` fraction
  of keys (f on a grid), averaged — how concentrated ("Pareto") attention is.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from lcx.hookspecs import hookimpl
from lcx.io import pyplot, save_figure, write_json  # noqa: F401  (write_json: re-exported for the CLI)
from lcx.method import Method

RANK_FRACTIONS = [0.01, 0.02, 0.05, 0.1, 0.15, 0.2, 0.25, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 1.0]


@dataclass
class AttentionStats:
    max_len: int
    bin_size: int = 1024
    by_distance: torch.Tensor = field(init=False)  # (max_len,) float64 summed mass
    by_rank: torch.Tensor = field(init=False)  # (len(RANK_FRACTIONS),) summed cumulative shares
    queries: int = 0  # (layer, head, query) rows accumulated

    def __post_init__(self) -> None:
        self.by_distance = torch.zeros(self.max_len, dtype=torch.float64)
        self.by_rank = torch.zeros(len(RANK_FRACTIONS), dtype=torch.float64)

    def add(self, probs: torch.Tensor, q_pos: torch.Tensor) -> None:
        """``probs`` (R, S): attention rows of queries at positions ``q_pos`` (R,) over keys 0..S-1."""
        R, S = probs.shape
        k_pos = torch.arange(S)
        dist = (q_pos[:, None] - k_pos[None, :])  # (R, S)
        valid = dist >= 0
        self.by_distance.index_add_(0, dist[valid], probs[valid].double())
        ctx = (q_pos + 1).clamp(max=S)  # keys each query can see
        srt = probs.sort(dim=-1, descending=True).values.double().cumsum(-1)  # (R, S)
        for i, f in enumerate(RANK_FRACTIONS):
            r = (torch.ceil(f * ctx.double()).long() - 1).clamp(min=0)
            self.by_rank[i] += srt.gather(1, r[:, None]).sum()
        self.queries += R

    def summary(self) -> dict[str, Any]:
        total = self.by_distance.sum().item() or 1.0
        mass = (self.by_distance / total).tolist()
        cum = torch.tensor(mass).cumsum(0).tolist()
        n_bins = (self.max_len + self.bin_size - 1) // self.bin_size
        bins = [sum(mass[b * self.bin_size:(b + 1) * self.bin_size]) for b in range(n_bins)]
        by_rank = (self.by_rank / max(self.queries, 1)).tolist()
        pareto = next((f for f, v in zip(RANK_FRACTIONS, by_rank) if v >= 0.8), 1.0)
        return {
            "queries": self.queries,
            "mass_per_bin": {f"{b * self.bin_size}-{(b + 1) * self.bin_size}": v for b, v in enumerate(bins)},
            "cumulative_mass_by_distance": {str(d): cum[d - 1] for d in _log_points(self.max_len)},
            "mass_share_of_top_fraction": {str(f): v for f, v in zip(RANK_FRACTIONS, by_rank)},
            "smallest_top_fraction_with_80pct_mass": pareto,
        }


def _log_points(n: int) -> list[int]:
    pts, d = [], 1
    while d < n:
        pts.append(d)
        d *= 2
    return pts + [n]


@dataclass
class AttentionProbe(Method):
    """Not a registered method: attach an instance to record attention statistics."""

    name = "attention-probe"
    description = "records attention statistics; computes attention unchanged"

    max_len: int = 4096
    chunk: int = 256
    layers: list[int] | None = None

    def __post_init__(self) -> None:
        self.stats = AttentionStats(self.max_len)

    @hookimpl
    def lcx_attention(self, run, module, query, key, value, attention_mask, kwargs):
        if self.layers is not None and module.layer_idx not in self.layers:
            return None
        B, H, T, D = query.shape
        S = key.shape[-2]
        rep = H // key.shape[1]
        k = key.repeat_interleave(rep, dim=1).float()  # (B, H, S, D)
        scaling = kwargs.get("scaling") or D ** -0.5
        q_pos_all = torch.arange(S - T, S, device=query.device)
        for s in range(0, T, self.chunk):
            q = query[:, :, s:s + self.chunk].float()  # (B, H, c, D)
            c = q.shape[2]
            scores = (q @ k.transpose(-1, -2)) * scaling  # (B, H, c, S)
            qp = q_pos_all[s:s + c]
            causal = torch.arange(S, device=query.device)[None, :] <= qp[:, None]  # (c, S)
            scores = scores.masked_fill(~causal, float("-inf"))
            if attention_mask is not None and attention_mask.dtype == torch.bool:
                scores = scores.masked_fill(~attention_mask[:, :, s:s + c, :S], float("-inf"))
            probs = scores.softmax(-1).nan_to_num(0.0)  # (B, H, c, S)
            self.stats.add(probs.reshape(-1, S).cpu(), qp.repeat(B * H).cpu())  # the statistics live on the CPU
        return None


def analyze(model: Any, documents: list[tuple[str, list[int]]], length: int, chunk: int = 256,
            layers: list[int] | None = None, progress: bool = True) -> dict[str, Any]:
    from tqdm.auto import tqdm

    from lcx.composition import attach
    from lcx.generation import model_device

    probe = AttentionProbe(max_len=length, chunk=chunk, layers=layers)
    with attach(model, [probe]), torch.no_grad():
        for name, ids in tqdm(documents, desc="attention", disable=not progress):
            x = torch.tensor(ids[:length], device=model_device(model))[None]
            model(x, logits_to_keep=1)
    return {"length": length, "documents": [n for n, _ in documents], "layers": layers or "all",
            **probe.stats.summary()}


def plot(result: dict[str, Any], path: Path, title: str) -> Path:
    fig, axes = pyplot().subplots(1, 3, figsize=(13, 3.6))
    cum = result["cumulative_mass_by_distance"]
    axes[0].plot([int(d) for d in cum], list(cum.values()), marker="o")
    axes[0].set_xscale("log", base=2)
    axes[0].set_xlabel("query-key distance (tokens)")
    axes[0].set_title("cumulative attention mass by distance", fontsize=9)
    bins = result["mass_per_bin"]
    axes[1].bar(range(len(bins)), list(bins.values()))
    axes[1].set_xticks(range(len(bins)), [k.split("-")[0] for k in bins], rotation=45, fontsize=7)
    axes[1].set_xlabel("distance bin start (tokens)")
    axes[1].set_title("attention mass per 1024-token bin", fontsize=9)
    rk = result["mass_share_of_top_fraction"]
    axes[2].plot([float(f) for f in rk], list(rk.values()), marker="o")
    axes[2].plot([0, 1], [0, 1], ls="--", c="grey", lw=0.8)
    axes[2].set_xlabel("top fraction of keys (by attention)")
    axes[2].set_title("share of mass held by the top keys", fontsize=9)
    for ax in axes:
        ax.grid(alpha=0.3)
    return save_figure(fig, path, title)


# ---------------------------------------------------------------------- retrieval layers
@dataclass
class RetrievalProbe(Method):
    """Not a registered method: attention mass that the last queries put on given key positions."""

    name = "retrieval-probe"
    description = "records attention mass on target keys; computes attention unchanged"

    n_layers: int = 1
    n_heads: int = 1
    max_queries: int = 16

    def __post_init__(self) -> None:
        self.targets: list[int] = []
        self.total = 0  # positions read so far, the measured queries' included
        self.mass = torch.zeros(self.n_layers, self.n_heads, dtype=torch.float64)
        self.count = 0

    @hookimpl
    def lcx_attention(self, run, module, query, key, value, attention_mask, kwargs):
        B, H, T, D = query.shape
        if T > self.max_queries or not self.targets:  # the prompt's prefill: not measured
            return None
        S = key.shape[-2]
        k = key.repeat_interleave(H // key.shape[1], dim=1).float()
        scores = (query.float() @ k.transpose(-1, -2)) * (kwargs.get("scaling") or D ** -0.5)  # (B, H, T, S)
        # a sliding-window layer's cache holds only the last S of the `total` positions
        k_pos = torch.arange(self.total - S, self.total, device=query.device)
        q_pos = torch.arange(self.total - T, self.total, device=query.device)
        visible = k_pos[None, :] <= q_pos[:, None]  # (T, S)
        window = kwargs.get("sliding_window") or getattr(module, "sliding_window", None)
        if window:
            visible &= q_pos[:, None] - k_pos[None, :] < window
        probs = scores.masked_fill(~visible, float("-inf")).softmax(-1)
        seen = [t - (self.total - S) for t in self.targets if t >= self.total - S]  # targets still in the cache
        self.mass[module.layer_idx] += probs[..., seen].sum(-1).mean(dim=(0, 2)).double().cpu()
        if module.layer_idx == 0:
            self.count += 1
        return None


def retrieval_layers(model: Any, tokenizer: Any, length: int, depths: list[float], keys: list[int],
                     threshold: float = 0.15, progress: bool = True) -> dict[str, Any]:
    """Which layers retrieve: the attention mass each head puts on a passkey's digits while the
    model repeats them (teacher-forced), over a prompt the model reads natively (``length`` tokens).

    Layers whose best head puts at least ``threshold`` of its mass on the needle are the
    suggested memory layers: a memory method that leaves them out cannot copy from memory.
    """
    from tqdm.auto import tqdm

    from lcx.composition import attach
    from lcx.evals.passkey import build_prompt_ids
    from lcx.generation import model_device

    device = model_device(model)
    cfg = getattr(model.config, "text_config", None) or model.config
    n_layers, n_heads = cfg.num_hidden_layers, cfg.num_attention_heads
    probe = RetrievalProbe(n_layers=n_layers, n_heads=n_heads)
    cases = [(d, key) for d in depths for key in keys]
    with attach(model, [probe]), torch.no_grad():
        for d, key in tqdm(cases, desc="retrieval", disable=not progress):
            ids = build_prompt_ids(tokenizer, length, d, key)
            answer = tokenizer(" " + str(key), add_special_tokens=False)["input_ids"]
            prompt = ids.tolist()
            hits = [i for i in range(len(prompt) - len(answer) + 1) if prompt[i:i + len(answer)] == answer]
            probe.targets = []
            out = model(ids[None, :-1].to(device), use_cache=True, logits_to_keep=1)  # prefill: not measured
            probe.targets = sorted({i + j for i in hits for j in range(len(answer))})
            probe.total = len(prompt) - 1 + len(answer)
            model(torch.tensor([prompt[-1:] + answer[:-1]], device=device), past_key_values=out.past_key_values,
                  logits_to_keep=1)
    mass = (probe.mass / max(probe.count, 1)).float()
    best = mass.max(dim=1).values
    layers = [i for i, v in enumerate(best.tolist()) if v >= threshold]
    heads = [f"{i}:{h}" for i, row in enumerate(mass.tolist()) for h, v in enumerate(row) if v >= threshold]
    return {"length": length, "depths": depths, "keys": keys, "threshold": threshold,
            "mass_by_layer_head": [[round(v, 4) for v in row] for row in mass.tolist()],
            "best_head_mass_by_layer": [round(v, 4) for v in best.tolist()],
            "suggested_memory_layers": ",".join(map(str, layers)),
            "suggested_memory_heads": ",".join(heads)}


def plot_retrieval(result: dict[str, Any], path: Path, title: str) -> Path:
    mass = result["mass_by_layer_head"]
    fig, ax = pyplot().subplots(figsize=(max(5.0, 1.5 + 0.35 * len(mass[0])), 1.2 + 0.22 * len(mass)))
    im = ax.imshow(mass, vmin=0, vmax=1, cmap="viridis", aspect="auto")
    ax.set_xlabel("query head")
    ax.set_ylabel("layer")
    chosen = {int(x) for x in result["suggested_memory_layers"].split(",") if x}
    ax.set_yticks(range(len(mass)), [f"{i}*" if i in chosen else str(i) for i in range(len(mass))], fontsize=6)
    fig.colorbar(im, ax=ax, fraction=0.046, label="attention mass on the needle")
    return save_figure(fig, path, f"{title}\n* = suggested memory layer (best head >= {result['threshold']})")
