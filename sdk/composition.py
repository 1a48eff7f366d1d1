"""Composition: attach a set of methods to a model, reversibly.

    with lcx.attach(model, ["rope", "streaming"], factor=4.0) as run:
        new_tokens = lcx.generate(run, input_ids, max_new_tokens=32)
    # the model is exactly as it was

``attach`` builds a per-run pluggy manager holding only the chosen method
instances, refuses incompatible combinations, routes every attention layer
through transformers' AttentionInterface under the name ``"lcx"`` (with a
matching mask function), and lets each method patch the model through
``lcx_patch_model``.  Every change is registered on ``run.patches`` and undone,
in reverse order, by ``run.detach()``.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterable, Mapping
from typing import Any, Callable

import pluggy
import torch
from torch import nn
from transformers import AttentionInterface
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from lcx import hookspecs, kernels
from lcx.adapters import families
from lcx.errors import ConflictError, LcxError, UnsupportedModelError
from lcx.method import Method
from lcx.registry import registry

ATTN_NAME = "lcx"
_RUN_ATTR = "_lcx_run"  # set on the model and on each attention module while attached
_BASE_ATTR = "_lcx_base_attn"  # set on the config while attached: the implementation lcx wraps

_CAPABILITY_TEXT = {
    "attention_interface": "transformers' attention interface",
    "rotary": "rotary (RoPE) positions",
}


class _Manager(pluggy.PluginManager):
    """A plugin manager that leaves out the stage hooks a method instance says it does not need."""

    def parse_hookimpl_opts(self, plugin: object, name: str) -> Any:
        if isinstance(plugin, Method) and name in plugin.idle_stages():
            return None
        return super().parse_hookimpl_opts(plugin, name)


class Run:
    """One attachment of methods to a model: the per-run plugin manager and its state."""

    def __init__(self, model: nn.Module, methods: list[Method], family: families.Family | None) -> None:
        self.model = model
        self.methods = methods
        self.family = family
        self.pm = _Manager(hookspecs.PROJECT)
        self.pm.add_hookspecs(hookspecs)
        for m in methods:
            if self.pm.has_plugin(m.name):
                raise LcxError(f"method {m.name!r} was selected twice; select each method once")
            self.pm.register(m, name=m.name)
        self.pm.check_pending()
        self.patches = contextlib.ExitStack()
        self.base_impl: str = "sdpa"
        self.attached = False
        #: The current input's plan (``lcx.plan.Plan``), set by ``lcx.generation`` before its forwards.
        self.plan: Any = None
        #: The current input's memory: the ``transformers.Cache`` its forwards use (``lcx_memory``'s or a
        #: DynamicCache); None between requests.
        self.memory: Any = None
        #: While ``generate`` plans with a ``lcx.generation.PrefixReuse``: that object (a method's chunking stage
        #: may keep work later prompts share in its ``memo``).
        self.reuse: Any = None
        #: While ``lcx.limits.check_request`` estimates a request: its input ids (B, T), for an estimate that
        #: depends on them (focusllm's chunk forwards, fewer where a memo already holds the chunks).
        self.request_ids: Any = None
        #: While ``tail_logits`` plans: how many trailing tokens are scored (a plan must not let the logits read
        #: the tokens they predict).
        self.scored: int = 0
        #: Training: the run's seed and this process's rank (per-process randomness in sampling stages).
        self.seed: int = 0
        self.rank: int = 0
        #: Training: the methods' values that metrics.jsonl logs (``state/NAME``) and checkpoints keep.
        self.train_state: dict[str, Any] = {}
        #: Each method's own per-run values, under keys it prefixes with its name (lcx never reads them).
        self.state: dict[str, Any] = {}
        #: Per-request resource limits (``lcx.limits.Limits``); None = defaults and LCX_* variables.
        self.limits: Any = None
        self._has_attention = bool(self.pm.hook.lcx_attention.get_hookimpls())

    # ------------------------------------------------------------------ conveniences
    @property
    def hook(self) -> Any:
        return self.pm.hook

    @property
    def window(self) -> int:
        """The model's trained context window (positions)."""
        return families.context_window(self.model)

    def method(self, name: str) -> Method | None:
        return next((m for m in self.methods if m.name == name), None)

    def implements(self, hook: str) -> list[str]:
        """Names of the selected methods that implement ``hook``."""
        return [impl.plugin_name for impl in getattr(self.pm.hook, hook).get_hookimpls()]

    def base_attention(self, module: nn.Module, query, key, value, attention_mask, **kwargs):
        """The attention the model used before attaching (sdpa or the family's eager)."""
        return _base_function(self.base_impl, module)(module, query, key, value, attention_mask, **kwargs)

    @property
    def dtype(self) -> str:
        """The dtype the model computes in (its first floating parameter's), e.g. ``"bfloat16"``."""
        from lcx.models import dtype_name, model_dtype

        return dtype_name(model_dtype(self.model))

    def describe(self) -> dict[str, Any]:
        """JSON-able description of the run (methods + options, the model's dtype), for result files and
        sidecars."""
        return {"methods": [{"name": m.name, "options": m.to_options()} for m in self.methods], "dtype": self.dtype}

    # ------------------------------------------------------------------ lifecycle
    def detach(self) -> None:
        """Undo every patch, newest first. Idempotent."""
        if self.attached:
            self.attached = False
            self.patches.close()

    def __enter__(self) -> "Run":
        return self

    def __exit__(self, *exc: object) -> None:
        self.detach()

    def __repr__(self) -> str:
        return f"Run({', '.join(map(str, self.methods)) or 'no method'})"


