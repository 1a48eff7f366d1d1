"""Where the model runs: ``--device`` / ``LCX_DEVICE`` / ``load_model(device=)``; lcx's plans, memories and
generation follow the model's device.

The CPU tests run everywhere.  The CUDA tests (marker ``gpu``) need a CUDA GPU: a method on the GPU must give
the logits and greedy tokens it gives on the CPU (fp32, TF32 off), through every stage (plan, memory stores,
memory attention, candidate forwards, generation).  CI has no GPU; the note of the change that adds a GPU
path records where they ran."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

import lcx
from lcx.cli import main
from lcx.errors import LcxError
from lcx.generation import generate, tail_logits
from lcx.plugins.fot.memory import faiss_gpu_available
from lcx.models import load_model, resolve_device
from tests.conftest import tiny_model
from tests.helpers import make_tiny_model_dir, make_word_documents

import os

#: The accelerator the GPU tests compare with the CPU: cuda where there is one.  LCX_TEST_DEVICE=cpu runs
#: them on the CPU against itself (checks the tests' own logic on a machine without a GPU).
TARGET = os.environ.get("LCX_TEST_DEVICE") or ("cuda" if torch.cuda.is_available() else None)
needs_cuda = pytest.mark.skipif(TARGET is None, reason="needs a CUDA GPU")


# ---------------------------------------------------------------------- everywhere
def test_device_defaults_to_cpu_and_reads_lcx_device(monkeypatch):
    monkeypatch.delenv("LCX_DEVICE", raising=False)
    assert resolve_device() == torch.device("cpu")
    monkeypatch.setenv("LCX_DEVICE", "cpu")
    assert resolve_device(None) == torch.device("cpu")
    assert resolve_device("cpu") == torch.device("cpu")  # the argument wins over the variable


def test_a_device_this_machine_lacks_is_a_clear_error(monkeypatch):
    with pytest.raises(LcxError, match=r"device 'gpu0' is not a torch device; give cpu, cuda or cuda:N"):
        resolve_device("gpu0")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(LcxError, match=r"device 'cuda': torch .* sees no CUDA GPU here; run on --device cpu"):
        resolve_device("cuda")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    with pytest.raises(LcxError, match=r"device 'cuda:3': this machine has 1 CUDA GPU\(s\), cuda:0..cuda:0"):
        resolve_device("cuda:3")


def test_cli_device_flag_reaches_the_model_and_fails_before_loading(tmp_path, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    r = CliRunner().invoke(main, ["generate", "-m", str(tmp_path / "no-such-model"), "--device", "cuda", "-p", "hi"])
    assert r.exit_code == 2 and "device 'cuda'" in r.output and "no-such-model" not in r.output, r.output
    monkeypatch.setenv("LCX_DEVICE", "cuda")  # the variable works where no flag is given
    r = CliRunner().invoke(main, ["generate", "-m", str(tmp_path / "no-such-model"), "-p", "hi"])
    assert r.exit_code == 2 and "device 'cuda'" in r.output, r.output
    monkeypatch.delenv("LCX_DEVICE")
    # the flag stays with its command: the next command in this process loads on the CPU again
    d = make_tiny_model_dir(tmp_path / "m")
    r = CliRunner().invoke(main, ["generate", "-m", str(d), "--device", "cpu", "-p", "hi", "-n", "2", "--json"])
    assert r.exit_code == 0, r.output
    model, _ = load_model(d)
    assert next(model.parameters()).device.type == "cpu"


def test_inputs_on_the_cpu_follow_a_model_on_another_device_through_make_plan():
    """make_plan moves the caller's tensors to the model's device (here the CPU: the same objects' values)."""
    from lcx.generation import make_plan

    model = tiny_model("llama")
    with lcx.attach(model, ["fot"], local=32, chunk=16) as run:
        plan = make_plan(run, torch.randint(3, 250, (1, 70)), None, 2)
    assert plan.input_ids.device == plan.attention_mask.device == torch.device("cpu")
    assert plan.windows[-1] == (64, 70)


# ---------------------------------------------------------------------- on a GPU
STACKS = [
    ("vanilla", {}),
    ("streaming", {"sinks": 2, "window": 40, "chunk": 16}),
    ("fot", {"local": 32, "chunk": 16, "k": 4}),
    ("fot", {"local": 32, "chunk": 16, "k": 4, "dense": True}),
    ("fot", {"local": 32, "chunk": 16, "k": 4, "backend": "faiss-flat"}),
    ("fot", {"local": 32, "chunk": 16, "k": 4, "backend": "faiss-gpu"}),  # its index on the GPU on both sides
    ("focusllm", {"chunk": 48, "local": 32, "fragment": 8}),
    ("rope+streaming", {"rope": {"factor": 2}, "streaming": {"sinks": 2, "window": 40, "chunk": 16}}),
]


def _attach(model, stack, opts):
    names = stack.split("+")
    return lcx.attach(model, names, **opts)


@needs_cuda
@pytest.mark.parametrize("stack,opts", STACKS, ids=[f"{s}-{i}" for i, (s, _) in enumerate(STACKS)])
def test_a_method_on_the_gpu_gives_the_cpu_logits_and_tokens(stack, opts):
    if opts.get("backend", "").startswith("faiss"):
        pytest.importorskip("faiss")
        if opts["backend"] == "faiss-gpu" and not faiss_gpu_available():
            pytest.skip("needs faiss built with CUDA (pip install 'lcx[gpu]')")
    torch.backends.cuda.matmul.allow_tf32 = False
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, 250, (1, 300), generator=g)  # past the tiny model's 128-token window
    results = {}
    for name, dev in (("cpu", "cpu"), ("target", TARGET)):
        model = tiny_model("llama").to(dev)
        with _attach(model, stack, opts) as run:
            logits = tail_logits(run, ids, 8)  # CPU ids: lcx moves them to the model
            tokens = generate(run, ids, max_new_tokens=6)
        assert logits.device.type == tokens.device.type == torch.device(dev).type
        results[name] = (logits.cpu(), tokens.cpu())
    (lc, tc), (lg, tg) = results["cpu"], results["target"]
    assert torch.allclose(lc, lg, atol=1e-4, rtol=1e-4), (lc - lg).abs().max()
    assert torch.equal(tc, tg)


