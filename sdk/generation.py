"""Generation through a run: chunking plan -> memory -> prefill windows -> ``model.generate``."""

from __future__ import annotations

import contextlib
import contextvars
import copy
import logging
from typing import Any, Callable, Iterator

import torch
from tqdm.auto import tqdm
from transformers import DynamicCache

from lcx.composition import Run
from lcx.errors import LcxError
from lcx.limits import check_request, trim_heap
from lcx.plan import Plan


def position_ids_from_mask(attention_mask: torch.Tensor) -> torch.Tensor:
    """Positions that skip left padding: 0 at each row's first real token."""
    return (attention_mask.long().cumsum(-1) - 1).clamp(min=0)


def new_memory(run: Run, plan: Plan) -> Any:
    """Record the plan and create the run's memory for it (the method's Cache, or a DynamicCache)."""
    run.plan = plan
    cache = run.hook.lcx_memory(run=run, batch_size=plan.input_ids.shape[0]) or DynamicCache(config=run.model.config)
    run.memory = cache
    return cache


class PrefixReuse:
    """Prompts that start alike feed their common leading windows once (a passkey grid: every key of a
    cell shares the filler before its needle).

    Generation with ``reuse=`` and ``shared=P`` (tokens the caller expects later prompts to share)
    keeps a copy of the memory after the last window that ends at or before P; a later prompt whose
    first tokens equal that snapshot's, on the same run, starts from a copy of it.  The copy is the
    whole per-prompt state of methods whose ``reusable_prefix()`` is true, so outputs are the same as
    feeding every window (tested); for other methods, or batches, it does nothing.  One snapshot is
    kept: its memory can be as large as the prompt's.

    A method whose chunking stage computes per-prompt state before any window is fed (focusllm's
    candidates) may keep what later prompts can take from it in :meth:`memo` (its ``lcx_plan`` finds
    this object in ``run.reuse`` while ``generate`` plans)."""

    def __init__(self) -> None:
        self.run: Run | None = None
        self.ids: torch.Tensor | None = None  # (1, E) tokens of the snapshot's windows
        self.windows: list[tuple[int, int]] = []
        self.cache: Any = None
        self.reused = 0  # windows not fed again, over all prompts (for reporting and tests)
        self._memos: dict[str, Any] = {}
        self._memo_run: Run | None = None

    def peek(self, run: Run, name: str) -> Any:
        """The method's memo ``name`` for prompts of ``run`` if one is kept, else None (an estimate reads it)."""
        return self._memos.get(name) if self._memo_run is run else None

    def memo(self, run: Run, name: str, factory: Callable[[], Any]) -> Any:
        """The method's own memo ``name`` for prompts of ``run`` (a new one from ``factory`` the first time,
        and for every name again when the run changes: another model, adapter or options)."""
        if self._memo_run is not run:
            self._memos, self._memo_run = {}, run
        if name not in self._memos:
            self._memos[name] = factory()
        return self._memos[name]

    @staticmethod
    def applies(run: Run, plan: Plan) -> bool:
        return plan.input_ids.shape[0] == 1 and bool(run.methods) and all(m.reusable_prefix() for m in run.methods)

    def restore(self, run: Run, plan: Plan, windows: list[tuple[int, int]]) -> tuple[int, Any]:
        """(windows already fed, the cache holding them) for this plan: from the snapshot, or (0, new)."""
        n = len(self.windows)
        if (self.cache is None or self.run is not run or not self.applies(run, plan) or windows[:n] != self.windows
                or not torch.equal(plan.input_ids[:, : self.ids.shape[1]], self.ids)
                or not bool(plan.attention_mask[:, : self.ids.shape[1]].all())):
            return 0, new_memory(run, plan)
        run.plan = plan
        run.memory = cache = copy.deepcopy(self.cache)
        self.reused += n
        return n, cache

    def offer(self, run: Run, plan: Plan, windows: list[tuple[int, int]], done: int, shared: int, cache: Any) -> None:
        """After ``done`` windows: snapshot if they are all the windows inside the first ``shared`` tokens."""
        if done != sum(1 for _, e in windows if e <= shared) or not self.applies(run, plan):
            return  # not the last window inside the shared tokens (a restored prompt starts past it)
        self.run, self.windows, self.ids = run, list(windows[:done]), plan.input_ids[:, : windows[done - 1][1]].clone()
        self.cache = None  # free the old snapshot before copying the new one
        self.cache = copy.deepcopy(cache)


