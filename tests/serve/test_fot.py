"""`fot` inside vLLM's attention (lcx.integrations.vllm.attention), reading a document memory built by
`lcx memory build` (loaded once by the server) plus a kNN memory of its own per request."""

from __future__ import annotations

import random
from concurrent.futures import ThreadPoolExecutor

import torch
from click.testing import CliRunner

from lcx.evals.passkey import build_prompt_ids

from .harness import FOT_LAYERS, LONG, MODEL, NEW, SERVING, hf_tokens, method_args, model_path, server_starting

pytestmark = SERVING


def test_fot_server_with_a_document_memory_equals_the_hf_path_for_concurrent_requests(tmp_path_factory, tok):
    """The passkey prompt past the window and 8 concurrent prompts (longer than the 512-token local window: their own
    memory is in use), shuffled, are each answered with the tokens `lcx generate --memory` gives that prompt
    alone: no request reads another's memory or writes the shared one; the questions about the documents are
    answered otherwise without the memory.  The same server serves a LoRA adapter (vLLM's LoRA under lcx's
    memory attention, what a crossbatch-trained fot adapter needs): on a short prompt its answer equals
    `lcx generate --adapter --memory`, and differs from the bare model's (the parity of adapters past the window is
    test_lora's)."""
    from lcx.adapters.peft_bridge import random_adapter
    from lcx.cli import main
    from lcx.models import load_model

    tmp = tmp_path_factory.mktemp("fot")
    opts = {"local": 512, "k": 16, "memory_layers": FOT_LAYERS, "sinks": 4}  # sinks: served as lcx generate keeps them
    # q/k LoRA at scale 0.2 (the smt-shaped adapters of test_lora, at 0.05, happen not to change these answers)
    lora = random_adapter(load_model(model_path())[0], tmp / "lora", 1, scale=0.2)
    counting = tok("One, two, three, four, five, six,")["input_ids"]
    docs = []
    for name, key in (("a", 61728), ("b", 94051)):  # two documents, each with its own passkey
        docs.append(tmp / f"{name}.txt")
        docs[-1].write_text(tok.decode(build_prompt_ids(tok, 1500, 0.5, key)))
    r = CliRunner().invoke(main, ["memory", "build", "-m", model_path(), *(x for k, v in opts.items() for x in ("-o", f"{k}={v}")),
                                  "--out", str(tmp / "mem"), *map(str, docs)])
    assert r.exit_code == 0, r.output
    mem = tmp / "mem"
    ids = build_prompt_ids(tok, LONG, 0.5, 38127)
    rng = random.Random(4)
    jobs = [build_prompt_ids(tok, rng.choice([800, 1600]), rng.uniform(0.1, 0.9), k).tolist()
            for k in rng.sample(range(10000, 99999), 6)]
    question = tok("What is the pass key? The pass key is")["input_ids"]
    jobs += [question] * 2  # read from the documents
    rng.shuffle(jobs)

    fot = (["fot"], {"fot": opts})
    with server_starting(["--method", "fot", *method_args("fot", opts), "--memory", str(mem),
                          "--adapter", f"lora={lora}", "--max-model-len", str(LONG + 64)], tmp) as starting:
        want = {"long": hf_tokens(ids, *fot, memory=mem),
                "short": {MODEL: hf_tokens(torch.tensor(counting), *fot, memory=mem, max_new_tokens=16),
                          "lora": hf_tokens(torch.tensor(counting), *fot, adapter=lora, memory=mem, max_new_tokens=16)},
                "jobs": [hf_tokens(torch.tensor(j), *fot, memory=mem) for j in jobs],
                "without memory": hf_tokens(torch.tensor(question), *fot)}
        s = starting.wait_ready()
        got = s.complete(MODEL, ids.tolist(), NEW)
        short = {name: s.complete(name, counting, 16) for name in (MODEL, "lora")}
        with ThreadPoolExecutor(len(jobs)) as pool:
            answers = list(pool.map(lambda j: s.complete(MODEL, j, NEW), jobs))
    log = s.log_path.read_text()
    assert "lcx: fot answers vLLM's attention" in log
    # the jobs share the long prompt's instruction and filler up to their needles: vLLM's prefix cache found
    # those blocks, and the served attention rebuilt their state from them (their answers are checked below)
    assert "lcx: fot: a request starts at position" in log
    assert got == want["long"]
    assert short == want["short"]
    assert short["lora"] != short[MODEL]  # the adapter is applied
    assert sum(len(j) > opts["local"] for j in jobs) == 6  # their own memory is in use
    assert answers == want["jobs"]
    assert answers[jobs.index(question)] != want["without memory"]  # the memory was read
