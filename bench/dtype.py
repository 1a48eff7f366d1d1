"""bfloat16 against float32, side by side in one run: this CPU's matrix-product peaks (the roofline), the bare
model's long prefill as a fraction of them, and each method's prefill and decode step in both dtypes.

    .venv/bin/python bench/dtype.py                      # SmolLM2-135M, 16K tokens, the five inference paths
    .venv/bin/python bench/dtype.py --tokens 4K --methods none,fot --rounds 2
    python bench/dtype.py --device cuda --random-weights --model DIR  # a GPU: the peaks are the GPU's
    .venv/bin/python bench/dtype.py --peaks-only --sizes 512,1024  # the roofline alone (a CPU that emulates bf16)

Per method and dtype: the prompt's prefill (every window the method feeds, up to the first new token) and the
median decode step of the next ``--new`` tokens.  The two dtypes alternate within a round (the first one
flips every round), so the fp32/bf16 ratios cancel the machine's drift.  Writes bench/results/dtype.json.
On a GPU, float32 means float32 (TF32 off, torch's default for matrix products).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

import lcx
from lcx.generation import generate
from lcx.io import token_counts
from lcx.models import cpu_flags, resolve_device
from loading import bench_model, device_name, sync, sync_device
from lcx.session import parse_options
from provenance import environment  # bench/provenance.py (scripts here run as `python bench/NAME.py`)

OUT = Path(__file__).parent / "results" / "dtype.json"
PEAKS_OUT = OUT.with_name("dtype-peaks.json")
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
# fot at its defaults before issue 52, pinned (dtype.json measured them); -o fot.KEY=VALUE still overrides
FOT_BEFORE = ("fot.local=2048", "fot.chunk=0", "fot.sinks=0", "fot.positions=first", "fot.fixed_distance=0",
              "fot.gate=off")


def random_prompt(tokens: int) -> torch.Tensor:
    """The (1, tokens) prompt every dtype comparison reads (a fixed draw, so runs and scripts compare)."""
    return torch.randint(100, 40000, (1, tokens), generator=torch.Generator().manual_seed(0))


# ---------------------------------------------------------------------- the roofline
def bf16_flags() -> list[str]:
    """This CPU's flags that make bfloat16 products native (every JSON here records them)."""
    return sorted({"amx_bf16", "amx_tile", "avx512_bf16"} & cpu_flags())


def matmul_peak(dtype: torch.dtype, sizes: tuple[int, ...], seconds: float = 1.0,
                device: torch.device = torch.device("cpu")) -> dict[str, float]:
    """FLOP/s of n x n x n matrix products in ``dtype`` per size n (the best of at least ``seconds`` of repeats,
    after as long a warm-up: AMX units and clocks take a moment to reach speed), and their maximum, "peak"."""
    out: dict[str, float] = {}
    for n in sizes:
        a, b = torch.randn(n, n).to(device, dtype), torch.randn(n, n).to(device, dtype)
        best, spent, t_end = float("inf"), 0.0, time.perf_counter() + seconds
        while time.perf_counter() < t_end:  # warm-up (synced: a GPU would queue products faster than it runs them)
            torch.mm(a, b)
            sync_device(device)
        while spent < seconds:
            sync_device(device)
            t0 = time.perf_counter()
            torch.mm(a, b)
            sync_device(device)
            dt = time.perf_counter() - t0
            best, spent = min(best, dt), spent + dt
        out[str(n)] = 2 * n ** 3 / best
    out["peak"] = max(out.values())
    return out


def matmul_peaks(device: torch.device, sizes: str | None = None) -> dict[str, dict[str, float]]:
    """:func:`matmul_peak` in each of ``DTYPES`` on ``device``, at ``--sizes`` (comma-separated n) where given, else
    at sizes that reach the device's peak."""
    ns = (tuple(int(n) for n in sizes.split(",")) if sizes
          else (4096, 8192, 16384) if device.type == "cuda" else (1024, 2048, 3072, 4096))
    return {name: matmul_peak(dt, ns, device=device) for name, dt in DTYPES.items()}


def attention_seconds(model, tokens: int, dtype: torch.dtype) -> float:
    """Seconds the model's layers spend in causal SDPA over ``tokens`` tokens (one layer's, timed, times the
    layer count): the part of the bare prefill that torch's CPU flash-attention kernel computes."""
    cfg = model.config
    heads, kv = cfg.num_attention_heads, getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads
    d = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
    dev = model.device
    q, k, v = (torch.randn(1, h, tokens, d).to(dev, dtype) for h in (heads, kv, kv))
    sdpa = torch.nn.functional.scaled_dot_product_attention
    sdpa(q[:, :, :512], k[:, :, :512], v[:, :, :512], is_causal=True, enable_gqa=True)
    best = float("inf")
    for _ in range(2):
        sync_device(dev)
        t0 = time.perf_counter()
        sdpa(q, k, v, is_causal=True, enable_gqa=True)
        sync_device(dev)
        best = min(best, time.perf_counter() - t0)
    return best * cfg.num_hidden_layers


