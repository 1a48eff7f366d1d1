"""bf16: a method adds no error of its own to a bfloat16 model.

What needs range or precision runs in float32 whatever the model's dtype: fot's joint softmax over local and
memory keys, re-rotated RoPE queries and keys, memory keys (FAISS's too), focusllm's gated candidates, losses.
End to end, the bf16-vs-float32 gap of a method's logits (the root mean square of the difference of their
log-softmaxes over the scored tokens, in nats) stays within SLACK times the bare model's own.  That gap is the
model's bf16 noise, about one rounding per matmul, so it catches crashes and gross errors (positions, ranges,
masks) but not one extra rounding; the float32 parts are held to their contract directly at the end of the file.
The end-to-end tests run on ``LCX_TEST_DEVICE`` (cpu where unset; cuda on a GPU machine), the parts on the CPU.
"""

from __future__ import annotations

import os
from functools import cache

import pytest
import torch
from transformers import AutoModelForCausalLM

import lcx
from lcx.adapters.peft_bridge import add_adapter
from lcx.adapters.rotary import rotate
from lcx.generation import tail_logits
from lcx.plugins.fot.memory import make_store
from lcx.plugins.fot.attention import memory_attention
from lcx.plugins.fot.cache import add_to_memory
from lcx.registry import BUILTIN_PLUGINS, registry
from tests.conftest import tiny_model

T, N = 300, 32  # input tokens (window 128; past 256 bf16 cannot count positions), scored tokens at its end
TRAIN_T = 64  # training windows: (w + 1) x local of fot's crossbatch below
SLACK = 2.0  # a method may be this much further from float32 than the bare model is
DEVICE = torch.device(os.environ.get("LCX_TEST_DEVICE") or "cpu")

#: Every built-in method, with options that make it act on a T-token input.  Each test runs over the cases
#: whose method has the stages it tests: logits, an inference stage; losses, a loss stage.
CASES = [
    ("vanilla", {}),  # drops the input's middle
    ("rope", {"factor": 4.0}),  # yarn: reads all T tokens at stretched positions
    ("streaming", {"window": 32, "chunk": 32}),  # evicts; sink keys re-rotated
    # fot: k covers the whole memory, so the kNN search hands every key to the joint softmax.  A smaller k
    # picks among near-tied scores, which any rounding reorders: another valid choice, not an error.  So does
    # its default gate (a threshold: keys near it go in or out with the rounding), left off here.
    ("fot", {"local": 32, "chunk": 32, "memory_layers": "all", "k": 1024, "gate": "off", "w": 1, "d": 2}),  # w, d: crossbatch
    ("fot", {"local": 32, "chunk": 32, "memory_layers": "all", "k": 1024, "gate": "off", "backend": "faiss-flat"}),
    ("fot", {"local": 32, "chunk": 32, "memory_layers": "all", "gate": "off", "dense": True}),
    ("focusllm", {"chunk": 32, "local": 48, "fragment": 8, "train_chunks": "16,32"}),  # 7 candidates
    ("smt", {"budget": 32, "window": 8, "decay_iters": 3}),  # training only
]
INFERENCE = {"chunking", "memory", "attention", "patching"}


def cases(stages: set[str], first_only: bool = False) -> list:
    """The cases whose method has one of ``stages`` (``first_only``: each method's first case)."""
    out, seen = [], set()
    for i, (method, options) in enumerate(CASES):
        if stages & set(registry().get(method).stages()) and not (first_only and method in seen):
            out.append(pytest.param(method, options, id=f"{method}-{i}"))
            seen.add(method)
    return out


def as_bf16(model):
    """``model`` in bfloat16 as ``lcx.load_model(dtype="bfloat16")`` gives it: the weights in bf16, the RoPE
    frequencies left in float32 (``model.to(torch.bfloat16)`` would round those too)."""
    bf16 = AutoModelForCausalLM.from_config(model.config, dtype=torch.bfloat16, attn_implementation="sdpa")
    bf16.load_state_dict(model.state_dict())
    return bf16.to(DEVICE).eval()


@cache
def models(family: str):
    """(float32, bf16) tiny models of ``family``, the same weights."""
    model = tiny_model(family)
    return model.to(DEVICE), as_bf16(model)