# ---------------------------------------------------------------------- attach
def attach(
    model: nn.Module,
    methods: Iterable[str | Method] | str | Method | None = None,
    /,
    **options: Any,
) -> Run:
    """Attach ``methods`` to ``model``; use as a context manager or call ``run.detach()``.

    ``methods`` are names (``"streaming"``) or configured instances
    (``Streaming(window=1024)``).  ``options`` are either per-method dicts keyed by
    method name (``streaming={"window": 1024}``) or flat option names, routed to
    the one selected method that has such an option.
    """
    from lcx.adapters.peft_bridge import unwrap

    model = unwrap(model)  # a PeftModel: attach to the transformers model inside (LoRA layers stay active)
    if getattr(model, _RUN_ATTR, None) is not None:
        raise LcxError(
            f"this model already has lcx methods attached ({getattr(model, _RUN_ATTR)!r}); "
            "detach them first (leave the `with` block or call run.detach())"
        )
    instances = resolve_methods(methods, options)
    family = families.FAMILIES.get(getattr(model.config, "model_type", ""))
    needs = frozenset().union(*(m.requires for m in instances)) if instances else frozenset()
    if family is None and needs:
        family = families.family_of(model)  # raises with what is missing and what still works
    if family is not None:
        caps = families.capabilities(model, family)
        for m in instances:
            missing = sorted(m.requires - caps)
            if missing:
                working = [n for n, c in sorted(registry().methods.items()) if c.requires <= caps]
                raise UnsupportedModelError(
                    f"method {m.name!r} needs {_CAPABILITY_TEXT.get(missing[0], missing[0])}, which model family "
                    f"{family.model_type!r} lacks ({family.notes or family.positions + ' positions'}); "
                    f"methods that work with it: {', '.join(working)}"
                )

    _resolve_auto(model, instances)
    run = Run(model, instances, family)
    _check_conflicts(run)
    run.attached = True
    try:
        if family is not None and families._uses_attention_interface(model):
            _route_attention(run)
        elif run._has_attention:  # its lcx_attention would never run: results without the method in them
            names = sorted({impl.plugin_name for impl in run.pm.hook.lcx_attention.get_hookimpls()})
            kind = getattr(model.config, "model_type", type(model).__name__)
            why = ("lcx has no map for that family" if family is None else
                   "its attention does not go through transformers' attention interface")
            raise UnsupportedModelError(
                f"{', '.join(names)} work inside the attention of each layer, which lcx cannot reach in model "
                f"family {kind!r} ({why}); families it reaches: {', '.join(sorted(families.FAMILIES))}")
        run.hook.lcx_patch_model(run=run, model=model)
        setattr(model, _RUN_ATTR, run)
        run.patches.callback(_delattr, model, _RUN_ATTR)
    except BaseException:
        run.detach()
        raise
    return run


def _resolve_auto(model: nn.Module, instances: list[Method]) -> None:
    """Each method's ``auto`` options measured on ``model`` itself, before anything is attached: on its base
    weights, with an adapter's LoRA off, as ``lcx export`` and ``lcx methods -m`` measure them (one cache entry
    for the model in its folder, whichever runs first)."""
    from lcx import auto
    from lcx.models import dtype_name, model_dtype

    def load() -> tuple[nn.Module, Any]:
        from transformers import AutoTokenizer

        return model, AutoTokenizer.from_pretrained(folder)

    folder = auto.model_folder(model)
    bare = contextlib.nullcontext()
    if "peft" in sys.modules:  # an adapter may be loaded (no LoRA layer exists otherwise)
        from lcx.adapters.peft_bridge import lora_off

        bare = lora_off(model)
    with bare:
        auto.resolve(instances, folder, load, dtype_name(model_dtype(model)))


def attached_run(model: nn.Module) -> Run | None:
    """The run currently attached to ``model``, if any."""
    return getattr(model, _RUN_ATTR, None)


def resolve_methods(methods: Any, options: dict[str, Any]) -> list[Method]:
    """Method instances for ``methods`` (names or instances) with ``options`` routed as ``attach`` does."""
    if methods is None:
        methods = []
    elif isinstance(methods, (str, Method)):
        methods = [methods]
    reg = registry()
    chosen: list[str | Method] = list(methods)
    names = [m if isinstance(m, str) else m.name for m in chosen]
    per_method = split_options(names, options)
    out: list[Method] = []
    for m in chosen:
        if isinstance(m, Method):
            if per_method[m.name]:  # they would be dropped: the instance is already configured
                given = ", ".join(f"{k}={v!r}" for k, v in per_method[m.name].items())
                raise LcxError(f"options {given} for {m!r}, a configured method: set them on it "
                               f"(dataclasses.replace(method, ...)) or pass its name instead")
            out.append(m)
        else:
            out.append(reg.get(m).from_options(**per_method[m]))
    return out


