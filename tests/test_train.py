"""`lcx train`: learns, resumes exactly, writes an adapter that reloads identically, fails clearly."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from safetensors.torch import load_file

from lcx.cli import main
from lcx.errors import LcxError
from lcx.train import TrainConfig, train
from tests.helpers import make_tiny_model_dir

TEXT = "the quick brown fox jumps over the lazy dog. " * 40


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    # hidden 128: wide enough that LoRA on attention alone visibly lowers the loss in 30 steps
    return make_tiny_model_dir(tmp_path_factory.mktemp("tiny") / "llama", hidden_size=128, intermediate_size=256)


@pytest.fixture
def corpus(tmp_path) -> Path:
    d = tmp_path / "corpus"
    d.mkdir()
    (d / "a.txt").write_text(TEXT)
    (d / "b.txt").write_text(TEXT.upper())
    return d


def _cfg(model_dir, corpus, out, **kw) -> TrainConfig:
    base = dict(model=str(model_dir), data=[str(corpus)], out=str(out), methods=["vanilla"], seq_len=64,
                steps=6, batch_size=2, lr=5e-3, save_every=0, seed=3)
    base.update(kw)
    return TrainConfig(**base)


def _metrics(out: Path) -> list[dict]:
    return [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]


def test_short_run_reduces_loss(model_dir, corpus, tmp_path):
    out = train(_cfg(model_dir, corpus, tmp_path / "run", steps=30, lr=1e-2), progress=False)
    losses = [m["loss"] for m in _metrics(out)]
    assert len(losses) == 30 and all("loss/lm" in m for m in _metrics(out))
    # a random tiny model under LoRA on attention: ~1 nat lower after 30 steps (measured 4.90 -> 3.93)
    assert sum(losses[-5:]) / 5 < losses[0] - 0.5, losses
    assert (out / "adapter_model.safetensors").exists() and (out / "lcx.json").exists()


def test_resume_is_bit_identical(model_dir, corpus, tmp_path):
    full = train(_cfg(model_dir, corpus, tmp_path / "full", grad_accum=2), progress=False)
    part = tmp_path / "part"
    train(_cfg(model_dir, corpus, part, grad_accum=2, save_every=2), progress=False, stop_after=3)
    assert (part / "checkpoints" / "step-3" / "meta.json").exists()
    assert not (part / "adapter_model.safetensors").exists()
    train(_cfg(model_dir, corpus, part, grad_accum=2, save_every=2), resume=True, progress=False)
    a, b = load_file(str(full / "adapter_model.safetensors")), load_file(str(part / "adapter_model.safetensors"))
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k
    fm, pm = _metrics(full), _metrics(part)
    assert [m["step"] for m in pm] == [1, 2, 3, 4, 5, 6]  # no repeated or skipped steps
    assert [m["loss"] for m in fm] == [m["loss"] for m in pm]


def test_adapter_reloads_in_a_fresh_process_with_identical_logits(model_dir, corpus, tmp_path):
    out = train(_cfg(model_dir, corpus, tmp_path / "run"), progress=False)
    ids = torch.randint(4, 99, (1, 30), generator=torch.Generator().manual_seed(0))
    from lcx.adapters.peft_bridge import load_adapter
    from lcx.models import load_model

    model, _ = load_model(str(model_dir))
    peft_model, _ = load_adapter(model, out)
    with torch.no_grad():
        here = peft_model(ids).logits
    script = (
        "import sys, torch; from safetensors.torch import save_file\n"
        "from lcx.models import load_model; from lcx.adapters.peft_bridge import load_adapter\n"
        f"m, _ = load_model({str(model_dir)!r}); pm, _ = load_adapter(m, {str(out)!r})\n"
        f"ids = torch.tensor({ids.tolist()})\n"
        "with torch.no_grad(): save_file({'logits': pm(ids).logits.contiguous()}, sys.argv[1])\n"
    )
    dest = tmp_path / "logits.safetensors"
    subprocess.run([sys.executable, "-c", script, str(dest)], check=True, capture_output=True)
    assert torch.equal(load_file(str(dest))["logits"], here)


def test_a_run_can_start_from_an_adapter_it_then_continues(model_dir, corpus, tmp_path):
    """--init-adapter: the run starts from that adapter's weights (its LoRA B is not zero), so its first loss is
    the trained adapter's, not the base model's; a rank other than the adapter's, or --full, is refused."""
    first = train(_cfg(model_dir, corpus, tmp_path / "first", steps=20, lr=1e-2), progress=False)
    same = train(_cfg(model_dir, corpus, tmp_path / "same", steps=1, lr=1e-12, init_adapter=str(first)), progress=False)
    a, b = load_file(str(first / "adapter_model.safetensors")), load_file(str(same / "adapter_model.safetensors"))
    assert a.keys() == b.keys() and any(k.endswith("lora_B.weight") and a[k].abs().sum() > 0 for k in a)
    for k in a:
        torch.testing.assert_close(b[k], a[k], atol=1e-9, rtol=0)
    fresh = _metrics(first)[0]["loss"]
    assert _metrics(same)[0]["loss"] < fresh - 0.5 and abs(_metrics(same)[0]["loss"] - _metrics(first)[-1]["loss"]) < 0.5
    with pytest.raises(LcxError, match=r"has LoRA rank 8, not --lora-rank 4; pass --lora-rank 8"):
        train(_cfg(model_dir, corpus, tmp_path / "r4", lora_rank=4, init_adapter=str(first)), progress=False)
    r = _cli("train", "-m", str(model_dir), "-d", str(corpus), "--out", str(tmp_path / "full"), "--full", "q_proj",
             "--init-adapter", str(first))
    assert r.exit_code != 0 and "brings its own LoRA modules and roles; drop --full" in r.output


