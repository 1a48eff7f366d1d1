"""Resource limits: token and memory-entry caps per request, and the free-RAM check, refuse a request
with a clear error before any work starts."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

import lcx
from lcx import limits
from lcx.cli import main
from lcx.generation import generate
from lcx.limits import LimitError, Limits, check_request, kv_bytes_per_token
from tests.conftest import tiny_model
from tests.helpers import LiveTensors, make_tiny_model_dir


@pytest.fixture(autouse=True)
def _estimate_as_it_is(monkeypatch):
    """The arithmetic below is the estimate's; glibc's heap allowance has its own test."""
    monkeypatch.setenv("LCX_HEAP_ALLOWANCE", "1")


def _ids(T, seed=0):
    return torch.randint(3, 256, (1, T), generator=torch.Generator().manual_seed(seed))


class _Forwards:
    """Counts the model's forward passes (a refused request must run none)."""

    def __init__(self, model):
        self.n = 0
        model.register_forward_pre_hook(lambda *a: setattr(self, "n", self.n + 1))


def test_defaults_environment_and_overrides(monkeypatch):
    monkeypatch.delenv("LCX_HEAP_ALLOWANCE")
    assert Limits.from_env() == Limits(262_144, 4_096, 4_194_304, 0.9, 1.5)
    monkeypatch.setenv("LCX_MAX_INPUT_TOKENS", "1000")
    monkeypatch.setenv("LCX_RAM_FRACTION", "0.5")
    assert Limits.from_env().max_input_tokens == 1000 and Limits.from_env().ram_fraction == 0.5
    assert Limits.from_env(max_input_tokens=7).max_input_tokens == 7
    monkeypatch.setenv("LCX_MAX_NEW_TOKENS", "lots")
    with pytest.raises(lcx.LcxError, match="LCX_MAX_NEW_TOKENS='lots' is not a number"):
        Limits.from_env()


def test_a_prompt_over_the_token_cap_is_refused_before_any_forward(monkeypatch):
    model = tiny_model("llama")
    calls = _Forwards(model)
    monkeypatch.setenv("LCX_MAX_INPUT_TOKENS", "50")
    with lcx.attach(model, ["streaming"], chunk=16) as run:
        with pytest.raises(LimitError, match=r"the prompt has 60 tokens, over the limit of 50 .*--max-input-tokens"):
            generate(run, _ids(60), max_new_tokens=2)
        assert calls.n == 0
        generate(run, _ids(50), max_new_tokens=2)  # at the cap: served
    monkeypatch.setenv("LCX_MAX_NEW_TOKENS", "8")
    with lcx.attach(model, []) as run, pytest.raises(LimitError, match="max_new_tokens=9 is over the limit of 8"):
        generate(run, _ids(5), max_new_tokens=9)


def test_the_cli_flag_sets_the_cap_and_the_error_is_one_line(tmp_path):
    d = make_tiny_model_dir(tmp_path / "m")
    r = CliRunner().invoke(main, ["generate", "-m", str(d), "-p", "x" * 40, "-n", "1", "--max-input-tokens", "10"])
    assert r.exit_code == 2 and "over the limit of 10 per request" in r.output and "Traceback" not in r.output
    r = CliRunner().invoke(main, ["generate", "-m", str(d), "-p", "x" * 40, "-n", "1", "--max-input-tokens", "100"])
    assert r.exit_code == 0, r.output


