"""RULER's tasks generated over real text: exact lengths, determinism, needles at their depth, RULER's scoring."""

from __future__ import annotations

import itertools
import json
import random
import re

import pytest

from lcx.errors import LcxError
from lcx.evals import ruler
from lcx.evals.passkey import Haystack
from tests.helpers import char_tokenizer, make_tiny_model_dir

SYLLABLES = ["ba", "ko", "ru", "di", "me", "la", "to", "ne", "pi", "su", "ga", "fe", "lo", "mi", "da", "vu",
             "ri", "ka", "zo", "he"]
#: six-letter words: no word is part of another, so a scored word cannot be found inside a different one
WORDS = ["".join(w) for w in itertools.product(SYLLABLES, repeat=3)][:3000]
NEEDLE_TASKS = [t for t in ruler.TASKS if t.startswith("niah") or t == "vt"]


def _sentences(n: int, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    return [" ".join(rng.choices(WORDS, k=rng.randint(4, 12))).capitalize() + "." for _ in range(n)]


@pytest.fixture(scope="module")
def books(tmp_path_factory):
    d = tmp_path_factory.mktemp("books")
    text = _sentences(3000)
    (d / "a.txt").write_text("\n".join(text[:1500]))
    (d / "b.txt").write_text(" ".join(text[1500:]))
    return d


@pytest.fixture(scope="module")
def source(books):
    return ruler.Source(Haystack([str(books)]))


@pytest.fixture(scope="module")
def bpe_tokenizer():
    """A small BPE tokenizer trained offline: several characters per token, as a real model's."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=600, special_tokens=["<pad>", "<s>", "</s>", "<unk>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(_sentences(2000, seed=1) + ["VAR ABCDE = 12345. One of the special magic numbers"],
                            trainer=trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>",
                                   pad_token="<pad>")


@pytest.fixture(params=["char", "bpe"])
def tokenizer(request, bpe_tokenizer):
    return char_tokenizer() if request.param == "char" else bpe_tokenizer


@pytest.mark.parametrize("task", list(ruler.TASKS))
def test_prompts_are_deterministic_by_seed_and_within_one_percent_of_the_length(task, tokenizer, source):
    for length in (2000, 6000):
        a = ruler.make_prompt(task, tokenizer, source, length, 0.5, seed=3, index=1)
        assert abs(len(a.ids) - length) <= 0.01 * length, (task, length, len(a.ids))
        assert ruler.make_prompt(task, tokenizer, source, length, 0.5, seed=3, index=1) == a
        other = ruler.make_prompt(task, tokenizer, source, length, 0.5, seed=4, index=1)
        assert other.ids != a.ids and other.answers != a.answers
    assert a.answers and all(isinstance(x, str) and x for x in a.answers)


@pytest.mark.parametrize("task", NEEDLE_TASKS)
@pytest.mark.parametrize("depth", [0.0, 0.25, 0.5, 0.9, 1.0])
def test_the_queried_needle_sits_at_the_requested_depth_between_sentences(task, depth, source):
    tok = char_tokenizer()  # one character, one token: text offsets are token offsets
    p = ruler.make_prompt(task, tok, source, 5000, depth, seed=0, index=2)
    text = tok.decode(p.ids).replace("<unk>", "\n")
    start, end = p.context
    others = [m for m in re.finditer(r" (One of the special magic [^.]*|VAR [^.]*)\.", text) if m.start() != p.needle_at]
    assert len(others) == len(p.answers) - 1 if task in ("niah_multivalue", "vt") else len(others) == 3 * (
        task in ("niah_multikey", "niah_multiquery"))
    slack = 110 + sum(len(m.group(0)) for m in others)  # a sentence, and the other needles the depth does not count
    assert abs((p.needle_at - start) - depth * (end - start)) <= slack
    needle = text[p.needle_at:p.needle_at + 120]
    assert needle.startswith((" One of the special magic", " VAR ")) and p.answers[0].lower() in needle.lower()
    assert text[p.needle_at - 1] == "." or p.needle_at == start  # after a whole sentence
    other = ruler.make_prompt(task, tok, source, 5000, depth, seed=0, index=3)
    assert p.ids[:min(p.shared, other.shared)] == other.ids[:min(p.shared, other.shared)]  # reusable prefix


def test_variable_tracking_is_a_chain_in_reading_order(source):
    tok = char_tokenizer()
    p = ruler.make_prompt("vt", tok, source, 4000, 0.3, seed=0, index=0)
    text = tok.decode(p.ids)
    names = p.answers
    first = text.index(f"VAR {names[0]} = ")
    value = text[first:].split("= ")[1].split(".")[0]
    assert value.isdigit() and f"assigned the value {value}" in text
    at = [text.index(f"VAR {b} = VAR {a}.") for a, b in zip(names, names[1:])]
    assert first < at[0] and at == sorted(at)


def test_aggregation_answers_are_the_most_frequent_words_of_the_list(source):
    from collections import Counter

    tok = char_tokenizer()
    p = ruler.make_prompt("cwe", tok, source, 6000, 0.5, seed=0, index=0)
    body = tok.decode(p.ids[p.context[0]:]).split("<unk>")[0]
    counts = Counter(w for w in body.split() if w.isalpha())
    top = [w for w, _ in counts.most_common(10)]
    assert sorted(top) == sorted(p.answers) and counts.most_common(11)[-1][1] < counts[p.answers[-1]]
    p = ruler.make_prompt("fwe", tok, source, 6000, 0.5, seed=0, index=0)
    body = tok.decode(p.ids[p.context[0]:]).split("<unk>")[0]
    assert [w for w, _ in Counter(body.split()).most_common(3)] == p.answers


@pytest.mark.parametrize("task", list(ruler.TASKS))
def test_the_scorer_gives_all_to_the_gold_answers_and_nothing_to_another_samples(task, source):
    tok = char_tokenizer()
    prompts = [ruler.make_prompt(task, tok, source, 3000, 0.5, seed=0, index=i) for i in range(5)]
    for i, p in enumerate(prompts):
        score = ruler.METRICS[p.metric]
        assert score(" " + ", ".join(p.answers) + ".", p.answers) == 1.0
        assert score(" " + ", ".join(reversed(p.answers)).upper(), p.answers) == 1.0  # order and case free
        shuffled = prompts[(i + 1) % len(prompts)].answers
        assert score(" " + ", ".join(shuffled), p.answers) == 0.0
    if len(p.answers) > 1:  # "all" gives part credit, "part" all of it
        assert ruler.score_all(p.answers[0], p.answers) == 1 / len(p.answers)
        assert ruler.score_part(p.answers[0], p.answers) == 1.0


def test_a_grid_scores_each_task_and_length_and_resumes_from_its_journal(books, tmp_path):
    from lcx.io import Journal

    tok = char_tokenizer()
    source = ruler.Source(Haystack([str(books)]))
    calls = []

    def echo_gold(ids, n, shared):  # answers with the gold of its prompt: found by the prompt's own ids
        calls.append(ids.shape[1])
        for task, length, i in itertools.product(cfg.tasks, cfg.lengths, range(cfg.samples)):
            p = ruler.make_prompt(task, tok, source, length, cfg.depths[i % len(cfg.depths)], cfg.seed, i)
            if p.ids == ids[0].tolist():
                assert shared == p.shared and n == p.max_new_tokens
                return tok(" " + " ".join(p.answers if task != "cwe" else p.answers[:5]),
                           return_tensors="pt")["input_ids"]
        raise AssertionError("a prompt no sample made")

    cfg = ruler.RulerConfig(lengths=[1500, 2500], tasks=["niah_single_number", "cwe"], samples=2,
                            haystack=str(books))
    journal = Journal(tmp_path / "j.jsonl", {"config": "x"})
    out = ruler.evaluate(echo_gold, tok, cfg, progress=False, journal=journal)
    s = out["summary"]
    assert len(calls) == 8 and s["n"] == 8
    assert s["score_by_task"] == {"niah_single_number": {"1500": 1.0, "2500": 1.0}, "cwe": {"1500": 0.5, "2500": 0.5}}
    assert s["score_by_length"] == {"1500": 0.75, "2500": 0.75} and s["score"] == 0.75
    again = ruler.evaluate(echo_gold, tok, cfg, progress=False,
                           journal=Journal(tmp_path / "j.jsonl", {"config": "x"}, resume=True))
    assert len(calls) == 8 and again["resumed_samples"] == 8 and again["summary"] == s


def test_bad_input_is_named_before_any_sample(books, tmp_path):
    tok = char_tokenizer()
    calls = []
    cfg = ruler.RulerConfig(lengths=[2000, 900_000], tasks=["vt"], haystack=str(books))
    with pytest.raises(LcxError, match=r"has [\d,]+ tokens of text, [\d,]+ fewer than .*more text"):
        ruler.evaluate(lambda *a: calls.append(1), tok, cfg, progress=False)
    assert calls == []
    with pytest.raises(LcxError, match="unknown RULER task 'niah_sngle'.*niah_single_number"):
        ruler.parse_tasks("niah_sngle")
    assert ruler.parse_tasks("niah,vt") == NEEDLE_TASKS and ruler.parse_tasks("all") == list(ruler.TASKS)
    with pytest.raises(LcxError, match="haystack"):
        ruler.RulerConfig(lengths=[2000]).validate()
    few = tmp_path / "few.txt"
    few.write_text("The cat sat. The dog ran. " * 50)
    with pytest.raises(LcxError, match="distinct lower-case words"):
        ruler.Source(Haystack([str(few)]))
    with pytest.raises(LcxError, match="cannot hold"):
        ruler.make_prompt("niah_multiquery", tok, ruler.Source(Haystack([str(books)])), 300, 0.5, 0, 0)


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return make_tiny_model_dir(tmp_path_factory.mktemp("m") / "llama", max_position_embeddings=512)


def test_cli_ruler_and_compare_ruler_on_a_tiny_model(tiny_dir, books, tmp_path, monkeypatch):
    from click.testing import CliRunner

    from lcx.cli import main

    out = tmp_path / "r"
    args = ["eval", "ruler", "-m", str(tiny_dir), "--method", "vanilla", "--tasks", "niah_single_number,fwe",
            "--lengths", "700", "--samples", "2", "--max-new-tokens", "3", "--haystack", str(books),
            "--out", str(out), "--json"]
    r = CliRunner().invoke(main, args)
    assert r.exit_code == 0, r.output
    result = json.loads((out / "ruler.json").read_text())
    assert result["summary"]["n"] == 4 and (out / "ruler.png").exists()
    assert {s["task"] for s in result["samples"]} == {"niah_single_number", "fwe"}
    assert all(abs(s["tokens"] - 700) <= 7 for s in result["samples"])
    r = CliRunner().invoke(main, args + ["--resume"])
    assert r.exit_code == 0 and json.loads((out / "ruler.json").read_text())["resumed_samples"] == 4
    r = CliRunner().invoke(main, args[:-1] + ["--seed", "5", "--resume"])
    assert r.exit_code != 0 and "config.seed" in r.output

    r = CliRunner().invoke(main, ["eval", "compare", "ruler", "-m", str(tiny_dir), "--stack", "none",
                                  "--stack", "vanilla", "--tasks", "vt", "--lengths", "600", "--samples", "1",
                                  "--max-new-tokens", "2", "--haystack", str(books), "--out", str(tmp_path / "c"),
                                  "--json"])
    assert r.exit_code == 0, r.output
    table = json.loads(r.output)
    assert table["header"] == ["stack", "600", "all", "vt"] and [row[0] for row in table["rows"]] == ["none", "vanilla"]
    assert (tmp_path / "c" / "compare-ruler.vanilla.samples.jsonl").exists()
    # another compare takes vanilla's row from that journal: the same table, vanilla not rerun
    import lcx.generation

    calls, generate = [], lcx.generation.generate
    monkeypatch.setattr(lcx.generation, "generate", lambda *a, **kw: calls.append(1) or generate(*a, **kw))
    r = CliRunner().invoke(main, ["eval", "compare", "ruler", "-m", str(tiny_dir), "--stack", "none",
                                  "--include", str(tmp_path / "c" / "compare-ruler.vanilla.samples.jsonl"),
                                  "--tasks", "vt", "--lengths", "600", "--samples", "1", "--max-new-tokens", "2",
                                  "--haystack", str(books), "--out", str(tmp_path / "c2"), "--json"])
    assert r.exit_code == 0, r.output
    assert json.loads(r.output)["rows"] == table["rows"]
    assert len(calls) == 1  # the none stack's one sample
    assert not (tmp_path / "c2" / "compare-ruler.vanilla.samples.jsonl").exists()
    r = CliRunner().invoke(main, ["eval", "compare", "passkey", "-m", str(tiny_dir), "--lengths", "600",
                                  "--include", str(tmp_path / "c" / "compare-ruler.vanilla.samples.jsonl")])
    assert r.exit_code == 2 and "which this suite has not" in r.output, r.output  # a RULER row in a passkey table

    for bad, says in ((["--tasks", "nope"], "unknown RULER task 'nope'"),
                      (["--lengths", "900000"], "fewer than a prompt of this length needs")):
        r = CliRunner().invoke(main, ["eval", "ruler", "-m", str(tiny_dir), "--haystack", str(books),
                                      "--out", str(tmp_path / "bad"), *bad])
        assert r.exit_code == 2 and says in r.output, r.output
    r = CliRunner().invoke(main, ["eval", "compare", "ruler", "-m", str(tiny_dir), "--stack", "none"])
    assert r.exit_code == 2 and "--haystack" in r.output


def test_a_model_folder_without_its_tokenizer_is_refused_offline(tiny_dir, books, tmp_path):
    import shutil

    from click.testing import CliRunner

    from lcx.cli import main

    bare = tmp_path / "bare"
    shutil.copytree(tiny_dir, bare, ignore=shutil.ignore_patterns("tokenizer*", "special_tokens*"))
    r = CliRunner().invoke(main, ["eval", "ruler", "-m", str(bare), "--haystack", str(books), "--out",
                                  str(tmp_path / "o")])
    assert r.exit_code == 2 and "tokenizer" in r.output, r.output
