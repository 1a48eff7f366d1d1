"""`streaming` runs inside vLLM's attention (lcx.integrations.vllm.attention)."""

from __future__ import annotations

import random
from concurrent.futures import ThreadPoolExecutor

from lcx.evals.passkey import build_prompt_ids

from .harness import LONG, MODEL, NEW, SERVING, hf_tokens, method_args, server_starting

pytestmark = SERVING


def test_streaming_server_equals_the_hf_path_and_keeps_concurrent_requests_apart(tmp_path_factory, tok):
    """Past the window (1.25x) the served tokens equal lcx's streaming path; 8 concurrent requests, shuffled, those of
    1,500 tokens longer than sinks + window (each evicting its own keys), passkeys in their recent windows, each
    get their own key (the per-request state is keyed and reset per request).  A 1,024-token recent window (not
    the default, near the model's window) has the 1,500-token prompts evict.
    A prompt whose first blocks vLLM's prefix cache holds (the long prompt's) gets the tokens of its own HF run."""
    opts = {"sinks": 4, "chunk": 512, "window": 1024}
    ids = build_prompt_ids(tok, LONG, 0.5, 60413)
    rng = random.Random(3)
    keys = rng.sample(range(10000, 99999), 8)
    jobs = [(build_prompt_ids(tok, rng.choice([600, 1500]), rng.uniform(0.55, 0.9), k).tolist(), k) for k in keys]
    rng.shuffle(jobs)
    # the long prompt's first ~1.3K tokens (instruction and filler, up to its needle): vLLM's prefix cache holds
    # them once the long prompt is computed, and this request is scheduled from there, its state rebuilt from them
    again = build_prompt_ids(tok, 2400, 0.9, 27182)
    with server_starting(["--method", "streaming", *method_args("streaming", opts), "--max-model-len", str(LONG + 64)],
                         tmp_path_factory.mktemp("streaming")) as starting:
        want = hf_tokens(ids, ["streaming"], {"streaming": opts})
        want_again = hf_tokens(again, ["streaming"], {"streaming": opts})
        s = starting.wait_ready()
        assert s.ready["methods"] == ["streaming"]
        got = s.complete(MODEL, ids.tolist(), NEW)
        got_again = s.complete(MODEL, again.tolist(), NEW)
        with ThreadPoolExecutor(len(jobs)) as pool:
            answers = list(pool.map(lambda j: tok.decode(s.complete(MODEL, j[0], NEW)), jobs))
    log = s.log_path.read_text()
    assert "lcx: streaming answers vLLM's attention" in log  # not vLLM's own attention
    assert "lcx: streaming: a request starts at position" in log  # a prefix found in vLLM's cache
    assert got == want and got_again == want_again
    assert "27182" in tok.decode(got_again)
    evicting = [len(j) > opts["sinks"] + opts["window"] for j, _ in jobs]
    assert any(evicting) and not all(evicting)  # both kinds were sent
    for (_, key), text in zip(jobs, answers):
        assert str(key) in text and not any(str(k) in text for k in keys if k != key), (key, text)
