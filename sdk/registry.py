"""Discovery: which methods (and training tasks, and commands) exist.

In-tree methods are plugins like any other: each module in ``BUILTIN_PLUGINS``
implements ``lcx_register_methods`` (and may register training tasks and commands:
``lcx_register_tasks``, ``lcx_register_commands``).  Third-party packages add a module to the
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
from typing import Any

import pluggy

from lcx import hookspecs
from lcx.data import Task
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

#: What ``lcx train`` trains with when no method is named: the in-tree baseline (the model as it is, its
#: prompts truncated to its window at inference).
DEFAULT_METHOD = "vanilla"


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
        self.tasks: dict[str, Task] = {}
        self._task_plugin: dict[str, str] = {}
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
        """Register a plugin object/module and collect the methods and training tasks it registers."""
        if self.pm.has_plugin(name):
            return
        self.pm.register(plugin, name=name)
        self._sources[name] = source
        try:
            for cls in self._collect(self.pm.hook.lcx_register_methods, name):
                self._add_method(cls, name)
            for task in self._collect(self.pm.hook.lcx_register_tasks, name):
                self._add_task(task, name)
        except Exception:
            self.remove_plugin(name)  # all or nothing: no half-registered plugin stays behind
            raise

    def _collect(self, hook: pluggy.HookCaller, plugin: str) -> list:
        """What plugin ``plugin``'s implementations of the ``register`` hook ``hook`` register, in order."""
        collected: list = []
        for impl in hook.get_hookimpls():
            if impl.plugin_name == plugin:
                impl.function(register=collected.append)
        return collected

    def remove_plugin(self, name: str) -> None:
        self.pm.unregister(name=name)
        self._sources.pop(name, None)
        for m in [m for m, p in self._method_plugin.items() if p == name]:
            del self.methods[m], self._method_plugin[m]
        for t in [t for t, p in self._task_plugin.items() if p == name]:
            del self.tasks[t], self._task_plugin[t]

    def add_commands(self, cli: Any) -> None:
        """Let every plugin add its commands to the click group ``cli`` (``lcx_register_commands``); a plugin whose
        hook fails is skipped with a warning, as a plugin that fails to load is."""
        for impl in self.pm.hook.lcx_register_commands.get_hookimpls():
            try:
                impl.function(cli=cli)
            except Exception as e:  # a broken third-party plugin must not break lcx
                print(f"lcx: warning: plugin {impl.plugin_name!r} could not add its commands: {e}", file=sys.stderr)

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

    def _add_task(self, task: Task, plugin: str) -> None:
        if not isinstance(task, Task) or not task.name or ":" in task.name or not callable(task.make):
            raise LcxError(f"plugin {plugin!r} registered {task!r}, which is not an lcx.data.Task with a name "
                           f"(no ':' in it) and a callable `make`; register lcx.data.Task(name, make, help)")
        if task.name in self.tasks and self.tasks[task.name] is not task:
            raise LcxError(f"plugin {plugin!r} registers training task {task.name!r}, already registered by plugin "
                           f"{self._task_plugin[task.name]!r}; rename one of them")
        self.tasks[task.name] = task
        self._task_plugin[task.name] = plugin

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

    def task(self, name: str) -> Task:
        """The synthetic training task ``task:NAME`` names."""
        try:
            return self.tasks[name]
        except KeyError:
            known = "; ".join(f"task:{n}" + (f" ({t.help})" if t.help else "") for n, t in sorted(self.tasks.items()))
            raise LcxError(f"unknown synthetic task {name!r}; known: {known or '(none installed)'}") from None

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