# ---------------------------------------------------------------------- bad input, through the CLI
def _cli(*args: str):
    return CliRunner().invoke(main, list(args))


def test_missing_data_path(model_dir, tmp_path):
    r = _cli("train", "-m", str(model_dir), "-d", str(tmp_path / "nope"), "--out", str(tmp_path / "o"))
    assert r.exit_code == 2 and "does not exist" in r.output


def test_empty_corpus(model_dir, tmp_path):
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "blank.txt").write_text("  \n")
    r = _cli("train", "-m", str(model_dir), "-d", str(tmp_path / "empty"), "--out", str(tmp_path / "o"))
    assert r.exit_code == 2 and "empty" in r.output


def test_documents_shorter_than_the_window(model_dir, tmp_path):
    (tmp_path / "short.txt").write_text("tiny doc")
    r = _cli("train", "-m", str(model_dir), "-d", str(tmp_path / "short.txt"), "--out", str(tmp_path / "o"),
             "--seq-len", "64", "--no-concat")
    assert r.exit_code == 2 and "longest document has" in r.output and "--concat" in r.output


def test_existing_output_folder_needs_overwrite(model_dir, corpus, tmp_path):
    """An earlier run's folder is replaced with --overwrite; a folder that is not a run's is never deleted."""
    out = tmp_path / "o"
    args = ["train", "-m", str(model_dir), "-d", str(corpus), "--out", str(out), "--seq-len", "64", "--steps", "1"]
    assert _cli(*args).exit_code == 0
    (out / "keep.txt").write_text("x")
    r = _cli(*args)
    assert r.exit_code == 2 and "--overwrite" in r.output and (out / "keep.txt").exists()
    r = _cli(*args, "--overwrite")
    assert r.exit_code == 0, r.output
    assert not (out / "keep.txt").exists() and (out / "adapter_model.safetensors").exists()
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "notes.txt").write_text("x")
    r = _cli(*args[:5], "--out", str(mine), "--seq-len", "64", "--steps", "1", "--overwrite")
    assert r.exit_code == 2 and "is not the folder of an lcx train run" in r.output and (mine / "notes.txt").exists()


def test_overwrite_never_deletes_what_the_run_reads(model_dir, corpus, tmp_path):
    """--out naming the adapter the run starts from, the model or the data (or a folder holding them) is refused
    before anything is deleted: --overwrite there would remove the run's own input."""
    first = tmp_path / "a"
    base = ["train", "-m", str(model_dir), "-d", str(corpus), "--seq-len", "64", "--steps", "1"]
    assert _cli(*base, "--out", str(first)).exit_code == 0
    before = sorted(p.name for p in first.iterdir())
    r = _cli(*base, "--init-adapter", str(first), "--out", str(first), "--overwrite")
    assert r.exit_code == 2 and f"holds --init-adapter {str(first)!r}, which this run reads" in r.output
    assert sorted(p.name for p in first.iterdir()) == before
    r = _cli(*base, "--out", str(corpus.parent), "--overwrite")
    assert r.exit_code == 2 and "which this run reads" in r.output and corpus.is_dir()


