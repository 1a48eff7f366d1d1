"""Per-request resource limits: token and memory-entry caps, and a memory estimate checked against
the machine's free RAM before any work starts, so a request too big for the machine is a clear
error rather than an out-of-memory kill halfway through a long prefill.

Defaults (documented in docs/limits.md; each can be changed per command or by environment variable):

==========================  ===========  ===============================  =========================
cap                         default      flag                             environment
==========================  ===========  ===============================  =========================
prompt tokens per request   262,144      ``--max-input-tokens``           ``LCX_MAX_INPUT_TOKENS``
new tokens per request      4,096        --                               ``LCX_MAX_NEW_TOKENS``
memory entries per layer    4,194,304    ``--max-memory-entries``         ``LCX_MAX_MEMORY_ENTRIES``
and KV head (fot)
share of free RAM a         0.9          --                               ``LCX_RAM_FRACTION``
request may plan to use
allowance for glibc's heap  1.5          --                               ``LCX_HEAP_ALLOWANCE``
(RAM, its own policy)
==========================  ===========  ===============================  =========================

The memory estimate is an upper bound: the keys and values of every layer for every token the cache
holds at once (every token of the request for the bare model; a method whose cache keeps a window says
how many, ``Method.cache_tokens``), what the largest forward pass allocates besides (masks, attention,
activations, logits: ``forward_bytes`` of ``Method.forward_shapes``, by default windows of
``lcx.plan.PREFILL_CHUNK`` queries), plus the methods' own memories after the request (``Method.memory_bytes``:
fot's stores in its memory layers, with what a multi-document memory already holds).  Each part is checked
against the device it lives on: the cache against the model's (a GPU's free memory for a model on CUDA, the
machine's free RAM otherwise), a method's memory against ``Method.memory_device`` (fot's FAISS stores: the
host's RAM, wherever the model runs).  What is planned in RAM counts ``heap_allowance`` times under glibc's own
heap policy, which keeps freed activations in its heap (``bound_heap``: none with ``LCX_BOUNDED_HEAP=1``).
"""

from __future__ import annotations

import dataclasses
import os
import sys
from dataclasses import dataclass
from typing import Any

from lcx.errors import LcxError

_ENV = {"max_input_tokens": "LCX_MAX_INPUT_TOKENS", "max_new_tokens": "LCX_MAX_NEW_TOKENS",
        "max_memory_entries": "LCX_MAX_MEMORY_ENTRIES", "ram_fraction": "LCX_RAM_FRACTION",
        "heap_allowance": "LCX_HEAP_ALLOWANCE"}
_FRACTIONS = ("ram_fraction", "heap_allowance")


class LimitError(LcxError):
    """A request over a resource limit."""


@dataclass(frozen=True)
class Limits:
    max_input_tokens: int = 262_144
    max_new_tokens: int = 4_096
    max_memory_entries: int = 4_194_304
    ram_fraction: float = 0.9
    heap_allowance: float = 1.5  # what a request grows RAM by, per byte of its estimate, under glibc's heap policy

    @classmethod
    def from_env(cls, **overrides: Any) -> "Limits":
        """Defaults, then ``LCX_*`` environment variables, then ``overrides`` that are not None."""
        values: dict[str, Any] = {}
        for f in dataclasses.fields(cls):
            raw = os.environ.get(_ENV[f.name])
            if raw:
                try:
                    values[f.name] = float(raw) if f.name in _FRACTIONS else int(raw)
                except ValueError:
                    raise LcxError(f"{_ENV[f.name]}={raw!r} is not a number") from None
        values.update({k: v for k, v in overrides.items() if v is not None})
        limits = cls(**values)
        for f in dataclasses.fields(cls):
            if getattr(limits, f.name) <= 0:
                raise LcxError(f"{f.name} must be > 0, got {getattr(limits, f.name)}")
        if limits.heap_allowance < 1:
            raise LcxError(f"heap_allowance must be >= 1 (1: the estimate as it is), got {limits.heap_allowance}")
        return limits


def available_ram() -> int:
    """Bytes the kernel says can be allocated without swapping (``MemAvailable``)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def _glibc(call: str, *args: int) -> None:
    """``call(*args)`` in glibc's allocator; nothing where the C library is another (musl) or not Linux's."""
    if not sys.platform.startswith("linux"):
        return
    try:
        import ctypes

        getattr(ctypes.CDLL("libc.so.6"), call)(*args)
    except (OSError, AttributeError):  # not glibc: its own allocator's policy stands
        pass


def trim_heap() -> None:
    """Hand freed heap pages back to the OS (glibc ``malloc_trim``).  Tensors of a few MB come from malloc's
    heap, whose freed pages glibc may keep: the process can reuse them, but ``available_ram`` does not count
    them, so a long grid's next prompt could be refused for memory its last one had just freed."""
    _glibc("malloc_trim", 0)