@torch.no_grad()
def prefill(run: Run, plan: Plan, include_last: bool = False,
            on_window: Callable[[int, int], None] | None = None,
            reuse: PrefixReuse | None = None, shared: int = 0, progress: bool = False) -> Any:
    """Create the run's memory and feed the plan's windows into it: all but the last (which
    generation feeds), or all of them with ``include_last`` (building a memory).
    ``on_window(start, end)`` runs after each window (progress, timing); ``progress`` shows a bar over
    the tokens fed (on stderr, gone when they are in).  With ``reuse``, the windows inside the first
    ``shared`` tokens come from, or go to, its snapshot (:class:`PrefixReuse`)."""
    model = run.model
    windows = plan.windows if include_last else plan.windows[:-1]
    done, cache = reuse.restore(run, plan, windows) if reuse is not None else (0, new_memory(run, plan))
    pos = position_ids_from_mask(plan.attention_mask)
    fed = sum(e - s for s, e in windows[done:])
    bar = tqdm(total=fed, desc="reading the prompt", unit="tok", leave=False, disable=not progress or not fed)
    try:
        for i in range(done, len(windows)):
            s, e = windows[i]
            model(
                input_ids=plan.input_ids[:, s:e],
                attention_mask=plan.attention_mask[:, :e],
                position_ids=pos[:, s:e],
                past_key_values=cache,
                use_cache=True,
                logits_to_keep=1,
            )
            if reuse is not None and shared:
                reuse.offer(run, plan, windows, i + 1, shared, cache)
            if on_window is not None:
                on_window(s, e)
            bar.update(e - s)
    finally:
        bar.close()
    return cache


def release_last_request(run: Run) -> None:
    """A new request starts: the last one's memory and the methods' state for it go now, so that the limits
    check sees the memory they held as free (a long focusllm prompt's chunk caches are gigabytes)."""
    held = run.memory is not None
    run.memory = run.plan = None
    for m in run.methods:
        m.release(run)
    if held:  # what it held is in the process's heap still, where the check would not see it as free
        trim_heap()


def make_plan(run: Run, input_ids: torch.Tensor, attention_mask: torch.Tensor | None, max_new_tokens: int) -> Plan:
    if input_ids.ndim != 2:
        raise LcxError(f"input_ids must be a (batch, tokens) tensor, got shape {tuple(input_ids.shape)}; "
                       f"for one prompt pass ids[None]")
    if input_ids.shape[1] == 0:
        raise LcxError(f"empty input: got input_ids of shape {tuple(input_ids.shape)}; give at least one token")
    if attention_mask is None:
        attention_mask = torch.ones_like(input_ids)
    release_last_request(run)
    for m in run.methods:
        m.begin_request(run, int(input_ids.shape[1]), max_new_tokens)
    run.request_ids = input_ids
    try:
        check_request(run, int(input_ids.shape[1]), max_new_tokens, batch=int(input_ids.shape[0]))
    finally:
        run.request_ids = None
    device = model_device(run.model)  # inputs follow the model: the caller's tensors may be on the CPU
    input_ids, attention_mask = input_ids.to(device), attention_mask.to(device)
    plan = run.hook.lcx_plan(
        run=run, input_ids=input_ids, attention_mask=attention_mask, max_new_tokens=max_new_tokens
    )
    plan = plan if plan is not None else Plan.whole(input_ids, attention_mask)
    plan.input_ids, plan.attention_mask = plan.input_ids.to(device), plan.attention_mask.to(device)
    return plan


def model_device(model: Any) -> torch.device:
    """Where ``model`` runs (the device of its first parameter; a PeftModel's too)."""
    try:
        return next(model.parameters()).device
    except StopIteration:
        return torch.device("cpu")


@torch.no_grad()
def generate(
    run: Run,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor | None = None,
    max_new_tokens: int = 32,
    reuse: PrefixReuse | None = None,
    shared: int = 0,
    progress: bool = False,
    **generate_kwargs: Any,
) -> torch.Tensor:
    """Generate ``max_new_tokens`` after a (possibly very long) prompt; returns only the new tokens (B, N).
    ``reuse``/``shared``: feed leading windows other prompts share once (:class:`PrefixReuse`);
    ``progress``: a bar while the prompt's windows are read (methods that read it window by window)."""
    if reuse is not None:
        run.reuse = reuse
    try:
        plan = make_plan(run, input_ids, attention_mask, max_new_tokens)
    finally:
        run.reuse = None
    cache = prefill(run, plan, reuse=reuse, shared=shared, progress=progress)
    kwargs = dict(do_sample=False, pad_token_id=_pad_id(run.model))
    kwargs.update(generate_kwargs)
    with _past_window_reminder_muted(any(m.reads_past_window for m in run.methods)):
        out = run.model.generate(
            input_ids=plan.input_ids,
            attention_mask=plan.attention_mask,
            past_key_values=cache,
            max_new_tokens=max_new_tokens,
            **kwargs,
        )
    return out[:, plan.input_ids.shape[1]:]


