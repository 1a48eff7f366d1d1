"""The FSDP2 teardown abort, looked for: a 2-rank gloo ``fully_shard`` run (a frozen base and trainable LoRA-like
matrices, as lcx's LoRA training) started N times per way of ending it; prints how each way's runs exited.

    OMP_NUM_THREADS=1 python bench/fsdp_teardown.py --runs 10            # every ending, 10 runs each
    OMP_NUM_THREADS=1 python bench/fsdp_teardown.py --runs 10 --ending lcx --model DIR --data DIR

Endings (what a rank does after its last optimizer step):
  exit             nothing: the process exits with its process group and the sharded model alive
  exit-skewed      the same, rank 1 half a second after rank 0 (its peer's sockets close under a live group)
  destroy          destroy_process_group(), the model still alive (freed at interpreter exit)
  free-destroy     the model and optimizer dropped and collected, a barrier, then destroy_process_group()
                   (what lcx train does)
  lcx              the real thing: `accelerate launch --config_file configs/accelerate/fsdp2-2proc.yaml lcx train`
"""

from __future__ import annotations

import argparse
import collections
import gc
import json
import os
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
ENDINGS = ("exit", "exit-skewed", "destroy", "free-destroy")


def worker(ending: str) -> None:
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    dist.init_process_group("gloo")
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    torch.manual_seed(0)

    class Block(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.base = torch.nn.Linear(64, 64).requires_grad_(False)
            self.a = torch.nn.Linear(64, 8, bias=False)  # the trainable low-rank pair
            self.b = torch.nn.Linear(8, 64, bias=False)

        def forward(self, x):
            return torch.relu(self.base(x) + self.b(self.a(x)))

    model = torch.nn.Sequential(*[Block() for _ in range(4)])
    for block in model:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2, foreach=True)
    gen = torch.Generator().manual_seed(dist.get_rank())
    for _ in range(5):
        loss = model(torch.randn(4, 64, generator=gen)).square().mean()
        loss.backward()
        torch.nn.utils.clip_grad_norm_([p for p in model.parameters() if p.requires_grad], 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
    if ending == "exit-skewed" and dist.get_rank() == 1:
        time.sleep(0.5)
    if ending == "destroy":
        dist.destroy_process_group()
    elif ending == "free-destroy":
        del model, opt, loss
        gc.collect()
        dist.barrier()
        dist.destroy_process_group()


def run_once(ending: str, args) -> tuple[int, str]:
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads), "PYTHONUNBUFFERED": "1"}
    if ending == "lcx":
        out = Path(args.tmp) / f"lcx-{time.time_ns()}"
        cmd = [str(Path(sys.executable).with_name("accelerate")), "launch", "--config_file",
               str(REPO / "configs/accelerate/fsdp2-2proc.yaml"), "-m", "lcx.cli", "train", "-m", args.model,
               "-d", args.data, "--out", str(out), "--seq-len", "64", "--steps", "2", "--save-every", "1", "--json"]
    else:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port",
               str(29500 + (time.time_ns() // 1000) % 2000), __file__, "--worker", ending]
    r = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=REPO, timeout=300)
    return r.returncode, (r.stdout + r.stderr)[-3000:]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--worker", choices=ENDINGS, help=argparse.SUPPRESS)
    ap.add_argument("--runs", type=int, default=10)
    ap.add_argument("--ending", action="append", choices=(*ENDINGS, "lcx"))
    ap.add_argument("--model", help="lcx: a tiny model folder")
    ap.add_argument("--data", help="lcx: a text folder")
    ap.add_argument("--threads", type=int, default=1, help="OMP_NUM_THREADS of each rank")
    ap.add_argument("--tmp", default="/tmp/fsdp_teardown")
    ap.add_argument("--json", dest="json_out", help="write the tallies and failing outputs here")
    args = ap.parse_args()
    if args.worker:
        worker(args.worker)
        return
    Path(args.tmp).mkdir(parents=True, exist_ok=True)
    report = {}
    for ending in args.ending or ENDINGS:
        codes, failures = collections.Counter(), []
        t0 = time.perf_counter()
        for i in range(args.runs):
            rc, tail = run_once(ending, args)
            codes[rc] += 1
            if rc:
                failures.append({"run": i, "rc": rc, "tail": tail})
        report[ending] = {"exit_codes": dict(codes), "seconds": round(time.perf_counter() - t0, 1), "failures": failures}
        print(f"{ending:14s} exit codes {dict(codes)}  ({report[ending]['seconds']} s)", flush=True)
        for f in failures[:2]:
            print(f"  run {f['run']} rc {f['rc']}:\n" + "\n".join("    " + x for x in f["tail"].splitlines()[-15:]))
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