#: Allocations of this many bytes or more get their own mapping from glibc, unmapped when freed.
MMAP_THRESHOLD = 1 << 20
_heap_bounded = False


def bound_heap() -> None:
    """With ``LCX_BOUNDED_HEAP=1``, have glibc map every allocation of ``MMAP_THRESHOLD`` bytes or more on its
    own and unmap it when freed, so a request grows the process by its live tensors, which is what the memory
    estimate counts.  glibc's own policy raises that threshold (up to 32 MiB) after large frees, so activations
    of a few MB come from its heap, whose holes can grow the process past the estimate; it is faster, hence the
    default (benchmarks/memory-estimate.md).  Once per process; ``MALLOC_MMAP_THRESHOLD_``, if set, is kept."""
    global _heap_bounded
    if _heap_bounded or os.environ.get("LCX_BOUNDED_HEAP", "0") in ("", "0") or "MALLOC_MMAP_THRESHOLD_" in os.environ:
        return
    _heap_bounded = True
    _glibc("mallopt", -3, MMAP_THRESHOLD)  # -3: M_MMAP_THRESHOLD in glibc's malloc.h


def heap_allowance(device: Any, limits: Limits) -> float:
    """How many bytes of ``device``'s free memory a planned byte counts for: ``limits.heap_allowance`` in RAM
    under glibc's own heap policy, whose kept holes grow the process past the request's live tensors
    (benchmarks/memory-estimate.md); 1 on a GPU, or with a bounded heap (``bound_heap``, or a threshold the user
    fixed with ``MALLOC_MMAP_THRESHOLD_``, which glibc then does not raise)."""
    import torch

    bounded = _heap_bounded or "MALLOC_MMAP_THRESHOLD_" in os.environ or not sys.platform.startswith("linux")
    return 1.0 if torch.device(device).type != "cpu" or bounded else limits.heap_allowance


def available_memory(device: Any) -> int:
    """Bytes free for new tensors on ``device``: a CUDA device's free memory plus what torch's allocator holds
    unused (it reuses those blocks), the machine's free RAM otherwise."""
    import torch

    device = torch.device(device)
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return int(free + torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device))
    return available_ram()


def _model_device(model: Any) -> Any:
    return next(model.parameters()).device


def _where(device: Any) -> str:
    return "this machine" if str(device) == "cpu" else f"the GPU {device}"


def kv_dims(model: Any) -> tuple[int, int, int, int]:
    """(layers, KV heads, head dim, bytes per element) of the model's cache."""
    cfg = model.config
    cfg = getattr(cfg, "get_text_config", lambda: cfg)()
    heads = getattr(cfg, "num_attention_heads", 1)
    kv_heads = getattr(cfg, "num_key_value_heads", None) or heads
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
    return cfg.num_hidden_layers, kv_heads, head_dim, next(model.parameters()).element_size()


def kv_bytes_per_token(model: Any) -> int:
    """Bytes of keys + values one token takes in every layer's cache."""
    layers, kv_heads, head_dim, size = kv_dims(model)
    return 2 * layers * kv_heads * head_dim * size


def forward_bytes(model: Any, shapes: list[tuple[int, ...]]) -> int:
    """An upper bound on what the largest of the forward passes ``shapes`` allocates besides the cache, per
    batch row.  A shape is (rows, queries, keys), optionally with a fourth term: bytes a method's own attention
    adds per row.  Counted: a boolean mask per kind of layer (sliding-window and full) and its float copy inside
    attention, the layer's activations in float32, the kept logits."""
    cfg = model.config
    cfg = getattr(cfg, "get_text_config", lambda: cfg)()
    _, kv_heads, head_dim, _ = kv_dims(model)
    heads = getattr(cfg, "num_attention_heads", 1)
    hidden = cfg.hidden_size
    inter = getattr(cfg, "intermediate_size", None) or 4 * hidden
    kinds = len(set(getattr(cfg, "layer_types", None) or ["full"]))
    per_query = 4 * (6 * hidden + 4 * inter + 2 * (heads + 2 * kv_heads) * head_dim)
    logits = 2 * 4 * getattr(cfg, "vocab_size", 0)
    return max(shape[0] * (shape[1] * shape[2] * (kinds + 4) + shape[1] * per_query + logits + sum(shape[3:]))
               for shape in shapes)


