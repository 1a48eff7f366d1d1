"""lm-evaluation-harness model ``lcx``: lm-eval's three request types answered through an lcx method stack.

    lcx eval lm-eval run --model lcx --model_args model=smollm2-135m,method=fot,fot.local=1024 --tasks ...

``model_args``: ``model`` (a known name or a folder), ``method`` (methods joined by ``+``; none: the bare
model), ``adapter``, ``dtype``, ``device``, ``tokenizer`` (read by lm-eval's RULER tasks to size their
prompts, not by this model), and every other ``KEY=VALUE`` a method option as ``-o`` takes it
(``fot.local=1024``).  Prompts longer than the model's window are the point: they go through the stack's
plan and memory as ``lcx generate`` and ``lcx eval ppl`` read them.

lm-eval 0.4 finds models only in its own list or where they were imported; importing this module registers
``lcx``, which ``lcx eval lm-eval`` (lm-eval's command line, this module imported first) and Python users
(``import lcx.integrations.lm_eval`` before ``lm_eval.simple_evaluate``) rely on.
"""

from __future__ import annotations

from typing import Any

import lm_eval.models  # noqa: F401  (lm-eval fills its model list only while empty: its own models first)
import torch
from lm_eval.api.model import LM
from lm_eval.api.registry import register_model
from tqdm.auto import tqdm

from lcx.data import special_prefix
from lcx.generation import generate, score_tail
from lcx.session import open_session, parse_options

#: model_args lm-eval passes to every model, which this one has no use for
_IGNORED = ("batch_size", "max_batch_size", "tokenizer", "pretrained", "trust_remote_code_warning")


@register_model("lcx")
class LcxLM(LM):
    """One lcx session (model, adapter, methods) answering lm-eval requests one at a time."""

    def __init__(self, model: str, method: str | None = None, adapter: str | None = None, dtype: str | None = None,
                 device: str | None = None, trust_remote_code: bool = False, **options: Any) -> None:
        super().__init__()
        if device and str(device).startswith("cuda") and not torch.cuda.is_available():
            device = None  # lm-eval's default device, "cuda:0", on a CPU machine: lcx's own default, as HFLM does
        methods = [m for m in str(method or "").split("+") if m.strip() and m.strip() != "none"]
        extra = {k: v for k, v in options.items() if k not in _IGNORED}
        self.session = open_session(str(model), methods, parse_options([f"{k}={v}" for k, v in extra.items()]),
                                    adapter, trust_remote_code=bool(trust_remote_code), device=device, dtype=dtype)
        self.run, self.tokenizer = self.session.run, self.session.tokenizer
        self.bos = special_prefix(self.tokenizer)  # Gemma's <bos>; none for SmolLM2 and Qwen2.5
        # a first token is predicted from the BOS, or else from the EOS, as lm-eval's own HF model does
        self.prefix = self.bos or [self.tokenizer.eos_token_id]

    # ------------------------------------------------------------------ requests
    def _encode_pair(self, context: str, continuation: str) -> tuple[list[int], list[int]]:
        """Context and continuation ids, split where the whole string's ids start the continuation (merges
        across the seam stay with the continuation, as lm-eval's HF model splits them)."""
        spaces = len(context) - len(context.rstrip())
        if spaces:  # lm-eval moves trailing spaces of the context onto the continuation
            context, continuation = context[:-spaces], context[-spaces:] + continuation
        whole = self.bos + self.tokenizer(context + continuation, add_special_tokens=False)["input_ids"]
        ctx = self.bos + self.tokenizer(context, add_special_tokens=False)["input_ids"]
        if not ctx:  # nothing to predict the first token from
            return self.prefix, whole
        return whole[:len(ctx)], whole[len(ctx):]

    def _score(self, ids: list[int], n: int) -> tuple[float, bool]:
        s = score_tail(self.run, torch.tensor([ids]), n)
        return -s["nll_sum"], s["correct"] == s["count"]

    def loglikelihood(self, requests: list[Any], disable_tqdm: bool = False) -> list[tuple[float, bool]]:
        out = []
        for req in tqdm(requests, desc="lcx loglikelihood", disable=disable_tqdm):
            context, continuation = req.args
            ctx, cont = self._encode_pair(context, continuation)
            out.append(self._score(ctx + cont, len(cont)) if cont else (0.0, True))
        return out

    def loglikelihood_rolling(self, requests: list[Any], disable_tqdm: bool = False) -> list[float]:
        """Every token of the text scored, through the stack's plan (its windows and memory) at once."""
        out = []
        for req in tqdm(requests, desc="lcx loglikelihood_rolling", disable=disable_tqdm):
            ids = self.tokenizer(req.args[0], add_special_tokens=False)["input_ids"]
            out.append(self._score(self.prefix + ids, len(ids))[0] if ids else 0.0)
        return out

    def generate_until(self, requests: list[Any], disable_tqdm: bool = False) -> list[str]:
        """Greedy continuations (lcx's decoding; sampling arguments are not honoured), cut at the first stop
        string."""
        out = []
        for req in tqdm(requests, desc="lcx generate_until", disable=disable_tqdm):
            context, kwargs = req.args
            until = kwargs.get("until") or []
            until = [until] if isinstance(until, str) else list(until)
            ids = torch.tensor([self.tokenizer(context, add_special_tokens=True)["input_ids"]])
            stop = dict(stop_strings=until, tokenizer=self.tokenizer) if until else {}
            new = generate(self.run, ids, max_new_tokens=int(kwargs.get("max_gen_toks", 256)), **stop)
            text = self.tokenizer.decode(new[0], skip_special_tokens=True)
            for s in until:
                text = text.split(s)[0]
            out.append(text)
        return out

    def close(self) -> None:
        self.session.close()