def test_a_run_that_failed_while_setting_up_does_not_block_the_corrected_one(model_dir, corpus, tmp_path):
    out = tmp_path / "o"
    r = _cli("train", "-m", str(model_dir), "-d", str(corpus), "--out", str(out), "--method", "nosuch")
    assert r.exit_code == 2 and "nosuch" in r.output
    r = _cli("train", "-m", str(model_dir), "-d", str(corpus), "--out", str(out), "--seq-len", "64", "--steps", "1")
    assert r.exit_code == 0, r.output
    # refused at its first batch (fot wants (w + 1) x local tokens): the corrected run needs no --overwrite
    out = tmp_path / "p"
    fot = ["train", "-m", str(model_dir), "-d", str(corpus), "--out", str(out), "--method", "fot", "-o", "local=32",
           "--steps", "1"]
    r = _cli(*fot, "--seq-len", "96")
    assert r.exit_code == 2 and "--seq-len 64" in r.output
    r = _cli(*fot, "--seq-len", "64")
    assert r.exit_code == 0, r.output


def test_resume_refuses_settings_that_change_the_run(model_dir, corpus, tmp_path):
    """Windows (concat), the learning-rate curve (warmup, schedule) and the processes' count must match the
    interrupted run's; so must the trainable parameters, whose optimizer state otherwise fails inside torch."""
    out = tmp_path / "o"
    train(_cfg(model_dir, corpus, out, steps=2, save_every=1), progress=False)
    for change, name in (({"concat": False}, "concat"), ({"warmup": 1}, "warmup"), ({"schedule": "cosine"}, "schedule"),
                         ({"lora_roles": ["q", "k"]}, "lora_roles")):
        with pytest.raises(LcxError, match=f"--resume: {name} differs from the interrupted run"):
            train(_cfg(model_dir, corpus, out, steps=3, save_every=1, **change), resume=True, progress=False)
    latest = sorted((out / "checkpoints").iterdir())[-1]
    meta = json.loads((latest / "meta.json").read_text())
    (latest / "meta.json").write_text(json.dumps({**meta, "world_size": 2}))
    with pytest.raises(LcxError, match="written by 2 processes, and this run has 1"):
        train(_cfg(model_dir, corpus, out, steps=3, save_every=1), resume=True, progress=False)
    (latest / "meta.json").write_text(json.dumps(meta))
    assert train(_cfg(model_dir, corpus, out, steps=3, save_every=1), resume=True, progress=False) is not None


def test_resume_past_a_lower_steps_is_refused(model_dir, corpus, tmp_path):
    """A checkpoint at step 3 resumed with --steps 2 would save step 3's weights as a 2-step run."""
    out = tmp_path / "o"
    train(_cfg(model_dir, corpus, out, steps=4, save_every=0), progress=False, stop_after=3)
    assert (out / "checkpoints" / "step-3").is_dir()
    with pytest.raises(LcxError, match=r"is at step 3, past --steps 2; .* pass --steps 3 or more"):
        train(_cfg(model_dir, corpus, out, steps=2), resume=True, progress=False)
    assert not (out / "adapter_model.safetensors").exists()
    train(_cfg(model_dir, corpus, out, steps=3), resume=True, progress=False)  # at the checkpoint: only writes it
    assert [m["step"] for m in _metrics(out)] == [1, 2, 3]


def test_resume_without_checkpoint_is_refused(model_dir, corpus, tmp_path):
    with pytest.raises(LcxError, match="no checkpoint"):
        train(_cfg(model_dir, corpus, tmp_path / "fresh"), resume=True, progress=False)