def test_a_multi_document_memory_over_its_entry_cap_is_refused_unless_it_evicts(monkeypatch):
    model = tiny_model("llama")
    monkeypatch.setenv("LCX_MAX_MEMORY_ENTRIES", "200")
    with lcx.attach(model, ["fot"], local=32, memory_layers="0", mode="multi") as run:
        fot = run.method("fot")
        fot.ingest(run, _ids(120, 1), 0)
        assert fot.memory_entries(run, 0) == 120
        with pytest.raises(LimitError, match=r"fot: its memory would hold 240 entries .* over the limit of 200; "
                                             r"cap it with -o fot.max_entries=N"):
            fot.ingest(run, _ids(120, 2), 1)
        assert len(fot.stores_for_saving()[(0, 0)]) == 120  # the refused document left nothing behind
    with lcx.attach(model, ["fot"], local=32, memory_layers="0", mode="multi", max_entries=150) as run:
        fot = run.method("fot")
        for doc in range(3):  # evicting: the memory stays at 150 entries, never refused
            fot.ingest(run, _ids(120, doc), doc)
        assert len(fot.stores_for_saving()[(0, 0)]) == 150


def test_a_request_whose_keys_and_values_exceed_the_free_ram_is_refused(monkeypatch):
    model = tiny_model("llama")
    per_token = kv_bytes_per_token(model)
    assert per_token == 2 * 2 * 1 * 32 * 4  # layers x (k, v) x kv heads x head dim x fp32
    monkeypatch.setattr(limits, "available_ram", lambda: 100 * per_token)  # room for 90 tokens at 0.9
    monkeypatch.setattr(limits, "forward_bytes", lambda model, shapes: 0)  # the cache alone (passes: below)
    calls = _Forwards(model)
    with lcx.attach(model, ["vanilla"]) as run:
        with pytest.raises(LimitError, match=r"needs up to .* GiB \(1 x 100 cached tokens x \d+ bytes for keys and "
                                             r"values \+ 0\.0 GiB for the largest forward pass"):
            generate(run, _ids(96), max_new_tokens=4)
        assert calls.n == 0
        generate(run, _ids(80), max_new_tokens=4)
        est = check_request(run, 80, 4)
    assert est["kv_bytes"] == 84 * per_token


def _held_bytes(stores) -> int:
    """Bytes the buffers of memory stores hold (spare capacity included), and their FAISS indexes' codes."""
    rows = sum(r.buf.numel() * r.buf.element_size() for st in stores for r in st._rows.values() if r.buf is not None)
    index = sum(st.index.ntotal * st.index.code_size for st in stores if getattr(st, "index", None) is not None)
    return rows + index


@pytest.mark.parametrize("backend", ["torch", "faiss-flat"])
def test_windowed_caches_are_estimated_by_their_window_and_fots_memory_by_what_it_holds(monkeypatch, backend):
    """fot's cache keeps its local window and streaming's its sinks + recent window: a 640-token request is
    estimated by those (and fot's memory by its stores in its one memory layer), not as 640 tokens in each
    of the 8 layers, so it runs where the bare model's estimate is refused.  The estimate bounds what fot's
    stores then hold, and not loosely."""
    model = tiny_model("llama", num_hidden_layers=8)
    per_token = kv_bytes_per_token(model)
    T, new = 640, 4  # past 576 entries the stores' rows have just doubled (1,216): spare capacity counts
    fot_opts = dict(local=32, memory_layers="0", mode="multi", backend=backend)
    stream_opts = dict(sinks=4, window=24, chunk=32)
    with lcx.attach(model, ["fot"], **fot_opts) as run:
        plan = check_request(run, T, new)
        est = plan["kv_bytes"]
        fot = run.method("fot")
        memory = fot.memory_bytes(run, T)
        # its sinks (4), local window (32) and one chunk (32)
        assert fot.cache_tokens(run, T + new) == 68 and est == 68 * per_token + memory
    with lcx.attach(model, ["streaming"], **stream_opts) as run:
        assert check_request(run, T, new)["kv_bytes"] == (4 + 24 + 32) * per_token
    # room for fot's estimate and 300 more tokens of every layer: the windowed methods run, the bare model
    # (644 tokens of every layer) is refused
    monkeypatch.setattr(limits, "available_ram", lambda: int((est + plan["forward_bytes"] + 300 * per_token) / 0.9))
    with lcx.attach(model, ["fot"], **fot_opts) as run:
        assert generate(run, _ids(T), max_new_tokens=new).shape[1] == new
        held = _held_bytes(run.method("fot").stores_for_saving().values())
    assert 0 < held <= memory <= 3 * held  # an upper bound on the stores' buffers, within 3x
    with lcx.attach(model, ["streaming"], **stream_opts) as run:
        assert generate(run, _ids(T), max_new_tokens=new).shape[1] == new
    with lcx.attach(model, []) as run, pytest.raises(LimitError, match=rf"\(1 x {T + new:,} cached tokens"):
        generate(run, _ids(T), max_new_tokens=new)


