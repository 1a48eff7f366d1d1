"""`focusllm` with its prompt's candidates (refresh=0): lcx's middleware has vLLM's engine run the chunk forwards
(lcx's path when a candidate adapter is applied) and vLLM reads [placeholders ; local tokens] on its own model
code, the candidates' keys/values loaded into its KV cache in the placeholders' stead by lcx's KV connector
(lcx.integrations.vllm.connector)."""

from __future__ import annotations

import random
from concurrent.futures import ThreadPoolExecutor

import torch

from lcx.evals.passkey import build_prompt_ids

from .harness import LONG, MODEL, NEW, SERVING, hf_tokens, method_args, model_path, server_starting

pytestmark = SERVING


def test_focusllm_server_equals_the_hf_path_and_keeps_concurrent_requests_apart(tmp_path_factory, tok):
    """Past the window (1.25x) the served tokens equal `lcx generate --method focusllm -o focusllm.refresh=0`;
    8 concurrent prompts, shuffled, each with its own key (one chunk of candidates, or short enough to be read
    as it is), get the tokens that prompt gets alone; every candidate file is gone after its request; a request
    over lcx's limits (the middleware reads the whole prompt) gets a 400 and the server serves on.
    A focusllm adapter (its candidate projections) is applied by the middleware: the name it is served under
    answers as `lcx generate --adapter` does, and otherwise than the base model."""
    from lcx.adapters.peft_bridge import random_adapter
    from lcx.limits import Limits
    from lcx.models import load_model

    # chunks of 1,024 and 512 local tokens: the defaults (2,048 each, with the 512-token fragment) do not fit the
    # 2,048-token window
    opts = {"refresh": 0, "local": 512, "chunk": 1024}
    focus = (["focusllm"], {"focusllm": opts})
    tmp = tmp_path_factory.mktemp("focusllm")
    lora = random_adapter(load_model(model_path())[0], tmp / "cand", 2, scale=1.0, roles=("q", "k", "v", "o"),
                          methods=[{"name": "focusllm", "options": {}}])
    mid = build_prompt_ids(tok, 1200, 0.5, 51846)  # one chunk of candidates (688 tokens, the key in it)
    ids = build_prompt_ids(tok, LONG, 0.98, 27094)  # the key among the local tokens, the rest read as candidates
    over = Limits.from_env().max_new_tokens + 1  # the server's environment is this process's
    rng = random.Random(5)
    keys = rng.sample(range(10000, 99999), 8)
    jobs = [(build_prompt_ids(tok, rng.choice([400, 1400]), 0.9, k).tolist(), k) for k in keys]  # 0 or 1 chunk
    rng.shuffle(jobs)

    with server_starting(["--method", "focusllm", *method_args("focusllm", opts), f"--adapter=cand={lora}"],
                         tmp) as starting:
        want = {"adapted": {MODEL: hf_tokens(mid, *focus), "cand": hf_tokens(mid, *focus, adapter=lora)},
                "long": hf_tokens(ids, *focus), "jobs": [hf_tokens(torch.tensor(j), *focus) for j, _ in jobs]}
        s = starting.wait_ready()
        assert s.ready["methods"] == ["focusllm"] and s.ready["adapters"] == ["cand"]
        adapted = {name: s.complete(name, mid.tolist(), NEW) for name in (MODEL, "cand")}
        got = s.complete(MODEL, ids.tolist(), NEW)
        with ThreadPoolExecutor(len(jobs)) as pool:
            answers = list(pool.map(lambda j: s.complete(MODEL, j[0], NEW), jobs))
        status, bad = s.post("/v1/completions", {"model": MODEL, "prompt": ids.tolist(), "max_tokens": over})
        # finished requests are released when they leave vLLM's batch, at its next step: one more request
        assert len(s.complete(MODEL, tok("One, two, three,")["input_ids"], 2)) == 2
        left = list((tmp / "export" / "request-state").glob("*.safetensors"))
    log = s.log_path.read_text()
    assert "through lcx's KV connector" in log and "answers vLLM's attention" not in log
    assert "chunk forwards run on vLLM's engine" in log  # the base model's candidates; the adapter's are lcx's
    assert not left  # each request's candidate file was deleted with its state
    assert status == 400 and f"max_tokens={over:,} is over the limit" in bad["error"]["message"], bad
    assert got == want["long"]
    assert {len(j) > opts["local"] for j, _ in jobs} == {True, False}  # both kinds were sent
    assert answers == want["jobs"]
    texts = [tok.decode(a) for a in answers]
    assert not any(str(k) in text for (_, key), text in zip(jobs, texts) for k in keys if k != key)
    assert sum(str(key) in text for (_, key), text in zip(jobs, texts)) >= 4  # real answers (the 400-token prompts are read as they are)
    assert adapted == want["adapted"]
    assert adapted["cand"] != adapted[MODEL]