def prefill_flops(model, tokens: int) -> tuple[float, float]:
    """Matrix-product FLOPs of a causal forward over ``tokens`` tokens with one logit row: 2 per weight per
    token for the projections and MLPs, and 2 * T^2 * heads * head_dim per layer for QK^T and AV (causal:
    half of each T x T product): (projections and MLPs, attention)."""
    cfg = model.config
    emb = model.get_input_embeddings().weight.numel()
    linear = sum(p.numel() for n, p in model.named_parameters() if p.ndim == 2) - emb
    if not cfg.tie_word_embeddings:
        linear -= model.get_output_embeddings().weight.numel()  # logits_to_keep=1: one row, negligible
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    attention = 2 * tokens ** 2 * cfg.num_attention_heads * head_dim * cfg.num_hidden_layers
    return 2 * linear * tokens, attention


# ---------------------------------------------------------------------- one path
class StepClock:
    """A logits processor that only notes when each generation step's logits are ready."""

    def __init__(self) -> None:
        self.stamps: list[float] = []

    def __call__(self, input_ids, scores):
        sync_device(scores.device)
        self.stamps.append(time.perf_counter())
        return scores


def run_once(model, method: str, options: dict, ids: torch.Tensor, new: int) -> dict:
    """Prefill seconds (start to the first token's logits) and the median decode step (s) of ``new`` tokens."""
    from transformers import LogitsProcessorList

    clock = StepClock()
    methods = [] if method == "none" else [method]
    with lcx.attach(model, methods, **({method: options} if options else {})) as run:
        sync(model)
        t0 = time.perf_counter()
        out = generate(run, ids, max_new_tokens=new, min_new_tokens=new,
                       logits_processor=LogitsProcessorList([clock]))
    steps = [b - a for a, b in zip(clock.stamps, clock.stamps[1:])]
    return {"prefill_s": clock.stamps[0] - t0, "decode_step_s": statistics.median(steps) if steps else None,
            "tokens": out[0].tolist()}


