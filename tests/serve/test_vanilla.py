"""`vanilla` is served by lcx's request middleware: the 2x-window prompt reaches vLLM cut to its start and end,
the same tokens lcx's plan feeds the model."""

from __future__ import annotations

import torch

from lcx.evals.passkey import build_prompt_ids

from .harness import LONG, MODEL, NEW, SERVING, WINDOW, hf_tokens, server_starting

pytestmark = SERVING


def test_vanilla_server_truncates_as_the_hf_path_does_at_twice_the_window(tmp_path_factory, tok):
    """The key sits in the kept start, so it is found; a text prompt is tokenized by the middleware, then cut;
    a request leaving no room to generate gets a 400."""
    ids = build_prompt_ids(tok, LONG, 0.1, 52817)
    text = tok.decode(ids)
    text_ids = tok(text, return_tensors="pt")["input_ids"][0]

    with server_starting(["--method", "vanilla"], tmp_path_factory.mktemp("vanilla")) as starting:
        want = hf_tokens(ids, ["vanilla"])
        # a text that tokenizes back to the same ids needs no second reference
        want_text = want if torch.equal(text_ids, ids) else hf_tokens(text_ids, ["vanilla"])
        s = starting.wait_ready()
        assert s.ready["methods"] == ["vanilla"]
        got = s.complete(MODEL, ids.tolist(), NEW)
        as_text = s.complete(MODEL, text, NEW)
        status, out = s.post("/v1/completions", {"model": MODEL, "prompt": text, "max_tokens": WINDOW})
    assert got == want
    assert "52817" in tok.decode(got)
    assert as_text == want_text
    assert status == 400 and f"max_new_tokens={WINDOW} leaves no room in a window of {WINDOW}" in out["error"]["message"]
