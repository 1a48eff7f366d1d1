"""focusllm: parallel chunk decoding into candidate tokens (FocusLLM, Li et al. 2024).

A long input is split into *memory* (everything but the last ``local`` tokens) and *local* tokens.
The memory is cut into chunks of at most ``chunk`` tokens (never more than the model's window); the
last ``fragment`` local tokens are appended to every chunk, and the last position of each
[chunk ; fragment] is a *candidate token*: its per-layer key/value summarises the chunk as seen from
the local context.  The frozen model then reads the local tokens after the candidates, with
contiguous positions: candidates at 0..n-1, local tokens from n (the chunking stage builds that plan).

The candidate position uses the method's own q/k/v/o projections: a LoRA adapter gated per token
(``lcx.adapters.gated_lora``) open only there, so an untrained (zero) adapter is the base model and a
trained one is a plain PEFT adapter.  Chunks are processed ``parallel`` at a time as one batch
(1 = serially, flat memory; 0 = all at once).  The candidates enter through the cache: the plan's
first window holds one placeholder token per candidate, and the cache stores the candidates'
keys/values instead of the placeholders' (memory stage), so ``model.generate()`` continues as usual.

This first version computes the candidates once, from the prompt (generated tokens do not refresh
them yet).  Batches of several inputs need equal lengths without padding.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch
from transformers.cache_utils import Cache, DynamicLayer

from lcx.adapters import families
from lcx.adapters.rotary import rotate
from lcx.errors import LcxError
from lcx.hookspecs import hookimpl
from lcx.method import Method, option
from lcx.plan import Plan


# ---------------------------------------------------------------------- chunking
def chunk_spans(memory: int, chunk: int) -> list[tuple[int, int]]:
    """``[start, end)`` of each memory chunk: ``chunk`` tokens, the last one possibly shorter."""
    return [(s, min(s + chunk, memory)) for s in range(0, memory, chunk)]


# ---------------------------------------------------------------------- candidates
@torch.no_grad()
def candidate_kv(model, memory_ids: torch.Tensor, fragment_ids: torch.Tensor, chunk: int, parallel: int,
                 gate=None) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per layer, the candidates' (keys, values) of shape (B, H_kv, n_chunks, D), keys rotated at the
    position each candidate had in its own [chunk ; fragment] forward (its last position).

    ``memory_ids`` (B, M), ``fragment_ids`` (B, F).  Chunks of equal length are batched ``parallel`` at
    a time (0 = all); ``gate`` (a ``TokenGate``) opens the candidate adapter at the last position only.
    """
    B, F = fragment_ids.shape
    spans = chunk_spans(memory_ids.shape[1], chunk)
    per_chunk: list[list[tuple[torch.Tensor, torch.Tensor]] | None] = [None] * len(spans)
    groups: dict[int, list[int]] = {}
    for i, (s, e) in enumerate(spans):
        groups.setdefault(e - s, []).append(i)
    step = parallel or len(spans)
    for members in groups.values():
        for g in range(0, len(members), step):
            idx = members[g:g + step]
            ids = torch.cat([torch.cat([memory_ids[:, spans[i][0]:spans[i][1]], fragment_ids], dim=1) for i in idx])
            mask = torch.zeros_like(ids, dtype=torch.float32)
            mask[:, -1] = 1
            with gate.only(mask) if gate is not None else contextlib.nullcontext():
                out = model(input_ids=ids, use_cache=True)
            for j, i in enumerate(idx):
                rows = slice(j * B, (j + 1) * B)
                # clone: a slice would keep the chunk's whole cache alive (memory growing with the input)
                per_chunk[i] = [(layer.keys[rows, :, -1:].clone(), layer.values[rows, :, -1:].clone())
                                for layer in out.past_key_values.layers]
            del out
    n_layers = len(per_chunk[0])  # type: ignore[index]
    return [(torch.cat([c[l][0] for c in per_chunk], dim=2), torch.cat([c[l][1] for c in per_chunk], dim=2))  # type: ignore[index]
            for l in range(n_layers)]


class CandidateLayer(DynamicLayer):
    """A cache layer whose first update stores the given candidate keys/values instead of the
    placeholders' (the plan's first window), then behaves like an ordinary dynamic layer."""

    def __init__(self, keys: torch.Tensor, values: torch.Tensor) -> None:
        super().__init__()
        self.pending: tuple[torch.Tensor, torch.Tensor] | None = (keys, values)

    def update(self, key_states, value_states, *args, **kwargs):
        if self.pending is not None:
            keys, values = self.pending
            if keys.shape[-2] != key_states.shape[-2]:
                raise LcxError(f"focusllm: {keys.shape[-2]} candidates but {key_states.shape[-2]} placeholder tokens")
            self.pending = None
            key_states, value_states = keys.to(key_states.dtype), values.to(value_states.dtype)
        return super().update(key_states, value_states, *args, **kwargs)