def test_a_model_on_a_gpu_is_checked_against_the_gpus_free_memory(monkeypatch):
    """A CUDA model's cache is checked against that GPU's free memory, not the host's RAM; fot's FAISS memory
    against the host's RAM, its torch memory against the GPU (the devices are stand-ins: the check is
    arithmetic, no tensor is made)."""
    model = tiny_model("llama", num_hidden_layers=8)
    per_token = kv_bytes_per_token(model)
    gpu = torch.device("cuda:0")
    free = {"cpu": 10**12, "cuda:0": 100 * per_token}  # a roomy host, a GPU with room for 90 tokens at 0.9
    monkeypatch.setattr(limits, "_model_device", lambda m: gpu)
    monkeypatch.setattr(limits, "available_memory", lambda d: free[str(d)])
    monkeypatch.setattr(limits, "forward_bytes", lambda model, shapes: 0)  # the caches' arithmetic only
    with lcx.attach(model, []) as run:
        assert check_request(run, 80, 4)["free_bytes"] == free["cuda:0"]
        with pytest.raises(LimitError, match=r"\(1 x 100 cached tokens x .* bytes for keys and values \+ 0\.0 GiB for "
                                             r"the largest forward pass\) on the GPU cuda:0, more than"):
            check_request(run, 96, 4)
    opts = dict(local=32, memory_layers="0", mode="multi")
    with lcx.attach(model, ["fot"], backend="faiss-flat", **opts) as run:
        memory = run.method("fot").memory_bytes(run, 4000)
        free["cuda:0"] = 100 * per_token  # the 68-token window fits the GPU; the memory goes to the host
        check_request(run, 4000, 4)
        free["cpu"] = memory  # the host has less than the memory needs (over 0.9 of it)
        with pytest.raises(LimitError, match=r"on this machine, more than") as e:
            check_request(run, 4000, 4)
        assert "cached tokens" not in str(e.value) and "4,000 memory entries" in str(e.value)
    with lcx.attach(model, ["fot"], backend="torch", **opts) as run:
        free["cpu"] = 10**12
        with pytest.raises(LimitError, match=r"\(1 x 68 cached tokens .* memory entries\) on the GPU cuda:0"):
            check_request(run, 4000, 4)  # the torch store lives with the model: on the GPU
        free["cuda:0"] = int((68 * per_token + run.method("fot").memory_bytes(run, 4000)) / 0.85)
        check_request(run, 4000, 4)