@cache
def ids(n: int = T, rows: int = 1) -> torch.Tensor:
    return torch.randint(3, 256, (rows, n), generator=torch.Generator().manual_seed(0))


def gap(a: torch.Tensor, b: torch.Tensor) -> float:
    """The root mean square of the difference of two logits' log-softmaxes (..., V), in nats (steadier than
    the largest difference, an extreme of the same noise)."""
    return float((a.float().log_softmax(-1) - b.float().log_softmax(-1)).pow(2).mean().sqrt())


@cache
def bare_gap(family: str) -> float:
    """The bare model's own bf16-vs-float32 gap on the same N scored tokens, read as it reads them natively:
    the input's last window."""
    window = ids()[:, -models(family)[0].config.max_position_embeddings:].to(DEVICE)
    with torch.no_grad():
        fp32, bf16 = (m(window).logits[0, -N - 1:-1] for m in models(family))
    return gap(fp32, bf16)


def test_every_builtin_method_has_a_case():
    reg = registry()
    assert {m for m in reg.methods if reg.plugin_of(m) in BUILTIN_PLUGINS} == {m for m, _ in CASES}


@pytest.mark.parametrize("family", ["llama", "gemma3_text"])
@pytest.mark.parametrize("method,options", cases(INFERENCE))
def test_logits_in_bf16_are_as_close_to_float32_as_the_bare_models(family, method, options):
    logits = []
    for model in models(family):
        with lcx.attach(model, [method], **{method: options}) as run:
            logits.append(tail_logits(run, ids(), N))
    assert gap(*logits) <= SLACK * bare_gap(family), (
        f"{method} {options} on a bf16 {family}: {gap(*logits):.4f} nats from float32, the bare model "
        f"{bare_gap(family):.4f}")


def with_adapters(seed: int = 3):
    """The float32 and bf16 tiny llama with the same LoRA adapter, its B random (an untrained one, B = 0,
    would change nothing; focusllm's candidate gate opens it at candidate positions only)."""
    fp32 = add_adapter(tiny_model("llama").to(DEVICE), roles=("q", "k", "v", "o"), rank=4)
    g = torch.Generator().manual_seed(seed)
    for name, p in fp32.named_parameters():
        if "lora_B" in name:
            p.data.copy_(torch.randn(p.shape, generator=g).to(p.device) * 0.5)
    bf16 = add_adapter(as_bf16(models("llama")[0]), roles=("q", "k", "v", "o"), rank=4)
    bf16.load_state_dict(fp32.state_dict())
    return fp32, bf16


@pytest.mark.parametrize("method,options", cases({"loss"}, first_only=True))
def test_training_losses_are_float32_and_as_close_as_the_bare_models_logits(method, options):
    """A loss is a mean of per-token log-softmaxes, so its bf16-vs-float32 difference is at most the root mean
    square of theirs (Cauchy-Schwarz): within SLACK times the bare model's gap."""
    losses = []
    for model in with_adapters():
        x = ids(TRAIN_T, rows=2).to(DEVICE)
        batch = {"input_ids": x, "attention_mask": torch.ones_like(x), "labels": x.clone()}
        with lcx.attach(model, [method], **{method: options}) as run, torch.no_grad():
            run.seed = 0
            batch = run.hook.lcx_sample(run=run, batch=batch, step=0)
            results = run.hook.lcx_loss(run=run, model=model, batch=batch)
            losses.append({term: loss for r in results if r for term, loss in r.items()})
    assert losses[0] and set(losses[0]) == set(losses[1])
    for term, loss in losses[1].items():
        assert loss.dtype == torch.float32, f"{method}'s {term} loss in bf16 is {loss.dtype}"
        err = abs(float(loss) - float(losses[0][term]))
        assert err <= SLACK * bare_gap("llama"), (
            f"{method}'s {term} loss: {err:.4f} from float32, the bare model's logits {bare_gap('llama'):.4f}")


# ---------------------------------------------------------------------- the float32 parts, directly
# Given bf16 inputs, each answers what it answers for the same values in float32, rounded once at the end:
# nothing is rounded to bf16 on the way (exact equality, so one extra rounding shows).
INV_FREQ = 1.0 / 10000 ** (torch.arange(0, 32, 2) / 32)  # (16,) head_dim 32