# ---------------------------------------------------------------------- the method
@dataclass
class FocusLLM(Method):
    name = "focusllm"
    description = "FocusLLM: one candidate token per memory chunk (decoded in parallel), read by the frozen model"
    requires = frozenset({"rotary"})

    chunk: int = option(2048, "memory chunk size in tokens (at most the model's window)")
    local: int = option(2048, "local tokens: the input's tail the frozen model reads after the candidates")
    fragment: int = option(512, "local tokens appended to every chunk (at most the chunk size)")
    parallel: int = option(0, "chunks per forward pass: 0 = all at once (fast), 1 = serial (flat memory)")

    def __post_init__(self) -> None:
        if self.chunk <= 0 or self.local <= 0 or self.fragment <= 0 or self.parallel < 0:
            raise ValueError(f"chunk, local and fragment must be > 0 and parallel >= 0 (got chunk={self.chunk}, "
                             f"local={self.local}, fragment={self.fragment}, parallel={self.parallel})")
        if self.fragment > self.chunk:
            raise ValueError(f"fragment ({self.fragment}) must not be longer than the chunk ({self.chunk})")
        if self.fragment > self.local:
            raise ValueError(f"fragment ({self.fragment}) must not be longer than the local tokens ({self.local})")

    def check_window(self, run) -> None:
        if self.chunk + self.fragment > run.window:
            raise LcxError(f"focusllm chunk={self.chunk} + fragment={self.fragment} exceeds the model's window "
                           f"({run.window}); use -o focusllm.chunk={run.window - self.fragment} or less")
        if self.local >= run.window:
            raise LcxError(f"focusllm local={self.local} leaves no room for candidates in the model's window "
                           f"({run.window}); lower -o focusllm.local")

    # ------------------------------------------------------------------ patching: the candidate adapter
    @hookimpl
    def lcx_patch_model(self, run, model):
        """A LoRA adapter on the model (trained with focusllm) becomes the candidate projections: gated
        open at candidate positions only, so every other token uses the base weights."""
        from peft.tuners.lora import LoraLayer

        from lcx.adapters.gated_lora import TokenGate, gate_lora

        if not any(isinstance(m, LoraLayer) for m in model.modules()):
            return  # training-free: the candidates use the base projections
        gate = TokenGate(default_open=False)
        for handle in gate_lora(model, gate):
            run.patches.callback(handle.remove)
        run.state["focusllm_gate"] = gate

    # ------------------------------------------------------------------ chunking stage
    @hookimpl
    def lcx_plan(self, run, input_ids, attention_mask, max_new_tokens):
        self.check_window(run)
        B, T = input_ids.shape
        if T <= self.local:
            return None  # one window: the model reads it as it is
        if not bool(attention_mask.all()):
            raise LcxError("focusllm: padded batches are not supported yet; give inputs of equal length "
                           "(or one at a time)")
        memory, local = input_ids[:, : T - self.local], input_ids[:, T - self.local:]
        spans = chunk_spans(memory.shape[1], self.chunk)
        n = len(spans)
        if n + self.local + max_new_tokens > run.window:
            raise LcxError(f"focusllm: {n} candidates + {self.local} local tokens + {max_new_tokens} new tokens "
                           f"exceed the model's window ({run.window}); raise -o focusllm.chunk or lower -o focusllm.local")
        cand = candidate_kv(run.model, memory, local[:, -self.fragment:], self.chunk, self.parallel,
                            run.state.get("focusllm_gate"))
        # each candidate was rotated at the last position of its own forward; move it to its slot i
        lengths = torch.tensor([e - s + self.fragment for s, e in spans])
        shift = torch.arange(n) - (lengths - 1)
        for layer, (k, v) in enumerate(cand):
            cand[layer] = (rotate(k, shift, families.rotary_inv_freq(run.model, run.family, layer)), v)
        run.state["focusllm_candidates"] = cand
        placeholder = torch.full((B, n), int(local[0, 0]), dtype=input_ids.dtype)
        ids = torch.cat([placeholder, local], dim=1)
        return Plan(ids, torch.ones_like(ids), [(0, n), (n, n + self.local)], dropped=0,
                    info={"candidates": n, "memory_tokens": int(memory.shape[1])})

    # ------------------------------------------------------------------ memory stage
    @hookimpl
    def lcx_memory(self, run, batch_size):
        cand = run.state.pop("focusllm_candidates", None)
        if cand is None:
            return None
        return Cache(layers=[CandidateLayer(k, v) for k, v in cand])


@hookimpl
def lcx_register_methods(register):
    register(FocusLLM)
