"""focusllm training: the sampling and loss stages that train the candidate adapter.

Training (``lcx train --method focusllm``; only the candidate adapter trains, the base weights stay
frozen): per step and loss term, a chunk size is drawn from ``train_chunks`` and a local size at
random; the *continuation* term reads the training window's end as the local tokens, the
*repetition* term a span copied from inside the memory, the *recall* term (with ``fresh``) the window's
end followed by a short cue copied from the memory and the value that follows it there, as a question is
followed by what a document said after the same words; the value is random tokens of the window, which the
local tokens cannot guess (as a passkey's digits); with ``recall_local``, a share of the draws puts a random
cue and value among the local tokens instead, earlier than the question (a passkey near the end).  The
candidates see the local tokens' first ``fragment`` tokens; the loss is the frozen decoder's next-token
loss on the local tokens after them.  Only the candidate position of each chunk carries autograd (its
chunk is read without it), so a step costs one no-grad pass over the window plus a backward pass over
the local tokens.

That training predicts most local tokens with candidates that have not seen the tokens before them,
while exact generation refreshes every candidate before each token.  ``fresh=N`` trains for what
generation does: only the last N local tokens are predicted, token j with every candidate refreshed
through the token before it (``fresh_candidates``: N candidate sets from one gated pass), and the
earlier local tokens read the first set without autograd, as a prefill would.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, replace

import torch

from lcx.errors import LcxError
from lcx.hookspecs import hookimpl
from lcx.plugins.focusllm.cache import _kv_cache
from lcx.plugins.focusllm.candidates import (_additive, candidate_kv, candidate_positions, chunk_spans, fresh_candidates,
                                             to_slots)

#: Training loss terms (``-o focusllm.losses``).
LOSSES = ("continuation", "repetition", "recall")
#: The recall term's cue: how many copied tokens come before the predicted ones (drawn per step).
RECALL_CUE = (4, 32)


@dataclass(frozen=True)
class TrainDraw:
    """One loss term's draw for a training step (token counts; ``start`` is where the local tokens begin)."""

    chunk: int
    local: int
    fragment: int
    memory: int
    start: int
    fresh: int = 0  # predicted tokens with refreshed candidates (0: every local token after the fragment)
    source: int = 0  # recall: where in the memory the local tokens' last `copied` tokens come from
    copied: int = 0
    values: tuple[int, ...] = ()  # recall: window positions whose tokens are the value (placed: the cue and value)
    placed: int = -1  # recall: where among the local tokens the cue and value sit (-1: in the memory)


