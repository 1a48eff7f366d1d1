"""fot: Focused Transformer / LongLLaMA memory attention at inference (Tworkowski et al. 2023).

The prompt is ingested ``chunk`` tokens at a time (``chunk=0``: ``local``, FoT's
windows; smaller chunks give every query a sliding local context; the chunking
stage).  Every layer keeps only its local window in the cache; the chosen memory
layers move the tokens that leave it into a kNN memory (the memory stage), and
attend to their local keys plus the top-``k`` memory keys per query and head
under one softmax (the attention stage).  The defaults keep the model's whole
window local (memory adds only what truncation drops), the prompt's first tokens
beside it, memory keys placed at a fixed distance, and read only where they score
near the best local key (a gate calibrated on the model's first use); FoT's own
settings are ``-o fot.local=2048 -o fot.chunk=0 -o fot.sinks=0 -o fot.positions=first
-o fot.gate=off``.  Training-free, a memory only helps in
the layers that copy from far context: ``lcx analyze retrieval`` finds them.  Generation continues with
``model.generate()``; new tokens join memory as the local window slides.

Training (``lcx train --method fot``) is FoT's crossbatch procedure, the sampling,
loss and attention stages of ``crossbatch.py``: memory layers attend,
differentiably, to earlier contexts of their own document and of ``d - 1`` others.
"""

from __future__ import annotations

import copy
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import torch

from lcx import auto
from lcx.adapters import families
from lcx.errors import LcxError
from lcx.hookspecs import hookimpl
from lcx.limits import kv_dims
from lcx.masking import kept_positions, to_additive, visible_mask
from lcx.plugins.fot.memory import (KINDS, SEARCH_BATCH, SHARD_KINDS, MemoryStore, StoreConfig, bytes_per_store, load_memory,
                                    make_store, search_bytes)
from lcx.method import Method, option
from lcx.plan import Plan
from lcx.plugins.fot import crossbatch
from lcx.plugins.fot.attention import memory_attention
from lcx.plugins.fot.cache import FoTLayer, fot_cache
from lcx.plugins.fot.ray_memory import NO_HOST, STARTS_HERE, split_address


GATE_RULE = -1.0  # gate=auto where it cannot be calibrated (no model folder, or no probe answered)
#: How memory_layers=auto measures the layers that retrieve (``lcx analyze retrieval``'s inputs; the length is
#: capped at the model's window).
RETRIEVAL_PROBE = {"probe": "retrieval", "length": 4096, "depths": [0.2, 0.5, 0.8], "keys": 1, "seed": 12345,
                   "threshold": 0.15}


