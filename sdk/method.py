"""The base class every long-context method derives from.

A method is a small dataclass: its fields are its hyperparameters (each with
``metadata={"help": ...}``), and its stage hooks are ordinary methods decorated
with ``@hookimpl``.  An instance is what a run's plugin manager holds.
"""

from __future__ import annotations

import dataclasses
import math
import typing
from typing import Any, ClassVar

from lcx.errors import LcxError
from lcx.hookspecs import STAGES


_NO_BEFORE = object()


def option(default: Any, help: str, before: Any = _NO_BEFORE, **kwargs: Any) -> Any:
    """A dataclass field with help text (shown by ``lcx methods -v`` and ``--help``).  ``before``: the value
    records written without this option (older journals, adapter sidecars) ran with, when that is not
    ``default`` (the option was added, or its default changed, after they were written)."""
    meta = {"help": help} if before is _NO_BEFORE else {"help": help, "before": before}
    return dataclasses.field(default=default, metadata=meta, **kwargs)


@dataclasses.dataclass
class Method:
    """Base class: subclass it, set ``name``, add option fields and ``@hookimpl`` methods."""

    #: Registry name, used on the command line (``--method NAME``).
    name: ClassVar[str] = ""
    #: One line for ``lcx methods``.
    description: ClassVar[str] = ""
    #: Capabilities the model family must have (see ``lcx.adapters.families.Family``):
    #: "attention_interface" (transformers' attention registry), "rotary" (RoPE positions).
    requires: ClassVar[frozenset[str]] = frozenset()
    #: Attention roles a LoRA adapter targets by default when this method is trained.
    lora_roles: ClassVar[tuple[str, ...]] = ("q", "k", "v", "o")
    #: Whether the method reads its LoRA adapter at some positions only (focusllm: its candidates, through a
    #: per-token gate): an adapter trained with it acts as trained only under it, and another method's adapter
    #: would be read at those positions only (``lcx.session.apply_adapter`` refuses both).
    lora_gated: ClassVar[bool] = False
    #: Whether the method's training loss reaches a block's weights through keys and values an earlier forward
    #: left in a cache (focusllm's candidates): under FSDP2 every block's parameters then stay gathered until
    #: the step's backward passes end, since FSDP2's hooks would free them after the block's own backward.
    grads_through_cache: ClassVar[bool] = False
    #: Training data order this method needs: "shuffle" (windows in a seeded random order) or
    #: "streams" (every batch row continues its own stretch of the corpus, step after step).
    data_order: ClassVar[str] = "shuffle"
    #: Options an adapter trained with this method fixes: using it with other values is refused.
    fixed_by_training: ClassVar[tuple[str, ...]] = ()
    #: Options only inference reads, never training: an adapter's record of them is not carried into its use,
    #: so the method's current default (or the user's value) applies.
    inference_only: ClassVar[tuple[str, ...]] = ()
    #: How vLLM serves this method (``lcx export --for vllm``, ``lcx serve``): "base" (inference is the
    #: plain model, plus the method's LoRA adapter when trained), "config" (the model's config.json
    #: is rewritten by :meth:`vllm_config`), "prompt" (the method only rewrites the prompt's tokens:
    #: :meth:`serve_prompt`, applied by lcx's request middleware in front of vLLM), "attention" (lcx
    #: answers vLLM's attention with the class :meth:`served_attention` names), or "" (not servable yet).
    serving: ClassVar[str] = ""
    #: Why a method with ``serving == ""`` is not served, for the error that refuses it.
    not_served_because: ClassVar[str] = ""
    #: For ``serving == "attention"``: whether the served attention reads tensors that lcx's request
    #: middleware computes from each whole prompt with the model (:meth:`serve_request`).
    serve_state: ClassVar[bool] = False

    #: Whether the model with this method reads prompts longer than its window (positions stretched, memory, a
    #: bounded cache): transformers' reminder that a generation passes the window is then muted.
    reads_past_window: ClassVar[bool] = False

    #: Whether this method reads a document memory built by ``lcx memory build`` (``lcx generate --memory``,
    #: ``lcx serve --memory``): the stack's method with this set gets :meth:`load_memory` / :meth:`check_memory`.
    reads_memory: ClassVar[bool] = False
    #: For ``reads_memory`` methods: the options that shaped a memory's entries when it was built (a document's
    #: later windows are encoded reading its earlier ones under them); :meth:`memory_built_otherwise` compares them.
    shapes_memory: ClassVar[tuple[str, ...]] = ()

    def memory_built_otherwise(self, meta: dict[str, Any], window: int | None = None) -> dict[str, tuple[Any, Any]]:
        """The :attr:`shapes_memory` options a memory (``meta``: what ``load_memory`` / ``check_memory`` return,
        with the ``method`` its build recorded) was built with other values of than this instance has:
        ``{option: (built, here)}``.  An option the build predates counts at its :meth:`unrecorded_options` value.
        ``window``: the model's trained window, for an instance not attached to the model (a server's, before
        vLLM loads it) whose options follow that window."""
        recorded = meta.get("method") or {}
        if recorded.get("name") != self.name:
            return {}
        built, here = {**self.unrecorded_options(), **(recorded.get("options") or {})}, self.to_options()
        return {k: (built[k], here[k]) for k in self.shapes_memory if k in built and built[k] != here[k]}

    def memory_built_note(self, path: Any, meta: dict[str, Any], window: int | None = None) -> str | None:
        """A note for a memory read under other values of :attr:`shapes_memory` than it was built with (allowed:
        e.g. another k on purpose), naming both and the options that read it as built; None when they agree."""
        differ = self.memory_built_otherwise(meta, window)
        if not differ:
            return None
        word = lambda v: str(v).lower() if isinstance(v, bool) else str(v)  # noqa: E731  (as -o takes it)
        built = ", ".join(f"{k}={word(b)}" for k, (b, _) in differ.items())
        here = ", ".join(f"{k}={word(h)}" for k, (_, h) in differ.items())
        again = " ".join(f"-o {self.name}.{k}={word(b)}" for k, (b, _) in differ.items())
        return (f"note: memory {str(path)!r} was built with {self.name} {built}, and is read with {here}: its "
                f"entries were encoded under the build's options (read it with {again}, or rebuild it with these)")

    def load_memory(self, path: Any, model: Any) -> dict[str, Any]:
        """For ``reads_memory`` methods: use the document memory at ``path`` with ``model`` (refusing one built
        with another model or other options); returns its metadata (``dtype``, ``adapter``, ``documents``)."""
        raise LcxError(f"method {self.name!r} reads no document memory")

    def check_memory(self, path: Any, model: dict[str, Any]) -> dict[str, Any]:
        """For ``reads_memory`` methods: check the memory at ``path`` before a server loads it, for ``model`` (its
        identity: config.json's ``model_type``, ``num_hidden_layers``, ``hidden_size``, ``layer_types`` and its
        ``embedding_sha256``): whole files, built with that model, what this method reads; returns its metadata."""
        raise LcxError(f"method {self.name!r} reads no document memory")

    def resolve_auto(self, folder: Any, load: Any) -> None:
        """Before the method attaches to the model in ``folder`` (a local model folder): set the ``auto`` options
        whose value depends on the model to values measured on it (``lcx.auto.measured``: once, cached beside
        the model); ``load()`` returns ``(model, tokenizer)`` for measuring, with no method attached.  Options
        the user gave are left as given.  Nothing to resolve by default."""

    def resolved(self, config: dict[str, Any]) -> dict[str, Any]:
        """What this instance's model-dependent options come to on the model whose config.json is ``config`` (after
        :meth:`resolve_auto`): option name -> value, or a line on how a request fixes it (``lcx methods -m``).
        Nothing by default."""
        return {}

    def begin_request(self, run: Any, tokens: int, new: int) -> None:
        """A request of ``tokens`` prompt tokens generating ``new`` more is about to be planned on ``run`` (after
        :meth:`release`, before the limits check): set what follows the request's length (rope's factor=auto).
        Nothing by default."""

    def request_options(self) -> dict[str, Any]:
        """The options the last request ran with where they follow its length (rope's factor=auto): reported
        in ``lcx generate --json``.  Nothing by default."""
        return {}

    def fix_length(self, window: int, tokens: int) -> None:
        """Every request this instance answers is at most ``tokens`` tokens (prompt + new) on a model whose
        trained window is ``window``: ``lcx serve``'s --max-model-len, ``lcx train``'s --seq-len.  Set once
        what would otherwise follow each request's length (rope's factor=auto), before the model loads the
        method and before its options are written beside an export or adapter.  Nothing by default."""

    def begin_training(self) -> None:
        """``lcx train`` is about to attach this instance to train it (after :meth:`fix_length`, before
        :meth:`resolve_auto`): leave unmeasured the ``auto`` options only inference reads.  Nothing by default."""

    def check_training(self) -> None:
        """Refuse (``LcxError`` naming the option and the fix) options ``lcx train`` cannot train with; called
        before the model loads."""

    def reach(self, run: Any, tokens: int, new: int, span: tuple[int, int]) -> tuple[bool, str] | None:
        """Whether the model, with this method, reads the tokens ``span`` (start, end) of a prompt of ``tokens``
        tokens generating ``new`` more, and one line on how (``lcx demo``'s why column: "the key was cut with the
        middle of the prompt"); None: nothing to say."""
        return None

    def reusable_prefix(self) -> bool:
        """Whether a prompt's leading windows may be fed once and their memory (the run's cache, copied)
        reused by later prompts that start with the same tokens (``lcx.generation.PrefixReuse``): true
        only when everything the method keeps per prompt lives in that cache."""
        return False

    def release(self, run: Any) -> None:
        """A new request starts on ``run``: drop what this method keeps in ``run.state`` for the last one (its
        memory, ``run.memory``, is dropped by lcx), before the limits check measures free memory."""

    def memory_entries(self, run: Any, input_tokens: int) -> int:
        """Entries per memory layer and KV head this method's own memory holds after a request of
        ``input_tokens`` (checked against ``lcx.limits``); 0 for methods whose memory is the model's cache."""
        return 0

    def generation_entries(self, run: Any, input_tokens: int, max_new_tokens: int) -> int:
        """Entries per layer and KV head this method's own memory gains while generating ``max_new_tokens``
        (added to ``memory_entries`` by ``lcx.limits``); 0 by default."""
        return 0

    def memory_bytes(self, run: Any, entries: int) -> int:
        """An upper bound on the bytes this method's own memory takes per batch row at ``entries`` entries per
        memory layer and KV head (``lcx.limits``' estimate); by default a key and a value of every layer each."""
        from lcx.limits import kv_bytes_per_token

        return entries * kv_bytes_per_token(run.model)

    def memory_device(self, run: Any) -> Any:
        """Where this method's own memory lives (``lcx.limits`` checks its ``memory_bytes`` against that
        device's free memory); None: the model's device."""
        return None

    def cache_tokens(self, run: Any, tokens: int) -> int:
        """The most tokens per batch row whose keys and values the model's cache holds at once during a
        request of ``tokens`` tokens (prompt + new; ``lcx.limits``' estimate): every one by default, fewer for
        a method whose cache keeps a window."""
        return tokens

    def forward_shapes(self, run: Any, tokens: int) -> list[tuple[int, ...]] | None:
        """The largest forward passes of a request of ``tokens`` tokens, per batch row, as (rows, queries, keys)
        and optionally the bytes the method's own attention adds per row (``lcx.limits.forward_bytes`` bounds
        what each pass allocates besides the cache); None: the default, windows of ``lcx.plan.PREFILL_CHUNK``
        queries over every cached token."""
        return None

    def forward_hint(self, run: Any) -> str | None:
        """How a user makes this method's largest forward pass smaller (an option to give), said when a request
        is refused for memory; None: no such option."""
        return None

    def served_attention(self) -> type:
        """For ``serving == "attention"``: the class that answers vLLM's attention for this method in vLLM's
        worker, a subclass of ``lcx.integrations.vllm.attention.ServedAttention`` kept in the method's plugin
        (import it inside this method: only served processes need it).  ``lcx serve`` asks the class for its
        per-request state bound, memory entries and prefix caching; the worker builds it with ``from_method``."""
        raise NotImplementedError(f"method {self.name!r} has no served attention (serving={self.serving!r})")

    def serves_prefix_kv(self) -> bool:
        """For ``serve_state`` methods: whether the tensors :meth:`serve_request` computes are only a fixed
        prefix of keys and values (``"{layer}.k"``/``"{layer}.v"``, (KV heads, n, head dim), rotated at
        positions ``0..n-1``, standing in for the rewritten prompt's first ``n`` tokens).  Then vLLM serves the
        method on its own model code: lcx's KV connector loads them into its paged cache
        (``lcx.integrations.vllm.connector``) instead of lcx answering its attention."""
        return False

    def check_serving(self) -> None:
        """Refuse (``LcxError`` naming the option and the fix) options this method's served form cannot
        run; called by ``lcx export --for vllm``, ``lcx serve`` and the vLLM plugin (which reads the export)."""

    def vllm_config(self, config: dict[str, Any]) -> dict[str, Any]:
        """For ``serving == "config"``: the model's config.json (a dict) as vLLM should load it."""
        return config

    def serve_prompt(self, ids: list[int], max_new_tokens: int, window: int) -> list[int]:
        """For ``serving == "prompt"``: the token ids vLLM should read for one prompt of ``ids`` that asks
        for ``max_new_tokens`` (``window``: the model's trained window); the same tokens the method's
        plan feeds the model on lcx's own path."""
        raise NotImplementedError(f"method {self.name!r} does not rewrite prompts (serving={self.serving!r})")

    def serve_request(self, run: Any, ids: list[int], max_new_tokens: int,
                      forward: Any = None) -> tuple[list[int], dict[str, Any]] | None:
        """For ``serve_state`` methods: the token ids vLLM should read for one prompt of ``ids`` and the
        tensors (name -> tensor) its served attention reads with them, computed on lcx's own path (``run``,
        the method attached to the model) by lcx's request middleware; None when vLLM reads the prompt as
        it is.  ``serves_prefix_kv`` methods may be given ``forward``, which runs token rows through the
        server's engine and returns per row and layer the last position's keys/values (see focusllm)."""
        raise NotImplementedError(f"method {self.name!r} computes no per-request state for serving")

    # ------------------------------------------------------------------ options
    @classmethod
    def options(cls) -> list[dataclasses.Field]:
        return [f for f in dataclasses.fields(cls) if f.init]

    @classmethod
    def from_options(cls, **options: Any) -> "Method":
        """Build an instance from user options, converting strings (CLI) to field types."""
        known = {f.name: f for f in cls.options()}
        unknown = sorted(set(options) - set(known))
        if unknown:
            raise LcxError(
                f"unknown option {unknown[0]!r} for method {cls.name!r}; "
                f"its options are: {', '.join(known) or '(none)'} (see `lcx methods -v`)"
            )
        hints = typing.get_type_hints(cls)
        values = {k: _convert(cls.name, k, v, hints.get(k)) for k, v in options.items()}
        try:
            return cls(**values)
        except (TypeError, ValueError) as e:
            raise LcxError(f"bad options for method {cls.name!r}: {e}") from e

    def idle_stages(self) -> frozenset[str]:
        """Stage hooks this instance implements but does not need with its options (e.g. ``lcx_attention`` of
        an option left off): not registered for its run, so they claim no stage and are never called."""
        return frozenset()

    def to_options(self) -> dict[str, Any]:
        """Hyperparameters as plain JSON-able values (for sidecars and result files)."""
        return {f.name: getattr(self, f.name) for f in self.options()}

    @classmethod
    def default_options(cls) -> dict[str, Any]:
        """The options' defaults: what ``to_options`` gives when the user sets nothing."""
        return cls.from_options().to_options()

    @classmethod
    def before_options(cls) -> dict[str, Any]:
        """The options that name a ``before`` value, at it."""
        return {f.name: f.metadata["before"] for f in cls.options() if "before" in f.metadata}

    @classmethod
    def unrecorded_options(cls) -> dict[str, Any]:
        """What a record that lacks an option (a journal or sidecar written before it existed or before its
        default changed) ran with: its ``before`` value, else its default."""
        return {**cls.default_options(), **cls.before_options()}

    # ------------------------------------------------------------------ introspection
    @classmethod
    def stages(cls) -> list[str]:
        """The stages this method implements, by their user-facing names."""
        return [label for hook, label in STAGES.items() if _is_hookimpl(getattr(cls, hook, None))]

    def __str__(self) -> str:
        opts = ", ".join(f"{k}={v}" for k, v in self.to_options().items())
        return f"{self.name}({opts})"