def _bf16_values(*shape: int, scale: float = 1.0, seed: int = 0) -> torch.Tensor:
    return (torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * scale).bfloat16()


def test_rerotation_rounds_once_at_positions_bf16_cannot_count():
    x = _bf16_values(2, 6, 32)  # (H, S, D)
    shift = torch.tensor([1, 257, -301, 1001, 4097, 131073])  # bf16 holds whole numbers up to 256 only
    assert torch.equal(rotate(x, shift, INV_FREQ), rotate(x.float(), shift, INV_FREQ).bfloat16())


def test_memory_keys_are_float32_unrotated_from_the_bf16_keys():
    keys, values = _bf16_values(2, 5, 32), _bf16_values(2, 5, 32, seed=1)  # (Hkv, n, D)
    positions = torch.tensor([300, 301, 302, 303, 999])
    memory = {(0, h): make_store() for h in range(2)}
    add_to_memory(memory, 0, keys, values, positions, INV_FREQ, doc_id=0)
    want = rotate(keys.float(), -positions, INV_FREQ)
    for h in range(2):
        assert memory[(0, h)].keys.dtype == torch.float32
        assert torch.equal(memory[(0, h)].keys, want[h])


@pytest.mark.parametrize("dense", [False, True], ids=["knn", "dense"])
def test_fots_joint_softmax_of_bf16_inputs_is_the_float32_one_rounded_once(dense):
    """Scores as large as a trained model's (std ~9): a score or softmax statistic rounded to bf16 would move
    the answer by far more than its last bit."""
    B, H, Hkv, Q, S, D, M = 1, 4, 2, 6, 10, 32, 40  # GQA; Q queries, the last of S local keys; M memory keys
    query = _bf16_values(B, H, Q, D, scale=3.0)
    key, value = _bf16_values(B, Hkv, S, D, scale=3.0, seed=1), _bf16_values(B, Hkv, S, D, seed=2)
    memory = {(0, h): make_store() for h in range(Hkv)}
    add_to_memory(memory, 0, _bf16_values(Hkv, M, D, scale=3.0, seed=3), _bf16_values(Hkv, M, D, seed=4),
                  torch.arange(M), INV_FREQ, doc_id=0)
    causal = torch.ones(Q, S, dtype=torch.bool).tril(S - Q)
    mask = torch.zeros(1, 1, Q, S).masked_fill(~causal, torch.finfo(torch.float32).min)
    shift = torch.full((B, Q), -300.0, dtype=torch.float64)  # queries moved to the local window's start

    def attend(dtype):
        return memory_attention(query.to(dtype), key.to(dtype), value.to(dtype), mask, memory, shift, INV_FREQ,
                                D ** -0.5, k=8, dense=dense, block=4)

    out = attend(torch.bfloat16)
    assert out.dtype == torch.bfloat16
    assert torch.equal(out, attend(torch.float32).bfloat16())


def test_a_bf16_models_memory_search_picks_its_candidates_in_bf16(monkeypatch):
    """The search's matrix product, fot's largest cost at long memories, runs at the model's precision; the
    scores it answers are float32 (tests/test_memory.py holds the search to that)."""
    import lcx.plugins.fot.memory as store_module

    seen, search = [], store_module.top_inner_products
    monkeypatch.setattr(store_module, "top_inner_products", lambda *a: seen.append(a[3]) or search(*a))
    H, Q, S, D, M = 2, 4, 6, 32, 40
    memory = {(0, 0): make_store()}
    add_to_memory(memory, 0, _bf16_values(1, M, D, seed=3), _bf16_values(1, M, D, seed=4), torch.arange(M),
                  INV_FREQ, doc_id=0)
    mask = torch.zeros(1, 1, Q, S)
    for dtype in (torch.bfloat16, torch.float32):
        memory_attention(_bf16_values(1, H, Q, D).to(dtype), _bf16_values(1, 1, S, D, seed=1).to(dtype),
                         _bf16_values(1, 1, S, D, seed=2).to(dtype), mask, memory,
                         torch.zeros(1, Q, dtype=torch.float64), INV_FREQ, D ** -0.5, k=8, dense=False, block=4)
    assert seen == [torch.bfloat16, torch.float32]
