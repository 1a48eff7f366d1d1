"""`lcx memory build` (lcx.plugins.fot.build): a killed build resumes and gives the memory of an uninterrupted
one; damaged or foreign journals are redone or refused; Ray workers index in parallel into the same memory (one
file, or sharded over Ray actors) that `lcx generate --memory` reads token for token as the in-process one."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from safetensors.torch import load_file

from lcx.cli import main
from lcx.plugins.fot import build
from tests.helpers import make_tiny_model_dir

FOT = ["-o", "local=32", "-o", "memory_layers=1"]


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory) -> Path:
    return make_tiny_model_dir(tmp_path_factory.mktemp("m") / "llama", max_position_embeddings=512)


@pytest.fixture(scope="module")
def docs(tmp_path_factory) -> list[Path]:
    d = tmp_path_factory.mktemp("docs")
    paths = []
    for i, words in enumerate(["apples and pears. ", "the river runs north. ", "seven silver keys. "]):
        p = d / f"{i}.txt"
        p.write_text(words * (20 + 15 * i))
        paths.append(p)
    return paths


def lcx(*args):
    return CliRunner().invoke(main, [str(a) for a in args])


def build_memory(tiny_dir, docs, out, *extra):
    r = lcx("memory", "build", "-m", tiny_dir, *FOT, "--out", out, *extra, *docs)
    assert r.exit_code == 0, r.output
    return r


def tensors(mem: Path) -> dict[str, torch.Tensor]:
    return load_file(str(mem / "memory.safetensors"))


@pytest.fixture(scope="module")
def reference(tiny_dir, docs, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("ref") / "mem"
    build_memory(tiny_dir, docs, out)
    return out


def test_a_finished_build_leaves_no_journal_and_lists_every_document(tiny_dir, reference, docs):
    assert not (reference / build.BUILD_DIR).exists()
    meta = json.loads((reference / "memory.json").read_text())
    assert [d["source"] for d in meta["documents"]] == [str(p) for p in docs]
    doc_ids = tensors(reference)["1.0.doc_ids"]
    assert doc_ids.tolist() == sorted(doc_ids.tolist()) and set(doc_ids.tolist()) == {0, 1, 2}  # document order
    assert _answer(tiny_dir, reference) != _answer(tiny_dir, None)  # the answers compared below read the memory


def test_a_killed_build_resumes_with_only_the_unfinished_documents(tiny_dir, docs, reference, tmp_path, monkeypatch):
    real, calls = build.index_one, []

    def dies_on_the_second(session, fot, text, doc_id, progress=False):
        calls.append(doc_id)
        if len(calls) == 2:
            raise KeyboardInterrupt  # killed mid-build
        return real(session, fot, text, doc_id, progress)

    monkeypatch.setattr(build, "index_one", dies_on_the_second)
    out = tmp_path / "mem"
    r = lcx("memory", "build", "-m", tiny_dir, *FOT, "--out", out, *docs)
    assert r.exit_code != 0 and not (out / "memory.json").exists()
    journal = json.loads((out / build.BUILD_DIR / build.JOURNAL).read_text())
    assert list(journal["done"]) == ["0"]
    calls.clear()
    monkeypatch.setattr(build, "index_one", lambda *a, **k: (calls.append(a[3]), real(*a, **k))[1])
    r = build_memory(tiny_dir, docs, out)
    assert calls == [1, 2] and "resuming an unfinished build: 1 of 3 document(s) already indexed" in r.stderr
    want, got = tensors(reference), tensors(out)
    assert want.keys() == got.keys() and all(torch.equal(want[k], got[k]) for k in want)
    assert not (out / build.BUILD_DIR).exists()


def test_a_damaged_part_is_indexed_again_and_other_inputs_are_refused(tiny_dir, docs, reference, tmp_path, monkeypatch):
    out = tmp_path / "mem"
    real = build.Journal.record

    def stop_after_two(self, item):
        real(self, item)
        if len(self.done) == 2:
            raise KeyboardInterrupt

    monkeypatch.setattr(build.Journal, "record", stop_after_two)
    assert lcx("memory", "build", "-m", tiny_dir, *FOT, "--out", out, *docs).exit_code != 0
    monkeypatch.setattr(build.Journal, "record", real)
    part = out / build.BUILD_DIR / "doc-1.safetensors"
    part.write_bytes(part.read_bytes()[:-7])  # truncated
    # another document set: refused, naming what differs, until --overwrite
    r = lcx("memory", "build", "-m", tiny_dir, *FOT, "--out", out, *docs[:2])
    assert r.exit_code == 2 and "holds an unfinished build of other inputs (documents differ)" in r.stderr
    r = lcx("memory", "build", "-m", tiny_dir, "-o", "local=64", "-o", "memory_layers=1", "--out", out, *docs)
    assert r.exit_code == 2 and "options differ" in r.stderr
    moved = [tmp_path / "moved" / p.name for p in docs]  # the same texts by other paths: the same build
    for src, dst in zip(docs, moved):
        dst.parent.mkdir(exist_ok=True)
        dst.write_text(src.read_text())
    r = build_memory(tiny_dir, moved, out)
    assert "document 1's indexed entries (doc-1.safetensors) are missing or damaged: indexing it again" in r.stderr
    assert "1 of 3 document(s) already indexed" in r.stderr
    want, got = tensors(reference), tensors(out)
    assert all(torch.equal(want[k], got[k]) for k in want)
    # a build killed after saving its memory leaves no journal behind; a finished memory is replaced only with --overwrite
    (out / build.BUILD_DIR).mkdir()
    (out / build.BUILD_DIR / build.JOURNAL).write_text("{}")
    r = lcx("memory", "build", "-m", tiny_dir, *FOT, "--out", out, *docs)
    assert r.exit_code == 2 and "exists; pass --overwrite" in r.stderr and not (out / build.BUILD_DIR).exists()


def test_a_build_over_the_entry_limit_is_refused_before_indexing(tiny_dir, docs, tmp_path):
    r = lcx("memory", "build", "-m", tiny_dir, *FOT, "--max-memory-entries", "100", "--out", tmp_path / "m", *docs)
    assert r.exit_code == 2 and "over the limit of 100" in r.stderr and "-o fot.max_entries=N" in r.stderr
    assert not (tmp_path / "m" / build.BUILD_DIR).exists()


# ---------------------------------------------------------------------- on Ray workers
def _answer(tiny_dir, mem, *extra):
    r = lcx("generate", "-m", tiny_dir, "--method", "fot", *FOT, *extra, *(["--memory", mem] if mem else []), "-p",
            "seven silver", "-n", "6", "--json")
    assert r.exit_code == 0, r.output
    return json.loads(r.stdout)["text"]


@pytest.mark.slow
def test_ray_workers_build_the_in_process_memory(local_ray, tiny_dir, docs, reference, tmp_path):
    out = tmp_path / "mem"
    r = build_memory(tiny_dir, docs, out, "--workers", "2", "--json")
    assert json.loads(r.stdout)["workers"] == 2
    want, got = tensors(reference), tensors(out)
    assert want.keys() == got.keys()
    for k in want:  # other processes, other thread counts: the same entries up to float rounding
        if want[k].is_floating_point():
            torch.testing.assert_close(got[k], want[k], atol=1e-5, rtol=1e-5)
        else:  # positions and document ids: exactly, in document order
            assert torch.equal(got[k], want[k]), k
    assert _answer(tiny_dir, out) == _answer(tiny_dir, reference)


@pytest.mark.slow
def test_ray_workers_write_a_sharded_memory_that_generate_reads(local_ray, tiny_dir, docs, reference, tmp_path):
    out = tmp_path / "mem"
    ray_opts = ["-o", "backend=ray", "-o", "shards=2"]
    build_memory(tiny_dir, docs, out, "--workers", "2", *ray_opts)
    meta = json.loads((out / "memory.json").read_text())
    assert [s["file"] for s in meta["shards"]] == ["memory-shard-0-of-2.safetensors", "memory-shard-1-of-2.safetensors"]
    assert _answer(tiny_dir, out, *ray_opts) == _answer(tiny_dir, reference)


@pytest.mark.slow
def test_more_workers_than_the_cluster_has_cpus_is_refused(local_ray, tiny_dir, docs, tmp_path):
    r = lcx("memory", "build", "-m", tiny_dir, *FOT, "--workers", "3", "--out", tmp_path / "m", *docs)
    assert r.exit_code == 2 and "--workers 3: the Ray cluster has 2 CPU(s)" in r.stderr and "--workers 2" in r.stderr


@pytest.mark.slow
def test_a_workers_refusal_is_the_commands_own_error_with_the_commands_limits(local_ray, tiny_dir, docs, tmp_path):
    args = ["memory", "build", "-m", tiny_dir, *FOT, "--max-input-tokens", "200", "--out", tmp_path / "m", *docs]
    here, there = lcx(*args, "--workers", "0"), lcx(*args, "--workers", "2")
    for r in (here, there):  # the longest document is over 200 tokens: refused on the worker as here
        assert r.exit_code == 2 and "over the limit of 200" in r.stderr and "ray::" not in r.stderr, r.output
