"""`vanilla` is served by lcx's request middleware: a prompt past the window reaches vLLM cut to its start and end,
the same tokens lcx's plan feeds the model."""

from __future__ import annotations

import torch

from lcx.evals.passkey import build_prompt_ids

from .harness import LONG, MODEL, NEW, SERVING, WINDOW, hf_tokens, model_path, server_starting

pytestmark = SERVING


def test_vanilla_server_truncates_as_the_hf_path_does_past_the_window(tmp_path_factory, tok):
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
        served = _niah_through_lm_eval("local-completions", f"model={MODEL},base_url=http://127.0.0.1:{s.port}"
                                       "/v1/completions,tokenized_requests=False,num_concurrent=1,max_retries=1")
    assert got == want
    assert "52817" in tok.decode(got)
    assert as_text == want_text
    assert status == 400 and f"max_new_tokens={WINDOW} leaves no room in a window of {WINDOW}" in out["error"]["message"]
    # lm-eval's RULER needle task against the server (its local-completions model), and through lcx's own lm-eval
    # model: the same answers and scores
    assert served == _niah_through_lm_eval("lcx", f"model={model_path()},method=vanilla") and len(served) == 2


RULER = 1024  # lm-eval's RULER length: inside the window, so both paths read the prompts whole
_TASKS: dict = {}  # tokenizer -> lm-eval's TaskManager for it, shared by the runs


def _niah_through_lm_eval(model: str, model_args: str) -> list[tuple[str, float]]:
    """lm-eval's niah_single_1, 2 samples of 1,024 tokens (inside the window), 8 new tokens each: (answer, score)
    per sample."""
    import os
    from pathlib import Path

    import lm_eval
    from lm_eval.tasks import TaskManager

    import lcx.integrations.lm_eval  # noqa: F401  (registers `lcx`)
    from lcx.models import resolve_model_path

    os.environ["HF_DATASETS_OFFLINE"] = "1"
    tokenizer = str(resolve_model_path(MODEL))
    if tokenizer not in _TASKS:  # what simple_evaluate's own TaskManager would carry for the task (its tokenizer
        # and lengths), indexing only the RULER folder: every lm-eval task folder takes seconds to index
        ruler = Path(lm_eval.__file__).parent / "tasks" / "ruler"
        _TASKS[tokenizer] = TaskManager(include_defaults=False, include_path=str(ruler),
                                        metadata={"tokenizer": tokenizer, "max_seq_lengths": [RULER]})
    out = lm_eval.simple_evaluate(model=model, model_args=f"{model_args},tokenizer={tokenizer}", tasks=["niah_single_1"],
                                  task_manager=_TASKS[tokenizer], limit=2, log_samples=True, gen_kwargs="max_gen_toks=8")
    return [(x["resps"][0][0], x[str(RULER)]) for x in out["samples"]["niah_single_1"]]