class CandidateTraining:
    """FocusLLM's training hooks, a mixin of :class:`~lcx.plugins.focusllm.method.FocusLLM`: they read its options
    (``local``, ``fragment``, ``overlap``, ``parallel``, ``fresh``, ``recall_local``, ``train_chunks``)."""

    # ------------------------------------------------------------------ training: sampling stage
    @hookimpl
    def lcx_sample(self, run, batch, step):
        """Per loss term, a draw of chunk size, local size and (repetition) the copied span: a pure
        function of (seed, step), so resumed runs draw the same.  Every process draws the same: the draw
        sets how many forwards a step makes, and DDP needs the same number on each (each forward of the
        wrapped model is a collective); the processes differ by their data."""
        self._check_trainable(run)
        ids = batch["input_ids"]
        rng = random.Random(f"focusllm:{run.seed}:{step}")
        return {"input_ids": ids, "focusllm": {t: self._draw(run.window, ids.shape[1], t, rng) for t in self._terms}}

    def _draw(self, window: int, N: int, term: str, rng: random.Random) -> TrainDraw:
        """Chunk c from ``train_chunks`` (one chunk + its fragment within the window, at least one chunk of
        memory, candidates + local tokens within the window); local size l uniform in [hi / 4, hi] with
        hi = ``local`` (continuation, recall) or c (repetition: a span no longer than a chunk, so that one or two
        candidates hold it); fragment = min(``fragment``, c, l // 2), so at least half the local tokens are
        predicted.  Continuation: memory = the first N - l tokens, local = the last l.  Repetition: the same
        memory, local = a copy of memory[s:s + l].  Recall: local = the last l - m tokens, then a copy of
        memory[s:s + m], m = cue + ``fresh`` (the fresh tokens predicted are the copy's after the cue;
        the cue is 4-32 tokens, and at least 2 local tokens precede it); those ``fresh`` tokens, in the memory
        and so in the copy, are the window's tokens at ``values`` (random positions).  With probability
        ``recall_local`` (when l >= 2m) the copy is instead m random tokens of the window (cue and value), which
        also replace local[p:p + m], p = ``placed``, before the copy."""
        least = RECALL_CUE[0] + self.fresh + 2 if term == "recall" else 2

        def limit(c: int) -> int:
            hi = min(c, (N - c) // 2) if term == "repetition" else min(self.local, N - c)
            if term == "recall":  # the memory holds the copied span (a cue of 4 or more, then `fresh` tokens)
                hi = min(hi, N - RECALL_CUE[0] - self.fresh)
            reads = c + self.overlap + min(self.fragment, c) + self.fresh  # one chunk's forward
            return hi if hi >= least and reads <= window and -(-(N - 2) // c) + hi <= window and self.overlap < c else 0

        fits = [c for c in self._chunks if limit(c)]
        if not fits:
            raise LcxError(f"focusllm {term} training: no chunk size in train_chunks={self.train_chunks} fits "
                           f"{N}-token training windows and the model's {window}-token window; use a longer --seq-len "
                           f"or smaller -o focusllm.train_chunks" + (f" (each longer than overlap={self.overlap})" if self.overlap else ""))
        c = rng.choice(fits)
        hi = limit(c)
        l = rng.randint(max(least, hi // 4), hi)
        start = rng.randrange(0, N - l - l + 1) if term == "repetition" else N - l
        if not self.fresh:
            return TrainDraw(chunk=c, local=l, fragment=max(1, min(self.fragment, c, l // 2)), memory=N - l, start=start)
        # the last `fresh` tokens predicted (at most half the local ones; recall: every one, after its cue);
        # the fragment ends before them
        fresh = self.fresh if term == "recall" else min(self.fresh, l // 2)
        draw = TrainDraw(chunk=c, local=l, fragment=max(1, min(self.fragment, c, l - fresh)), memory=N - l,
                         start=start, fresh=fresh)
        if term != "recall":
            return draw
        m = rng.randint(RECALL_CUE[0], min(RECALL_CUE[1], l - fresh - 2, N - l - fresh)) + fresh
        placed = -1
        if self.recall_local and rng.random() < self.recall_local and l >= 2 * m:
            placed = rng.randrange(0, l - 2 * m + 1)
        return replace(draw, source=rng.randrange(0, N - l - m + 1), copied=m, placed=placed,
                       values=tuple(rng.randrange(0, N) for _ in range(m if placed >= 0 else fresh)))

    def _check_trainable(self, run) -> None:
        if run.state.get("focusllm_checked"):
            return
        if "focusllm_gate" not in run.state:
            raise LcxError("focusllm trains its candidate adapter (a LoRA on q/k/v/o), and this model has none; "
                           "train without --full all")
        extra = [n for n, p in run.model.named_parameters() if p.requires_grad and "lora_" not in n]
        if extra:
            raise LcxError(f"focusllm trains only its candidate adapter, which keeps the base weights frozen; "
                           f"{extra[0]!r} would train for every token; drop --full")
        run.state["focusllm_checked"] = True

    # ------------------------------------------------------------------ training: loss stage
    @hookimpl
    def lcx_loss(self, run, model, batch):
        """Per term: candidates of the memory's chunks (with autograd through the adapter at the candidate
        positions only), then the frozen decoder reads [candidates ; local] with contiguous positions and
        the loss is the next-token loss on the local tokens after the fragment (the candidates saw the
        fragment, never the tokens predicted)."""
        draws = batch.get("focusllm")
        if draws is None:
            return None
        ids = batch["input_ids"]
        gate = run.state["focusllm_gate"]
        terms = {}
        for term, d in draws.items():
            local = ids[:, d.start:d.start + d.local]
            memory = ids[:, :d.memory]
            if d.copied:  # recall: the local tokens end with a cue and its value, the value random tokens
                head = local[:, :d.local - d.copied]
                if d.placed < 0:  # the cue is a span of the memory, its value written after it there
                    memory = memory.clone()
                    memory[:, d.source + d.copied - d.fresh:d.source + d.copied] = ids[:, list(d.values)]
                    span = memory[:, d.source:d.source + d.copied]
                else:  # cue and value random, and among the local tokens before the question
                    span = ids[:, list(d.values)]
                    head = torch.cat([head[:, :d.placed], span, head[:, d.placed + d.copied:]], 1)
                local = torch.cat([head, span], 1)
            if d.fresh:
                terms[term] = self._fresh_loss(run, model, gate, memory, local, d)
                continue
            spans = chunk_spans(d.memory, d.chunk, self.overlap)
            cand = candidate_kv(model, memory, local[:, :d.fragment], spans, self.parallel, gate, grad=True)
            cache = _kv_cache(run.model.config, to_slots(cand, candidate_positions(spans, d.fragment), run))
            n = len(spans)
            labels = local.clone()
            labels[:, :d.fragment] = -100
            pos = torch.arange(n, n + d.local, device=ids.device)[None].expand(ids.shape[0], -1)
            with gate.only(torch.zeros_like(local, dtype=torch.float32)):
                terms[term] = model(input_ids=local, position_ids=pos, past_key_values=cache, labels=labels,
                                    attention_mask=torch.ones(ids.shape[0], n + d.local, dtype=torch.long,
                                                              device=ids.device),
                                    use_cache=True).loss
        return terms


    def _fresh_loss(self, run, model, gate, memory, local, d: TrainDraw) -> torch.Tensor:
        """``fresh`` training: the last N = ``d.fresh`` local tokens predicted as exact generation predicts
        them.  The prompt is local[:t0 + 1] (t0 = l - N - 1), its fragment the F tokens ending at t0; token
        t0 + j is read with candidate set j (refreshed through it) and the prompt tokens before t0 with set
        0, without autograd (as a prefill would compute them)."""
        l, N, F = d.local, d.fresh, d.fragment
        t0 = l - N - 1
        sets, positions = fresh_candidates(model, memory, local[:, t0 - F + 1:l - 1], F,
                                           chunk_spans(d.memory, d.chunk, self.overlap), self.parallel, gate, grad=True)
        n = len(positions) // N
        sets = to_slots(sets, positions, run, slots=torch.arange(n).repeat(N))
        B, dev = local.shape[0], local.device
        prefix = [(k[:, :, :n].detach(), v[:, :, :n].detach()) for k, v in sets]
        if t0:  # the prompt before its last token, reading set 0 (the prefill's candidates)
            cache = _kv_cache(run.model.config, prefix)
            with torch.no_grad(), gate.only(torch.zeros(B, t0, device=dev)):
                cache = model(input_ids=local[:, :t0], position_ids=torch.arange(n, n + t0, device=dev)[None].expand(B, -1),
                              past_key_values=cache, attention_mask=torch.ones(B, n + t0, dtype=torch.long, device=dev),
                              use_cache=True, logits_to_keep=1).past_key_values
            prefix = [(layer.keys[:, :, n:], layer.values[:, :, n:]) for layer in cache.layers]
        else:
            prefix = [(k[:, :, :0], v[:, :, :0]) for k, v in prefix]
        cache = _kv_cache(run.model.config, [(torch.cat([k, pk], 2), torch.cat([v, pv], 2))
                                             for (k, v), (pk, pv) in zip(sets, prefix)])
        allowed = torch.zeros(N, N * n + t0 + N, dtype=torch.bool, device=dev)
        for j in range(N):  # token t0 + j: candidate set j, the prompt before t0, the fed tokens t0..t0 + j
            allowed[j, j * n:(j + 1) * n] = True
            allowed[j, N * n:N * n + t0 + j + 1] = True
        mask = _additive(allowed, model)
        with gate.only(torch.zeros(B, N, device=dev)):
            logits = model(input_ids=local[:, t0:l - 1], position_ids=torch.arange(n + t0, n + l - 1, device=dev)[None].expand(B, -1),
                           past_key_values=cache, attention_mask=mask[None, None].expand(B, 1, -1, -1),
                           use_cache=True).logits
        return torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), local[:, t0 + 1:].flatten())
