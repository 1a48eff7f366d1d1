"""Resumable evaluations: the sample journal (lcx.io.Journal) and passkey's use of it."""

import json

import pytest
import torch

from lcx.errors import LcxError
from lcx.evals import passkey
from lcx.io import Journal
from tests.helpers import char_tokenizer

FP = {"model": "m", "methods": [{"name": "fot", "options": {"k": 8}}]}


def counting_generate(tok, calls):
    def gen(ids, n, shared):  # answers with the key it finds in the prompt, so "found" depends on the sample
        calls.append(ids.shape[1])
        text = tok.decode(ids[0])
        key = text.split("The pass key is ")[1][:5]
        return torch.tensor([tok(key, add_special_tokens=False)["input_ids"]])
    return gen


def test_resumed_grid_reuses_recorded_samples_and_redoes_the_rest(tmp_path):
    tok = char_tokenizer()
    cfg = passkey.PasskeyConfig(lengths=[400], depths=[0.2, 0.8], samples=2)
    path = tmp_path / "pk.samples.jsonl"
    calls: list[int] = []
    full = passkey.evaluate(counting_generate(tok, calls), tok, cfg, progress=False, journal=Journal(path, FP))
    assert len(calls) == 4 and full["summary"]["accuracy"] == 1.0
    lines = path.read_text().splitlines()
    assert json.loads(lines[0]) == {"fingerprint": FP} and len(lines) == 5
    # a crash: the last finished sample is cut mid-line and the one before it never written
    path.write_text("\n".join(lines[:3]) + "\n" + lines[4][:20])
    calls.clear()
    again = passkey.evaluate(counting_generate(tok, calls), tok, cfg, progress=False,
                             journal=Journal(path, FP, resume=True))
    assert len(calls) == 2 and again["resumed_samples"] == 2
    strip = lambda r: [{k: v for k, v in s.items() if k != "seconds"} for s in r["samples"]]  # noqa: E731
    assert strip(again) == strip(full)
    assert all(json.loads(x) for x in path.read_text().splitlines()) and len(path.read_text().splitlines()) == 5


def test_without_resume_the_journal_starts_afresh(tmp_path):
    path = tmp_path / "j.jsonl"
    j = Journal(path, FP)
    j.append("a", {"found": True})
    assert Journal(path, FP, resume=True).get("a") == {"id": "a", "found": True}
    assert Journal(path, FP).get("a") is None and len(path.read_text().splitlines()) == 1


def test_resume_with_other_options_is_refused_naming_file_and_difference(tmp_path):
    path = tmp_path / "j.jsonl"
    Journal(path, FP).append("a", {"found": True})
    other = {**FP, "methods": [{"name": "fot", "options": {"k": 16}}]}
    with pytest.raises(LcxError, match=r"j\.jsonl.*differs in: methods.*drop --resume"):
        Journal(path, other, resume=True)


def test_an_option_added_since_the_journal_was_written_matches_at_its_default_only(tmp_path):
    """A method that gained an option (fot's training options) must not strand a long evaluation's
    journal: the new option at its default changes nothing, so the journal resumes; any other value,
    or a changed old option, is still refused."""
    path = tmp_path / "j.jsonl"
    old = {**FP, "methods": [{"name": "fot", "options": {"k": 32}}]}
    Journal(path, old).append("a", {"found": True})
    defaults = {"methods": [{"options": {"k": 32, "d": 1}}]}
    grown = {**FP, "methods": [{"name": "fot", "options": {"k": 32, "d": 1}}]}
    assert Journal(path, grown, resume=True, defaults=defaults).get("a") == {"id": "a", "found": True}
    for bad in ({"k": 32, "d": 2}, {"k": 16, "d": 1}):
        with pytest.raises(LcxError, match="differs in: methods"):
            Journal(path, {**FP, "methods": [{"name": "fot", "options": bad}]}, resume=True, defaults=defaults)
    with pytest.raises(LcxError, match="differs in: methods"):  # without defaults nothing new matches
        Journal(path, grown, resume=True)


def test_an_option_whose_default_changed_matches_old_journals_at_its_value_before(tmp_path):
    """A journal written before an option existed ran it at its ``before`` value, not at today's default: a
    run at today's default must not reuse those samples, a run at the old value may."""
    import dataclasses
    from typing import ClassVar

    from lcx.method import Method, option

    @dataclasses.dataclass
    class Grown(Method):
        name: ClassVar[str] = "grown"
        k: int = option(32, "k")
        sinks: int = option(4, "sinks", before=0)

    assert Grown.default_options() == {"k": 32, "sinks": 4}
    assert Grown.unrecorded_options() == {"k": 32, "sinks": 0}
    path = tmp_path / "j.jsonl"
    Journal(path, {**FP, "methods": [{"name": "grown", "options": {"k": 32}}]}).append("a", {"found": True})
    defaults = {"methods": [{"options": Grown.unrecorded_options()}]}
    as_before = {**FP, "methods": [{"name": "grown", "options": {"k": 32, "sinks": 0}}]}
    assert Journal(path, as_before, resume=True, defaults=defaults).get("a") == {"id": "a", "found": True}
    today = {**FP, "methods": [{"name": "grown", "options": Grown.default_options()}]}
    with pytest.raises(LcxError, match="differs in: methods"):
        Journal(path, today, resume=True, defaults=defaults)


@pytest.mark.parametrize("text,found", [(" 60494. Remember", True), ("60494", True), (" 6 0 4 9 4", True),
                                         ("key:60494!", True), (" 8604945", False), (" 604941", False),
                                         ("56049 4", False), ("1 60 4947", False), (" 6049", False), ("", False)])
def test_a_passkey_is_found_only_as_a_whole_number(text, found):
    """The key must be the whole number answered: removing every space and searching anywhere counted a longer
    number holding it (" 8604945") or digits run together across numbers ("56049 4")."""
    assert passkey.passkey_found(60494, text) is found


def test_resumed_samples_are_scored_with_todays_check(tmp_path):
    """A journal keeps each sample's output; a resumed grid scores it again, so a check made stricter after the
    samples were recorded applies to them too (a journal line claims found for a longer number)."""
    tok = char_tokenizer()
    cfg = passkey.PasskeyConfig(lengths=[400], depths=[0.5], samples=1)
    path = tmp_path / "pk.samples.jsonl"
    passkey.evaluate(counting_generate(tok, []), tok, cfg, progress=False, journal=Journal(path, FP))
    head, line = path.read_text().splitlines()
    sample = json.loads(line)
    path.write_text(head + "\n" + json.dumps({**sample, "output": f"9{sample['key']}", "found": True}) + "\n")
    again = passkey.evaluate(counting_generate(tok, []), tok, cfg, progress=False, journal=Journal(path, FP, resume=True))
    assert again["resumed_samples"] == 1 and again["summary"]["accuracy"] == 0.0


def test_a_journal_with_an_empty_or_damaged_header_says_so(tmp_path):
    """A crash while the header was written left an empty file, reported as 'written for a different run'."""
    path = tmp_path / "j.jsonl"
    for text in ("", "{not json\n"):
        path.write_text(text)
        with pytest.raises(LcxError, match=r"j\.jsonl: its first line is not a journal header.*drop --resume"):
            Journal(path, FP, resume=True)


def test_a_grid_without_depths_is_refused():
    with pytest.raises(LcxError, match="at least one needle depth"):
        passkey.PasskeyConfig(lengths=[400], depths=[]).validate()
