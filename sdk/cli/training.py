"""`lcx train`: fine-tune the few parameters a method needs (accelerate; an adapter or a model)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import click

from lcx.cli.base import CONTEXT, OUT_DIR, _dtype, _echo_json, _resolved_dtype, dtype_option, main, model_option, text_field_option


@main.command("train", context_settings=CONTEXT)
@model_option
@click.option("--method", "methods", multiple=True, metavar="NAME", help="Method(s) to train with (default: vanilla).")
@click.option("--option", "-o", "options", multiple=True, metavar="KEY=VALUE", help="Method option (see `lcx methods -v`).")
@click.option("--data", "-d", multiple=True, required=True, metavar="PATH",
              help="Text file, folder (one document per file) or .jsonl; repeatable.  Or a synthetic task: "
                   "task:dictionary (FoT's dictionary lookup, fresh seeded documents every step: one document "
                   "per --seq-len row; task:dictionary:512 for 512-token documents back to back; "
                   "task:dictionary:near=0.5 for keys half of which share 2 of 4 symbols with an earlier key).")
@click.option("--out", required=True, type=OUT_DIR, help="Output folder for the adapter.")
@click.option("--seq-len", type=click.IntRange(2), default=1024, show_default=True, help="Tokens per training window.")
@click.option("--steps", type=click.IntRange(1), default=100, show_default=True)
@click.option("--batch-size", type=click.IntRange(1), default=1, show_default=True, help="Windows per process per micro-batch.")
@click.option("--grad-accum", type=click.IntRange(1), default=1, show_default=True, help="Micro-batches per optimizer step.")
@click.option("--lr", type=click.FloatRange(min=0, min_open=True), default=2e-4, show_default=True)
@click.option("--warmup", type=click.IntRange(0), default=0, show_default=True, help="Linear warm-up steps.")
@click.option("--schedule", type=click.Choice(["constant", "cosine"]), default="constant", show_default=True)
@click.option("--lora-rank", type=click.IntRange(1), default=8, show_default=True)
@click.option("--lora-targets", default=None, metavar="ROLES", help="Comma-separated attention roles q,k,v,o (default: the method's).")
@click.option("--full", default=None, metavar="MODULES|all",
              help="Train these modules fully (module-name suffixes, e.g. q_proj,k_proj for SMT; saved whole in the PEFT "
                   "adapter), or 'all': every weight, no LoRA, written as a model folder (load it with -m OUT).")
@click.option("--init-adapter", type=click.Path(path_type=Path), default=None, metavar="DIR",
              help="Start from this lcx adapter's weights instead of a fresh LoRA (same base model and rank; its "
                   "roles): continue a training, e.g. with another loss.  The run's steps, optimizer and schedule "
                   "start anew (--resume continues an interrupted run instead).")
@click.option("--seed", type=int, default=0, show_default=True, help="Seed of the data order, the adapter initialisation and the sampling stage.")
@click.option("--bf16", is_flag=True, help="bf16 autocast (where the hardware supports it).")
@click.option("--save-every", type=click.IntRange(0), default=50, show_default=True, help="Checkpoint every N steps.")
@click.option("--concat/--no-concat", default=True, show_default=True, help="Concatenate short documents into windows.")
@text_field_option
@click.option("--resume", is_flag=True, help="Continue exactly from the latest checkpoint in --out.")
@click.option("--overwrite", is_flag=True, help="Replace an existing --out folder.")
@dtype_option
@click.option("--json", "as_json", is_flag=True, help="Print a JSON summary at the end.")
def train_cmd(model, methods, options, data, out, seq_len, steps, batch_size, grad_accum, lr, warmup, schedule,
              lora_rank, lora_targets, full, init_adapter, seed, bf16, save_every, concat, text_field, resume, overwrite, as_json):
    """Fine-tune the few parameters a method needs; writes an lcx (PEFT LoRA) adapter to --out.

    \b
    Example (tiny budget, books as data):
      lcx train -m smollm2-135m --method vanilla -d ../shared/data/books --seq-len 1024 --steps 50 --out out/vanilla
    Scale out with accelerate (same command; DDP, or FSDP2 with sharded checkpoints):
      accelerate launch --config_file configs/accelerate/ddp-2proc.yaml -m lcx.cli train ...
      accelerate launch --config_file configs/accelerate/fsdp2-2proc.yaml -m lcx.cli train ...
    Ctrl-C stops after the current step and keeps a checkpoint; rerun with --resume.
    """
    from lcx.registry import DEFAULT_METHOD
    from lcx.session import parse_options
    from lcx.train import TrainConfig, train

    dtype = _resolved_dtype(_dtype())  # resolved here: a resumed run is compared by what it computed in
    cfg = TrainConfig(
        model=model, data=list(data), out=str(out), methods=list(methods) or [DEFAULT_METHOD], options=parse_options(options),
        seq_len=seq_len, steps=steps, batch_size=batch_size, grad_accum=grad_accum, lr=lr, warmup=warmup,
        schedule=schedule, lora_rank=lora_rank, lora_roles=lora_targets.split(",") if lora_targets else None,
        full=[x.strip() for x in full.split(",") if x.strip()] if full else [],
        init_adapter=str(init_adapter) if init_adapter else None,
        seed=seed, bf16=bf16, save_every=save_every, concat=concat, text_field=text_field, dtype=dtype,
    )
    path = train(cfg, resume=resume, overwrite=overwrite, progress=not as_json)
    if int(os.environ.get("RANK", "0")) != 0:  # under accelerate launch: one report, from the main process
        return
    if as_json:
        lines = (path / "metrics.jsonl").read_text().splitlines()
        kind = "model" if cfg.full_model else "adapter"  # a model folder loads with -m, an adapter with --adapter
        _echo_json({kind: str(path), "steps": len(lines), "last": json.loads(lines[-1]) if lines else None})
    elif cfg.full_model:
        click.echo(f"model written to {path} (load it with -m {path})")
    else:
        click.echo(f"adapter written to {path} (load it with --adapter {path})")
