"""Crash safety: a writer killed (SIGKILL) at random points never leaves a file lcx cannot load.

Each trial forks a writer that saves version after version of an adapter, a memory or a training
checkpoint into the same place, kills it after a random delay, and loads what is there: it must
load, be one whole version (every file of it agreeing), and never be older than what loaded before.
"""

from __future__ import annotations

import copy
import multiprocessing
import os
import random
import signal
import time
from pathlib import Path

import torch

from lcx.adapters.peft_bridge import add_adapter, load_adapter, read_sidecar, save_adapter
from lcx.io import COMMIT, STAGING, commit_files, recover
from lcx.plugins.fot.memory import load_memory, make_store, save_memory
from tests.conftest import tiny_model

TRIALS = 24
_fork = multiprocessing.get_context("fork")


def _writer(save, first: int) -> None:  # runs in the forked child until killed
    # OpenMP's thread pool does not survive fork: a parallel torch op in the child would hang for good
    # once the parent has used its pool (it has, by the time other tests ran). One thread runs inline.
    torch.set_num_threads(1)
    v = first
    while True:
        save(v)
        v += 1


def kill_trials(save, load, trials: int = TRIALS, seed: int = 0) -> list[int]:
    """Save version 0, then per trial: fork a writer of versions base, base + 1, ..., SIGKILL it after a
    random delay (0 to ~8 save times), ``load()`` -> the version found.  Returns the versions found."""
    save(0)
    t0 = time.perf_counter()
    for _ in range(3):
        save(0)
    cycle = (time.perf_counter() - t0) / 3
    rng = random.Random(seed)
    found, last = [], load()
    assert last == 0
    for t in range(trials):
        base = (t + 1) * 1000
        proc = _fork.Process(target=_writer, args=(save, base), daemon=True)
        proc.start()
        time.sleep(rng.uniform(0.0, 8 * cycle) + 0.002)
        os.kill(proc.pid, signal.SIGKILL)
        proc.join()
        assert proc.exitcode == -signal.SIGKILL, "the writer ended on its own before the kill"
        v = load()  # raises if the files are half-written or mixed
        assert v == last or base <= v, f"trial {t}: found version {v} after {last}: an older version came back"
        found.append(v)
        last = v
    return found


# ---------------------------------------------------------------------- adapters
def test_adapter_saves_survive_kills_at_random_points(tmp_path):
    base = tiny_model("llama")
    model = add_adapter(copy.deepcopy(base), roles=("q", "k", "v", "o"), rank=64)  # ~0.5 MB per save
    lora = [p for n, p in model.named_parameters() if "lora_" in n]
    out = tmp_path / "adapter"

    def save(v: int) -> None:
        with torch.no_grad():
            for p in lora:
                p.fill_(float(v))
        save_adapter(model, out, methods=[], extra={"version": v})

    def load() -> int:
        peft_model, sidecar = load_adapter(copy.deepcopy(base), out)
        values = {float(p.flatten()[0]) for n, p in peft_model.named_parameters() if "lora_" in n}
        weights_whole = all(bool((p == p.flatten()[0]).all()) for n, p in peft_model.named_parameters() if "lora_" in n)
        assert weights_whole and values == {float(sidecar["version"])}, \
            f"weights of version(s) {values} with the sidecar of version {sidecar['version']}"
        return sidecar["version"]

    found = kill_trials(save, load)
    assert len(set(found)) > TRIALS // 2, f"the kills mostly landed before any save finished: {found}"


# ---------------------------------------------------------------------- memories
def test_memory_saves_survive_kills_at_random_points(tmp_path):
    out = tmp_path / "memory"
    n = 4000  # 4000 x 64 keys + values per store, 4 stores: ~8 MB per save

    def save(v: int) -> None:
        stores = {}
        for layer in (1, 2):
            for head in (0, 1):
                s = make_store(kind="torch")
                s.add(torch.full((n, 64), float(v)), torch.full((n, 64), float(v)), torch.arange(n), doc_id=v)
                stores[(layer, head)] = s
        save_memory(stores, out, {"version": v})

    def load() -> int:
        stores, meta = load_memory(out)  # checks the sha256 of the tensors against the metadata
        assert all(bool((s.keys == meta["version"]).all()) for s in stores.values())
        return meta["version"]

    found = kill_trials(save, load)
    assert len(set(found)) > TRIALS // 2, f"the kills mostly landed before any save finished: {found}"


