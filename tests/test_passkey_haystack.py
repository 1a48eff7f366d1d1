"""Passkey prompts with the needle hidden in real text (``--haystack``) instead of the repeated filler."""

from __future__ import annotations

import json

import pytest

from lcx.errors import LcxError
from lcx.evals.passkey import FILLER, INSTRUCTION, NEEDLE, QUESTION, Haystack, PasskeyConfig, evaluate, prompt_and_needle
from tests.helpers import char_tokenizer

SENTENCES = [f"Sentence number {i} tells of {'a cat' if i % 2 else 'the sea'}." for i in range(400)]


@pytest.fixture
def books(tmp_path):
    d = tmp_path / "books"
    d.mkdir()
    (d / "a.txt").write_text("\n".join(SENTENCES[:200]))  # hard line wraps, as in novels
    (d / "b.txt").write_text("  ".join(SENTENCES[200:]))
    return d


@pytest.mark.parametrize("depth", [0.0, 0.1, 0.5, 0.9, 1.0])
def test_the_needle_sits_between_whole_sentences_at_the_depth(books, depth):
    tok = char_tokenizer()  # one character, one token: text offsets are token offsets
    ids, start = prompt_and_needle(tok, 3000, depth, 48213, Haystack([str(books)]))
    assert abs(len(ids) - 3000) <= 40  # whole sentences: short by less than one
    text = tok.decode(ids)
    needle = " " + NEEDLE.format(key=48213) + " "
    at = text.index(needle)
    assert len(tok.decode(ids[:start])) == at and text.count("48213") == 2 and FILLER not in text
    head = text.index(INSTRUCTION) + len(INSTRUCTION)
    end = text.rindex(QUESTION)
    before, after = (x.replace("<unk>", "") for x in (text[head:at], text[at + len(needle):end]))  # "\n": unk
    assert (before == "" or before.endswith(".")) and (after == "" or after.startswith(" Sentence"))
    assert abs(len(before) - depth * (len(before) + len(after))) <= 40  # within one sentence of the depth
    assert " ".join(SENTENCES).startswith((before + after).strip())  # the books' text, in order


def test_prompts_of_a_length_share_their_text_and_only_the_needle_moves(books):
    tok = char_tokenizer()
    hay = Haystack([str(books)])
    a, sa = prompt_and_needle(tok, 2000, 0.3, 11111, hay)
    b, sb = prompt_and_needle(tok, 2000, 0.3, 22222, hay)
    assert sa == sb and a[:sa].tolist() == b[:sb].tolist()
    c, sc = prompt_and_needle(tok, 2000, 0.7, 11111, hay)
    needle = len(tok(" " + NEEDLE.format(key=11111) + " ", add_special_tokens=False)["input_ids"])
    drop = lambda ids, s: ids[:s].tolist() + ids[s + needle:].tolist()  # noqa: E731
    assert drop(a, sa) == drop(c, sc)  # the same text around a needle at another depth


def test_a_haystack_too_short_names_the_shortfall_before_any_sample(books):
    tok = char_tokenizer()
    calls = []
    cfg = PasskeyConfig(lengths=[2000, 60000], depths=[0.5], samples=1, haystack=str(books))
    with pytest.raises(LcxError, match=r"has [\d,]+ tokens of text, [\d,]+ fewer than .*more text"):
        evaluate(lambda ids, n, s: calls.append(1), tok, cfg, progress=False)
    assert calls == []
    with pytest.raises(LcxError, match="no text|no documents"):
        empty = books.parent / "empty.txt"
        empty.write_text("   \n")
        Haystack([str(empty)])


def test_the_filler_prompt_is_unchanged_without_a_haystack():
    tok = char_tokenizer()
    ids, start = prompt_and_needle(tok, 1500, 0.5, 12345)
    text = tok.decode(ids)
    body = text[text.index(INSTRUCTION) + len(INSTRUCTION):text.rindex(QUESTION)].replace("<unk>", "")
    needle = " " + NEEDLE.format(key=12345) + " "
    n = (len(body) - len(needle)) // len(" " + FILLER)
    assert body == (" " + FILLER) * round(0.5 * n) + needle + (" " + FILLER) * (n - round(0.5 * n))


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    from tests.helpers import make_tiny_model_dir

    return make_tiny_model_dir(tmp_path_factory.mktemp("m") / "llama", max_position_embeddings=512)


def test_cli_passkey_with_a_haystack_records_it_and_refuses_a_journal_of_the_filler(tiny_dir, tmp_path, books):
    from click.testing import CliRunner

    from lcx.cli import main

    out = tmp_path / "pk"
    args = ["eval", "passkey", "-m", str(tiny_dir), "--lengths", "700", "--depths", "0.5", "--samples", "1",
            "--out", str(out)]
    r = CliRunner().invoke(main, args + ["--haystack", str(books)])
    assert r.exit_code == 0, r.output
    result = json.loads((out / "passkey.json").read_text())
    assert result["config"]["haystack"] == str(books)
    r = CliRunner().invoke(main, args + ["--resume"])  # the filler: another grid than the journal's
    assert r.exit_code != 0 and "haystack" in r.output
    r = CliRunner().invoke(main, ["eval", "passkey", "-m", str(tiny_dir), "--lengths", "90000", "--samples", "1",
                                  "--haystack", str(books), "--out", str(tmp_path / "pk2")])
    assert r.exit_code != 0 and "fewer than a prompt of this length needs" in r.output


def test_perplexity_spans_start_with_the_tokenizers_bos_where_it_adds_one():
    """Gemma's tokenizer adds <bos> and the model degenerates without it; SmolLM2's and Qwen's add none."""
    from lcx.data import special_prefix
    from lcx.evals import ppl

    tok = char_tokenizer()
    assert special_prefix(tok) == []  # this tokenizer adds nothing
    seen = []

    def score(ids, n):
        seen.append(ids[0].tolist())
        return {"nll_sum": 1.0, "correct": 0, "count": n}

    doc = ("d", list(range(10, 110)))
    out = ppl.evaluate(score, [doc], ppl.PplConfig(contexts=[8], target=4), progress=False, prefix=[1])
    assert seen[0][0] == 1 and len(seen[0]) == 1 + 8 + 4 and out["prefix_tokens"] == [1]
