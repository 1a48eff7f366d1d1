"""What the needle's own candidate knows: the upper bound of focusllm's passkey with these chunks.

For each passkey prompt of a journal (default: results/focusllm/passkey-fresh), the base model greedily
continues [the chunk holding the needle ; the fragment] -- exactly the sequence whose last position is
that chunk's candidate (defaults: chunk 2048, local 2048, fragment 512).  If it answers the key, the
candidate holds it and the decoder only has to read it; if not, no candidate adapter that only changes
how the decoder reads the candidates can find it.  Prompts whose needle lies among the local tokens are
marked "local".

    .venv/bin/python results/focusllm/passkey-ceiling/ceiling.py            # -> ceiling.json (~5 s a prompt)
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from lcx.evals.passkey import prompt_and_needle
from lcx.models import load_model

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[2]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--journal", type=Path, default=ROOT / "results/focusllm/passkey-fresh/passkey.samples.jsonl")
    ap.add_argument("--chunk", type=int, default=2048)
    ap.add_argument("--local", type=int, default=2048)
    ap.add_argument("--fragment", type=int, default=512)
    ap.add_argument("--out", type=Path, default=HERE / "ceiling.json")
    args = ap.parse_args()
    model, tok = load_model("smollm2-135m")
    rows = []
    for line in args.journal.read_text().splitlines():
        s = json.loads(line)
        if "key" not in s:
            continue  # the journal's header
        ids, start = prompt_and_needle(tok, s["length"], s["depth"], s["key"])
        ids = torch.as_tensor(ids)
        memory = len(ids) - args.local
        row = {"length": s["length"], "depth": s["depth"], "key": s["key"], "stack_found": s["found"],
               "stack_output": s["output"]}
        if start >= memory:
            row.update(needle="local", candidate_output=None, candidate_found=None)
        else:
            c = start // args.chunk
            x = torch.cat([ids[c * args.chunk:min((c + 1) * args.chunk, memory)], ids[-args.fragment:]])[None]
            with torch.no_grad():
                out = model.generate(x, max_new_tokens=8, do_sample=False)
            answer = tok.decode(out[0, x.shape[1]:])
            row.update(needle=f"chunk {c}", candidate_output=answer, candidate_found=str(s["key"]) in answer)
        rows.append(row)
        print(row, flush=True)
    args.out.write_text(json.dumps({"journal": str(args.journal.resolve().relative_to(ROOT)), "chunk": args.chunk,
                                    "local": args.local, "fragment": args.fragment, "prompts": rows}, indent=1))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
