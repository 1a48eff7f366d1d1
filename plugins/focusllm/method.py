"""focusllm: parallel chunk decoding into candidate tokens (FocusLLM, Li et al. 2024).

A long input is split into *memory* (everything but the last ``local`` tokens) and *local* tokens.
The memory is cut into chunks of at most ``chunk`` tokens (never more than the model's window; ``auto``:
``BASE_CHUNK``, doubled while a prompt's memory would make more than ``MAX_CANDIDATES`` candidates); the
last ``fragment`` local tokens are appended to every chunk, and the last position of each
[chunk ; fragment] is a *candidate token*: its per-layer key/value summarises the chunk as seen from
the local context.  The frozen model then reads the local tokens after the candidates, with
contiguous positions: candidates at 0..n-1, local tokens from n (the chunking stage builds that plan).
With ``overlap`` (an lcx extension; the paper's chunks are disjoint) each chunk but the first also reads
the last ``overlap`` tokens of the chunk before it, so that a short fact cut by a boundary is whole in one.

The candidate position uses the method's own q/k/v/o projections: a LoRA adapter gated per token
(``lcx.adapters.gated_lora``) open only there, so an untrained (zero) adapter is the base model and a
trained one is a plain PEFT adapter.  Chunks are processed ``parallel`` at a time as one batch
(1 = serially, flat memory; 0 = all at once).  The candidates enter through the cache: the plan's
first window holds one placeholder token per candidate, and the cache stores the candidates'
keys/values instead of the placeholders' (memory stage), so ``model.generate()`` continues as usual.

Generation (``refresh``): every generated token joins the local tokens, so it also joins every
chunk's [chunk ; fragment] sequence and becomes that chunk's new candidate.  Each chunk keeps its own
cache; ``refresh=1`` (exact) feeds every new token to every chunk (batched across chunks, one token
each) and swaps the refreshed candidates into the decoder's cache before the token is read;
``refresh=N`` does that every N tokens, feeding the N pending tokens at once (approximate: in between,
the decoder reads candidates up to N-1 tokens old; cheaper, measured in bench/focusllm_generation.py);
``refresh=0`` keeps the prompt's candidates and no chunk cache (flat memory).  The newest token is
computed with the candidate projections (gate open) and kept in the chunk cache with the base ones.
Batches of several inputs need equal lengths without padding.

Training (``lcx train --method focusllm``; only the candidate adapter trains, the base weights stay
frozen) is in training.py.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers.cache_utils import Cache

from lcx.adapters import families
from lcx.errors import LcxError
from lcx.hookspecs import hookimpl
from lcx.method import Method, option
from lcx.plan import Plan
from lcx.plugins.focusllm.attention import candidate_topk_mask
from lcx.plugins.focusllm.cache import CandidateLayer
from lcx.plugins.focusllm.candidates import (ChunkGroup, ChunkMemo, _group_rows, candidate_kv, candidate_positions,
                                             chunk_spans, refresh_candidates, to_slots)
from lcx.plugins.focusllm.training import LOSSES, CandidateTraining

#: chunk=auto: the chunk size to start from, and the most candidates it lets a prompt make before doubling
#: (the 128K passkey grids: 63 candidates lost keys that 31 found; results/focusllm/README.md)
BASE_CHUNK = 2048
MAX_CANDIDATES = 32


@dataclass
class FocusLLM(CandidateTraining, Method):
    name = "focusllm"
    description = "FocusLLM: one candidate token per memory chunk (decoded in parallel), read by the frozen model"
    requires = frozenset({"rotary"})
    # served (lcx.integrations.vllm.attention.FocusServed): lcx's request middleware computes a prompt's
    # candidates on lcx's own path and rewrites the prompt to [placeholders ; local tokens]; the served
    # attention stores the candidates' keys/values in the placeholders' stead, as CandidateLayer does
    serving = "attention"
    serve_state = True
    reads_past_window = True
    lora_gated = True  # the candidate adapter is open at candidate positions only
    grads_through_cache = True  # its loss reaches the blocks through the candidates' cached keys and values
    inference_only = ("chunk",)  # training draws its chunk sizes from train_chunks

    chunk: int | str = option("auto", "memory chunk size in tokens (at most the model's window); each chunk makes "
                                     "one candidate, and a decoder reading too many candidates loses keys. auto: "
                                     f"{BASE_CHUNK}, doubled while the prompt's memory would make more than "
                                     f"{MAX_CANDIDATES} candidates, as far as the window allows", before=2048)
    overlap: int = option(0, "tokens each chunk also reads from the end of the chunk before it (0 = the paper's "
                             "disjoint chunks): a fact that a chunk boundary cuts, such as a passkey sentence, is "
                             "then whole in one chunk; a chunk's forward reads up to chunk + overlap + fragment tokens")
    local: int = option(2048, "local tokens: the input's tail the frozen model reads after the candidates")
    fragment: int = option(512, "local tokens appended to every chunk (at most the chunk size)")
    parallel: int = option(0, "chunks per forward pass: 0 = all at once (fast), 1 = serial (flat memory)")
    refresh: int = option(1, "generation: refresh every chunk's candidate every N new tokens (1 = exact; N > 1 = "
                             "approximate, faster; 0 = never: the prompt's candidates, no chunk caches kept)")
    losses: str = option("continuation,repetition", "training: loss terms, comma-separated: continuation (the local "
                         "tokens are the window's end), repetition (a span copied from the memory), recall (the "
                         "window's end, then a 4-32 token cue copied from the memory: the fresh tokens that follow "
                         "it there, replaced by random tokens of the window in both places, are predicted; needs fresh)")
    fresh: int = option(0, "training: predict only the last N local tokens of each term, the way exact generation "
                           "reads them: each with every candidate refreshed through the token before it (one "
                           "candidate set per predicted token; the earlier local tokens run without gradient). "
                           "0 = the paper's training: the candidates see the fragment, every later token is predicted")
    recall_local: float = option(0.0, "training (recall): the share of draws whose cue and value (random tokens) sit "
                                      "among the local tokens, before the question, instead of the memory: the answer "
                                      "is then local, as a passkey near the end (0 = always in the memory)")
    topk: int = option(0, "candidates each local query reads, per head: the ones with the highest q.k among the "
                          "candidates, the others hidden (lcx's addition: with many chunks, the right candidate's "
                          "share of attention is diluted by the others). 0 = all of them (the paper)")
    train_chunks: str = option("64,128,256,512,1024,2048", "training: chunk sizes, one drawn per step and loss term "
                               "(among those that fit the window and the training window)")

    def __post_init__(self) -> None:
        if isinstance(self.chunk, str) and self.chunk != "auto":
            raise ValueError(f"chunk must be a number of tokens or auto, got {self.chunk!r}")
        fixed = self.chunk != "auto"
        if min(self.chunk if fixed else 1, self.local, self.fragment) <= 0 or \
                min(self.parallel, self.refresh, self.fresh, self.topk) < 0:
            raise ValueError(f"chunk, local and fragment must be > 0, parallel, refresh, fresh and topk >= 0 (got "
                             f"chunk={self.chunk}, local={self.local}, fragment={self.fragment}, "
                             f"parallel={self.parallel}, refresh={self.refresh}, fresh={self.fresh}, topk={self.topk})")
        if fixed and self.fragment > self.chunk:
            raise ValueError(f"fragment ({self.fragment}) must not be longer than the chunk ({self.chunk})")
        if self.overlap < 0 or (fixed and self.overlap >= self.chunk):
            raise ValueError(f"overlap must be at least 0 and shorter than the chunk ({self.chunk}), got {self.overlap}")
        if self.fragment > self.local:
            raise ValueError(f"fragment ({self.fragment}) must not be longer than the local tokens ({self.local})")
        terms = [t.strip() for t in self.losses.split(",") if t.strip()]
        if not terms or set(terms) - set(LOSSES):
            raise ValueError(f"losses must name one or more of {', '.join(LOSSES)}, got {self.losses!r}")
        if not 0 <= self.recall_local <= 1:
            raise ValueError(f"recall_local is a share of the recall draws, from 0 to 1, got {self.recall_local}")
        if "recall" in terms and not self.fresh:
            raise ValueError("the recall loss predicts the tokens after its cue, the way exact generation reads them: "
                             "set -o focusllm.fresh=N (e.g. 32)")
        try:
            chunks = sorted({int(c) for c in self.train_chunks.split(",") if c.strip()})
        except ValueError:
            chunks = []
        if not chunks or chunks[0] <= 0:
            raise ValueError(f"train_chunks must be positive integers separated by commas, got {self.train_chunks!r}")
        self._terms, self._chunks = terms, chunks
        self._last_chunk: int | None = None  # the chunk size the last planned prompt was cut with

    def chunk_for(self, window: int, tokens: int, new: int = 1) -> int:
        """The chunk size of a prompt of ``tokens`` tokens generating ``new`` more on a model of ``window``:
        ``chunk``, or for auto the smallest of ``BASE_CHUNK`` doubled that makes at most ``MAX_CANDIDATES``
        candidates, within what one chunk's forward may read (refreshed candidates: with the new tokens)."""
        if self.chunk != "auto":
            return int(self.chunk)
        room = window - self.overlap - self.fragment - (new - 1 if self.refresh else 0)
        chunk = max(min(BASE_CHUNK, room), self.fragment, self.overlap + 1)
        memory = max(0, tokens - self.local)
        while len(chunk_spans(memory, chunk, self.overlap)) > MAX_CANDIDATES and chunk < room:
            chunk = min(2 * chunk, room)
        return chunk

    def resolved(self, config: dict) -> dict:
        if self.chunk != "auto":
            return {"chunk": int(self.chunk)}
        room = families.json_window(config) - self.overlap - self.fragment
        return {"chunk": f"per request: {min(BASE_CHUNK, room):,}, doubled while the memory makes more than "
                         f"{MAX_CANDIDATES} candidates, up to {room:,} (the window less fragment and overlap), less "
                         f"the new tokens when candidates are refreshed"}

    def begin_request(self, run, tokens: int, new: int) -> None:
        self._last_chunk = None  # a prompt read as it is has no chunks: not the last one's size

    def request_options(self) -> dict:
        return {"chunk": self._last_chunk} if self.chunk == "auto" and self._last_chunk is not None else {}

    def check_window(self, run) -> None:
        chunk = self.chunk_for(run.window, 0)  # auto: its smallest
        if chunk + self.overlap + self.fragment > run.window:
            w, room = run.window, run.window - self.fragment - self.overlap
            fix = (f"-o focusllm.chunk={room} or less" if room >= max(self.fragment, self.overlap + 1) else
                   f"smaller pieces, e.g. -o focusllm.chunk={w // 2} -o focusllm.fragment={w // 8} -o focusllm.local={w // 2}"
                   + (" and a smaller -o focusllm.overlap" if self.overlap else ""))
            reads = (f"chunk={chunk}" + (" (auto's smallest)" if self.chunk == "auto" else "")
                     + (f" + overlap={self.overlap}" if self.overlap else ""))
            raise LcxError(f"focusllm {reads} + fragment={self.fragment} exceeds the model's window ({w}); use {fix}")
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

        handle = model.register_forward_pre_hook(lambda mod, args, kwargs: self._refresh(run, kwargs), with_kwargs=True)
        run.patches.callback(handle.remove)
        if not any(isinstance(m, LoraLayer) for m in model.modules()):
            return  # training-free: the candidates use the base projections
        gate = TokenGate(default_open=False)
        for handle in gate_lora(model, gate):
            run.patches.callback(handle.remove)
        run.state["focusllm_gate"] = gate

    def _refresh(self, run, kwargs) -> None:
        """Before each decoding step: the step's tokens join every chunk (every ``refresh`` tokens), and the
        decoder's candidate slots take the refreshed candidates."""
        gen = run.state.get("focusllm_generation")
        cache = kwargs.get("past_key_values")
        if gen is None or cache is None or cache is not gen["cache"] or cache.layers[0].pending is not None:
            return  # not our decoder (a chunk forward, training, another call) or still the prefill
        ids = kwargs.get("input_ids")
        if ids is None:
            raise LcxError("focusllm refresh needs token ids (not input embeddings) during generation")
        ids = ids[:, max(0, gen["prompt"] - cache.get_seq_length()):]  # prompt tokens are in the chunks already
        if ids.shape[1] == 0:
            return
        gen["pending"].append(ids)
        if sum(t.shape[1] for t in gen["pending"]) < self.refresh:
            return
        new = torch.cat(gen["pending"], dim=1)
        gen["pending"].clear()
        cand = refresh_candidates(run.model, gen["groups"], new, run.state.get("focusllm_gate"))
        positions = torch.empty(cand[0][0].shape[2], dtype=torch.long)
        for g in gen["groups"]:
            positions[g.idx] = g.length - 1
        for layer, (k, v) in zip(cache.layers, to_slots(cand, positions, run)):
            n = k.shape[2]
            layer.keys[:, :, :n] = k.to(layer.keys.dtype)
            layer.values[:, :, :n] = v.to(layer.values.dtype)
        gen["refreshes"] += 1

    # ------------------------------------------------------------------ chunking stage
    @hookimpl
    def lcx_plan(self, run, input_ids, attention_mask, max_new_tokens):
        return self._plan(run, input_ids, attention_mask, max_new_tokens)

    def _plan(self, run, input_ids, attention_mask, max_new_tokens, forward=None):
        """``lcx_plan``; with ``forward`` (``serve_request``'s), the chunks' candidates are computed by it."""
        # an earlier plan's candidates that never reached lcx_memory (its caller failed in between) must not
        # reach this prompt's cache, nor the last prompt's chunk caches live on while this one's are made
        # (make_plan has done this already; serve_request plans directly)
        self.release(run)
        self.check_window(run)
        B, T = input_ids.shape
        if T <= self.local:
            return None  # one window: the model reads it as it is
        if not bool(attention_mask.all()):
            raise LcxError("focusllm: padded batches are not supported yet; give inputs of equal length "
                           "(or one at a time)")
        memory, local = input_ids[:, : T - self.local], input_ids[:, T - self.local:]
        chunk, spans = self._chunking(run, T, max_new_tokens)
        self._last_chunk = chunk
        n = len(spans)
        if n + self.local + max_new_tokens > run.window:
            raise LcxError(f"focusllm: {n} candidates + {self.local} local tokens + {max_new_tokens} new tokens "
                           f"exceed the model's window ({run.window}); "
                           + ("lower -o focusllm.local" if self.chunk == "auto" else
                              "raise -o focusllm.chunk or lower -o focusllm.local"))
        # the fragment: the last local tokens, or when scoring, the last ones before the scored tokens (every
        # local token reads the candidates, so they may only have read what the first scored logit reads)
        scored = run.scored
        if scored >= self.local:
            raise LcxError(f"focusllm scores at most its local tokens minus one ({self.local - 1}), got {scored}; "
                           f"score fewer tokens or raise -o focusllm.local")
        fragment = self._fragment(local, scored)
        groups: list[ChunkGroup] | None = [] if self.refresh and max_new_tokens > 1 else None
        longest = max(e - s for s, e in spans) + fragment.shape[1]
        if groups is not None and longest + max_new_tokens - 1 > run.window:
            # refreshing grows each chunk's sequence by the generated tokens: past the window, its positions
            # are ones the model never saw
            fits = chunk - (longest + max_new_tokens - 1 - run.window)
            smaller = (f"-o focusllm.chunk={fits} or less" if fits >= max(self.fragment, self.overlap + 1)
                       else "a smaller -o focusllm.fragment" + (" or overlap" if self.overlap else ""))
            raise LcxError(f"focusllm refreshes each chunk's candidate as it generates: a chunk's {longest} tokens + "
                           f"{max_new_tokens - 1} generated ones exceed the model's window ({run.window}); use "
                           f"{smaller}, fewer new tokens, or -o focusllm.refresh=0")
        # a kept chunk cache trades its gated last token for the base one (crop, then one more token), which
        # transformers' sliding-window cache layers refuse; the layers that slide, not the config's field (Qwen2
        # names a window that no layer uses when max_window_layers covers them all)
        sliding = groups is not None and run.state.get("focusllm_gate") is not None and max(
            (w for w in families.sliding_windows(run.model, run.family) if w), default=None)
        if sliding:
            raise LcxError(f"focusllm with a candidate adapter refreshes its candidates from each chunk's cache, which "
                           f"this model's sliding-window layers (sliding_window={sliding}) cannot take back; use "
                           f"-o focusllm.refresh=0 (the prompt's candidates)")
        if forward is not None:
            cand = self._forwarded(run, forward, memory, fragment, spans)
        else:
            reuse = run.reuse  # a caller that expects prompts sharing chunks (a passkey grid)
            memo = reuse.memo(run, "focusllm_chunks", ChunkMemo) if reuse is not None else None
            cand = candidate_kv(run.model, memory, fragment, spans, self.parallel, run.state.get("focusllm_gate"),
                                groups, memo=memo)
        # each candidate was rotated at the last position of its own forward; move it to its slot i
        run.state["focusllm_candidates"] = to_slots(cand, candidate_positions(spans, fragment.shape[1]), run)
        run.state["focusllm_groups"] = groups
        placeholder = torch.full((B, n), int(local[0, 0]), dtype=input_ids.dtype, device=input_ids.device)
        ids = torch.cat([placeholder, local], dim=1)
        return Plan(ids, torch.ones_like(ids), [(0, n), (n, n + self.local)], dropped=0,
                    info={"candidates": n, "chunk": chunk, "memory_tokens": int(memory.shape[1])})

    @staticmethod
    def _forwarded(run, forward, memory, fragment, spans) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """``candidate_kv``'s result (B = 1) from ``forward`` (``serve_request``)."""
        if run.state.get("focusllm_gate") is not None:
            raise LcxError("focusllm's candidate adapter is open at the candidate position only, which only lcx's "
                           "own chunk forwards can do; compute these candidates without an outside forward")
        rows = [_group_rows(memory, spans, ChunkGroup([i], 0), fragment)[0].tolist() for i in range(len(spans))]
        per_chunk = forward(rows)
        layers = run.model.config.num_hidden_layers
        if len(per_chunk) != len(rows) or any(len(c) != layers for c in per_chunk):
            raise LcxError(f"focusllm: the outside chunk forward returned {len(per_chunk)} candidates for {len(rows)} "
                           f"chunks (of {[len(c) for c in per_chunk][:4]} layers; the model has {layers})")
        dtype = run.model.dtype
        return [(torch.stack([c[l][0] for c in per_chunk], dim=1)[None].to(dtype),
                 torch.stack([c[l][1] for c in per_chunk], dim=1)[None].to(dtype)) for l in range(len(per_chunk[0]))]

    def _chunking(self, run, input_tokens: int, new: int = 1) -> tuple[int, list[tuple[int, int]]]:
        """The chunk size of a prompt of ``input_tokens`` generating ``new`` more, and its memory chunks (none
        when it fits the local tokens)."""
        chunk = self.chunk_for(run.window, input_tokens, new)
        return chunk, chunk_spans(max(0, input_tokens - self.local), chunk, self.overlap)

    def _spans(self, run, input_tokens: int, new: int = 1) -> list[tuple[int, int]]:
        return self._chunking(run, input_tokens, new)[1]

    def _fragment(self, local: torch.Tensor, scored: int) -> torch.Tensor:
        """The tokens appended to every chunk: the last local ones, or when scoring, the last ones before the
        scored tokens."""
        return local[:, : self.local - scored][:, -self.fragment:]

    def reach(self, run, tokens: int, new: int, span: tuple[int, int]) -> tuple[bool, str]:
        if span[0] >= tokens - self.local:
            return True, f"the key was among the last {self.local:,} tokens, which the model reads as they are"
        chunk, spans = self._chunking(run, tokens, new)
        i = next((i for i, (s, e) in enumerate(spans) if s <= span[0] < e), len(spans) - 1)
        how = (f"; each query head reads only the best {self.topk} of these {len(spans)} candidates"
               if 0 < self.topk < len(spans) else "")
        return True, (f"the key was in memory chunk {i + 1} of {len(spans)} ({chunk:,} tokens each), which the "
                      f"model reads only through the one candidate token the chunk proposes{how}")

    def release(self, run) -> None:
        for key in ("focusllm_candidates", "focusllm_groups", "focusllm_generation"):
            run.state.pop(key, None)

    def forward_shapes(self, run, tokens: int) -> list[tuple[int, int, int]]:
        """The candidates' pass (its chunks as rows: all at once with parallel=0; in a grid, only the chunks
        the last prompt's memo lacks) and the local tokens' pass."""
        spans = self._spans(run, tokens)
        local = min(tokens, self.local)
        if not spans:
            return [(1, local, local)]
        width = max(e - s for s, e in spans) + self.fragment
        rows, passes = self.parallel or len(spans), [(1, local, len(spans) + local)]
        ids = run.request_ids
        if run.reuse is not None and ids is not None and ids.shape[0] == 1:  # a grid: a chunk memo is used
            todo = self._memo_misses(run, tokens)
            decoded = len(spans) if todo is None else len(todo)
            rows = min(rows, decoded)
            if self.refresh and tokens - ids.shape[1] > 1 and decoded:
                # the memo keeps the decoded chunks' own cache beside the copies refreshing reads (after their forward)
                from lcx.limits import kv_bytes_per_token

                passes.append((1, 0, 0, decoded * width * kv_bytes_per_token(run.model)))
        return ([(rows, width, width)] if rows else []) + passes

    def _memo_misses(self, run, tokens: int) -> list[int] | None:
        """While a request is checked: the chunks its forwards must decode when a grid's chunk memo holds the
        others (``ChunkMemo``); None without a memo (or an empty one): every chunk."""
        ids, reuse = run.request_ids, run.reuse
        memo = reuse.peek(run, "focusllm_chunks") if reuse is not None else None
        if memo is None or ids is None or ids.shape[0] != 1 or not memo.chunks:
            return None
        T = ids.shape[1]
        if T <= self.local:
            return []
        new = tokens - T
        fragment = self._fragment(ids[:, T - self.local:], run.scored)
        spans = self._spans(run, T, new)
        return memo.misses(ids[:, : T - self.local], fragment, spans, keep=bool(self.refresh) and new > 1)[1]

    def forward_hint(self, run) -> str | None:
        if self.parallel == 1:
            return None
        return "decode fewer candidate chunks at once (-o focusllm.parallel=N; 1 = one at a time)"

    def cache_tokens(self, run, tokens: int) -> int:
        """The decoder's cache: [candidates ; local tokens ; new tokens], at most the window (``lcx_plan``
        refuses more)."""
        return min(tokens, run.window)

    def memory_entries(self, run, input_tokens: int) -> int:
        """The chunk caches at their peak (``lcx.limits``): [chunk (+ overlap) ; fragment] per chunk, every chunk
        at once with parallel=0 or when candidates are refreshed (their caches are kept), else ``parallel``."""
        spans = self._spans(run, input_tokens)
        if not spans:
            return 0
        at_once = len(spans) if (not self.parallel or self.refresh) else min(self.parallel, len(spans))
        return at_once * (max(e - s for s, e in spans) + self.fragment)

    def generation_entries(self, run, input_tokens: int, max_new_tokens: int) -> int:
        """Refreshed candidates: each kept chunk cache grows by every generated token but the last."""
        if not self.refresh or max_new_tokens <= 1:
            return 0
        return len(self._spans(run, input_tokens, max_new_tokens)) * (max_new_tokens - 1)

    def check_serving(self):
        if self.refresh:
            raise LcxError(f"served focusllm keeps the prompt's candidates (vLLM runs no chunk forwards while it "
                           f"generates): serve it with -o focusllm.refresh=0, and compare it with `lcx generate "
                           f"--method focusllm -o focusllm.refresh=0` (got refresh={self.refresh})")

    def serves_prefix_kv(self):
        """The candidates' keys/values are the served state, read by plain attention: vLLM's own model code serves
        them through lcx's KV connector; with ``topk`` each query head picks its candidates, which only lcx's
        served attention can do (``served.FocusServed``)."""
        return not self.topk

    def served_attention(self) -> type:
        from lcx.plugins.focusllm.served import FocusServed

        return FocusServed

    @torch.no_grad()
    def serve_request(self, run, ids, max_new_tokens, forward=None):
        """The plan's tokens ([one placeholder per candidate ; local tokens]) and, per layer, the candidates'
        keys ``"{layer}.k"`` and values ``"{layer}.v"`` (H_kv, n, D), already at their slots 0..n-1; None for
        a prompt of at most ``local`` tokens (read as it is).  Served candidates are the prompt's
        (``refresh=0``): vLLM runs no chunk forwards while it generates.

        ``forward`` runs the chunk forwards elsewhere (the server's engine, ``lcx.integrations.vllm.connector``):
        given each chunk's [chunk ; fragment] token ids, it returns per chunk and layer the last position's
        (keys, values), each (H_kv, D), keys rotated at that position -- what ``candidate_kv`` computes
        training-free.  A candidate adapter needs lcx's forwards (its LoRA is open at one position only)."""
        self.check_serving()
        input_ids = torch.tensor([ids])
        plan = self._plan(run, input_ids, torch.ones_like(input_ids), max_new_tokens, forward)
        if plan is None:
            return None
        cand = run.state.pop("focusllm_candidates")
        tensors = {}
        for layer, (k, v) in enumerate(cand):
            tensors[f"{layer}.k"], tensors[f"{layer}.v"] = k[0].float().contiguous(), v[0].float().contiguous()
        return plan.input_ids[0].tolist(), tensors

    # ------------------------------------------------------------------ memory stage
    @hookimpl
    def lcx_memory(self, run, batch_size):
        cand = run.state.pop("focusllm_candidates", None)
        groups = run.state.pop("focusllm_groups", None)
        run.state.pop("focusllm_generation", None)
        if cand is None:
            return None
        cache = Cache(layers=[CandidateLayer(k, v) for k, v in cand])
        if groups is not None:
            plan = run.plan
            run.state["focusllm_generation"] = {"cache": cache, "groups": groups, "pending": [], "refreshes": 0,
                                                "prompt": int(plan.input_ids.shape[1]) if plan is not None else 0}
        return cache


    # ------------------------------------------------------------------ attention stage
    def idle_stages(self):
        return frozenset() if self.topk else frozenset({"lcx_attention"})  # without topk: the paper's attention

    @hookimpl
    def lcx_attention(self, run, module, query, key, value, attention_mask, kwargs):
        """``topk``: the decoder's queries read their ``topk`` best-scoring candidates only (per head)."""
        cache = run.memory
        layers = cache.layers if isinstance(cache, Cache) else []
        layer = layers[module.layer_idx] if module.layer_idx < len(layers) else None
        # the decoder's forward only (the chunk forwards that refresh candidates read their own caches)
        if (not isinstance(layer, CandidateLayer) or layer.candidates <= self.topk
                or key.data_ptr() != layer.keys.data_ptr()):
            return None
        mask = candidate_topk_mask(query, key, layer.candidates, self.topk, attention_mask, run.base_impl)
        return run.base_attention(module, query, key, value, mask, **kwargs)