def test_ctrl_c_keeps_a_checkpoint_and_says_how_to_resume(model_dir, corpus, tmp_path):
    out = tmp_path / "o"
    cmd = [sys.executable, "-m", "lcx.cli", "train", "-m", str(model_dir), "-d", str(corpus), "--out", str(out),
           "--seq-len", "64", "--steps", "100000", "--save-every", "0"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, "PYTHONUNBUFFERED": "1"})
    deadline = time.time() + 120
    while time.time() < deadline and not ((out / "metrics.jsonl").exists() and (out / "metrics.jsonl").read_text().count("\n") >= 2):
        time.sleep(0.2)
    proc.send_signal(signal.SIGINT)
    output, _ = proc.communicate(timeout=120)
    assert proc.returncode == 130, output
    assert "--resume" in output and "checkpoint kept" in output
    steps = [json.loads(x)["step"] for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert (out / "checkpoints" / f"step-{steps[-1]}" / "meta.json").exists()


@pytest.mark.slow
@pytest.mark.parametrize("method", [
    [],
    # several forwards per step, their number set by a per-step draw (every process must make as many)
    ["--method", "focusllm", "-o", "chunk=16", "-o", "local=24", "-o", "fragment=8", "-o", "train_chunks=16,32"],
], ids=["vanilla", "focusllm"])
def test_two_process_ddp_matches_one_process_with_the_same_global_batch(model_dir, corpus, tmp_path, method):
    """accelerate (config file, 2 processes, batch 1 each) == 1 process with batch 2: same loss curve."""
    repo = Path(__file__).resolve().parents[1]
    common = ["train", "-m", str(model_dir), "-d", str(corpus), "--seq-len", "64", "--steps", "5", "--lr", "1e-2",
              "--save-every", "0", "--json", *method]
    subprocess.run([sys.executable, "-m", "lcx.cli", *common, "--batch-size", "2", "--out", str(tmp_path / "one")],
                   check=True, capture_output=True)
    accelerate = Path(sys.executable).with_name("accelerate")
    proc = subprocess.Popen([str(accelerate), "launch", "--config_file", str(repo / "configs/accelerate/ddp-2proc.yaml"),
                             "-m", "lcx.cli", *common, "--batch-size", "1", "--out", str(tmp_path / "two")],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=repo, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=600)  # a collective mismatch hangs
    except subprocess.TimeoutExpired:
        import psutil  # torchrun starts each rank in a session of its own: killpg alone leaves them running
        for p in psutil.Process(proc.pid).children(recursive=True):
            p.kill()
        os.killpg(proc.pid, signal.SIGKILL)  # the launcher: no orphan waits on a dead peer
        out, err = proc.communicate()
        pytest.fail("2-process run still running after 600 s:\n" + out[-2000:] + err[-2000:])
    assert proc.returncode == 0, out[-2000:] + err[-2000:]
    one, two = _metrics(tmp_path / "one"), _metrics(tmp_path / "two")
    assert len(one) == len(two) == 5
    for a, b in zip(one, two):
        assert abs(a["loss"] - b["loss"]) < 1e-4, (a, b)
    assert abs(one[-1]["loss"] - one[0]["loss"]) > 0.1  # the curve moved: the comparison is not of constants


def test_bf16_autocast_takes_effect(model_dir, corpus, tmp_path):
    """--bf16 runs the forward under bf16 autocast: the loss moves a little, not a lot."""
    fp32 = _metrics(train(_cfg(model_dir, corpus, tmp_path / "fp32", steps=2), progress=False))
    bf16 = _metrics(train(_cfg(model_dir, corpus, tmp_path / "bf16", steps=2, bf16=True), progress=False))
    assert fp32[0]["loss"] != bf16[0]["loss"] and abs(fp32[0]["loss"] - bf16[0]["loss"]) < 0.05


def test_fot_crossbatch_trains_and_resumes_with_its_d_schedule(model_dir, corpus, tmp_path):
    """`lcx train --method fot`: crossbatch loss stage, streams data order, d schedule restored on resume."""
    opts = {"fot": {"local": 16, "w": 1, "d": 1, "memory_layers": "1", "d_schedule": "acc:0.0:2:1"}}
    kw = dict(methods=["fot"], options=opts, seq_len=32, batch_size=2, steps=4)
    full = train(_cfg(model_dir, corpus, tmp_path / "full", **kw), progress=False)
    fm = _metrics(full)
    # acc:0.0:2:1 switches after the first measured accuracy: d=1 at step 1, then 2 for good
    assert [m["state/d"] for m in fm] == [1, 2, 2, 2] and all(m["state/d_switched"] for m in fm[1:])
    # N counts optimizer steps, not micro-batches: with 2 per step, step 1 keeps d=1 in both (its second
    # micro-batch switched to d=2 when the history grew per micro-batch)
    acc2 = train(_cfg(model_dir, corpus, tmp_path / "accum", grad_accum=2, **kw), progress=False)
    assert [m["state/d"] for m in _metrics(acc2)] == [1, 2, 2, 2]
    assert json.loads((full / "lcx.json").read_text())["methods"][0]["options"]["w"] == 1
    part = tmp_path / "part"
    train(_cfg(model_dir, corpus, part, save_every=1, **kw), progress=False, stop_after=2)
    train(_cfg(model_dir, corpus, part, save_every=1, **kw), resume=True, progress=False)
    assert [m["state/d"] for m in _metrics(part)] == [1, 2, 2, 2]
    a, b = load_file(str(full / "adapter_model.safetensors")), load_file(str(part / "adapter_model.safetensors"))
    assert all(torch.equal(a[k], b[k]) for k in a)
    with pytest.raises(LcxError, match=r"set --seq-len 32"):
        train(_cfg(model_dir, corpus, tmp_path / "bad", **{**kw, "seq_len": 48}), progress=False)
    # inference with the adapter: trained options apply, user options override key by key,
    # but the positions mode the memory keys were trained with cannot change
    from lcx.session import open_session

    s = open_session(str(model_dir), adapter=full, options={"k": "8"})
    fot = s.run.method("fot")
    assert (fot.local, fot.memory_layers, fot.k) == (16, "1", 8)
    s.close()
    with pytest.raises(LcxError, match=r"trained with fot positions=fixed; positions=none is incompatible"):
        open_session(str(model_dir), adapter=full, options={"fot": {"positions": "none"}})
    with pytest.raises(LcxError, match=r"positions=first is incompatible"):
        open_session(str(model_dir), ["fot"], {"positions": "first"}, adapter=full)


def test_fot_training_leaves_its_gate_to_be_calibrated_where_the_adapter_is_used(corpus, tmp_path, monkeypatch):
    """Crossbatch attention reads no gate: training measures none (nor caches one beside the model); using the
    adapter does."""
    from lcx import auto
    from lcx.session import open_session

    folder = make_tiny_model_dir(tmp_path / "llama")
    opts = {"fot": {"local": 16, "memory_layers": "1"}}
    out = train(_cfg(folder, corpus, tmp_path / "run", methods=["fot"], options=opts, seq_len=32, steps=1),
                progress=False)

    def entries() -> dict:
        path = folder / auto.AUTO_FILE
        return json.loads(path.read_text())["entries"] if path.exists() else {}

    assert "fot.gate" not in entries()
    assert json.loads((out / "lcx.json").read_text())["methods"][0]["options"]["gate"] == "auto"
    lora_on: list[bool] = []

    def calibrate(model, tokenizer, options, length, probe):  # records whether the adapter's LoRA was on
        lora_on.append(any(not getattr(m, "disable_adapters", True) for m in model.modules()))
        return {"gate": "off", "answered": 1, "probes": [{}]}

    monkeypatch.setattr("lcx.plugins.fot.calibrate.calibrate_gate", calibrate)
    s = open_session(str(folder), adapter=out)
    try:  # measured on the base weights, as lcx export and lcx methods -m measure it: one entry for the model
        assert s.run.method("fot").gate == "off" and entries()["fot.gate"]["inputs"]["length"] == 32
        assert lora_on == [False] and any(not m.disable_adapters for m in s.model.modules()
                                          if hasattr(m, "disable_adapters"))  # and on again after
    finally:
        s.close()


def test_analyze_distraction_with_a_fot_adapter_calibrates_no_gate(corpus, tmp_path, monkeypatch):
    """Crossbatch attention reads no gate: `lcx analyze distraction --adapter` (fot's before/after comparison)
    measures without calibrating one, as it does on the base model."""
    from click.testing import CliRunner

    from lcx.cli import main
    from tests.helpers import make_word_documents

    folder = make_tiny_model_dir(tmp_path / "llama")
    opts = {"fot": {"local": 16, "memory_layers": "1", "gate_sinks": "false"}}  # moot under the pinned gate=off
    out = train(_cfg(folder, corpus, tmp_path / "run", methods=["fot"], options=opts, seq_len=32, steps=1),
                progress=False)

    def no_calibration(*a, **k):
        raise AssertionError("analyze distraction calibrated fot's gate")

    monkeypatch.setattr("lcx.plugins.fot.calibrate.calibrate_gate", no_calibration)
    r = CliRunner().invoke(main, ["analyze", "distraction", "-m", str(folder), "--adapter", str(out), "-d",
                                  str(make_word_documents(tmp_path / "docs")), "--ds", "1,2", "--batches", "1",
                                  "--out", str(tmp_path / "dis"), "--json"])
    assert r.exit_code == 0, r.output


def test_from_scratch_full_training_on_the_dictionary_task(tmp_path):
    """`lcx models init` + `lcx train --full all -d task:dictionary --method fot`: every weight trains,
    the result is a model folder `lcx eval dictionary` loads, and resuming is exact."""
    from lcx.models import init_model

    base = init_model(tmp_path / "base", "llama", dict(vocab_size=68, hidden_size=64, intermediate_size=128,
                                                        num_hidden_layers=2, num_attention_heads=2,
                                                        num_key_value_heads=2, max_position_embeddings=256))
    kw = dict(methods=["fot"], options={"fot": {"local": 32, "w": 1, "d": 2, "memory_layers": "1"}}, seq_len=64,
              batch_size=4, steps=4, full=["all"], lr=1e-3)
    def cfg(out, **more):
        return TrainConfig(model=str(base), out=str(out), **{"data": ["task:dictionary"], "save_every": 0, "seed": 1,
                                                             **kw, **more})
    out = train(cfg(tmp_path / "full"), progress=False)
    assert (out / "model.safetensors").exists() and json.loads((out / "lcx.json").read_text())["full_model"]
    before, after = load_file(str(base / "model.safetensors")), load_file(str(out / "model.safetensors"))
    assert all(not torch.equal(before[k], after[k]) for k in before if "norm" not in k)  # every matrix trained
    part = tmp_path / "part"
    train(cfg(part, save_every=1), progress=False, stop_after=2)
    train(cfg(part, save_every=1), resume=True, progress=False)
    again = load_file(str(part / "model.safetensors"))
    assert all(torch.equal(after[k], again[k]) for k in after)
    r = CliRunner().invoke(main, ["eval", "dictionary", "-m", str(out), "--method", "fot", "-o", "local=32",
                                  "-o", "memory_layers=1", "--dict-tokens", "64,256", "--query-tokens", "32",
                                  "--samples", "2", "--out", str(tmp_path / "ev"), "--json"])
    assert r.exit_code == 0, r.output
    r = CliRunner().invoke(main, ["train", "-m", str(base), "--method", "fot", "-o", "local=32", "-o", "w=1",
                                  "-o", "memory_layers=1", "-d", "task:dictionary", "--full", "all", "--seq-len", "64",
                                  "--batch-size", "2", "--steps", "1", "--out", str(tmp_path / "cli"), "--json"])
    assert r.exit_code == 0, r.output
    report = json.loads(r.output)  # a model folder (load it with -m), not an adapter
    assert report["model"] == str(tmp_path / "cli") and "adapter" not in report and report["steps"] == 1
    with pytest.raises(LcxError, match="unknown synthetic task 'dict'"):
        train(cfg(tmp_path / "bad", data=["task:dict"]), progress=False)


@pytest.mark.slow
def test_killed_three_times_and_resumed_ends_with_the_uninterrupted_adapter(model_dir, corpus, tmp_path):
    """SIGKILL (no chance to save) at random points, three times, each followed by --resume: the final
    adapter is bit-identical to an uninterrupted run's, and every step is recorded exactly once."""
    import random

    def cmd(out, *extra):
        return [sys.executable, "-m", "lcx.cli", "train", "-m", str(model_dir), "-d", str(corpus), "--out", str(out),
                "--method", "smt", "-o", "smt.budget=32", "-o", "smt.window=8", "--seq-len", "96", "--steps", "24",
                "--batch-size", "2", "--grad-accum", "2", "--lr", "5e-3", "--seed", "3", "--save-every", "1", *extra]

    env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}
    full = tmp_path / "full"
    subprocess.run(cmd(full), check=True, capture_output=True, env=env, timeout=600)
    part = tmp_path / "part"
    rng = random.Random(7)
    kill_after = sorted(rng.sample(range(2, 22), 3))  # steps recorded before each kill
    for i, k in enumerate(kill_after):
        proc = subprocess.Popen(cmd(part, *(["--resume"] if i else [])), stdout=subprocess.DEVNULL,
                                stderr=subprocess.DEVNULL, env=env)
        deadline = time.time() + 300
        while time.time() < deadline and proc.poll() is None and not (
                (part / "metrics.jsonl").exists() and (part / "metrics.jsonl").read_text().count("\n") >= k):
            time.sleep(0.01)
        time.sleep(rng.uniform(0, 0.3))  # somewhere inside a step or a checkpoint write
        proc.kill()
        proc.wait()
        assert proc.returncode == -signal.SIGKILL, f"run {i} ended on its own (rc {proc.returncode}) before the kill"
    subprocess.run(cmd(part, "--resume"), check=True, capture_output=True, env=env, timeout=600)
    a, b = load_file(str(full / "adapter_model.safetensors")), load_file(str(part / "adapter_model.safetensors"))
    assert a.keys() == b.keys()
    for key in a:
        assert torch.equal(a[key], b[key]), key
    fm, pm = _metrics(full), _metrics(part)
    assert [m["step"] for m in pm] == list(range(1, 25))  # redone steps are not recorded twice
    assert [m["loss"] for m in fm] == [m["loss"] for m in pm]