def test_ram_counts_glibcs_heap_allowance_unless_the_heap_is_bounded(monkeypatch):
    """Under glibc's own heap policy a request grows RAM past its live tensors (benchmarks/memory-estimate.md):
    a request whose estimate fits 0.9 of the free RAM but not 1.5x its estimate is refused, naming the way
    out; with a bounded heap, or LCX_HEAP_ALLOWANCE=1, it runs.  A GPU's memory has no such allowance."""
    model = tiny_model("llama")
    per_token = kv_bytes_per_token(model)
    monkeypatch.setenv("LCX_HEAP_ALLOWANCE", "1.5")
    monkeypatch.setattr(limits, "available_ram", lambda: 100 * per_token)  # 90 tokens at 0.9, 60 at 1.5x
    monkeypatch.setattr(limits, "forward_bytes", lambda model, shapes: 0)
    monkeypatch.delenv("MALLOC_MMAP_THRESHOLD_", raising=False)
    monkeypatch.setattr(limits, "_heap_bounded", False)
    with lcx.attach(model, []) as run:
        check_request(run, 56, 4)
        with pytest.raises(LimitError, match=r"on this machine, x1\.5 for what glibc's heap keeps besides, more than .*"
                                             r"or set LCX_BOUNDED_HEAP=1"):
            check_request(run, 76, 4)
        monkeypatch.setattr(limits, "_heap_bounded", True)
        check_request(run, 76, 4)
        monkeypatch.setattr(limits, "_heap_bounded", False)
        monkeypatch.setenv("MALLOC_MMAP_THRESHOLD_", "1048576")  # a threshold the user fixed: glibc keeps it
        check_request(run, 76, 4)
        monkeypatch.delenv("MALLOC_MMAP_THRESHOLD_")
        monkeypatch.setenv("LCX_HEAP_ALLOWANCE", "1")
        check_request(run, 76, 4)
    assert limits.heap_allowance(torch.device("cuda:0"), Limits(heap_allowance=1.5)) == 1.0
    monkeypatch.setenv("LCX_HEAP_ALLOWANCE", "0.5")
    with pytest.raises(lcx.errors.LcxError, match="heap_allowance must be >= 1"):
        Limits.from_env()


def test_available_ram_reads_the_machine():
    free = limits.available_ram()
    total = 0
    with open("/proc/meminfo") as f:
        total = int(next(l for l in f if l.startswith("MemTotal:")).split()[1]) * 1024
    assert 0 < free <= total


def test_focusllm_estimate_bounds_its_chunk_caches():
    """focusllm holds every chunk's [chunk ; fragment] cache at once (parallel=0), and with refreshed
    candidates keeps them all, each growing by the generated tokens: the estimate counted the prompt and the
    new tokens only (724 tokens where 3,763 were held)."""
    from lcx.generation import generate
    from lcx.limits import check_request, kv_bytes_per_token

    model = tiny_model("llama")
    T, new = 24 + 16 * 40, 60
    ids = torch.randint(3, 256, (1, T), generator=torch.Generator().manual_seed(0))
    with lcx.attach(model, ["focusllm"], focusllm={"chunk": 16, "fragment": 16, "local": 24}) as run:
        estimate = check_request(run, T, new)["kv_bytes"] // kv_bytes_per_token(model)
        generate(run, ids, max_new_tokens=new)
        held = sum(g.cache.layers[0].keys.shape[0] * g.cache.layers[0].keys.shape[2]
                   for g in run.state["focusllm_generation"]["groups"]) + run.memory.layers[0].keys.shape[2]
    assert held == 3763 and held <= estimate <= held + 8  # the decoder's cache: at most the window (128), not T + new


def test_the_largest_forward_pass_is_in_the_estimate_and_prefill_is_windowed(monkeypatch):
    """A prompt the methods leave whole is fed in windows of PREFILL_CHUNK queries (exactly: the same logits),
    and the estimate counts that window's masks and activations, not the whole prompt's."""
    from lcx import plan as plan_mod
    from lcx.generation import make_plan, tail_logits

    model = tiny_model("gemma3_text")  # sliding-window and full layers: two masks
    monkeypatch.setattr(plan_mod, "PREFILL_CHUNK", 16)
    ids = _ids(80)
    with lcx.attach(model, []) as run:
        assert make_plan(run, ids, None, 4).windows == [(0, 16), (16, 32), (32, 48), (48, 64), (64, 80)]
        windowed = tail_logits(run, ids, 40)
        est = check_request(run, 80, 4)
    torch.testing.assert_close(windowed, model(ids).logits[0, -41:-1], atol=1e-5, rtol=0)
    shapes = [(1, 16, 84)]
    assert est["forward_bytes"] == limits.forward_bytes(model, shapes) > 16 * 84 * 2
    monkeypatch.setattr(plan_mod, "PREFILL_CHUNK", 4096)
    with lcx.attach(model, []) as run:
        assert check_request(run, 80, 4)["forward_bytes"] == limits.forward_bytes(model, [(1, 84, 84)])
    with lcx.attach(model, ["fot"], local=32, chunk=8) as run:  # fot's joint softmax: float32 scores, every head
        (shape,) = run.method("fot").forward_shapes(run, 84)
        assert shape[:3] == (1, 8, 44)  # a chunk of 8 queries over its 4 sinks, 32 local keys and itself
        assert check_request(run, 80, 4)["forward_bytes"] == limits.forward_bytes(model, [shape])


