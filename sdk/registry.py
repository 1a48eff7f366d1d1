"""Discovery: which methods exist.

In-tree methods are plugins like any other: each module in ``BUILTIN_PLUGINS``
implements ``lcx_register_methods``.  Third-party packages add a module to the
``lcx.methods`` entry-point group.  ``LCX_PLUGINS`` (comma-separated entry-point
names) is an allowlist: when set, only those third-party plugins load;
``LCX_PLUGINS=""`` loads none.
"""

from __future__ import annotations

import importlib
import os
import sys
from dataclasses import dataclass
from importlib import metadata

import pluggy

from lcx import hookspecs
from lcx.errors import LcxError
from lcx.method import Method

ENTRY_POINT_GROUP = "lcx.methods"
ALLOWLIST_ENV = "LCX_PLUGINS"

#: In-tree method plugins.  Adding a method = one module under plugins/ + one line here.
BUILTIN_PLUGINS: tuple[str, ...] = (
    "lcx.plugins.vanilla",
    "lcx.plugins.rope",
    "lcx.plugins.streaming",
    "lcx.plugins.fot",
    "lcx.plugins.smt",
    "lcx.plugins.focusllm",
)


@dataclass(frozen=True)
class PluginInfo:
    name: str
    source: str  # "builtin" or "entry point <dist> <version>"
    methods: tuple[str, ...]


class Registry:
    """The global plugin manager plus the table of method classes it produced."""

    def __init__(self, load_entrypoints: bool = True) -> None:
        self.pm = pluggy.PluginManager(hookspecs.PROJECT)
        self.pm.add_hookspecs(hookspecs)
        self.methods: dict[str, type[Method]] = {}
        self._method_plugin: dict[str, str] = {}
        self._sources: dict[str, str] = {}
        for modname in BUILTIN_PLUGINS:
            self.add_plugin(importlib.import_module(modname), name=modname, source="builtin")
        if load_entrypoints:
            self._load_entrypoints()
        self.pm.check_pending()

    # ------------------------------------------------------------------ loading
    def _load_entrypoints(self) -> None:
        allow = os.environ.get(ALLOWLIST_ENV)
        allowed = None if allow is None else {x.strip() for x in allow.split(",") if x.strip()}
        for ep in metadata.entry_points(group=ENTRY_POINT_GROUP):
            if allowed is not None and ep.name not in allowed:
                continue
            try:
                plugin = ep.load()
            except Exception as e:  # a broken third-party plugin must not break lcx
                print(f"lcx: warning: could not load plugin {ep.name!r} ({ep.value}): {e}", file=sys.stderr)
                continue
            dist = ep.dist
            source = f"entry point {dist.name} {dist.version}" if dist else f"entry point {ep.value}"
            if self.pm.has_plugin(ep.name):
                print(f"lcx: warning: two plugins use the entry-point name {ep.name!r}; ignoring {source} "
                      f"(keeping {self._sources.get(ep.name)})", file=sys.stderr)
                continue
            try:
                self.add_plugin(plugin, name=ep.name, source=source)
            except Exception as e:  # a broken third-party plugin must not break lcx
                print(f"lcx: warning: skipped plugin {ep.name!r} ({source}): {e} "
                      f"(set {ALLOWLIST_ENV} to choose which plugins load)", file=sys.stderr)

    def add_plugin(self, plugin: object, name: str, source: str = "runtime") -> None:
        """Register a plugin object/module and collect the methods it registers."""
        if self.pm.has_plugin(name):
            return
        self.pm.register(plugin, name=name)
        self._sources[name] = source
        try:
            collected: list[type[Method]] = []
            impls = [i for i in self.pm.hook.lcx_register_methods.get_hookimpls() if i.plugin_name == name]
            for impl in impls:
                impl.function(register=collected.append)
            for cls in collected:
                self._add_method(cls, name)
        except Exception:
            self.remove_plugin(name)  # all or nothing: no half-registered plugin stays behind
            raise

    def remove_plugin(self, name: str) -> None:
        self.pm.unregister(name=name)
        self._sources.pop(name, None)
        for m in [m for m, p in self._method_plugin.items() if p == name]:
            del self.methods[m], self._method_plugin[m]

    def _add_method(self, cls: type[Method], plugin: str) -> None:
        if not (isinstance(cls, type) and issubclass(cls, Method)) or not cls.name:
            raise LcxError(
                f"plugin {plugin!r} registered {cls!r}, which is not a named lcx.Method subclass; "
                "subclass lcx.Method and set its `name`"
            )
        if cls.name in self.methods and self.methods[cls.name] is not cls:
            raise LcxError(
                f"plugin {plugin!r} registers method {cls.name!r}, already registered by plugin "
                f"{self._method_plugin[cls.name]!r}; rename one of them"
            )
        self.methods[cls.name] = cls
        self._method_plugin[cls.name] = plugin

    # ------------------------------------------------------------------ queries
    def get(self, name: str) -> type[Method]:
        try:
            return self.methods[name]
        except KeyError:
            raise LcxError(
                f"unknown method {name!r}; installed methods: {', '.join(sorted(self.methods))} "
                "(`lcx methods` lists them; third-party methods install as packages with an "
                f"{ENTRY_POINT_GROUP!r} entry point)"
            ) from None

    def plugin_of(self, method: str) -> str:
        return self._method_plugin[method]

    def plugins(self) -> list[PluginInfo]:
        return [
            PluginInfo(name, self._sources.get(name, "?"), tuple(m for m, p in self._method_plugin.items() if p == name))
            for name, _ in self.pm.list_name_plugin()
        ]


_REGISTRY: Registry | None = None


def registry() -> Registry:
    """The process-wide registry, built on first use."""
    global _REGISTRY
    if _REGISTRY is None:
        _REGISTRY = Registry()
    return _REGISTRY


def reset_registry() -> None:
    """Forget the process-wide registry (tests; after installing a plugin at run time)."""
    global _REGISTRY
    _REGISTRY = None