# ---------------------------------------------------------------------- training checkpoints
def test_checkpoints_survive_kills_at_random_points(tmp_path):
    from accelerate import Accelerator

    from lcx.train import TrainConfig, _latest_checkpoint, _load_checkpoint, _save_checkpoint

    model = add_adapter(tiny_model("llama"), roles=("q", "k", "v", "o"), rank=64)
    names = [n for n, p in model.named_parameters() if p.requires_grad]
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
    model(torch.ones(1, 4, dtype=torch.long), labels=torch.ones(1, 4, dtype=torch.long)).loss.backward()
    opt.step()  # optimizer state exists, so it is saved too
    accel = Accelerator(cpu=True)
    cfg = TrainConfig(model="x", data=[], out=str(tmp_path), keep_checkpoints=2)
    root = tmp_path / "checkpoints"
    params = [p for p in model.parameters() if p.requires_grad]

    def save(v: int) -> None:
        with torch.no_grad():
            for p in params:
                p.fill_(float(v))
        _save_checkpoint(root, v, model, names, opt, sched, cfg, accel)

    def load() -> int:
        latest = _latest_checkpoint(root)
        assert latest is not None, f"no loadable checkpoint left in {root}: {sorted(os.listdir(root))}"
        step = _load_checkpoint(latest, model, names, opt, sched, rank=0)
        assert all(bool((p == float(step)).all()) for p in params), f"checkpoint {latest.name} holds other weights"
        return step

    kill_trials(save, load)


# ---------------------------------------------------------------------- the commit protocol itself
def test_commit_rolls_forward_after_the_commit_point_and_back_before_it(tmp_path):
    def files(v):
        def write(d: Path):
            (d / "a.txt").write_text(f"a{v}")
            (d / "b.txt").write_text(f"b{v}")
        return write

    commit_files(tmp_path, files(1))
    # killed after the commit point, with a.txt moved and b.txt not yet: readers finish the move
    (tmp_path / COMMIT).mkdir()
    (tmp_path / COMMIT / "b.txt").write_text("b2")
    (tmp_path / "a.txt").write_text("a2")
    recover(tmp_path)
    assert [(tmp_path / f).read_text() for f in ("a.txt", "b.txt")] == ["a2", "b2"]
    assert not (tmp_path / COMMIT).exists()
    # killed before it: the staged files never replace anything, and the next save clears them
    (tmp_path / STAGING).mkdir()
    (tmp_path / STAGING / "a.txt").write_text("a3")
    recover(tmp_path)
    assert (tmp_path / "a.txt").read_text() == "a2" and (tmp_path / STAGING).exists()  # a reader leaves it
    commit_files(tmp_path, files(4))
    assert [(tmp_path / f).read_text() for f in ("a.txt", "b.txt")] == ["a4", "b4"]
    assert sorted(os.listdir(tmp_path)) == ["a.txt", "b.txt"]


def test_a_reader_finishes_an_interrupted_adapter_save(tmp_path):
    base = tiny_model("llama")
    model = add_adapter(copy.deepcopy(base), roles=("q",), rank=2)
    save_adapter(model, tmp_path, methods=[], extra={"version": 1})
    # the state a kill right after the commit point leaves: the new version sits in .lcx-commit
    staging = tmp_path / COMMIT
    staging.mkdir()
    for f in os.listdir(tmp_path):
        if f.endswith(".json") and f != COMMIT:
            (staging / f).write_text((tmp_path / f).read_text().replace('"version": 1', '"version": 2'))
    assert read_sidecar(tmp_path)["version"] == 2
    load_adapter(copy.deepcopy(base), tmp_path)


def _add_run(path: str, label: str, pause: float) -> None:
    import json

    from lcx.io import accumulated_runs, write_json

    with accumulated_runs(Path(path)) as runs:
        time.sleep(pause)  # widen the read-modify-write window: without the lock the runs overwrite each other
        runs[label] = {"label": label}
        write_json({"runs": runs}, Path(path))
    assert label in json.loads(Path(path).read_text())["runs"]


def test_runs_written_into_one_results_file_at_once_are_all_kept(tmp_path):
    """`lcx eval dictionary` / `lcx analyze distraction` runs into one --out at the same time: each adds its
    run under a lock, so none drops another's (they read, add and write the JSON in turn)."""
    import json

    from lcx.io import accumulated_runs

    path = tmp_path / "out" / "dictionary.json"
    ctx = multiprocessing.get_context("spawn")
    procs = [ctx.Process(target=_add_run, args=(str(path), f"run{i}", 0.3)) for i in range(4)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(60)
    assert [p.exitcode for p in procs] == [0] * 4
    assert sorted(json.loads(path.read_text())["runs"]) == ["run0", "run1", "run2", "run3"]
    with accumulated_runs(path) as runs:  # and the lock is free again
        assert len(runs) == 4
