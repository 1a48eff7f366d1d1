"""Prompts that share leading windows feed them once (lcx.generation.PrefixReuse): a passkey grid's keys
of one cell share the filler before their needle.  The reused memory must give the same tokens."""

from __future__ import annotations

import pytest
import torch

import lcx
from lcx.generation import PrefixReuse, generate
from tests.conftest import tiny_model


def _prompts(shared=200, tail=90, n=3, seed=0):
    g = torch.Generator().manual_seed(seed)
    head = torch.randint(3, 250, (shared,), generator=g)
    return [torch.cat([head, torch.randint(3, 250, (tail,), generator=g)])[None] for _ in range(n)]


@pytest.mark.parametrize("method,opts", [
    ("fot", {"local": 32, "chunk": 16, "k": 4}),
    ("fot", {"local": 32, "chunk": 16, "k": 4, "backend": "faiss-ivf", "nlist": 4, "nprobe": 2, "ivf_train": 64}),
    ("fot", {"local": 32, "chunk": 16, "k": 4, "backend": "faiss-hnsw"}),
    ("streaming", {"sinks": 2, "window": 40, "chunk": 16}),
])
def test_reused_prefix_gives_the_tokens_of_feeding_every_window(method, opts):
    model = tiny_model("llama")
    prompts = _prompts()
    with lcx.attach(model, [method], **opts) as run:
        fresh = [generate(run, p, max_new_tokens=6) for p in prompts]
        reuse = PrefixReuse()
        again = [generate(run, p, max_new_tokens=6, reuse=reuse, shared=200) for p in prompts]
    for a, b in zip(fresh, again):
        assert torch.equal(a, b)
    assert reuse.reused == 2 * (200 // 16)  # the 2nd and 3rd prompt started after 12 windows


def test_the_snapshot_is_not_changed_by_the_prompts_that_start_from_it():
    """Each prompt continues a copy: a second round from the same snapshot gives the same tokens."""
    model = tiny_model("llama")
    prompts = _prompts(n=2)
    with lcx.attach(model, ["fot"], local=32, chunk=16, k=4, backend="faiss-ivf", nlist=4, nprobe=2, ivf_train=64) as run:
        reuse = PrefixReuse()
        first = [generate(run, p, max_new_tokens=4, reuse=reuse, shared=200) for p in prompts]
        second = [generate(run, p, max_new_tokens=4, reuse=reuse, shared=200) for p in prompts]
    assert all(torch.equal(a, b) for a, b in zip(first, second)) and reuse.reused == 3 * 12


def test_a_prompt_that_differs_inside_the_snapshot_or_a_method_that_keeps_state_elsewhere_is_fed_whole():
    model = tiny_model("llama")
    a, b = _prompts(n=2)
    b[0, 5] = (b[0, 5] + 1) % 250  # differs in the first window
    with lcx.attach(model, ["fot"], local=32, chunk=16, k=4) as run:
        reuse = PrefixReuse()
        generate(run, a, max_new_tokens=2, reuse=reuse, shared=200)
        assert torch.equal(generate(run, b, max_new_tokens=2, reuse=reuse, shared=200), generate(run, b, max_new_tokens=2))
        assert reuse.reused == 0
    with lcx.attach(model, ["fot"], local=32, chunk=16, k=4, mode="multi") as run:  # memory kept across prompts
        reuse = PrefixReuse()
        for _ in range(2):
            generate(run, a, max_new_tokens=2, reuse=reuse, shared=200)
        assert reuse.reused == 0 and reuse.cache is None


def test_passkey_grid_answers_the_same_with_reuse(tmp_path):
    """`lcx eval passkey`'s generator (prefix reuse on) against plain generation, on a char tokenizer."""
    from lcx.cli.evaluation import _grid_generator
    from lcx.evals import passkey
    from tests.helpers import char_tokenizer

    tok = char_tokenizer()
    model = tiny_model("llama", vocab_size=len(tok))
    cfg = passkey.PasskeyConfig(lengths=[400], depths=[0.3, 0.8], samples=2, max_new_tokens=3)
    with lcx.attach(model, ["fot"], local=64, chunk=32, k=4) as run:
        plain = passkey.evaluate(lambda ids, n, shared: generate(run, ids, max_new_tokens=n), tok, cfg, progress=False)
        gen = _grid_generator(run)
        reused = passkey.evaluate(gen, tok, cfg, progress=False)
    assert [s["output"] for s in plain["samples"]] == [s["output"] for s in reused["samples"]]
    assert gen.reuse.reused > 0  # each cell's second key started from the first key's filler


def test_a_progress_bar_counts_the_tokens_read_window_by_window_and_changes_no_answer(capsys):
    """``progress=True`` (what `lcx generate` and `lcx eval passkey` pass): a bar over the windows the prompt is
    read in, on stderr; generation feeds the last window itself, and windows taken from a snapshot are not read."""
    model = tiny_model("llama")
    prompts = _prompts()  # 290 tokens: windows of 16, the last one [288, 290)
    with lcx.attach(model, ["fot"], local=32, chunk=16, k=4) as run:
        quiet = generate(run, prompts[0], max_new_tokens=4)
        assert "reading the prompt" not in capsys.readouterr().err
        shown = generate(run, prompts[0], max_new_tokens=4, progress=True)
        assert "reading the prompt" in (err := capsys.readouterr().err) and "/288 [" in err
        reuse = PrefixReuse()
        generate(run, prompts[1], max_new_tokens=4, reuse=reuse, shared=200)
        capsys.readouterr()
        generate(run, prompts[2], max_new_tokens=4, reuse=reuse, shared=200, progress=True)
        assert "/96 [" in capsys.readouterr().err  # 12 windows (192 tokens) restored, 6 read
    assert torch.equal(quiet, shown)
    with lcx.attach(model, ["rope"], factor=2) as run:  # read at once by generation: no bar
        generate(run, prompts[0], max_new_tokens=2, progress=True)
    assert "reading the prompt" not in capsys.readouterr().err
