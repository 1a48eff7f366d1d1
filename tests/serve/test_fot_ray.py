"""`lcx serve --memory` reading a document memory sharded over Ray actors (``-o fot.backend=ray``): the server's
answers are those of `lcx generate --memory` with the one-process memory of the same documents."""

from __future__ import annotations

import json

import torch
from click.testing import CliRunner

from lcx.evals.passkey import build_prompt_ids

from .harness import FOT_LAYERS, MODEL, NEW, SERVING, hf_tokens, method_args, model_path, server_starting

pytestmark = SERVING


def test_fot_server_reads_a_ray_sharded_document_memory_as_the_one_process_one(local_ray, tmp_path_factory, tok):
    """(The build joins this module's local Ray, which is shut down after it: a Ray left running would be the
    later modules' ``ray.init`` called twice.)"""
    from lcx.cli import main

    tmp = tmp_path_factory.mktemp("fot-ray")
    opts = {"local": 512, "k": 16, "memory_layers": FOT_LAYERS}
    ray_opts = {**opts, "backend": "ray", "shards": 2}
    docs = []
    for name, key in (("a", 61728), ("b", 94051)):
        docs.append(tmp / f"{name}.txt")
        docs[-1].write_text(tok.decode(build_prompt_ids(tok, 1500, 0.5, key)))
    for out, o in (("mem", opts), ("mem-ray", ray_opts)):
        r = CliRunner().invoke(main, ["memory", "build", "-m", model_path(), *(x for k, v in o.items() for x in ("-o", f"{k}={v}")),
                                      "--out", str(tmp / out), *map(str, docs)])
        assert r.exit_code == 0, r.output
    assert len(json.loads((tmp / "mem-ray" / "memory.json").read_text())["shards"]) == 2
    question = tok("What is the pass key? The pass key is")["input_ids"]
    fot = (["fot"], {"fot": opts})
    want = hf_tokens(torch.tensor(question), *fot, memory=tmp / "mem")
    assert want != hf_tokens(torch.tensor(question), *fot)  # the memory is read
    with server_starting(["--method", "fot", *method_args("fot", ray_opts), "--memory", str(tmp / "mem-ray"),
                          "--max-model-len", "2048"], tmp) as starting:
        s = starting.wait_ready()
        got = s.complete(MODEL, question, NEW)
    assert got == want