@pytest.mark.parametrize("kv_heads, head_dim, k, dense", [
    (1, 16, 32, False),  # the exact search's scores outweigh the retrieved values
    (2, 32, 64, False),  # the values outweigh the search; GQA heads over KV heads
    (2, 32, 64, True),  # every entry's scores and values
])
def test_fots_estimate_bounds_the_tensors_its_prefill_holds(kv_heads, head_dim, k, dense):
    """What a prefill with fot holds at once, its memory grown to 4,096 entries per layer and KV head, is
    within the estimate, and the estimate within 2x of it."""
    model = tiny_model("llama", num_attention_heads=8, num_key_value_heads=kv_heads, head_dim=head_dim)
    ids = _ids(4096)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # topk's per-thread buffers, which no tensor shows, counted for one thread
    try:
        with lcx.attach(model, ["fot"], local=64, chunk=64, block=64, k=k, dense=dense) as run:
            est = check_request(run, 4096, 1)
            live = LiveTensors([*model.parameters(), *model.buffers(), ids])
            with torch.no_grad(), live:
                generate(run, ids, max_new_tokens=1)
    finally:
        torch.set_num_threads(threads)
    assert live.peak <= est["kv_bytes"] + est["forward_bytes"] < 2 * live.peak


def test_a_refusal_for_memory_names_the_option_that_shrinks_the_methods_forward_pass(monkeypatch):
    """focusllm decodes every candidate chunk in one batch by default: its refusal says how to decode fewer."""
    model = tiny_model("llama")
    monkeypatch.setattr(limits, "available_memory", lambda d: 10**6)
    with lcx.attach(model, ["focusllm"], chunk=64, local=64, fragment=16) as run:
        with pytest.raises(LimitError, match=r"generate fewer rows at once, decode fewer candidate chunks at once "
                                             r"\(-o focusllm.parallel=N; 1 = one at a time\), or free memory"):
            check_request(run, 4000, 4)
    with lcx.attach(model, ["focusllm"], chunk=64, local=64, fragment=16, parallel=1) as run, \
            pytest.raises(LimitError, match=r"generate fewer rows at once, or free memory"):
        check_request(run, 4000, 4)


HEAP_PROBE = """
import os
import torch
import lcx
from lcx.generation import generate
from tests.conftest import tiny_model

def rss():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")

with lcx.attach(tiny_model("llama"), []) as run:
    generate(run, torch.tensor([[1, 2, 3]]), max_new_tokens=1)  # a request: its check bounds the heap
big = torch.ones(16 << 18)  # 16 MiB freed: glibc's own policy would now keep the next 8 MiB in its heap
del big
before = rss()
t = torch.ones(8 << 18)
del t
print((rss() - before) / 2**20)
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's allocator")
def test_with_a_bounded_heap_a_freed_tensor_of_a_few_mib_goes_back_to_the_os_after_a_request():
    env = {**{k: v for k, v in os.environ.items() if k != "MALLOC_MMAP_THRESHOLD_"}, "LCX_BOUNDED_HEAP": "1"}
    r = subprocess.run([sys.executable, "-c", HEAP_PROBE], capture_output=True, text=True, env=env,
                       cwd=Path(__file__).resolve().parents[1])
    assert r.returncode == 0, r.stderr[-2000:]
    assert float(r.stdout.split()[-1]) < 1.0, "an 8 MiB tensor's pages stayed with the process after it was freed"