_REMINDER = "predefined maximum length"
_reminder_muted: contextvars.ContextVar[bool] = contextvars.ContextVar("lcx_past_window_reminder_muted", default=False)


@contextlib.contextmanager
def _past_window_reminder_muted(muted: bool) -> Iterator[None]:
    """Mute transformers' reminder that a generation 'has exceeded the model's predefined maximum length' while a
    method that reads past the window generates, in this thread or task only.  The reminder is skipped before
    transformers' once-a-process cache sees it, so the bare model past its window still hears it."""
    if not muted:
        yield
        return
    logger = logging.getLogger("transformers.generation.stopping_criteria")
    if "warning_once" not in logger.__dict__:  # one filter for good: installing and removing races across threads

        def warning_once(msg: object, *args: Any, **kwargs: Any) -> None:
            if not (_reminder_muted.get() and _REMINDER in str(msg)):
                logging.Logger.warning_once(logger, msg, *args, **kwargs)  # type: ignore[attr-defined]

        logger.warning_once = warning_once  # type: ignore[attr-defined]
    token = _reminder_muted.set(True)
    try:
        yield
    finally:
        _reminder_muted.reset(token)


def _pad_id(model: Any) -> int | None:
    gc = getattr(model, "generation_config", None)
    pad = getattr(gc, "pad_token_id", None)
    if pad is None:
        eos = getattr(gc, "eos_token_id", None)
        pad = eos[0] if isinstance(eos, list) else eos
    return pad


@torch.no_grad()
def tail_logits(run: Run, input_ids: torch.Tensor, n_target: int) -> torch.Tensor:
    """Logits (n_target, V) predicting the last ``n_target`` tokens of ``input_ids`` (1, T), computed
    through the run's plan and memory; each window's logits are kept only where they predict a target."""
    if input_ids.shape[1] <= n_target:
        raise LcxError(f"input of {input_ids.shape[1]} tokens is too short to score its last {n_target}")
    run.scored = n_target  # a plan that reads later tokens for earlier positions must keep these out of that
    try:
        plan = make_plan(run, input_ids, None, 0)
    finally:
        run.scored = 0
    ids = plan.input_ids
    T = ids.shape[1]
    if not torch.equal(ids[0, T - n_target - 1:].cpu(), input_ids[0, -n_target - 1:].cpu()):
        raise LcxError(f"the {run!r} plan dropped scored tokens; score fewer than the window ({T} tokens kept)")
    model = run.model
    cache = new_memory(run, plan)
    pos = position_ids_from_mask(plan.attention_mask)
    first_pred = T - n_target - 1  # logits at positions [first_pred, T-2] predict the targets
    chunks = []
    for s, e in plan.windows:
        keep = max(0, min(e, T - 1) - max(s, first_pred))
        out = model(input_ids=ids[:, s:e], attention_mask=plan.attention_mask[:, :e], position_ids=pos[:, s:e],
                    past_key_values=cache, use_cache=True, logits_to_keep=(keep + (1 if e == T else 0)) or 1)
        if keep:
            logits = out.logits[0, :keep] if e != T else out.logits[0, :-1][-keep:]
            chunks.append(logits.float())
    return torch.cat(chunks)[-n_target:]


def score_tail(run: Run, input_ids: torch.Tensor, n_target: int) -> dict[str, float]:
    """Summed next-token NLL and correct count of the last ``n_target`` tokens (see ``tail_logits``)."""
    logits = tail_logits(run, input_ids, n_target)
    targets = input_ids[0, -n_target:].to(logits.device)
    nll = torch.nn.functional.cross_entropy(logits, targets, reduction="sum")
    correct = (logits.argmax(-1) == targets).sum()
    return {"nll_sum": float(nll), "correct": int(correct), "count": int(n_target)}