def request_forward_shapes(run: Any, tokens: int) -> list[tuple[int, ...]]:
    """The methods' largest forward passes for ``tokens`` tokens, or the default: windows of ``PREFILL_CHUNK``
    queries over every cached token."""
    from lcx.plan import PREFILL_CHUNK

    for m in run.methods:
        shapes = m.forward_shapes(run, tokens)
        if shapes:
            return shapes
    cached = min([tokens, *(m.cache_tokens(run, tokens) for m in run.methods)])
    return [(1, min(tokens, PREFILL_CHUNK), cached)]


def _gib(n: float) -> str:
    return f"{n / 2**30:.1f} GiB"


def _raise_with(flag: str | None, env: str, served: bool) -> str:
    """How a limit is raised: the CLI's option (or its environment variable), or, for a request to a
    server, the environment the server was started with."""
    if served:
        return f"the server's {env} (set where it starts)"
    return f"{flag} (or {env})" if flag else env


def check_request(run: Any, input_tokens: int, max_new_tokens: int, batch: int = 1,
                  limits: Limits | None = None, served: bool = False) -> dict[str, int]:
    """Refuse a request over a cap or whose memory estimate exceeds the free memory of the device it would
    take it from; returns the estimate (``kv_bytes``) and the model's device's free bytes.  ``served``: the
    request came to a server (its messages name the request's ``max_tokens`` and the server's environment)."""
    limits = limits or getattr(run, "limits", None) or Limits.from_env()
    bound_heap()
    if input_tokens > limits.max_input_tokens:
        raise LimitError(f"the prompt has {input_tokens:,} tokens, over the limit of {limits.max_input_tokens:,} "
                         f"per request; raise it with {_raise_with('--max-input-tokens', 'LCX_MAX_INPUT_TOKENS', served)} "
                         f"if the machine has the memory, or shorten the prompt")
    if max_new_tokens > limits.max_new_tokens:
        raise LimitError(f"{'max_tokens' if served else 'max_new_tokens'}={max_new_tokens:,} is over the limit of "
                         f"{limits.max_new_tokens:,} per request; raise it with "
                         f"{_raise_with(None, 'LCX_MAX_NEW_TOKENS', served)}")
    import torch

    model_device = _model_device(run.model)
    needs: dict[torch.device, int] = {}  # device -> bytes the request plans to hold there
    entries, memory = 0, 0
    for m in run.methods:
        n = m.memory_entries(run, input_tokens) + m.generation_entries(run, input_tokens, max_new_tokens)
        if n > limits.max_memory_entries:
            raise LimitError(f"{m.name}: its memory would hold {n:,} entries per layer and KV head after this "
                             f"request, over the limit of {limits.max_memory_entries:,}; cap it with "
                             f"-o {m.name}.max_entries=N (the oldest are evicted), or raise the limit with "
                             f"{_raise_with('--max-memory-entries', 'LCX_MAX_MEMORY_ENTRIES', served)}")
        if n:
            entries = max(entries, n)
            b = batch * m.memory_bytes(run, n)
            memory += b
            where = torch.device(m.memory_device(run) or model_device)
            needs[where] = needs.get(where, 0) + b
    per_token = kv_bytes_per_token(run.model)
    tokens = input_tokens + max_new_tokens
    cached = min([tokens, *(m.cache_tokens(run, tokens) for m in run.methods)])  # a windowed cache bounds it
    passes = batch * forward_bytes(run.model, request_forward_shapes(run, tokens))
    needs[model_device] = needs.get(model_device, 0) + per_token * batch * cached + passes
    hints = "".join(f"{h}, " for m in run.methods if (h := m.forward_hint(run)))
    free = {}
    for device, n in needs.items():
        free[device] = have = available_memory(device)
        allowance = heap_allowance(device, limits)
        if n * allowance > limits.ram_fraction * have:
            cache = per_token * batch * cached if device == model_device else 0
            parts = [f"{batch} x {cached:,} cached tokens x {per_token:,} bytes for keys and values"] if cache else []
            if device == model_device:
                parts.append(f"{_gib(passes)} for the largest forward pass")
            if n > cache + (passes if device == model_device else 0):
                parts.append(f"{_gib(n - cache - (passes if device == model_device else 0))} for {entries:,} "
                             "memory entries")
            heap = (f", x{allowance:g} for what glibc's heap keeps besides" if allowance > 1 else "")
            unheap = (" (or set LCX_BOUNDED_HEAP=1: freed tensors go back to the system, no allowance)"
                      if allowance > 1 else "")
            raise LimitError(f"this request needs up to {_gib(n)} ({' + '.join(parts)}) on "
                             f"{_where(device)}{heap}, more than the {_gib(limits.ram_fraction * have)} it has free; "
                             f"shorten the prompt, generate fewer rows at once, {hints}or free memory{unheap}")
    return {"kv_bytes": per_token * batch * cached + memory, "forward_bytes": passes,
            "free_bytes": free[model_device]}