def _is_hookimpl(fn: Any) -> bool:
    return fn is not None and hasattr(fn, "lcx_impl")


def _convert(method: str, key: str, value: Any, hint: Any) -> Any:
    """Convert a CLI string to the field's declared type.  JSON numbers (sidecars, vLLM requests) become the
    field's number type: an int for a float field, an integral float for an int field; a fraction for an
    int field, a bool for a number field or a non-bool for a bool field is an error.  Other values pass through."""
    if hint in (str, None, Any):
        return value
    origin = typing.get_origin(hint)
    args = [a for a in typing.get_args(hint) if a is not type(None)]
    target = args[0] if origin in (typing.Union, getattr(__import__("types"), "UnionType", ())) and args else hint
    if isinstance(value, str) and str in args and target in (int, float):  # a number, or a word the method checks
        try:
            return _finite(method, key, target(value))
        except ValueError:
            return value
    if not isinstance(value, str):
        return _convert_number(method, key, value, target)
    if origin is typing.Literal:
        if value not in typing.get_args(hint):
            raise LcxError(
                f"option {key}={value!r} of method {method!r} must be one of {', '.join(map(str, typing.get_args(hint)))}"
            )
        return value
    try:
        if target is bool:
            if value.lower() in ("1", "true", "yes", "on"):
                return True
            if value.lower() in ("0", "false", "no", "off"):
                return False
            raise ValueError(value)
        if target in (int, float):
            return _finite(method, key, target(value))
        if typing.get_origin(target) in (list, tuple):
            inner = typing.get_args(target)[0] if typing.get_args(target) else str
            return [inner(x) for x in value.split(",") if x]
    except ValueError:
        raise LcxError(
            f"option {key}={value!r} of method {method!r} is not a valid {getattr(target, '__name__', target)}"
        ) from None
    return value


def _finite(method: str, key: str, value: float) -> float:
    """nan and inf parse as floats, and pass every ``<`` check a method makes (rope's factor=nan gave a NaN
    rotary table, and JSON output with NaN in it)."""
    if not math.isfinite(value):
        raise LcxError(f"option {key}={value!r} of method {method!r} must be a finite number")
    return value


def _convert_number(method: str, key: str, value: Any, target: Any) -> Any:
    """A JSON-typed option value as its field's type (see ``_convert``)."""
    number = isinstance(value, (int, float)) and not isinstance(value, bool)
    if target is float and number:
        return _finite(method, key, float(value))
    if target is int and number:
        if isinstance(value, float) and not _finite(method, key, value).is_integer():  # nan/inf: int() fails below
            raise LcxError(f"option {key}={value!r} of method {method!r} must be a whole number, e.g. {key}={int(value)}")
        return int(value)
    if target in (int, float) and isinstance(value, bool):
        raise LcxError(f"option {key}={value!r} of method {method!r} must be a number, not true or false")
    if target is bool and not isinstance(value, bool):
        raise LcxError(f"option {key}={value!r} of method {method!r} must be true or false")
    return value