def split_options(names: list[str], options: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """``options`` per method of ``names``: ``{method: {...}}`` entries as they are, a flat ``key`` to the one
    method that has that option (else a one-line error: none has it, or several do)."""
    reg = registry()
    per_method: dict[str, dict[str, Any]] = {n: {} for n in names}
    for key, value in options.items():
        if key in per_method and isinstance(value, Mapping):
            per_method[key].update(value)
            continue
        if isinstance(value, Mapping) and key in reg.methods:  # -o rope.factor=4 without --method rope
            raise LcxError(f"options for method {key!r}, which is not selected ({', '.join(names) or 'none'}); "
                           f"add --method {key}, or drop the option")
        owners = [n for n in names if isinstance(n, str) and key in {f.name for f in reg.get(n).options()}]
        if not owners:
            raise LcxError(
                f"option {key!r} belongs to none of the selected methods ({', '.join(names) or 'none'}); "
                "`lcx methods -v` lists each method's options"
            )
        if len(owners) > 1:
            raise LcxError(
                f"option {key!r} is ambiguous: methods {owners[0]!r} and {owners[1]!r} both have it; "
                f"pass it per method, e.g. {owners[0]}={{{key!r}: ...}}"
            )
        per_method[owners[0]][key] = value
    return per_method


def _check_conflicts(run: Run) -> None:
    for hook, stage in hookspecs.EXCLUSIVE_STAGES.items():
        owners = run.implements(hook)
        if len(owners) > 1:
            a, b = sorted(owners)[:2]
            raise ConflictError(
                f"methods {a!r} and {b!r} both claim the {stage} stage ({hook}); "
                f"they cannot be combined in one run; choose one of them"
            )


# ---------------------------------------------------------------------- attention routing
def _route_attention(run: Run) -> None:
    """Send every attention layer through the "lcx" attention function, reversibly."""
    model = run.model
    cfg = model.config
    run.base_impl = cfg._attn_implementation or "sdpa"
    if run.base_impl not in ("sdpa", "eager"):
        raise UnsupportedModelError(
            f"model uses attn_implementation={run.base_impl!r}; lcx wraps 'sdpa' or 'eager': "
            "load the model with attn_implementation='sdpa'"
        )
    configs = {id(m.config): m.config for m in model.modules() if hasattr(m, "config") and hasattr(m.config, "_attn_implementation_internal")}
    saved = [(c, c._attn_implementation_internal, c.__dict__.get("_attn_was_changed", _MISSING)) for c in configs.values()]

    def restore() -> None:
        for c, impl, changed in saved:
            c._attn_implementation_internal = impl
            if changed is _MISSING:
                c.__dict__.pop("_attn_was_changed", None)
            c.__dict__.pop(_BASE_ATTR, None)

    run.patches.callback(restore)
    for c in configs.values():
        c.__dict__[_BASE_ATTR] = run.base_impl
    model.set_attn_implementation(ATTN_NAME)
    for module in families.attention_modules(model, run.family):
        module.__dict__[_RUN_ATTR] = run
        run.patches.callback(module.__dict__.pop, _RUN_ATTR, None)


_MISSING = object()
_EAGER_CACHE: dict[type, Callable] = {}


def _base_function(impl: str, module: nn.Module) -> Callable:
    if impl == "eager":
        cls = type(module)
        fn = _EAGER_CACHE.get(cls)
        if fn is None:
            fn = getattr(sys.modules[cls.__module__], "eager_attention_forward")
            _EAGER_CACHE[cls] = fn
        return fn
    return kernels.sdpa if impl == "sdpa" else ALL_ATTENTION_FUNCTIONS[impl]


def lcx_attention_forward(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                          attention_mask: torch.Tensor | None, **kwargs: Any):
    """The function registered as attention implementation "lcx": dispatch to the run's attention stage."""
    run: Run | None = module.__dict__.get(_RUN_ATTR)
    if run is None:  # an lcx-configured model whose run is gone: behave like sdpa
        return kernels.sdpa(module, query, key, value, attention_mask, **kwargs)
    if run._has_attention:
        out = run.pm.hook.lcx_attention(
            run=run, module=module, query=query, key=key, value=value, attention_mask=attention_mask, kwargs=kwargs
        )
        if out is not None:
            return out
    return _base_function(run.base_impl, module)(module, query, key, value, attention_mask, **kwargs)


def lcx_mask(*args: Any, config: Any = None, **kwargs: Any):
    """The mask function registered as "lcx": the mask of the implementation lcx wraps."""
    base = getattr(config, "__dict__", {}).get(_BASE_ATTR, "sdpa")
    return ALL_MASK_ATTENTION_FUNCTIONS[base](*args, config=config, **kwargs)


AttentionInterface.register(ATTN_NAME, lcx_attention_forward)
AttentionMaskInterface.register(ATTN_NAME, lcx_mask)


def _delattr(obj: object, name: str) -> None:
    obj.__dict__.pop(name, None)