def test_a_fully_trained_model_on_text_loads_with_its_tokenizer(model_dir, corpus, tmp_path):
    """`--full all` on text writes a model folder that `-m OUT` loads, tokenizer included (it said so, and the
    folder had none)."""
    from lcx.models import load_model

    out = train(_cfg(model_dir, corpus, tmp_path / "full", steps=1, full=["all"]), progress=False)
    model, tok = load_model(str(out))
    assert tok is not None and tok("the quick brown fox")["input_ids"]


def test_sharding_accelerate_configs_are_refused_before_anything_is_written(model_dir, corpus, tmp_path, monkeypatch):
    """FSDP/DeepSpeed shard the parameters and optimizer state that lcx's checkpoints read whole on the main
    process (names, shapes): refused at start with the DDP config to use, not a KeyError at the first
    checkpoint.  (accelerate's FSDP needs GPUs: a stand-in Accelerator reports the type.)"""
    import accelerate
    from accelerate.utils import DistributedType

    class Sharded:
        def __init__(self, **kw):
            self.distributed_type, self.process_index, self.num_processes = DistributedType.FSDP, 0, 1

    monkeypatch.setattr(accelerate, "Accelerator", Sharded)
    with pytest.raises(LcxError, match="lcx train runs under DDP .*, not FSDP"):
        train(_cfg(model_dir, corpus, tmp_path / "o"), progress=False)
    assert not (tmp_path / "o").exists()


def test_a_failed_final_write_keeps_the_trained_state_for_resume(model_dir, corpus, tmp_path, monkeypatch):
    """The adapter write fails after the last step (say, a full disk) with --save-every 0: the run's state is
    kept as a checkpoint and the error says to --resume, which writes the same adapter as an unfailed run."""
    from lcx.adapters import peft_bridge

    ok = train(_cfg(model_dir, corpus, tmp_path / "ok"), progress=False)
    real = peft_bridge.save_adapter

    def full_disk(*a, **kw):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(peft_bridge, "save_adapter", full_disk)
    with pytest.raises(LcxError, match="No space left on device.*the trained state is kept in .*--resume"):
        train(_cfg(model_dir, corpus, tmp_path / "o"), progress=False)
    monkeypatch.setattr(peft_bridge, "save_adapter", real)
    out = train(_cfg(model_dir, corpus, tmp_path / "o"), resume=True, progress=False)
    a, b = load_file(str(ok / "adapter_model.safetensors")), load_file(str(out / "adapter_model.safetensors"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