def peaks_only(args: argparse.Namespace) -> None:
    """``--peaks-only``: both dtypes' matrix-product peaks and their ratio, written to ``--out``."""
    sizes = matmul_peaks(resolve_device(args.device), args.sizes)
    ratio = sizes["float32"]["peak"] / sizes["bfloat16"]["peak"]
    result = {"benchmark": "dtype-peaks", **environment(),
              "cpu_bf16_flags": bf16_flags(),
              "matmul_flop_per_s_by_size": sizes, "fp32_over_bf16_peak": ratio}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    for name, s in sizes.items():
        print(f"{name:>8}: " + ", ".join(f"{k} {v / 1e9:.2f} GFLOP/s" for k, v in s.items()))
    print(f"bf16 takes {ratio:.1f}x float32's time per product at the peaks; wrote {args.out}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--tokens", default="16K", help="prompt length (K suffix allowed)")
    ap.add_argument("--methods", default="none,vanilla,streaming,fot,focusllm",
                    help="comma-separated; none = the bare model over the whole prompt")
    ap.add_argument("-o", "--option", action="append", default=[], help="METHOD.KEY=VALUE, as lcx's -o")
    ap.add_argument("--new", type=int, default=16, help="decode steps timed after the prefill")
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--device", default=None, help="where the models run: cpu (default), cuda (or LCX_DEVICE)")
    ap.add_argument("--random-weights", action="store_true",
                    help="the model's architecture with random weights (from its config.json; speed only)")
    ap.add_argument("--sizes", default=None,
                    help="comma-separated n of the n x n x n peak products (default 1024-4096, 4096-16384 on a GPU)")
    ap.add_argument("--peaks-only", action="store_true",
                    help="the matrix-product peaks alone, no model (where one bf16 product takes minutes)")
    ap.add_argument("--out", type=Path, default=None, help=f"default {OUT} ({PEAKS_OUT.name} with --peaks-only)")
    args = ap.parse_args()
    if args.peaks_only:
        args.out = args.out or PEAKS_OUT
        return peaks_only(args)
    args.out = args.out or OUT
    tokens = token_counts(args.tokens)[0]
    options = parse_options((*FOT_BEFORE, *args.option))

    models = {name: bench_model(args.model, args.device, args.random_weights, name)[0] for name in DTYPES}
    device = models["float32"].device
    gpu = device.type == "cuda"
    sizes = matmul_peaks(device, args.sizes)
    peaks = {name: s["peak"] for name, s in sizes.items()}
    print(f"matrix-product peak ({device_name(models['float32'])}{'' if gpu else f', {torch.get_num_threads()} threads'}): "
          f"fp32 {peaks['float32'] / 1e9:.0f} GFLOP/s, bf16 {peaks['bfloat16'] / 1e9:.0f} GFLOP/s", flush=True)
    ids = random_prompt(tokens).to(device)
    linear_flops, attention_flops = prefill_flops(models["float32"], tokens)
    flops = linear_flops + attention_flops
    rows: dict[str, dict] = {}
    for method in args.methods.split(","):
        per: dict[str, list[dict]] = {name: [] for name in DTYPES}
        for name in DTYPES:  # untimed: what a method resolves on first use (fot's memory layers=auto) and kernel warm-up
            # (a GPU picks kernels per shape on first use: warm it up on the whole prompt)
            run_once(models[name], method, options.get(method, {}), ids if gpu else ids[:, :256], 2)
        for r in range(args.rounds):
            order = list(DTYPES) if r % 2 == 0 else list(DTYPES)[::-1]
            for name in order:
                res = run_once(models[name], method, options.get(method, {}), ids, args.new)
                per[name].append(res)
                print(f"  {method:>10} {name:>8}: prefill {res['prefill_s']:7.2f} s, decode step "
                      f"{res['decode_step_s'] * 1e3:7.1f} ms", flush=True)
        row = {}
        for name, runs in per.items():
            row[name] = {"prefill_s": statistics.median(x["prefill_s"] for x in runs),
                         "decode_step_s": statistics.median(x["decode_step_s"] for x in runs),
                         "prefill_all_s": [round(x["prefill_s"], 3) for x in runs]}
        row["prefill_speedup"] = row["float32"]["prefill_s"] / row["bfloat16"]["prefill_s"]
        row["decode_speedup"] = row["float32"]["decode_step_s"] / row["bfloat16"]["decode_step_s"]
        a, b = per["float32"][0]["tokens"], per["bfloat16"][0]["tokens"]
        row["same_tokens"] = sum(x == y for x, y in zip(a, b))
        if method == "none":  # the roofline: achieved FLOP/s, and where the time goes
            for name, dt in DTYPES.items():
                achieved = flops / row[name]["prefill_s"]
                attn = attention_seconds(models[name], tokens, dt)
                rest = row[name]["prefill_s"] - attn
                row[name].update(flop_per_s=achieved, fraction_of_peak=achieved / peaks[name],
                                 attention_s=attn, attention_flop_per_s=attention_flops / attn,
                                 other_s=rest, other_flop_per_s=linear_flops / rest if rest > 0 else None)
        rows[method] = row

    result = {"benchmark": "dtype", **environment(),
              "model": args.model, "device": device_name(models["float32"]), "random_weights": args.random_weights,
              "tokens": tokens, "new_tokens": args.new, "rounds": args.rounds,
              "cpu_bf16_flags": bf16_flags(),
              "matmul_peak_flop_per_s": peaks, "matmul_flop_per_s_by_size": sizes, "bare_prefill_flops": flops,
              "bare_prefill_flops_attention": attention_flops, "options": options, "methods": rows}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"\n{'method':>10} | {'fp32 prefill':>12} | {'bf16 prefill':>12} | ratio | {'fp32 step':>9} | "
          f"{'bf16 step':>9} | ratio")
    for method, row in rows.items():
        f, b = row["float32"], row["bfloat16"]
        print(f"{method:>10} | {f['prefill_s']:10.2f} s | {b['prefill_s']:10.2f} s | {row['prefill_speedup']:4.2f}x | "
              f"{f['decode_step_s'] * 1e3:6.1f} ms | {b['decode_step_s'] * 1e3:6.1f} ms | {row['decode_speedup']:4.2f}x")
    if "none" in rows:
        for name in DTYPES:
            r = rows["none"][name]
            print(f"bare {name} prefill: {r['flop_per_s'] / 1e9:.0f} GFLOP/s = {r['fraction_of_peak']:.0%} of the "
                  f"{name} matrix-product peak; attention (SDPA) {r['attention_s']:.1f} s at "
                  f"{r['attention_flop_per_s'] / 1e9:.0f} GFLOP/s, the rest {r['other_s']:.1f} s")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