@dataclass
class FoT(Method):
    name = "fot"
    description = "Focused Transformer memory attention: top-k keys of earlier windows from a kNN memory"
    requires = frozenset({"attention_interface", "rotary"})
    data_order = "streams"  # crossbatch: a document stays in its batch row across steps
    fixed_by_training = ("positions", "fixed_distance")  # how memory keys are encoded is learned
    #: vLLM serves it inside its attention, a memory per request (served.py).
    serving = "attention"
    #: Multi-document mode reads a memory built by `lcx memory build` (commands.py): ``load_memory``.
    reads_memory = True
    reads_past_window = True
    #: What a document's later windows read of its earlier ones while `lcx memory build` encodes it (the store's
    #: search options are left out: a memory is read with another backend on purpose).
    shapes_memory = ("local", "chunk", "sinks", "positions", "fixed_distance", "dense", "k", "gate", "gate_sinks",
                     "memory_heads", "max_entries")

    memory_layers: str = option("auto", "memory layers: auto (on a model with sliding-window layers, its full-attention "
                                        "layers; else the layers `lcx analyze retrieval` finds retrieving, measured "
                                        "once and cached beside the model; 3 at 1/4, 1/2, 3/4 depth where it finds "
                                        "none or the model has no folder), all, or indices like 7,15,22")
    memory_heads: str = option("all", "query heads of the memory layers that read memory (the others attend to their "
                                      "local keys only): all; auto (the heads `lcx analyze retrieval` finds putting "
                                      "at least its threshold of their attention on a needle, measured once and "
                                      "cached beside the model; all where the model has no folder); or LAYER:HEAD "
                                      "pairs like 7:6,14:1")
    k: int = option(32, "memory keys retrieved per query and head")
    # defaults: memory only adds what truncation to the window drops and reads only near-best keys (see
    # results/fot/ppl-safe); ``before``: FoT's own, which records written without these options ran with
    local: int = option(0, "local context: keys each layer keeps in its cache (a sliding window); 0 = the model's window (memory then holds only what truncation to the window would drop)", before=2048)
    chunk: int = option(256, "tokens ingested per forward pass, at most local (a larger value is cut to local); 0 = local (FoT); smaller keeps every query's local context >= local - chunk", before=0)
    sinks: int = option(4, "the prompt's first tokens every layer keeps beside its local window instead of moving them to memory (attention sinks, as streaming's); 0 = none (FoT)", before=0)
    positions: Literal["first", "fixed", "none"] = option("fixed", "memory key positions: first (as if at the local window's start, LongLLaMA), fixed (one distance: fixed_distance), none", before="first")
    fixed_distance: int = option(4096, "distance of every memory key in positions=fixed; 0 = local", before=0)
    dense: bool = option(False, "attend to all of memory (no kNN); exact but linear in memory size")
    backend: str = option("torch", f"kNN backend: {', '.join(KINDS)} (ray: the memory dealt over Ray actors, "
                                   f"see shards; pip install 'lcx[dist]')")
    shards: int = option(1, "backend=ray: shards, one Ray actor each; entries are dealt round-robin, a search asks all")
    shard_backend: str = option("faiss-flat", f"backend=ray: the store each shard holds: {', '.join(SHARD_KINDS)}")
    ray_address: str = option("", "backend=ray: a running Ray cluster (host:port, ray://host:port, auto); empty: "
                                  "$RAY_ADDRESS, else a local Ray for this process")
    nlist: int = option(1024, "faiss-ivf: inverted lists per memory (layer, head)")
    nprobe: int = option(8, "faiss-ivf: lists searched per query (recall vs speed)")
    ivf_train: int = option(32768, "faiss-ivf: entries searched exactly before the lists are trained on them")
    max_entries: int = option(0, "memory entries kept per layer and head (oldest evicted first); 0 = unbounded")
    mode: Literal["single", "multi"] = option("single", "single: memory cleared per input; multi: kept across inputs (documents)")
    gate: float | str = option("auto", "memory keys a query reads: only those scoring at least its best local key's score + GATE (a logit; 0: only keys that beat every local key; negative: a margin below it); off: all its k best; auto: the largest gate that keeps passkey probes' answers reading memory (off where none does), calibrated once per model and options (fot's first use takes three passkey forwards twice its local window long) and cached beside the model (-1 where the model has no folder or fot answers no probe)", before="off")
    gate_sinks: bool = option(True, "whether GATE's best local key may be a sink; false: the best of the window's own keys (a sink's score says how much a head attends nowhere, not how well a key matches)")
    block: int = option(256, "queries per block in memory attention (bounds peak memory)")
    # training (crossbatch; `lcx train --method fot`, training windows of (w + 1) * local tokens)
    d: int = option(1, "training: documents a memory layer sees (its own + d - 1 others as negatives)")
    w: int = option(1, "training: previous contexts per document in a row (rows hold w + 1 contexts of local tokens)")
    segments: str = option("", "training: POSITIVES:NEGATIVES per context, e.g. 0:0,1:1,2:1,3:0 (default j:(d-1)*j)")
    train_k: int = option(0, "training: memory keys each query attends to in crossbatch, its top-k by score (as kNN retrieval hands it at inference); 0 = all (FoT)")
    bank: int = option(0, "training: contexts of earlier steps kept per memory layer (no gradient); every query also attends to its bank_k best bank keys; 0 = none (FoT)")
    bank_k: int = option(32, "training: bank keys each query attends to, its top-k by score (as kNN retrieval at inference)")
    d_schedule: str = option("constant", "training: constant, step:N:D, acc:A:D[:N] (D once train accuracy over N steps >= A) or choice:D1,D2")

    def __post_init__(self) -> None:
        if self.k <= 0:
            raise ValueError(f"k must be > 0, got {self.k}")
        if self.train_k < 0:
            raise ValueError(f"train_k must be >= 0 (0 = every memory key), got {self.train_k}")
        if self.bank_k <= 0:
            raise ValueError(f"bank_k must be > 0, got {self.bank_k}")
        if self.bank < 0:
            raise ValueError(f"bank must be >= 0 (contexts of earlier steps kept as memory; 0 = none), got {self.bank}")
        if self.gate not in ("off", "auto") and isinstance(self.gate, str):
            raise ValueError(f"gate must be a number (a logit: 0, -2, ...), off or auto, got {self.gate!r}")
        if not self.gate_sinks and self.gate == "off":
            raise ValueError("gate_sinks=false says what a gate measures against, and gate is off; give a gate "
                             "(-o fot.gate=0) or drop gate_sinks")
        if self.local < 0 or self.block <= 0:
            raise ValueError(f"local must be >= 0 (0 = the model's window) and block > 0 (got local={self.local}, "
                             f"block={self.block})")
        if self.chunk < 0 or self.sinks < 0:
            raise ValueError(f"chunk and sinks must be >= 0 (got chunk={self.chunk}, sinks={self.sinks})")
        self._local_is_window = self.local == 0  # set per model by fit_window
        self._chunk_asked = self.chunk  # cut to each model's local window by fit_window
        if self.local:
            self._check_windows(ValueError)
        if self.positions not in ("first", "fixed", "none"):
            raise ValueError(f"positions must be first, fixed or none, got {self.positions!r}")
        if self.fixed_distance < 0:
            raise ValueError(f"fixed_distance must be >= 0 (0 = local), got {self.fixed_distance}")
        if self.shards < 1:
            raise ValueError(f"shards must be >= 1 (one Ray actor each), got {self.shards}")
        if self.backend != "ray" and (self.shards != 1 or self.ray_address):
            raise ValueError(f"{'shards' if self.shards != 1 else 'ray_address'} is an option of backend=ray (the "
                             f"memory on Ray actors); add -o fot.backend=ray, or drop it for backend={self.backend}")
        if self.ray_address not in NO_HOST:  # a typo refused here, not in a server's worker
            try:
                split_address(self.ray_address, "-o fot.ray_address")
            except LcxError as e:
                raise ValueError(str(e)) from None
        self.store_config().validate()
        crossbatch.parse_d_schedule(self.d_schedule)  # validates every field of the schedule
        self.crossbatch_layout(self.d)  # validates d, w and segments (against the largest d the schedule reaches)
        self.memory_heads = str(self.memory_heads).strip()
        parse_heads(self.memory_heads)  # validates LAYER:HEAD pairs (against the model at attach)
        self._auto_for: Path | None = None  # the model folder memory_layers=auto was measured on
        self._heads_auto_for: Path | None = None  # and memory_heads=auto
        self._gate_auto_for: Path | None = None  # and gate=auto
        self._gate_sinks_asked = self.gate_sinks  # what gate=auto calibrates with (it drops the option where off)
        self._trains = False  # lcx train attaches it: crossbatch attention reads no gate
        #: layer -> [(H, c) margins] while a calibration records them (calibrate.py); None otherwise
        self.record_margins: dict[int, list[torch.Tensor]] | None = None
        self._head_masks: dict[tuple[int, torch.device], torch.Tensor] = {}  # (layer, device) -> head_mask (cleared when the model changes)
        self._stores: dict[int, dict[tuple[int, int], MemoryStore]] | None = None  # multi-document memory
        self._shared: dict[int, dict[tuple[int, int], MemoryStore]] | None = None  # while a document is added

    # ------------------------------------------------------------------ configuration
    def _check_windows(self, error: type[Exception]) -> None:
        self.chunk = min(self._chunk_asked, self.local)
        if self.sinks >= self.local:
            raise error(f"sinks must be in 0..local - 1 ({self.local - 1}), got {self.sinks}")

    def fit_window(self, window: int) -> None:
        """local=0: the local window is the model's trained ``window`` (set per model; before anything reads it)."""
        if self._local_is_window:
            self.local = window
            self._check_windows(LcxError)

    def begin_training(self) -> None:
        self._trains = True

    def layer_indices(self, run) -> list[int]:
        return self.layers_of(families.num_layers(run.model, run.family), getattr(run.model.config, "layer_types", None))

    def resolve_auto(self, folder: Path, load) -> None:
        """memory_layers=auto on a model whose layers all attend fully: the layers that retrieve, by
        ``lcx analyze retrieval`` on its own passkey probes (seed 12345; no evaluation uses those keys);
        memory_heads=auto: the heads that retrieve, by the same analysis; gate=auto: calibrated on passkey probes
        with those layers and heads (``calibrate.py``)."""
        self._resolve_layers_and_heads(folder, load)
        if self._trains:  # gate=auto is kept as given: the adapter's use calibrates it
            return
        if self._gate_auto_for != folder and (self._gate_auto_for is not None or self.gate == "auto"):
            self._calibrate_gate(folder, load)

    def _calibrate_gate(self, folder: Path, load) -> None:
        from lcx.plugins.fot.calibrate import GATE_PROBE, calibrate_gate

        self.gate, self.gate_sinks, self._gate_auto_for = "auto", self._gate_sinks_asked, None
        config = json.loads((folder / "config.json").read_text())
        local = self.local or families.json_window(config)
        shaping = {*self.shapes_memory, "memory_layers"} - {"gate"}  # what the memory it reads depends on
        options = {**{k: v for k, v in self.to_options().items() if k in shaping}, "local": local}
        inputs = {**GATE_PROBE, "length": 2 * local, "fot": options}

        def gate_of(found) -> float | str | None:  # calibrate_gate's gate; None where it chose none
            gate = found.get("gate") if isinstance(found, dict) else None
            if gate == "off":
                return gate
            return float(gate) if isinstance(gate, (int, float)) and not isinstance(gate, bool) else None

        def describe(found) -> str:
            gate = gate_of(found)
            if gate is None:
                return f"fot: gate calibration: fot answered none of its passkey probes; gate {GATE_RULE:g} (auto's fallback)"
            answered = f"{found['answered']} of {len(found['probes'])} " if "answered" in found else ""
            if gate == "off":
                moot = "; gate_sinks=false dropped: it has no effect without a gate" if not self.gate_sinks else ""
                return (f"fot: gate off chosen by calibration (no gate keeps >= {GATE_PROBE['min_open']} memory heads "
                        f"open at every key token of the {answered}passkey probes it answered with the gate off)"
                        + moot)
            return (f"fot: gate {gate:g} chosen by calibration (the {answered}passkey probes answered "
                    f"from memory keep >= {GATE_PROBE['min_open']} memory heads open at each key token)")

        found = auto.measured(folder, "fot.gate", inputs,
                              lambda: calibrate_gate(*load(), options, 2 * local, GATE_PROBE), describe,
                              valid=lambda found: isinstance(found, dict) and (gate_of(found) is not None
                                                                               or found.get("gate", 0) is None))
        self.gate, self._gate_auto_for = (GATE_RULE if gate_of(found) is None else gate_of(found)), folder
        if self.gate == "off":
            self.gate_sinks = True  # moot without a gate, and refused beside gate=off where the options are rebuilt

    def _resolve_layers_and_heads(self, folder: Path, load) -> None:
        layers_auto = self._auto_for != folder and (self._auto_for is not None or str(self.memory_layers).strip() == "auto")
        heads_auto = self._heads_auto_for != folder and (self._heads_auto_for is not None or self.memory_heads == "auto")
        if not (layers_auto or heads_auto):
            return  # the user's choices, or measured on this model already
        config = json.loads((folder / "config.json").read_text())
        config = config.get("text_config", config)
        window = int(config.get("max_position_embeddings") or 0) or RETRIEVAL_PROBE["length"]
        inputs = {**RETRIEVAL_PROBE, "length": min(RETRIEVAL_PROBE["length"], window)}
        analysis: dict = {}

        def analyze(key: str) -> str:
            if not analysis:  # once for both options
                import random

                from lcx.analyze import retrieval_layers

                model, tokenizer = load()
                rng = random.Random(inputs["seed"])
                keys = [rng.randint(10000, 99999) for _ in range(inputs["keys"])]
                analysis.update(retrieval_layers(model, tokenizer, inputs["length"], inputs["depths"], keys,
                                                 inputs["threshold"], progress=True))
            return analysis[key]

        if layers_auto:
            self.memory_layers, self._auto_for = "auto", None
            if not any(t != "full_attention" for t in config.get("layer_types") or []):  # else the rule (layers_of)
                found = auto.measured(folder, "fot.memory_layers", inputs, lambda: analyze("suggested_memory_layers"),
                                      lambda found: f"fot: memory layers {found} chosen by retrieval analysis" if found
                                      else "fot: retrieval analysis found no retrieving layer; memory layers at 1/4, "
                                           "1/2, 3/4 depth")
                if found:
                    self.memory_layers, self._auto_for = found, folder
        if heads_auto:
            self._head_masks.clear()
            found = auto.measured(folder, "fot.memory_heads", inputs, lambda: analyze("suggested_memory_heads"),
                                  lambda found: f"fot: memory heads {found} chosen by retrieval analysis" if found
                                  else "fot: retrieval analysis found no retrieving head; every head reads memory")
            self.memory_heads, self._heads_auto_for = "auto", None
            if found:  # kept to the memory layers, so the value stands alone (exports, result files, lcx.attach)
                layers = self.layers_of(int(config["num_hidden_layers"]), config.get("layer_types"))
                kept = [(i, h) for i, h in parse_heads(found) if i in layers]
                if kept:
                    self.memory_heads = ",".join(f"{i}:{h}" for i, h in kept)
                    self._heads_auto_for = folder
                    idle = [i for i in layers if all(i != j for j, _ in kept)]
                    if idle:
                        auto.note(f"fot: memory layers {','.join(map(str, idle))} have no retrieving head: their "
                                  f"memory is kept but not read")
                else:
                    auto.note(f"fot: no retrieving head ({found}) is in a memory layer "
                              f"({','.join(map(str, layers))}); every head reads memory")

    def resolved(self, config: dict) -> dict:
        text = config.get("text_config", config)
        layers = self.layers_of(int(text["num_hidden_layers"]), text.get("layer_types"))
        out = {"memory_layers": ",".join(map(str, layers))}
        if self.memory_heads != "all":
            heads = self.heads_of(layers, int(text["num_attention_heads"]))
            out["memory_heads"] = "all" if heads is None else ",".join(f"{i}:{h}" for i in layers for h in heads[i])
        out["gate"] = "off" if self.gate_logit is None else self.gate_logit  # auto: calibrated, or its fallback
        return {**out, "local": families.json_window(config)} if self._local_is_window else out

    def reach(self, run, tokens: int, new: int, span: tuple[int, int]) -> tuple[bool, str]:
        if tokens - span[0] <= self.local - (self.chunk or self.local):
            return True, f"the key was in the local window ({self.local:,} tokens), which every layer reads"
        layers = self.layer_indices(run)
        return True, (f"the key was in memory, {tokens - span[0]:,} tokens from the end: only layers "
                      f"{','.join(map(str, layers))} read memory, each query its {self.k} best-matching keys")

    def layers_of(self, n: int, layer_types: list[str] | None = None) -> list[int]:
        """The memory layers of a model with ``n`` layers (``layer_types``: its config's, where it has them)."""
        spec = str(self.memory_layers).strip()
        if spec == "auto":
            full = [i for i, t in enumerate(layer_types or []) if t == "full_attention"]
            if 0 < len(full) < n:  # a sliding-window layer cannot read what its window dropped: memory breaks it
                return full
            return sorted({n // 4, n // 2, (3 * n) // 4})
        if spec == "all":
            return list(range(n))
        try:
            idx = sorted({int(x) for x in spec.split(",") if x.strip()})
        except ValueError:
            raise LcxError(f"memory_layers={spec!r} is not auto, all or comma-separated layer indices") from None
        bad = [i for i in idx if not 0 <= i < n]
        if bad or not idx:
            raise LcxError(f"memory layer {bad[0] if bad else spec!r} out of range: the model has {n} layers (0..{n - 1})")
        return idx

    def heads_of(self, layers: list[int], n_heads: int) -> dict[int, list[int]] | None:
        """The query heads of each memory layer in ``layers`` that read memory; None: every head.  A pair
        outside the memory layers is an error (auto keeps to them when it resolves)."""
        pairs = parse_heads(self.memory_heads)
        if pairs is None:
            return None
        out: dict[int, list[int]] = {i: [] for i in layers}
        for i, h in pairs:
            if not 0 <= h < n_heads:
                raise LcxError(f"memory_heads: head {i}:{h} out of range: the model has {n_heads} query heads per "
                               f"layer (0..{n_heads - 1})")
            if i in out:
                out[i].append(h)
            elif not (str(self.memory_layers).strip() == "auto" and auto.is_deferred()):  # measured when it runs
                raise LcxError(f"memory_heads: {i}:{h} names layer {i}, which reads no memory (memory layers: "
                               f"{','.join(map(str, layers))}); add it to memory_layers or drop the pair")
        return out

    def head_mask(self, config, layer: int, device) -> torch.Tensor | None:
        """(H,) bool: the query heads of memory layer ``layer`` that read memory, for a model of ``config``
        (its transformers config); None: all of them."""
        if self.memory_heads in ("all", "auto"):
            return None
        device = torch.device(device)
        if (layer, device) not in self._head_masks:  # built once per device: no host-to-device copy per step
            cfg = getattr(config, "text_config", None) or config
            n = int(cfg.num_attention_heads)
            heads = self.heads_of(self.layers_of(int(cfg.num_hidden_layers), getattr(cfg, "layer_types", None)), n)
            for i, hs in heads.items():
                mask = torch.zeros(n, dtype=torch.bool)
                mask[hs] = True
                self._head_masks[(i, device)] = mask.to(device)
        return self._head_masks[(layer, device)]

    def store_config(self) -> StoreConfig:
        return StoreConfig(kind=self.backend, max_entries=self.max_entries, nlist=self.nlist, nprobe=self.nprobe,
                           ivf_train=self.ivf_train, shards=self.shards, shard_kind=self.shard_backend,
                           ray_address=self.ray_address)

    def crossbatch_layout(self, d: int) -> crossbatch.Layout:
        try:
            return crossbatch.layout(self.local, self.w, d, self.segments, crossbatch.most_d(self.d_schedule, self.d))
        except LcxError as e:
            raise ValueError(str(e)) from None

    def served_attention(self) -> type:
        from lcx.plugins.fot.served import FoTServed

        return FoTServed

    def check_serving(self) -> None:
        if self.mode == "multi":
            raise LcxError("fot mode=multi is not how a server shares a memory (requests would write into each "
                           "other's): drop -o fot.mode=multi, and serve a document memory built by `lcx memory "
                           "build` with --memory PATH (read by every request, written by none)")

    # ------------------------------------------------------------------ stages
    @hookimpl
    def lcx_patch_model(self, run, model):
        self.fit_window(run.window)
        self._head_masks.clear()
        self.head_mask(run.model.config, self.layer_indices(run)[0], "cpu")  # validate at attach, not mid-generation

    @hookimpl
    def lcx_plan(self, run, input_ids, attention_mask, max_new_tokens):
        padded = attention_mask is not None and not bool(attention_mask.all())
        if self.sinks and padded and input_ids.shape[1] + max_new_tokens > self.local:
            # the sinks are the batch's first positions: padding in a left-padded row, which then has none
            raise LcxError(f"fot sinks={self.sinks}: a left-padded batch of {input_ids.shape[1]} + {max_new_tokens} "
                           f"tokens moves past the local window ({self.local}), and its padded rows would keep padding "
                           f"as sinks; give inputs of equal length, or one at a time")
        return Plan.chunked(input_ids, attention_mask, self.chunk or self.local)

    @hookimpl
    def lcx_memory(self, run, batch_size):
        from lcx.generation import model_device

        plan = run.plan
        pad = ((plan.attention_mask == 0).sum(-1) if plan is not None else torch.zeros(batch_size)).long()
        pad = pad.to(model_device(run.model))  # shifts the model's query positions
        cfg = run.model.config
        kv_heads = getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads
        if self.mode == "multi":
            if batch_size != 1:
                raise LcxError(f"fot mode=multi serves one input at a time (batch 1), got batch {batch_size}")
            if self._stores is None:
                self._stores = {}
            stores = self._stores
        else:
            stores = {}
        doc_ids = [int(x) for x in run.state.get("doc_ids", [0] * batch_size)]
        # a document being added (``ingest``) is encoded in stores of this process: its entries join the memory
        # at its end, in one add per store
        config = self.store_config() if self._shared is None else self.store_config().in_process()
        return fot_cache(
            families.num_layers(run.model, run.family), self.layer_indices(run), self.local, batch_size, kv_heads,
            lambda: make_store(config),
            lambda i: families.rotary_inv_freq(run.model, run.family, i), pad, doc_ids, stores, self.sinks,
            families.sliding_windows(run.model, run.family),
        )

    @hookimpl
    def lcx_sample(self, run, batch, step):
        """Crossbatch: rows of w + 1 contexts, positions restarting per context, this step's d."""
        ids = batch["input_ids"]
        B, T = ids.shape
        want = (self.w + 1) * self.local
        if T != want:
            raise LcxError(f"fot training needs windows of (w + 1) x local = {self.w + 1} x {self.local} = {want} tokens, "
                           f"got {T}; set --seq-len {want} or change -o w / -o local")
        if not bool(batch["attention_mask"].all()):
            raise LcxError("fot crossbatch training takes full windows (no padding); train with --concat")
        if self.memory_heads != "all":
            raise LcxError(f"fot memory_heads={self.memory_heads} is an inference option: crossbatch training trains "
                           f"every head of the memory layers; drop -o fot.memory_heads to train")
        sliding = getattr(run.model.config, "sliding_window", None)
        if sliding and sliding < self.local:  # crossbatch attends causally over whole contexts, no band
            raise LcxError(f"fot crossbatch training attends over whole {self.local}-token contexts, but this model's "
                           f"sliding-window layers see {sliding} tokens (it would train them otherwise than they "
                           f"run); set -o fot.local={sliding} or less")
        ts = run.train_state
        if run.state.get("fot_d_step") != step:  # d is decided once per optimizer step (this runs per micro-batch)
            done = ts.pop("step_accuracy", None)  # the previous step's micro-batches: one entry of the history
            if done:
                ts["accuracy_history"] = (ts.get("accuracy_history", []) + [sum(done) / len(done)])[-100:]
            d, switched = crossbatch.d_for_step(self.d_schedule, self.d, step, run.seed,
                                                ts.get("accuracy_history"), ts.get("d_switched", False))
            ts.update(d=d, d_switched=switched)
            run.state["fot_d_step"] = step
        d = ts["d"]
        if d > B:
            raise LcxError(f"d={d} (documents a memory layer sees) is larger than the batch ({B} rows); "
                           f"raise --batch-size to >= {d} or lower d")
        run.state["crossbatch"] = self.crossbatch_layout(d)
        return {**batch, "position_ids": crossbatch.chunk_positions(B, run.state["crossbatch"], ids.device)}

    @hookimpl
    def lcx_loss(self, run, model, batch):
        """The ordinary next-token loss under crossbatch attention; records training accuracy (for acc:A:D)."""
        if run.state.get("crossbatch") is None:
            return None
        out = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                    position_ids=batch["position_ids"], labels=batch["labels"])
        with torch.no_grad():
            pred, gold = out.logits[:, :-1].argmax(-1), batch["labels"][:, 1:]
            seen = gold != -100
            acc = float((pred == gold)[seen].float().mean()) if seen.any() else 0.0
        ts = run.train_state
        ts["accuracy"] = acc
        # this step's micro-batches; lcx_sample folds them into one entry of the per-step history (acc:A:D:N,
        # N <= 100) when the next step starts
        ts.setdefault("step_accuracy", []).append(acc)
        return {"lm": out.loss}

    @hookimpl
    def lcx_attention(self, run, module, query, key, value, attention_mask, kwargs):
        lay = run.state.get("crossbatch")
        if lay is not None and run.memory is None:  # training forward
            scaling = kwargs.get("scaling") or query.shape[-1] ** -0.5
            if module.layer_idx not in self.layer_indices(run):
                return crossbatch.local_attention(query, key, value, lay, scaling), None
            inv = families.rotary_inv_freq(run.model, run.family, module.layer_idx)
            probe = run.state.get("crossbatch_probe")
            banks = run.state.setdefault("crossbatch_bank", {})  # layer -> earlier steps' contexts (self.bank)
            out = crossbatch.memory_attention(query, key, value, lay, inv, self.positions, self.fixed_distance,
                                              scaling, probe.setdefault(module.layer_idx, []) if probe is not None else None,
                                              self.train_k, banks.get(module.layer_idx), self.bank_k)
            if self.bank and torch.is_grad_enabled():  # training steps fill it (not evaluation forwards)
                banks[module.layer_idx] = crossbatch.bank_update(banks.get(module.layer_idx), key, value, lay, inv,
                                                                 self.bank)
            return out, None
        cache = run.memory
        layer = cache.layers[module.layer_idx] if cache is not None and hasattr(cache, "layers") else None
        if not isinstance(layer, FoTLayer):
            return None
        has_memory = layer.memory is not None and any(len(s) for s in layer.memory.values())
        if layer.local_start == 0 and not has_memory:
            return None  # nothing left the window yet: plain attention
        T = query.shape[-2]
        total = layer.cumulative_length
        kept = layer.kept()
        mask = visible_mask(attention_mask, kept, total, T, run.base_impl, query.dtype, query.device)
        past_sinks = None if self.gate_sinks or not layer.held_sinks else (
            kept_positions(kept, query.device) >= layer.held_sinks)[None]
        if not has_memory:
            return run.base_attention(module, query, key, value, mask, **kwargs)
        q_index = torch.arange(total - T, total, device=query.device)[None, :] - layer.pad[:, None]  # (B, T) RoPE pos
        shift = self.query_shift(q_index, layer.local_start - layer.pad[:, None])
        out = memory_attention(
            query, key, value, to_additive(mask, torch.float32), layer.memory, shift.to(torch.float64),
            layer.inv_freq, kwargs.get("scaling") or query.shape[-1] ** -0.5, self.k, self.dense, self.block,
            self.gate_logit, self.head_mask(run.model.config, module.layer_idx, query.device),
            past_sinks,
            margins=None if self.record_margins is None else self.record_margins.setdefault(module.layer_idx, []),
        )
        return out, None

    @property
    def gate_logit(self) -> float | None:
        """``gate`` as memory attention takes it (None: off; auto not calibrated on this model: the default)."""
        if self.gate == "auto":
            return GATE_RULE
        return None if self.gate == "off" else float(self.gate)

    def query_shift(self, q_index: torch.Tensor, local_start: torch.Tensor) -> torch.Tensor:
        """(B, T) rotation taking each query (RoPE positions ``q_index``) to where the positions mode puts
        memory: the local window's start (``local_start``, (B, 1) RoPE position), a fixed distance, or none."""
        if self.positions == "first":
            return -local_start.expand_as(q_index)
        if self.positions == "fixed":
            return (self.fixed_distance or self.local) - q_index
        return -q_index

    def reusable_prefix(self) -> bool:
        return self.mode == "single"  # multi-document mode keeps what each prompt adds, by design

    # ------------------------------------------------------------------ multi-document memory
    @torch.no_grad()
    def ingest(self, run, input_ids: torch.Tensor, doc_id: int, progress: bool = False) -> int:
        """Add a whole document (1, T) to the multi-document memory; returns its token count (``progress``:
        a bar over its windows).

        The document is encoded on its own (its windows see only its own earlier windows), then its
        entries join the shared memory: a document's entries never depend on what was indexed before
        it, so the order of ``lcx memory build DOCS...`` does not matter."""
        from lcx.generation import make_plan, prefill

        self.mode = "multi"
        shared, self._stores = self._stores if self._stores is not None else {}, {}
        self._shared = shared  # counted by memory_entries (lcx.limits) while the document is encoded
        run.state["doc_ids"] = [doc_id]
        try:
            plan = make_plan(run, input_ids, None, 0)
            cache = prefill(run, plan, include_last=True, progress=progress)
            for layer in cache.layers:  # flush the sinks and the last local window into memory too
                if not isinstance(layer, FoTLayer) or layer.memory is None:
                    continue
                if layer.held_sinks:
                    layer._to_memory(layer.sink_k, layer.sink_v, 0)
                if layer.keys.shape[-2]:
                    layer._to_memory(layer.keys, layer.values, layer.cumulative_length - layer.keys.shape[-2])
            for i, per in self._stores.items():
                for key, store in per.items():
                    if len(store):
                        target = shared.setdefault(i, {}).setdefault(key, make_store(self.store_config()))
                        target.add(store.keys, store.values, store.positions, doc_id)
        finally:
            self._stores, self._shared = shared, None
            run.state.pop("doc_ids", None)
        return int(input_ids.shape[1])

    def memory_entries(self, run, input_tokens: int) -> int:
        """Entries per memory layer and KV head after a request: the input's tokens, plus in multi-document
        mode what the memory already holds; at most ``max_entries`` when it evicts."""
        held = 0
        if self.mode == "multi":
            groups = [*(self._stores or {}).values(), *(self._shared or {}).values()]
            held = max((len(s) for per in groups for s in per.values()), default=0)
        n = held + input_tokens
        return min(n, self.max_entries) if self.max_entries else n

    def cache_tokens(self, run, tokens: int) -> int:
        """Every layer's cache keeps the local window and its sinks, plus the tokens of the forward being ingested."""
        return min(tokens, self.sinks + self.local + (self.chunk or self.local))

    def forward_shapes(self, run, tokens: int) -> list[tuple[int, ...]]:
        """A chunk's queries over the local window and the chunk, plus what a memory layer's attention holds
        for one block of them (``attention_bytes``)."""
        q = min(tokens, self.chunk or self.local)
        keys = min(tokens, self.sinks + self.local + q)
        _, kv_heads, head_dim, _ = kv_dims(run.model)
        heads = getattr(getattr(run.model.config, "get_text_config", lambda: run.model.config)(), "num_attention_heads", 1)
        return [(1, q, keys, self.attention_bytes(heads, kv_heads, head_dim, q, keys, self.memory_entries(run, tokens)))]

    def attention_bytes(self, heads: int, kv_heads: int, head_dim: int, queries: int, keys: int, entries: int) -> int:
        """An upper bound on what a memory layer's attention (``memory_attention``) holds for one block of
        ``queries`` queries over ``keys`` local keys and ``entries`` memory entries per KV head, in float32: every
        head's local scores (exponentiated in place), its memory scores over ``k`` keys or, ``dense``, every entry
        (up to three alive at once: the scaled, the gated and the exponentiated), the values read with them (the
        store's rows in float32, then stacked), and an exact search's own (``search_bytes``: one KV head's block
        of queries, or up to ``SEARCH_BATCH`` of every head's at once; none here for a Ray memory on a cluster
        elsewhere).  lcx generate's per-request check and lcx serve's step budget both count it."""
        c = min(queries, self.block)
        scores = heads * c * (keys + 3 * (entries if self.dense else self.k))
        values = 2 * head_dim * (kv_heads * entries if self.dense else heads * c * self.k)
        searched = max(heads // kv_heads * c, min(heads * c, SEARCH_BATCH))
        search = 0 if self.dense or self._memory_elsewhere() else search_bytes(self.store_config(), searched, entries,
                                                                                  head_dim)
        return 4 * (scores + values) + search

    def _memory_elsewhere(self) -> bool:
        """A Ray memory on a cluster other than one this process starts: its actors hold and search the entries."""
        return self.backend == "ray" and (self.ray_address or os.environ.get("RAY_ADDRESS", "")) not in STARTS_HERE

    def memory_bytes(self, run, entries: int) -> int:
        """One store per memory layer and KV head (``bytes_per_store``); none here for a Ray memory on a cluster
        elsewhere (its actors hold the entries)."""
        if self._memory_elsewhere():
            return 0
        _, kv_heads, head_dim, size = kv_dims(run.model)
        return len(self.layer_indices(run)) * kv_heads * bytes_per_store(self.store_config(), entries, head_dim,
                                                                          head_dim, size)

    def memory_device(self, run) -> str | None:
        """FAISS stores (and a local Ray's actors) keep their entries in host arrays (faiss-gpu's index copy is
        counted there too); the torch backend's live with the model."""
        return None if self.store_config().kind == "torch" else "cpu"

    def stores_for_saving(self) -> dict[tuple[int, int], MemoryStore]:
        return {(layer, head): store for layer, per in (self._stores or {}).items() for (_, head), store in per.items()}

    def memory_built_otherwise(self, meta: dict, window: int | None = None) -> dict:
        if window:  # local=0 and the chunk cut to it, as attaching to the model settles them
            probe = copy.copy(self)
            probe.fit_window(window)
            return probe.memory_built_otherwise(meta)
        differ = super().memory_built_otherwise(meta)
        if "positions" not in differ and self.positions != "fixed":
            differ.pop("fixed_distance", None)  # unread on both sides
        if "dense" not in differ and self.dense:
            differ.pop("k", None)
        return differ

    def check_memory_layers(self, path: str | Path, meta: dict, n_layers: int,
                            layer_types: list[str] | None = None) -> None:
        """A memory (``lcx memory build``) holds keys for the memory layers it was built with; read with others,
        some of its layers would never be read and the reading layers would find nothing: refuse that."""
        stored = sorted({int(name.split(".")[0]) for name in meta.get("stores", [])})
        here = self.layers_of(n_layers, layer_types)
        if stored != here:
            raise LcxError(f"memory {str(path)!r} holds memory layers {','.join(map(str, stored))}, and fot here "
                           f"reads layers {','.join(map(str, here))} (memory_layers={self.memory_layers}); read it "
                           f"with -o fot.memory_layers={','.join(map(str, stored))}, as it was built")

    def check_memory(self, path: str | Path, model: dict) -> dict:
        """A memory (``lcx memory build``) for a server of ``model`` (its identity: config.json's model_type,
        num_hidden_layers, hidden_size, layer_types and its embedding_sha256): its files whole, built with that
        model, holding the memory layers fot reads here, sharded as fot here reads it; returns its metadata."""
        from lcx.plugins.fot.memory import check_memory_files, check_shards

        meta = check_memory_files(path)
        check_shards(path, meta, self.store_config())
        built = meta.get("model", {})
        for key in ("model_type", "num_hidden_layers", "hidden_size", "embedding_sha256"):
            if built.get(key) != model.get(key):
                raise LcxError(f"memory {str(path)!r} was built with another model ({key}: {built.get(key)!r} vs "
                               f"{model.get(key)!r}); rebuild it with this model")
        if model.get("num_hidden_layers"):
            self.check_memory_layers(path, meta, int(model["num_hidden_layers"]), model.get("layer_types"))
        return meta

    def load_memory(self, path: str | Path, model) -> dict:
        """Use a memory built by ``lcx memory build`` (multi-document mode, batch 1)."""
        from lcx.adapters.peft_bridge import base_identity, same_embeddings

        stores, meta = load_memory(path, self.store_config())
        want, have = meta.get("model", {}), base_identity(model)
        if not same_embeddings(want, have):  # the same weights in another dtype are the same model
            raise LcxError(f"memory {str(path)!r} was built with another model (embedding_sha256: "
                           f"{want.get('embedding_sha256')!r} vs {have.get('embedding_sha256')!r}); rebuild it with "
                           f"this model")
        for key in ("model_type", "num_hidden_layers", "hidden_size"):
            if want.get(key) != have.get(key):
                raise LcxError(f"memory {str(path)!r} was built with another model ({key}: {want.get(key)!r} vs "
                               f"{have.get(key)!r}); rebuild it with this model")
        self.check_memory_layers(path, meta, int(have["num_hidden_layers"]), getattr(model.config, "layer_types", None))
        self.mode = "multi"
        self._stores = {}
        for (layer, head), store in stores.items():
            self._stores.setdefault(layer, {})[(0, head)] = store
        return meta

    load = load_memory  # the name callers used before ``Method.load_memory``


def parse_heads(spec: str) -> list[tuple[int, int]] | None:
    """memory_heads as (layer, head) pairs; None for all (and for auto not yet measured: all)."""
    if spec in ("all", "auto"):
        return None
    try:
        pairs = [tuple(int(x) for x in p.split(":")) for p in spec.split(",") if p.strip()]
    except ValueError:
        pairs = []
    if not pairs or any(len(p) != 2 for p in pairs):
        raise ValueError(f"memory_heads must be all, auto or LAYER:HEAD pairs like 7:6,14:1; got {spec!r}")
    return sorted(set(pairs))
