"""`lcx train`: methods' sampling and loss stages on long documents -> an lcx (PEFT) adapter.

The loop is a small accelerate loop rather than the HF Trainer, for two reasons
that matter to users: resumption is exact by construction (the rows of step s
are a pure function of (seed, s), and every piece of state is restored), and
checkpoints are safetensors + JSON only (no pickle).  Scaling out is
accelerate's job: ``accelerate launch --config_file configs/accelerate/ddp-2proc.yaml -m lcx.cli train ...``
(DDP) or ``configs/accelerate/fsdp2-2proc.yaml`` (FSDP2: torch's ``fully_shard``, one unit per transformer
block; each process checkpoints its shards through torch.distributed.checkpoint, and the result is gathered
once, at the end).  DeepSpeed and FSDP version 1 are refused at start.

``train`` strings together the parts of a ``Trainer``: setup (its constructor), ``train_step`` (one
optimizer step), ``checkpoint``, ``save_result``.  Per optimizer step, for each gradient-accumulation micro-batch:
    batch = lcx_sample(batch, step) or batch          # sampling stage
    terms = lcx_loss(model, batch) or {"lm": loss}     # training-loss stage (named terms)
    backward(sum(terms) / accumulation)
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import os
import random
import re
import shutil
import signal
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch
from safetensors.torch import save_file

from lcx.data import Batches
from lcx.errors import LcxError
from lcx.registry import DEFAULT_METHOD

CHECKPOINTS = "checkpoints"
METRICS = "metrics.jsonl"
CONFIG = "train_config.json"


@dataclass
class TrainConfig:
    model: str = field(metadata={"help": "known model name or local HF folder"})
    data: list[str] = field(metadata={"help": "text files, folders (one document per file) or .jsonl"})
    out: str = field(metadata={"help": "output folder: adapter, metrics.jsonl, checkpoints/"})
    methods: list[str] = field(default_factory=lambda: [DEFAULT_METHOD], metadata={"help": "methods to train with"})
    options: dict[str, Any] = field(default_factory=dict, metadata={"help": "method options"})
    seq_len: int = field(default=1024, metadata={"help": "tokens per training window"})
    steps: int = field(default=100, metadata={"help": "optimizer steps"})
    batch_size: int = field(default=1, metadata={"help": "windows per process per micro-batch"})
    grad_accum: int = field(default=1, metadata={"help": "micro-batches per optimizer step"})
    lr: float = field(default=2e-4, metadata={"help": "peak learning rate (AdamW)"})
    warmup: int = field(default=0, metadata={"help": "linear warm-up steps"})
    schedule: str = field(default="constant", metadata={"help": "constant or cosine after warm-up"})
    weight_decay: float = field(default=0.0, metadata={"help": "AdamW weight decay"})
    max_grad_norm: float = field(default=1.0, metadata={"help": "gradient clipping (0 = off)"})
    lora_rank: int = field(default=8, metadata={"help": "LoRA rank"})
    lora_roles: list[str] | None = field(default=None, metadata={"help": "attention roles q,k,v,o (default: the method's)"})
    full: list[str] = field(default_factory=list, metadata={
        "help": "modules trained fully (PEFT modules_to_save, e.g. k_proj,q_proj), or ['all']: every weight, "
                "no LoRA, written as a whole model folder"})
    init_adapter: str | None = field(default=None, metadata={
        "help": "an lcx adapter whose weights the run starts from (same base model and rank; its roles)"})
    seed: int = field(default=0, metadata={"help": "seed for data order, init and sampling"})
    bf16: bool = field(default=False, metadata={"help": "bf16 autocast"})
    dtype: str = field(default="float32", metadata={
        "help": "dtype of the frozen base weights (float32, bfloat16); trained parameters stay float32, and a "
                "bfloat16 base computes under bf16 autocast"})
    save_every: int = field(default=50, metadata={"help": "checkpoint every N steps (0 = never; a stopped or failed run still keeps one)"})
    keep_checkpoints: int = field(default=2, metadata={"help": "how many recent checkpoints to keep"})
    concat: bool = field(default=True, metadata={"help": "concatenate short documents into windows"})
    text_field: str = field(default="text", metadata={"help": "JSONL field holding the text"})

    @property
    def full_model(self) -> bool:
        """Every weight trains (``--full all``): the output is a model folder, not an adapter."""
        return self.full == ["all"]

    def validate(self) -> None:
        for k in ("seq_len", "steps", "batch_size", "grad_accum", "lora_rank"):
            if getattr(self, k) <= 0:
                raise LcxError(f"{k} must be > 0, got {getattr(self, k)}")
        if self.lr <= 0:
            raise LcxError(f"lr must be > 0, got {self.lr}")
        if self.schedule not in ("constant", "cosine"):
            raise LcxError(f"schedule must be constant or cosine, got {self.schedule!r}")
        if self.dtype not in ("float32", "bfloat16", "float16"):
            raise LcxError(f"dtype {self.dtype!r}: train in float32, bfloat16 or float16 (auto is resolved before)")
        if self.dtype == "float16" and not torch.cuda.is_available():
            raise LcxError("float16 training needs a CUDA GPU (its loss scaling runs there); on the CPU train in "
                           "bfloat16 or float32")
        from lcx.composition import resolve_methods

        for m in resolve_methods(self.methods, self.options):
            m.check_training()
        if self.init_adapter and (self.full or self.lora_roles):
            raise LcxError(f"--init-adapter {self.init_adapter!r} brings its own LoRA modules and roles; drop "
                           f"{'--full' if self.full else '--lora-targets'}")


class Interrupted(LcxError):
    exit_code = 130


# ---------------------------------------------------------------------- data order
def rows_for(step: int, micro: int, rank: int, cfg: TrainConfig, world: int, n: int, order: str = "shuffle") -> list[int]:
    """Dataset rows of one micro-batch: a pure function of (seed, step, micro, rank).

    ``shuffle``: windows in a seeded random order.  ``streams``: the corpus's windows (in corpus
    order, documents concatenated) are cut into one contiguous stream per batch row, and each row
    reads the next window of its own stream every micro-batch, so a document stays in its row
    across steps (FoT's crossbatch); the streams wrap around at their end."""
    global_bs = cfg.batch_size * world
    if order == "streams":
        per = n // global_bs
        if per == 0:
            raise LcxError(f"{n} training windows cannot fill {global_bs} streams (batch size x processes); "
                           f"use more data, a smaller --batch-size or a shorter --seq-len")
        t = step * cfg.grad_accum + micro
        first = rank * cfg.batch_size
        return [(first + r) * per + t % per for r in range(cfg.batch_size)]
    start = (step * cfg.grad_accum + micro) * global_bs + rank * cfg.batch_size
    out = []
    for g in range(start, start + cfg.batch_size):
        epoch, pos = divmod(g, n)
        perm = _perm(cfg.seed, epoch, n)
        out.append(int(perm[pos]))
    return out


_PERM_CACHE: dict[tuple[int, int, int], torch.Tensor] = {}


def _perm(seed: int, epoch: int, n: int) -> torch.Tensor:
    key = (seed, epoch, n)
    if key not in _PERM_CACHE:
        _PERM_CACHE.clear()
        _PERM_CACHE[key] = torch.randperm(n, generator=torch.Generator().manual_seed(seed * 1_000_003 + epoch))
    return _PERM_CACHE[key]


# ---------------------------------------------------------------------- checkpoint I/O (no pickle)
def _atomic_dir_write(dest: Path, write: Callable[[Path], None]) -> None:
    tmp = dest.with_name(dest.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    write(tmp)
    _commit_dir(tmp, dest)


def _commit_dir(tmp: Path, dest: Path) -> None:
    """``tmp`` becomes ``dest`` (replacing it) by renames: a crash leaves the old or the new folder."""
    if dest.exists():
        old = dest.with_name(dest.name + ".old")
        shutil.rmtree(old, ignore_errors=True)
        os.replace(dest, old)
        os.replace(tmp, dest)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.replace(tmp, dest)


def _optimizer_to_files(opt: torch.optim.Optimizer) -> tuple[dict[str, torch.Tensor], dict]:
    sd = opt.state_dict()
    tensors = {}
    for idx, st in sd["state"].items():
        for k, v in st.items():
            tensors[f"state.{idx}.{k}"] = v if torch.is_tensor(v) else torch.tensor(v)
    return tensors, {"param_groups": sd["param_groups"]}


def _optimizer_from_files(opt: torch.optim.Optimizer, tensors: dict[str, torch.Tensor], meta: dict) -> None:
    state: dict[int, dict[str, torch.Tensor]] = {}
    for key, v in tensors.items():
        _, idx, k = key.split(".", 2)
        state.setdefault(int(idx), {})[k] = v
    opt.load_state_dict({"state": state, "param_groups": meta["param_groups"]})


def _rng_state() -> tuple[dict[str, torch.Tensor], dict]:
    np_state = np.random.get_state()
    return ({"torch": torch.get_rng_state()},
            {"python": _jsonable(random.getstate()), "numpy": [np_state[0], np_state[1].tolist(), *np_state[2:]]})


def _set_rng_state(tensors: dict[str, torch.Tensor], meta: dict) -> None:
    torch.set_rng_state(tensors["torch"])
    random.setstate(_tuplify(meta["python"]))
    n = meta["numpy"]
    np.random.set_state((n[0], np.array(n[1], dtype=np.uint32), *n[2:]))


def _jsonable(x: Any) -> Any:
    return [_jsonable(v) for v in x] if isinstance(x, (tuple, list)) else x


def _tuplify(x: Any) -> Any:
    return tuple(_tuplify(v) for v in x) if isinstance(x, list) else x


# ---------------------------------------------------------------------- the loop
def train(cfg: TrainConfig, resume: bool = False, overwrite: bool = False, progress: bool = True,
          stop_after: int | None = None) -> Path:
    """Train and write the adapter to ``cfg.out``; returns that folder.

    ``stop_after`` ends the run after that many optimizer steps of this call
    (with a checkpoint), as if interrupted; used to test exact resumption.
    """
    t = Trainer(cfg, resume=resume, overwrite=overwrite)
    stop_at = cfg.steps if stop_after is None else min(cfg.steps, t.step + stop_after)
    interrupted = t.run_until(stop_at, progress)
    if interrupted or t.step < cfg.steps:
        path = t.checkpoint()
        t.close()
        if interrupted:
            raise Interrupted(
                f"training interrupted after step {t.step}/{cfg.steps}; checkpoint kept in {path}; "
                f"continue with the same command plus --resume"
            )
        return t.out
    t.save_result()
    t.close()
    return t.out


class Trainer:
    """One run of ``train``, in parts: the constructor sets it up, ``train_step`` runs one optimizer step,
    ``checkpoint`` saves the exact state to resume from, ``save_result`` writes the adapter (or model) and
    ``close`` detaches the methods and leaves the process group.  ``run_until`` is the loop around
    ``train_step``: progress bar, metrics.jsonl, periodic checkpoints, Ctrl-C."""

    def __init__(self, cfg: TrainConfig, resume: bool = False, overwrite: bool = False) -> None:
        """Setup: the accelerator, the output folder (or the resumed run's settings compared), the model with what
        it trains and the methods attached, the optimizer and schedule, the data; on resume, the latest checkpoint."""
        from lcx.adapters.peft_bridge import trainable_parameters
        from lcx.adapters import families
        from lcx.composition import attach, resolve_methods
        from lcx.models import load_model

        cfg.validate()
        self.cfg, self.out = cfg, Path(cfg.out)
        self.ckpt_root = self.out / CHECKPOINTS
        self.accel = accel = _accelerator(cfg)
        self.rank, self.world = accel.process_index, accel.num_processes
        if accel.is_main_process:
            _prepare_out(self.out, cfg, resume, overwrite)
        accel.wait_for_everyone()

        torch.manual_seed(cfg.seed)
        random.seed(cfg.seed)
        np.random.seed(cfg.seed)
        self.task = synthetic_task(cfg.data)
        model, self.tok = load_model(cfg.model, require_tokenizer=self.task is None, dtype=cfg.dtype)
        model.train()
        self.model = _trainable(model, cfg)  # unwrapped; ``ddp_model`` is what accelerate prepared
        methods = resolve_methods(cfg.methods, cfg.options)
        for m in methods:  # an adapter learns one length: what follows a request's length is fixed by --seq-len
            m.fix_length(families.context_window(self.model), cfg.seq_len)
            m.begin_training()
        self.run = attach(self.model, methods)
        self.run.seed = cfg.seed
        self.run.rank = self.rank  # per-process randomness in sampling stages (DDP)
        # FSDP2 (one process: nothing to shard): each process holds a shard of every parameter
        self.sharded = self.world > 1 and _fsdp_version(accel) == 2
        if self.sharded:
            # in place: its parameters become DTensors, this process's shards of them
            _shard(self.model, accel, keep_gathered=any(m.grads_through_cache for m in self.run.methods))
        self.params = [p for p in self.model.parameters() if p.requires_grad]
        self.names = list(trainable_parameters(self.model))
        # foreach: one fused pass over all tensors (torch picks the slow per-tensor loop on CPU by default)
        opt = torch.optim.AdamW(self.params, lr=cfg.lr, weight_decay=cfg.weight_decay, foreach=True)
        self.sched = torch.optim.lr_scheduler.LambdaLR(opt, _lr_lambda(cfg))

        if self.task is None:
            from lcx.data import load_documents, token_windows

            with accel.main_process_first():
                self.windows = token_windows(load_documents(cfg.data, cfg.text_field), self.tok, cfg.seq_len,
                                             concat=cfg.concat)
            self.n = len(self.windows)
        else:
            self.windows, self.n = None, 0
        self.order = "streams" if any(m.data_order == "streams" for m in self.run.methods) else "shuffle"

        self.step = 0  # optimizer steps done
        latest = _latest_checkpoint(self.ckpt_root) if resume else None
        if latest is not None:
            load = _load_sharded_checkpoint if self.sharded else _load_checkpoint
            self.step = load(latest, self.model, self.names, opt, self.sched, self.rank, self.run.train_state, self.world)
            if self.step > cfg.steps:  # it would save the checkpoint's weights as a run of cfg.steps
                raise LcxError(f"--resume: the latest checkpoint ({str(latest)!r}) is at step {self.step}, past "
                               f"--steps {cfg.steps}; a run can be extended, not shortened: pass --steps {self.step} "
                               f"or more")
            if accel.is_main_process:
                _trim_metrics(self.out / METRICS, self.step)
        # FSDP2's model is sharded already, and its optimizer steps on the shards: nothing for accelerate to wrap
        self.ddp_model, self.opt = (self.model, opt) if self.sharded else accel.prepare(self.model, opt)

    def batch(self, micro: int) -> dict[str, torch.Tensor]:
        """Micro-batch ``micro`` of the current step, before the sampling stage: a pure function of (seed, step,
        micro, rank), which makes resuming exact."""
        cfg = self.cfg
        if self.task is not None:
            return self.task(random.Random(f"{cfg.seed}:{self.step}:{micro}:{self.rank}"), cfg.batch_size, cfg.seq_len)
        rows = rows_for(self.step, micro, self.rank, cfg, self.world, self.n, self.order)
        ids = self.windows[rows]["input_ids"]
        return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids.clone()}

    def train_step(self) -> dict[str, Any]:
        """One optimizer step over ``grad_accum`` micro-batches (sampling stage, loss terms, backward); returns its
        metrics record: the loss terms averaged over micro-batches and processes, the learning rate, the time."""
        cfg, accel, run = self.cfg, self.accel, self.run
        t0 = time.perf_counter()
        sums: dict[str, float] = {}
        for micro in range(cfg.grad_accum):
            batch = self.batch(micro)
            batch = run.hook.lcx_sample(run=run, batch=batch, step=self.step) or batch
            batch = {k: v.to(accel.device) if torch.is_tensor(v) else v for k, v in batch.items()}
            with accel.autocast():  # bf16 autocast when --bf16 (a no-op otherwise)
                terms = _loss_terms(run, self.ddp_model, batch)
            loss = sum(terms.values()) / cfg.grad_accum
            # FSDP2 reduce-scatters each micro-batch's gradients into the sharded ones (its no_sync would hold them
            # unsharded until the last micro-batch)
            last = micro == cfg.grad_accum - 1
            ctx = contextlib.nullcontext() if last or self.sharded else accel.no_sync(self.ddp_model)
            with ctx:
                accel.backward(loss)
            for k, v in terms.items():
                sums[k] = sums.get(k, 0.0) + float(v.detach()) / cfg.grad_accum
        if self.sharded:
            _reshard(self.model)
        if cfg.max_grad_norm > 0:
            accel.clip_grad_norm_(self.params, cfg.max_grad_norm)
        self.opt.step()
        self.sched.step()
        self.opt.zero_grad(set_to_none=True)
        self.step += 1
        reduced = {k: float(accel.reduce(torch.tensor(v), reduction="mean")) for k, v in sums.items()}
        return {"step": self.step, "loss": sum(reduced.values()), **{f"loss/{k}": v for k, v in reduced.items()},
                "lr": self.sched.get_last_lr()[0], "seconds": round(time.perf_counter() - t0, 4),
                **{f"state/{k}": v for k, v in run.train_state.items()
                   if isinstance(v, (int, float, bool, str))}}  # scalars only: histories stay in checkpoints

    def checkpoint(self) -> Path:
        """Save the state after the current step (trainable weights, optimizer, schedule, random generators, the
        methods' training state) as ``checkpoints/step-N``, which ``--resume`` continues from exactly."""
        save = _save_sharded_checkpoint if self.sharded else _save_checkpoint
        return save(self.ckpt_root, self.step, self.model, self.names, self.opt, self.sched, self.cfg, self.accel,
                    self.run.train_state)

    def run_until(self, stop_at: int, progress: bool = True) -> bool:
        """Train up to step ``stop_at``: each step recorded in metrics.jsonl, a checkpoint every ``save_every``
        steps (the last step's is the caller's).  Returns whether the run was asked to stop: Ctrl-C (SIGINT) or
        SIGTERM stops at the next step boundary, so the checkpoint is exact; a second Ctrl-C interrupts at once."""
        from tqdm.auto import tqdm

        cfg, accel = self.cfg, self.accel
        bar = tqdm(total=cfg.steps, initial=self.step, desc="train", disable=not (progress and accel.is_main_process))
        metrics_f = open(self.out / METRICS, "a") if accel.is_main_process else None
        stop = {"requested": False}

        def request_stop(signum, frame):
            if stop["requested"]:
                raise KeyboardInterrupt
            stop["requested"] = True
            if accel.is_main_process:
                print(f"\nstopping after step {self.step + 1} (Ctrl-C again to abort without a checkpoint)", flush=True)

        handlers = {}
        for sig in (signal.SIGINT, signal.SIGTERM):
            try:
                handlers[sig] = signal.signal(sig, request_stop)
            except ValueError:  # not the main thread
                pass
        try:
            while self.step < stop_at:
                requested = float(stop["requested"])
                if self.world > 1:  # every rank stops at the same step
                    requested = float(accel.reduce(torch.tensor(requested), reduction="sum"))
                if requested:
                    return True
                record = self.train_step()
                if metrics_f:
                    metrics_f.write(json.dumps(record) + "\n")
                    metrics_f.flush()
                bar.update(1)
                bar.set_postfix({k.split("/")[-1]: f"{v:.4f}" for k, v in record.items() if k.startswith("loss")})
                if cfg.save_every and self.step % cfg.save_every == 0 and self.step < cfg.steps:
                    self.checkpoint()
        finally:
            bar.close()
            if metrics_f:
                metrics_f.close()
            for sig, h in handlers.items():
                signal.signal(sig, h)
        return stop["requested"]

    def save_result(self) -> None:
        """Write the trained adapter (with ``--full all``, the model folder) to the output folder.  When that
        fails (a full disk, ...), the trained state is kept in a checkpoint and the error says how to finish."""
        from lcx.adapters.peft_bridge import save_adapter, save_full_model

        cfg, accel = self.cfg, self.accel
        accel.wait_for_everyone()
        failed = None
        model = self._gathered() if self.sharded else accel.unwrap_model(self.ddp_model)
        if accel.is_main_process:
            extra = {"training": dataclasses.asdict(cfg), "steps_done": self.step}
            try:
                if cfg.full_model:
                    save_full_model(model, self.out, methods=self.run.describe()["methods"], extra=extra,
                                    tokenizer=self.tok)
                else:
                    save_adapter(model, self.out, methods=self.run.describe()["methods"], extra=extra)
            except Exception as e:  # disk full, ...: the trained state must not go with it
                if self.world > 1:
                    raise
                failed = e
        if failed is not None:
            path = self.checkpoint()
            raise LcxError(f"writing the result to {str(self.out)!r} failed ({failed}); the trained state is kept in "
                           f"{path}: fix the cause and run the same command plus --resume (it only writes the "
                           f"result)") from failed

    def _gathered(self):
        """FSDP2: the trained model whole, on the main process (None on the others): the base model loaded again
        with the run's trainable modules (as the run set it up), each trained parameter all-gathered into it in
        turn, so no process ever holds more than one whole parameter besides it.  A collective: every process
        calls it."""
        from lcx.models import load_model

        whole = None
        if self.accel.is_main_process:
            base, _ = load_model(self.cfg.model, require_tokenizer=False, dtype=self.cfg.dtype)
            whole = _trainable(base, self.cfg)
            mine = dict(whole.named_parameters())
            missing = [n for n in self.names if n not in mine]
            if missing:  # every process must still take part in the gathers below: report after them
                whole = LcxError(f"the trained parameter {missing[0]!r} has no place in the model loaded again to "
                                 f"write the result; this is a bug in lcx, please report it")
        shards = dict(self.model.named_parameters())
        for n in self.names:
            full = shards[n].full_tensor()  # (all-gather)
            if isinstance(whole, torch.nn.Module):
                with torch.no_grad():
                    mine[n].copy_(full)
        if isinstance(whole, LcxError):
            raise whole
        return whole

    def close(self) -> None:
        """Detach the methods and leave the process group."""
        self.run.detach()
        # the DDP wrapper goes before the process group (see _end); FSDP2's units still hold the group when
        # destroy_process_group shuts it down, and no such exit has aborted or hung (bench/fsdp_teardown.py)
        self.ddp_model = None
        _end(self.accel)


def _accelerator(cfg: TrainConfig):
    """An accelerate ``Accelerator`` for the run's precision; refused under FSDP version 1, DeepSpeed and Megatron."""
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState
    from accelerate.utils import DistributedType

    # accelerate keeps mixed precision in a process-wide singleton; forget the previous run's choice so
    # train() can be called again with another precision (the process group, if any, is kept).
    AcceleratorState._reset_state()
    # half-precision weights compute under autocast, so float32 trained parameters mix with them
    mixed = "bf16" if cfg.bf16 or cfg.dtype == "bfloat16" else "fp16" if cfg.dtype == "float16" else "no"
    accel = Accelerator(gradient_accumulation_steps=1, mixed_precision=mixed, cpu=not torch.cuda.is_available())
    runs_under = ("lcx train runs under DDP (configs/accelerate/ddp-2proc.yaml) or FSDP2 "
                  "(configs/accelerate/fsdp2-2proc.yaml)")
    if accel.distributed_type in (DistributedType.DEEPSPEED, DistributedType.MEGATRON_LM):
        engine = accel.distributed_type.name
        raise LcxError(f"{runs_under}, not {engine}: {engine}'s engine owns the model and optimizer and writes "
                       f"checkpoints of its own, which lcx's exact resume does not read; to shard the parameters and "
                       f"optimizer state, launch with the FSDP2 config")
    version = _fsdp_version(accel)
    if version not in (None, 2):
        raise LcxError(f"{runs_under}, not FSDP version {version}: lcx shards with FSDP2 (torch's fully_shard), whose "
                       f"parameters keep their names and shapes for its checkpoints; set fsdp_version: 2 in the "
                       f"accelerate config's fsdp_config")
    return accel


def _fsdp_version(accel) -> int | None:
    """The FSDP version the launch asked for (accelerate config ``distributed_type: FSDP``), None without FSDP.
    On a machine without GPUs accelerate runs such a config as plain data parallelism (its FSDP wants a GPU), so
    the request is read from the settings ``accelerate launch`` passes in the environment."""
    from accelerate.utils import DistributedType

    plugin = getattr(getattr(accel, "state", None), "fsdp_plugin", None)
    if plugin is not None:
        return int(plugin.fsdp_version)
    if accel.distributed_type == DistributedType.FSDP or os.environ.get("ACCELERATE_USE_FSDP", "").lower() == "true":
        return int(os.environ.get("FSDP_VERSION", "1"))  # accelerate's default
    return None


def _shard(model, accel, keep_gathered: bool = False) -> None:
    """FSDP2, in place: every transformer block one unit (its parameters all-gathered for its forward and again
    for its backward, its gradients reduce-scattered), the rest (embeddings, final norm, head) the root's unit.
    The blocks are the accelerate config's ``fsdp_transformer_layer_cls_to_wrap``, else the model's own
    ``_no_split_modules``; ``fsdp_reshard_after_forward`` is honoured.  Every process must hold the same weights
    before (the same seed made them).

    With ``keep_gathered`` (a method with ``grads_through_cache``), a block's parameters, once gathered in the
    backward pass, stay gathered until the step's backward passes end (``_reshard`` frees them before the
    optimizer steps): its loss reaches a block's weights through the keys and values an earlier forward left in
    a cache (focusllm's candidates), a path FSDP2's hooks, on each block's inputs and outputs, do not see, so they
    would free the weights after the block's own backward and that later gradient would read freed memory.
    Otherwise each block is freed after its own backward, as FSDP2 does.  Gradients and optimizer state are
    always sharded."""
    from accelerate.utils import FullyShardedDataParallelPlugin
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    plugin = getattr(accel.state, "fsdp_plugin", None) or FullyShardedDataParallelPlugin()  # from the environment
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    names = plugin.transformer_cls_names_to_wrap or getattr(base, "_no_split_modules", None) or []
    blocks = [m for m in model.modules() if type(m).__name__ in set(names)]
    mesh = init_device_mesh(accel.device.type, (accel.num_processes,))
    reshard = plugin.reshard_after_forward if isinstance(plugin.reshard_after_forward, bool) else True
    for block in blocks:
        fully_shard(block, mesh=mesh, reshard_after_forward=reshard)
    fully_shard(model, mesh=mesh)  # the root keeps its parameters gathered between forward and backward
    if keep_gathered:
        model.set_reshard_after_backward(False)  # every unit (see above)


def _reshard(model) -> None:
    """Free the parameters FSDP2 gathered for the backward passes (``_shard``): before the optimizer steps, which
    updates the shards, so the next forward gathers the new values."""
    from torch.distributed.fsdp import FSDPModule

    for m in model.modules():
        if isinstance(m, FSDPModule):
            m.reshard()


def _trainable(model, cfg: TrainConfig):
    """``model`` with what the run trains: every weight (``--full all``), the ``--init-adapter``'s LoRA, or a fresh
    LoRA (plus the ``--full`` modules); the trained parameters in float32."""
    from lcx.adapters.peft_bridge import add_adapter
    from lcx.registry import registry

    if cfg.full_model:  # from scratch / full fine-tuning: no adapter, every weight trains
        peft_model = model.requires_grad_(True)
    elif cfg.init_adapter:
        peft_model = _from_adapter(model, cfg)
    else:
        roles = tuple(cfg.lora_roles) if cfg.lora_roles else _method_roles(cfg.methods, registry())
        peft_model = add_adapter(model, roles=roles, rank=cfg.lora_rank, modules_to_save=cfg.full or None)
    for p in peft_model.parameters():
        if p.requires_grad and p.dtype != torch.float32:  # float32 master weights: AdamW's updates need the range
            p.data = p.data.float()
    return peft_model


def _end(accel) -> None:
    """Leave the process group together: a rank exiting with its (gloo) group alive can abort at
    interpreter exit (seen once in CI: rank 1 SIGABRT after a finished 2-process run).

    The DDP wrapper must be gone (the caller drops its reference; here accelerate's, then a gc pass)
    before the group is destroyed: its C++ Reducer holds the group, and were the Reducer the last
    holder, freeing it (when train() returns) would run ~ProcessGroupGloo, which joins gloo's worker
    threads while holding the GIL, while a worker still tearing down the last collective waits for
    the GIL to free a tensor: a deadlock, the rank never exits (the DDP test's intermittent hang).
    Freed here, the group's last holder is its Python object, whose destructor releases the GIL."""
    if accel.num_processes > 1:
        accel.wait_for_everyone()
        accel.free_memory()  # accelerate's reference to the DDP wrapper; gc.collect() for any cycle
        accel.end_training()


def synthetic_task(data: list[str]) -> Batches | None:
    """The batches of the synthetic task ``data`` names (``task:NAME[:ARG...]``, a ``lcx.data.Task`` a plugin
    registers with ``lcx_register_tasks``), or None when ``data`` names files."""
    tasks = [d for d in data if str(d).startswith("task:")]
    if not tasks:
        return None
    if len(data) != 1:
        raise LcxError(f"a synthetic task trains alone: give --data {tasks[0]} without other data")
    from lcx.registry import registry

    name, *args = tasks[0].split(":")[1:]
    return registry().task(name).make(args)


def _loss_terms(run, model, batch) -> dict[str, torch.Tensor]:
    results = run.hook.lcx_loss(run=run, model=model, batch=batch)
    terms: dict[str, torch.Tensor] = {}
    for r in results:
        for k, v in (r or {}).items():
            if k in terms:
                raise LcxError(f"two methods return a loss term named {k!r}; rename one")
            terms[k] = v
    if not terms:
        model_inputs = {k: v for k, v in batch.items() if k in ("input_ids", "attention_mask", "labels", "position_ids")}
        terms["lm"] = model(**model_inputs).loss
    return terms


def _method_roles(methods: list[str], reg) -> tuple[str, ...]:
    roles: list[str] = []
    for m in methods:
        for r in reg.get(m).lora_roles:
            if r not in roles:
                roles.append(r)
    return tuple(roles) or ("q", "k", "v", "o")


def _from_adapter(model, cfg: TrainConfig):
    """The adapter ``cfg.init_adapter`` loaded trainable onto ``model`` (its base model checked), in training mode."""
    from lcx.adapters.peft_bridge import load_adapter

    peft_model, _ = load_adapter(model, cfg.init_adapter, trainable=True)
    rank = peft_model.peft_config["default"].r
    if rank != cfg.lora_rank:
        raise LcxError(f"--init-adapter {cfg.init_adapter!r} has LoRA rank {rank}, not --lora-rank {cfg.lora_rank}; "
                       f"pass --lora-rank {rank}")
    return peft_model.train()


def _lr_lambda(cfg: TrainConfig) -> Callable[[int], float]:
    def f(step: int) -> float:
        if cfg.warmup and step < cfg.warmup:
            return (step + 1) / cfg.warmup
        if cfg.schedule == "cosine":
            t = (step - cfg.warmup) / max(1, cfg.steps - cfg.warmup)
            return 0.5 * (1 + math.cos(math.pi * min(1.0, t)))
        return 1.0

    return f


#: What a resumed run must share with the interrupted one (``steps`` may grow: a run is extended; ``out``,
#: ``save_every`` and ``keep_checkpoints`` change nothing it computes).
RESUME_FIELDS = ("model", "methods", "options", "seq_len", "batch_size", "grad_accum", "seed", "lr", "warmup",
                 "schedule", "weight_decay", "max_grad_norm", "lora_rank", "lora_roles", "init_adapter", "data",
                 "full", "bf16", "concat", "text_field", "dtype")


def _inputs_inside(out: Path, cfg: TrainConfig) -> str | None:
    """The first of the run's inputs (model folder, --init-adapter, data) that is ``out`` or lies inside it."""
    here = out.resolve()
    for what, p in (("the model", cfg.model), ("--init-adapter", cfg.init_adapter), *(("data", d) for d in cfg.data)):
        if p and Path(p).exists() and (Path(p).resolve() == here or here in Path(p).resolve().parents):
            return f"{what} {p!r}"
    return None


def _prepare_out(out: Path, cfg: TrainConfig, resume: bool, overwrite: bool) -> None:
    if resume:
        if not (out / CHECKPOINTS).is_dir() or _latest_checkpoint(out / CHECKPOINTS) is None:
            raise LcxError(f"--resume: {str(out)!r} has no checkpoint to resume from; start without --resume")
        saved = json.loads((out / CONFIG).read_text())
        defaults = dataclasses.asdict(TrainConfig(model="", data=[], out=""))  # fields older runs did not record
        for k in RESUME_FIELDS:
            if saved.get(k, defaults[k]) != getattr(cfg, k):
                raise LcxError(
                    f"--resume: {k} differs from the interrupted run ({saved.get(k, defaults[k])!r} there, "
                    f"{getattr(cfg, k)!r} now); resume with the same settings"
                )
        return
    inside = _inputs_inside(out, cfg)
    if inside is not None:
        raise LcxError(f"--out {str(out)!r} holds {inside}, which this run reads; write the run to another folder")
    content = [p.name for p in out.iterdir()] if out.is_dir() else []
    # a config and no metrics yet: a run that failed while setting up or in its first step (its batch refused)
    unstarted = set(content) <= {CONFIG, METRICS} and not (METRICS in content and (out / METRICS).stat().st_size)
    if content and not unstarted:
        if not overwrite:
            raise LcxError(f"output folder {str(out)!r} exists and is not empty; pass --overwrite to replace it or --resume to continue")
        if CONFIG not in content:
            raise LcxError(f"--overwrite: {str(out)!r} is not the folder of an lcx train run (no {CONFIG}); it is not "
                           f"deleted: name a new or empty folder with --out")
        shutil.rmtree(out)
    out.mkdir(parents=True, exist_ok=True)
    (out / CONFIG).write_text(json.dumps(dataclasses.asdict(cfg), indent=2))


def _checkpoints(root: Path) -> list[Path]:
    """Finished checkpoints (``step-N`` with its meta.json, written last), oldest first; a crash's
    leftovers (``step-N.tmp``, ``step-N.old``) are not checkpoints."""
    if not root.is_dir():
        return []
    done = [p for p in root.iterdir() if re.fullmatch(r"step-\d+", p.name) and (p / "meta.json").exists()]
    return sorted(done, key=lambda p: int(p.name.split("-")[1]))


def _latest_checkpoint(root: Path) -> Path | None:
    done = _checkpoints(root)
    return done[-1] if done else None


def _trim_metrics(path: Path, step: int) -> None:
    """On resume: keep the metrics of steps up to the checkpoint, so steps redone after a crash are
    not recorded twice (and a line cut short by the crash goes)."""
    if not path.exists():
        return
    from lcx.io import write_text

    keep = []
    for line in path.read_text().splitlines():
        try:
            if int(json.loads(line)["step"]) <= step:
                keep.append(line)
        except (ValueError, KeyError, TypeError):
            continue
    write_text("".join(k + "\n" for k in keep), path)


def _clear_stale_checkpoints(root: Path) -> None:
    """Create ``root``; remove a killed run's half-written (.tmp) or replaced (.old) checkpoint folders."""
    root.mkdir(parents=True, exist_ok=True)
    for stale in root.glob("step-*.*"):
        if stale.suffix in (".tmp", ".old") and stale.is_dir():
            shutil.rmtree(stale, ignore_errors=True)


def _prune_checkpoints(root: Path, keep: int) -> None:
    """Keep the newest ``keep`` checkpoints (all of them when ``keep`` <= 0)."""
    for old in _checkpoints(root)[:-keep] if keep > 0 else []:
        shutil.rmtree(old, ignore_errors=True)


def _save_checkpoint(root: Path, step: int, model, names: list[str], opt, sched, cfg: TrainConfig, accel,
                     method_state: dict | None = None) -> Path:
    dest = root / f"step-{step}"
    rank = accel.process_index
    accel.wait_for_everyone()
    if accel.is_main_process:
        params = dict(accel.unwrap_model(model).named_parameters())

        def write(d: Path) -> None:
            save_file({n: params[n].detach().contiguous().cpu() for n in names}, str(d / "trainable.safetensors"))
            opt_t, opt_meta = _optimizer_to_files(opt.optimizer if hasattr(opt, "optimizer") else opt)
            save_file(opt_t, str(d / "optimizer.safetensors"))
            rng_t, rng_meta = _rng_state()
            save_file(rng_t, str(d / f"rng-{rank}.safetensors"))
            sd = {k: v for k, v in sched.state_dict().items() if k != "lr_lambdas"}
            (d / "meta.json").write_text(json.dumps(
                {"step": step, "optimizer": opt_meta, "scheduler": sd, "rng": {str(rank): rng_meta},
                 "world_size": accel.num_processes, "method_state": method_state or {}}, indent=2))

        _clear_stale_checkpoints(root)
        _atomic_dir_write(dest, write)
        _prune_checkpoints(root, cfg.keep_checkpoints)
    accel.wait_for_everyone()
    return dest


def _load_checkpoint(path: Path, model, names: list[str], opt, sched, rank: int, method_state: dict | None = None,
                     world: int = 1) -> int:
    from lcx.io import load_safetensors, read_json_file

    older = [p.name for p in _checkpoints(path.parent) if p != path]
    fix = (f"delete the folder {str(path)!r} to resume from {older[-1]}" if older else
           "start the run again without --resume")
    meta = read_json_file(path / "meta.json", fix)
    if meta.get("sharded"):
        raise LcxError(f"checkpoint {str(path)!r} was written sharded, by an FSDP2 run of {meta.get('world_size')} "
                       f"processes, and this run is not sharded; resume it with the launch that wrote it "
                       f"(configs/accelerate/fsdp2-2proc.yaml)")
    if method_state is not None and meta.get("method_state"):
        method_state.update(meta["method_state"])  # e.g. where a sampling stage's schedule stands
    weights = load_safetensors(path / "trainable.safetensors", fix)
    missing = set(names) - set(weights)
    if missing:
        raise LcxError(f"checkpoint {str(path)!r} lacks {sorted(missing)[0]!r}: it was written by another setup")
    params = dict(model.named_parameters())
    with torch.no_grad():
        for n in names:
            params[n].copy_(weights[n])
    saved_world = meta.get("world_size")
    if saved_world is not None and saved_world != world:
        raise LcxError(f"checkpoint {str(path)!r} was written by {saved_world} processes, and this run has {world}: the "
                       f"batches would differ; resume with {saved_world} (accelerate launch --num_processes {saved_world})")
    try:
        _optimizer_from_files(opt, load_safetensors(path / "optimizer.safetensors", fix), meta["optimizer"])
    except ValueError as e:  # torch: parameter groups of another size
        raise LcxError(f"checkpoint {str(path)!r}: its optimizer state does not fit this run's trainable parameters "
                       f"({e}); resume with the settings it was written with") from None
    sd = sched.state_dict()
    sd.update(meta["scheduler"])
    sched.load_state_dict(sd)
    rng_file = path / f"rng-{rank}.safetensors"
    if rng_file.exists() and str(rank) in meta["rng"]:
        _set_rng_state(load_safetensors(rng_file, fix), meta["rng"][str(rank)])
    return int(meta["step"])


# ---------------------------------------------------------------------- FSDP2: sharded checkpoints (DCP)
#: A sharded checkpoint's folder of shards: ``shard-0000R-model-00001-of-00001.safetensors``, one per process
#: R (1-based), written by torch.distributed.checkpoint; each file's header says where its pieces sit in the
#: whole tensors, so a run can load them onto another sharding.
SHARDS = "shards"


def _sharded_state(model, names: list[str], opt) -> tuple[dict[str, torch.Tensor], dict | None]:
    """What a sharded checkpoint holds: ``model.<name>`` for each trainable parameter and ``optim.<name>.<key>``
    for its optimizer state (DTensors: this process's shards; AdamW's step is a plain tensor, the same
    everywhere, written once), keyed by parameter name (torch's ``get_optimizer_state_dict``, returned too: its
    parameter groups go to meta.json).  An optimizer that has not stepped has no state (None): torch's
    ``get_optimizer_state_dict`` would make a zero one, one step old, and the resumed run would differ."""
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    params = dict(model.named_parameters())
    state = {f"model.{n}": params[n] for n in names}
    if not opt.state:
        return state, None
    osd = get_optimizer_state_dict(model, opt)
    for n, st in osd["state"].items():
        for k, v in st.items():
            state[f"optim.{n}.{k}"] = v
    return state, osd


def _save_sharded_checkpoint(root: Path, step: int, model, names: list[str], opt, sched, cfg: TrainConfig, accel,
                             method_state: dict | None = None) -> Path:
    """A checkpoint of an FSDP2 run, as ``step-N`` of a whole one (the same meta.json, written last, and atomic
    rename), but every process writes its own shards: ``shards/`` (see ``SHARDS``) and ``rng-R.safetensors``
    (each process's generators; meta.json keeps their Python and NumPy parts)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import HuggingFaceStorageWriter

    dest = root / f"step-{step}"
    tmp = dest.with_name(dest.name + ".tmp")
    rank = accel.process_index
    accel.wait_for_everyone()
    if accel.is_main_process:
        _clear_stale_checkpoints(root)
        tmp.mkdir()
    accel.wait_for_everyone()
    state, osd = _sharded_state(model, names, opt)
    dcp.save(state, storage_writer=HuggingFaceStorageWriter(str(tmp / SHARDS), save_distributed=True))
    rng_t, rng_meta = _rng_state()
    save_file(rng_t, str(tmp / f"rng-{rank}.safetensors"))
    rng_metas: list = [None] * accel.num_processes
    torch.distributed.all_gather_object(rng_metas, rng_meta)  # every process's, in rank order
    if accel.is_main_process:
        sd = {k: v for k, v in sched.state_dict().items() if k != "lr_lambdas"}
        optimizer = {"param_groups": osd["param_groups"] if osd else None}
        (tmp / "meta.json").write_text(json.dumps(
            {"step": step, "sharded": True, "optimizer": optimizer, "scheduler": sd,
             "rng": {str(r): m for r, m in enumerate(rng_metas)}, "world_size": accel.num_processes,
             "method_state": method_state or {}}, indent=2))
        _commit_dir(tmp, dest)
        _prune_checkpoints(root, cfg.keep_checkpoints)
    accel.wait_for_everyone()
    return dest


def _load_sharded_checkpoint(path: Path, model, names: list[str], opt, sched, rank: int,
                             method_state: dict | None = None, world: int = 1) -> int:
    """Restore ``_save_sharded_checkpoint``'s state into the sharded model and its optimizer; returns its step.
    A collective: every process calls it."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import HuggingFaceStorageReader
    from torch.distributed.checkpoint.state_dict import set_optimizer_state_dict

    from lcx.io import load_safetensors, read_json_file

    older = [p.name for p in _checkpoints(path.parent) if p != path]
    fix = (f"delete the folder {str(path)!r} to resume from {older[-1]}" if older else
           "start the run again without --resume")
    meta = read_json_file(path / "meta.json", fix)
    if not meta.get("sharded"):
        raise LcxError(f"checkpoint {str(path)!r} was written whole (DDP or one process), and this run is sharded "
                       f"(FSDP2); resume it with the launch that wrote it")
    saved_world = meta.get("world_size")
    if saved_world != world:
        raise LcxError(f"checkpoint {str(path)!r} was written by {saved_world} processes, and this run has {world}: the "
                       f"batches would differ; resume with {saved_world} (accelerate launch --num_processes {saved_world})")
    if method_state is not None and meta.get("method_state"):
        method_state.update(meta["method_state"])
    if meta["optimizer"]["param_groups"] is not None:  # the saved run had stepped: make the state to load into
        from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

        get_optimizer_state_dict(model, opt)
    state, osd = _sharded_state(model, names, opt)
    try:
        dcp.load(state, storage_reader=HuggingFaceStorageReader(str(path / SHARDS)))
    except Exception as e:  # a missing or cut shard, another setup's parameter names (DCP wraps them in its own error)
        raise LcxError(f"checkpoint {str(path)!r}: its shards do not load ({str(e).splitlines()[0][:300]}); {fix}") from None
    if osd is not None:
        set_optimizer_state_dict(model, opt, {"state": osd["state"], "param_groups": meta["optimizer"]["param_groups"]})
    sd = sched.state_dict()
    sd.update(meta["scheduler"])
    sched.load_state_dict(sd)
    _set_rng_state(load_safetensors(path / f"rng-{rank}.safetensors", fix), meta["rng"][str(rank)])
    return int(meta["step"])