@needs_cuda
def test_a_fot_memory_built_on_the_gpu_answers_like_the_cpu_and_a_saved_one_serves_a_gpu_model(tmp_path):
    from lcx.adapters.peft_bridge import base_identity
    from lcx.plugins.fot.memory import save_memory

    g = torch.Generator().manual_seed(1)
    doc, prompt = torch.randint(3, 250, (1, 200), generator=g), torch.randint(3, 250, (1, 40), generator=g)
    out = {}
    for name, dev in (("cpu", "cpu"), ("target", TARGET)):
        model = tiny_model("llama").to(dev)
        with lcx.attach(model, ["fot"], local=32, chunk=16, k=4, mode="multi") as run:
            fot = run.method("fot")
            fot.ingest(run, doc, doc_id=7)
            stores = fot.stores_for_saving()
            assert {s.keys.device.type for s in stores.values()} == {torch.device(dev).type}  # with the model
            save_memory(stores, tmp_path / name, {"model": base_identity(model)})
            out[name] = generate(run, prompt, max_new_tokens=5).cpu()
    assert torch.equal(out["cpu"], out["target"])
    model = tiny_model("llama").to(TARGET)  # a memory loaded from disk (CPU stores) read by a GPU model
    with lcx.attach(model, ["fot"], local=32, chunk=16, k=4) as run:
        run.method("fot").load(tmp_path / "target", model)
        assert torch.equal(generate(run, prompt, max_new_tokens=5).cpu(), out["cpu"])


@needs_cuda
def test_lcx_eval_passkey_runs_on_the_gpu(tmp_path):
    d = make_tiny_model_dir(tmp_path / "m", max_position_embeddings=512)
    r = CliRunner().invoke(main, ["eval", "passkey", "-m", str(d), "--method", "fot", "-o", "local=128", "-o", "chunk=64",
                                  "--device", TARGET, "--lengths", "1200", "--depths", "0.5", "--samples", "2",
                                  "--out", str(tmp_path / "pk"), "--json"])
    assert r.exit_code == 0, r.output
    res = json.loads(Path(tmp_path / "pk" / "passkey.json").read_text())
    assert len(res["samples"]) == 2 and res["samples"][0]["tokens"] > 1024


TRAIN_STACKS = [
    ("vanilla", {}),
    ("focusllm", {"focusllm": {"chunk": 16, "local": 24, "fragment": 8, "train_chunks": "16,32"}}),
    ("fot", {"fot": {"local": 16, "w": 1, "d": 2, "memory_layers": "1"}}),
    ("smt", {"smt": {"budget": 32, "window": 8}}),
]


@needs_cuda
@pytest.mark.parametrize("method,options", TRAIN_STACKS, ids=[m for m, _ in TRAIN_STACKS])
def test_lcx_train_on_the_gpu_gives_the_cpu_losses(tmp_path, monkeypatch, method, options):
    """accelerate puts the model on the GPU when there is one: every loss stage's batch follows it, and the
    first steps' losses are the CPU's (fp32, TF32 off)."""
    from lcx.train import TrainConfig, train

    torch.backends.cuda.matmul.allow_tf32 = False
    model_dir = make_tiny_model_dir(tmp_path / "tiny", hidden_size=128, intermediate_size=256)
    (tmp_path / "doc.txt").write_text("the pass key is 4821. remember it. " * 60)
    seq = {"fot": 32, "smt": 256}.get(method, 120)
    losses = {}
    for where in ("target", "cpu"):
        if where == "cpu":
            monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
        out = train(TrainConfig(model=str(model_dir), data=[str(tmp_path / "doc.txt")], out=str(tmp_path / where),
                                methods=[method], options=options, seq_len=seq, steps=2, batch_size=2, lr=1e-3,
                                save_every=0, seed=1), progress=False)
        losses[where] = [json.loads(x)["loss"] for x in (out / "metrics.jsonl").read_text().splitlines()]
        assert (out / "adapter_model.safetensors").exists()
    assert losses["target"] == pytest.approx(losses["cpu"], rel=1e-3, abs=1e-4), losses


@needs_cuda
def test_lcx_analyze_distraction_on_the_gpu_gives_the_cpu_shares(tmp_path):
    """FoT's distraction measure feeds crossbatch batches of its own making: they follow the model."""
    m, docs = make_tiny_model_dir(tmp_path / "m"), make_word_documents(tmp_path / "docs")
    shares = {}
    for dev in ("cpu", TARGET):
        r = CliRunner().invoke(main, ["analyze", "distraction", "-m", str(m), "-d", str(docs), "-o", "local=16",
                                      "-o", "memory_layers=1", "--ds", "1,2,3", "--batches", "2", "--device", dev,
                                      "--out", str(tmp_path / dev), "--json"])
        assert r.exit_code == 0, r.output
        shares[dev] = json.loads(r.output)["positive_share"]
    assert shares[TARGET] == pytest.approx(shares["cpu"], rel=1e-4)
