"""fot's memory sharded over Ray actors (``-o fot.backend=ray``): a memory larger than one machine's RAM.

``RayStore`` reads and writes as every ``MemoryStore`` does (memory.py), so `lcx generate|serve --memory`,
evaluation and `lcx memory build` use it unchanged.  Entries are dealt round-robin: the ``a``-th entry ever
added lives on shard ``a % N`` as that shard's ``a // N``-th, so where an entry lives is arithmetic (no table
per entry) and a RayStore's entry indices are those of one process's store given the same adds (oldest first;
the cap evicts the oldest).  A search goes to every shard at once; each answers its own top-k with those
entries' values, and the N x k candidates are merged: over exact shards (torch, faiss-flat) that is one
process's exact top-k.  A shard whose actor died is an error naming it, never an answer from the others.

One actor per shard holds the stores of every (layer, KV head) that this process makes with one configuration
(an actor is a process: one per store would be thousands).  The cluster: ``ray_address`` (host:port,
ray://host:port, auto), else $RAY_ADDRESS, else a Ray started here for this process; a Ray the process has
already joined (``ray.init`` by its caller) is used as it is.  Saved, every shard writes and reads its own
tensor file, so a cluster's nodes need the memory folder on a file system they share.
"""

from __future__ import annotations

import copy
import itertools
import logging
import os
import socket
import time
import weakref
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from lcx.errors import LcxError
from lcx.io import commit_files
from lcx.plugins.fot.memory import MEMORY_META, StoreConfig, _sha256, make_store, shard_file

#: An address where no Ray cluster answers is an error after this long, not a hang (Ray itself keeps trying
#: an address that accepts connections without answering for many minutes).
CONNECT_TIMEOUT_S = 10
#: What an HTTP/2 client sends first: the connection preface and an empty SETTINGS frame (RFC 9113, 3.4).  A Ray
#: cluster's GCS (and Ray Client's server) is a gRPC server, so it answers with a SETTINGS frame of its own.
_HTTP2_HELLO = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + bytes([0, 0, 0, 4, 0, 0, 0, 0, 0])
#: Shard actors that the cluster cannot place or start (no free CPU left, a node without lcx) are an error
#: after this long.
START_TIMEOUT_S = 300

#: -o fot.ray_address / $RAY_ADDRESS values that name no host:port: unset and "local" start a Ray in this process;
#: "auto" joins the one already running on this machine, as ``ray.init`` finds it
STARTS_HERE = ("", "local")
NO_HOST = (*STARTS_HERE, "auto")

_names = itertools.count()  # store names, unique in this process
_groups: dict[tuple, "_Shards"] = {}  # a configuration's actors, shared by its stores


# ---------------------------------------------------------------------- the cluster
def connect(address: str = "") -> Any:
    """The ``ray`` module, joined to a cluster: the one this process already joined, else ``address`` or
    $RAY_ADDRESS (an error within about ``CONNECT_TIMEOUT_S`` when nothing answers there), else a Ray started
    locally, as ``ray.init()`` does."""
    import ray

    if ray.is_initialized():
        return ray
    address = address or os.environ.get("RAY_ADDRESS", "")
    if address not in NO_HOST:
        _probe(address)
    try:
        ray.init(address=address or None, include_dashboard=False, log_to_driver=False, logging_level=logging.WARNING)
    except (ConnectionError, RuntimeError, ValueError) as e:
        where = f"at {address!r}" if address else "here"
        raise LcxError(f"could not join a Ray cluster {where}: {e}; check -o fot.ray_address / RAY_ADDRESS, or "
                       f"leave both unset for a local Ray") from None
    return ray


def split_address(address: str, given_as: str = "-o fot.ray_address / RAY_ADDRESS") -> tuple[str, int]:
    """(host, port) of a Ray address (host:port, ray://host:port); anything else is an error naming the fix."""
    host, _, port = address.split("://", 1)[-1].rpartition(":")
    if not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise LcxError(f"Ray address {address!r} is not host:port (or ray://host:port, or auto); fix {given_as}")
    return host.strip("[]"), int(port)


def _probe(address: str) -> None:
    """Refuse, within ``CONNECT_TIMEOUT_S``, an address where nothing accepts a connection or what does is not
    a gRPC server (no Ray cluster: ``ray.init`` would retry it for many minutes).  With TLS (RAY_USE_TLS) only
    the connection is checked."""
    host, port = split_address(address)
    fix = (f"waited at most {CONNECT_TIMEOUT_S} s): start one there (`ray start --head`), fix -o fot.ray_address / "
           f"RAY_ADDRESS, or leave both unset for a local Ray")
    deadline = time.monotonic() + CONNECT_TIMEOUT_S
    try:
        with socket.create_connection((host, port), timeout=CONNECT_TIMEOUT_S) as sock:
            if os.environ.get("RAY_USE_TLS", "0").lower() in ("1", "true"):
                return
            sock.settimeout(max(0.1, deadline - time.monotonic()))
            sock.sendall(_HTTP2_HELLO)
            head = b""
            while len(head) < 9:  # a frame header: length (3 bytes), type (4 = SETTINGS), flags, stream id
                got = sock.recv(9 - len(head))
                if not got:
                    break
                head += got
    except OSError as e:
        raise LcxError(f"no Ray cluster answers at {address!r} ({e.strerror or e}; {fix}") from None
    if len(head) < 9 or head[3] != 4:
        raise LcxError(f"no Ray cluster answers at {address!r} (something accepts connections there but does not "
                       f"answer as Ray's gRPC server does; {fix}")


class _Shard:
    """One shard (a Ray actor): a store per name, each holding the entries dealt to this shard."""

    def __init__(self, index: int, config: dict[str, Any], threads: int = 1) -> None:
        self.index, self.config, self.stores = index, StoreConfig(**config), {}
        threads = max(1, min(threads, len(os.sched_getaffinity(0))))  # at most this node's cores
        torch.set_num_threads(threads)  # Ray starts an actor with one thread (OMP_NUM_THREADS=1)
        try:
            import faiss

            faiss.omp_set_num_threads(threads)
        except ImportError:
            pass

    def ready(self) -> int:
        return os.getpid()

    def add(self, name: str, keys: torch.Tensor, values: torch.Tensor, positions: torch.Tensor,
            doc_ids: torch.Tensor, drop: int) -> None:
        if name not in self.stores:
            self.stores[name] = make_store(self.config)
        store = self.stores[name]
        if keys.shape[0]:
            store.add(keys, values, positions, doc_ids)
        store.drop_oldest(drop)

    def search(self, name: str, queries: torch.Tensor, k: int) -> tuple[torch.Tensor, ...] | None:
        """This shard's top-``k``: scores, its own row indices, and those rows' values."""
        store = self.stores.get(name)
        if store is None or not len(store):
            return None
        scores, idx = store.search(queries, k)
        return scores, idx, store.values[idx.clamp(min=0)]  # IVF marks missing neighbours -1 (score -inf)

    def rows(self, name: str, idx: torch.Tensor) -> torch.Tensor:
        return self.stores[name].values[idx]

    def read(self, name: str) -> tuple[torch.Tensor, ...] | None:
        store = self.stores.get(name)
        return None if store is None or not len(store) else (store.keys, store.values, store.positions, store.doc_ids)

    def forget(self, name: str) -> None:
        self.stores.pop(name, None)

    def copy(self, source: str, name: str) -> None:
        if source in self.stores:
            self.stores[name] = copy.deepcopy(self.stores[source])

    def save(self, prefixes: dict[str, str], path: str) -> str:
        """Write the named stores (name -> tensor prefix) to ``path``; returns its sha256."""
        tensors: dict[str, torch.Tensor] = {}
        for name, prefix in prefixes.items():
            if name in self.stores:
                tensors.update(self.stores[name].tensors(prefix))
        save_file(tensors, path)
        return _sha256(Path(path))

    def load(self, prefixes: dict[str, str], path: str, sha256: str) -> dict[str, tuple] | str:
        """Read the named stores (name -> tensor prefix) from ``path``: per store its entry count, key and value
        dimension and value dtype (None for an empty one); or why not."""
        if _sha256(Path(path)) != sha256:
            return f"memory file {path!r} is corrupted or truncated (checksum mismatch); rebuild it"
        tensors = load_file(path)
        for name, prefix in prefixes.items():
            store = make_store(self.config)
            store.load_tensors(tensors, prefix)
            self.stores[name] = store
        return {name: (len(s), s.keys.shape[1], s.values.shape[1], s.values.dtype) if len(s) else (0, None)
                for name, s in ((name, self.stores[name]) for name in prefixes)}


class _Shards:
    """A configuration's ``N`` shard actors, and calls to all of them at once."""

    def __init__(self, config: StoreConfig) -> None:
        ray = connect(config.ray_address)
        self.n = config.shards
        self.job = _session(ray)
        # max_restarts=0: a restarted shard would come back empty and answer searches without its entries
        actor = ray.remote(max_restarts=0)(_Shard)
        shard = asdict(replace(config.in_process(), max_entries=0))  # the cap counts all shards' entries: here
        threads = max(1, int(ray.cluster_resources().get("CPU", 1)) // self.n)  # the cluster's cores, shared out
        self.actors = [actor.options(scheduling_strategy="SPREAD").remote(i, shard, threads) for i in range(self.n)]
        self.broken: int | None = None  # a shard whose actor died
        self.call("ready", [()] * self.n, "starting", timeout=START_TIMEOUT_S)

    def call(self, method: str, args: list[tuple], what: str, timeout: float | None = None) -> list[Any]:
        """``method(*args[i])`` on shard i, for every i with args (None: skip that shard), run together;
        their answers in shard order.  A shard that died (or does not answer in ``timeout``) is an error."""
        refs = [getattr(a, method).remote(*x) if x is not None else None for a, x in zip(self.actors, args)]
        return [self.get(i, ref, what, timeout) if ref is not None else None for i, ref in enumerate(refs)]

    def get(self, i: int, ref: Any, what: str, timeout: float | None = None) -> Any:
        import ray

        try:
            return ray.get(ref, timeout=timeout)
        except ray.exceptions.GetTimeoutError:
            raise LcxError(f"memory shard {i} of {self.n} (a Ray actor) did not answer within {timeout} s while "
                           f"{what}; the cluster may lack free CPUs for {self.n} actors (`ray status`) or "
                           f"lcx on a node") from None
        except (ray.exceptions.RayActorError, ray.exceptions.ActorUnavailableError) as e:
            self.broken = i
            _groups.pop(next((k for k, g in _groups.items() if g is self), None), None)
            raise LcxError(f"memory shard {i} of {self.n} (Ray actor {self.actors[i]._actor_id.hex()[:12]}) died "
                           f"while {what}; its entries are lost, so the memory cannot answer: load the memory "
                           f"again (--memory) or rebuild it ({type(e).__name__})") from None


def _shards(config: StoreConfig) -> _Shards:
    """The actors for stores of ``config``: started at the first store of that configuration."""
    key = tuple(sorted(asdict(replace(config, max_entries=0)).items()))
    group = _groups.get(key)
    if group is not None:
        import ray

        if ray.is_initialized() and _session(ray) == group.job:
            return group
    _groups[key] = group = _Shards(config)
    return group


def _session(ray) -> tuple[str, str]:
    """This process's Ray session: its job and node (a Ray started again here numbers its jobs from 1 again, on
    a new node), so actors of a Ray that was shut down are never taken for live ones."""
    context = ray.get_runtime_context()
    return context.get_job_id(), context.get_node_id()


def _forget(shards: _Shards, name: str) -> None:
    """A store went away: its shards drop their parts (when Ray still runs; nothing to wait for)."""
    try:
        import ray

        if ray.is_initialized() and shards.broken is None:
            for a in shards.actors:
                a.forget.remote(name)
    except Exception:  # noqa: BLE001  # at interpreter exit Ray may be half shut down
        pass


# ---------------------------------------------------------------------- a store
class RayStore:
    """A ``MemoryStore`` (memory.py) whose entries are dealt round-robin over ``config.shards`` Ray actors."""

    def __init__(self, config: StoreConfig, shards: _Shards | None = None) -> None:
        config.validate()
        self.config = config
        self.shards = shards or _shards(config)
        self.name = f"{os.getpid()}.{next(_names)}"
        self.added = 0  # entries ever added (the next one's round-robin number)
        self.evicted = 0  # the oldest dropped by the cap (or before a save): entries are added - evicted
        self._found: tuple[torch.Tensor, torch.Tensor] | None = None  # the last search's indices and values
        self._shape: tuple[int, int, torch.dtype] | None = None  # key dim, value dim, value dtype
        weakref.finalize(self, _forget, self.shards, self.name).atexit = False  # at exit, Ray ends the actors

    def __len__(self) -> int:
        return self.added - self.evicted

    def __deepcopy__(self, memo: dict) -> "RayStore":
        """A copy with its own entries (each shard copies its part)."""
        new = RayStore(self.config, self.shards)
        memo[id(self)] = new
        self.shards.call("copy", [(self.name, new.name)] * self.shards.n, "copying a store")
        new.added, new.evicted, new._shape = self.added, self.evicted, self._shape
        return new

    def _dropped(self, shard: int, evicted: int) -> int:
        """How many of ``shard``'s entries are among the first ``evicted`` of all."""
        return max(0, (evicted - shard + self.shards.n - 1) // self.shards.n)

    def _where(self, idx: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Entry indices -> (shard, row in that shard)."""
        a = idx + self.evicted
        shard = a % self.shards.n
        first = torch.tensor([self._dropped(s, self.evicted) for s in range(self.shards.n)])
        return shard, a // self.shards.n - first[shard]

    def _entries(self, shard: int, rows: torch.Tensor) -> torch.Tensor:
        """Rows of ``shard`` -> entry indices."""
        return (rows + self._dropped(shard, self.evicted)) * self.shards.n + shard - self.evicted

    # ------------------------------------------------------------------ writing
    def add(self, keys: torch.Tensor, values: torch.Tensor, positions: torch.Tensor, doc_id: int | torch.Tensor = 0) -> None:
        """Append entries, dealt round-robin; with a cap, drop the oldest beyond it."""
        if keys.ndim != 2 or values.ndim != 2 or keys.shape[0] != values.shape[0]:
            raise LcxError(f"memory.add needs keys (N, D) and values (N, Dv); got {tuple(keys.shape)} and {tuple(values.shape)}")
        if self._shape is not None and keys.shape[1] != self._shape[0]:
            raise LcxError(f"key dimension {keys.shape[1]} differs from the memory's {self._shape[0]}")
        n, N = keys.shape[0], self.shards.n
        doc = doc_id.long().cpu() if torch.is_tensor(doc_id) else torch.full((n,), int(doc_id), dtype=torch.long)
        k, v, pos = keys.detach().float().cpu(), values.detach().cpu(), positions.long().cpu()
        cap = self.config.max_entries
        evicted = self.evicted + (max(0, len(self) + n - cap) if cap else 0)
        args: list[tuple | None] = []
        for s in range(N):
            part = slice((s - self.added) % N, None, N)  # entry added + j goes to shard (added + j) % N
            drop = self._dropped(s, evicted) - self._dropped(s, self.evicted)
            fresh = k[part].shape[0]
            args.append((self.name, k[part], v[part], pos[part], doc[part], drop) if fresh or drop else None)
        self.shards.call("add", args, "adding entries")
        self.added += n
        self.evicted = evicted
        self._found = None
        self._shape = (keys.shape[1], values.shape[1], values.dtype)

    def clear(self, doc_id: int | None = None) -> None:
        """Forget everything, or only the entries of one document (the rest are dealt again, in their order:
        every entry passes through this process)."""
        kept = None
        if doc_id is not None and len(self):
            everything = self._read()
            keep = everything[3] != doc_id
            kept = [x[keep] for x in everything]
        self.shards.call("forget", [(self.name,)] * self.shards.n, "clearing a store")
        self.added = self.evicted = 0
        self._found = None
        if kept is not None and kept[0].shape[0]:
            self.add(*kept)

    def load_tensors(self, t: dict[str, torch.Tensor], prefix: str = "") -> None:
        self.clear()
        if f"{prefix}keys" in t:
            self.add(t[f"{prefix}keys"], t[f"{prefix}values"], t[f"{prefix}positions"], t[f"{prefix}doc_ids"])

    # ------------------------------------------------------------------ reading
    def search(self, queries: torch.Tensor, k: int,
               select_dtype: torch.dtype | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Top-``k`` inner products: scores (Q, k') and entry indices (Q, k'), k' = min(k, len); each shard's
        top-k, merged (exact in float32: ``select_dtype`` is not sent to the shards).  The values of the entries
        found are fetched with them (``values[idx]`` reads those)."""
        if k <= 0:
            raise LcxError(f"k must be > 0, got {k}")
        k = min(k, len(self))
        if k == 0:
            return torch.zeros(queries.shape[0], 0), torch.zeros(queries.shape[0], 0, dtype=torch.long)
        import ray

        q = ray.put(queries.detach().float().cpu().contiguous())  # sent once, read by every shard
        found = self.shards.call("search", [(self.name, q, k)] * self.shards.n, "searching")
        parts = [(s, f) for s, f in enumerate(found) if f is not None]
        scores = torch.cat([f[0] for _, f in parts], dim=1)  # (Q, sum of the shards' k')
        idx = torch.cat([torch.where(f[1] >= 0, self._entries(s, f[1]), -1) for s, f in parts], dim=1)
        values = torch.cat([f[2] for _, f in parts], dim=1)  # (Q, sum of k', Dv)
        top = scores.topk(k, dim=1)
        idx = idx.gather(1, top.indices)
        self._found = (idx, values.gather(1, top.indices[..., None].expand(-1, -1, values.shape[-1])))
        return top.values, idx

    @property
    def values(self) -> "_ShardRows":
        """Indexable like a (N, Dv) tensor: ``values[idx]`` reads the rows (the last search's without a round trip)."""
        return _ShardRows(self)

    def _read(self) -> list[torch.Tensor] | None:
        """Keys, values, positions and document ids of every entry, in entry order (a copy of the whole memory)."""
        if not len(self):
            return None
        found = self.shards.call("read", [(self.name,)] * self.shards.n, "reading the memory")
        out = None
        for s, f in enumerate(found):
            if f is None:
                continue
            if out is None:
                out = [x.new_empty((len(self),) + tuple(x.shape[1:])) for x in f]
            at = self._entries(s, torch.arange(f[0].shape[0]))
            for o, x in zip(out, f):
                o[at] = x
        return out

    @property
    def keys(self) -> torch.Tensor | None:
        """(N, D) float32 keys, oldest first (a copy: only fot's dense mode reads every key)."""
        r = self._read()
        return None if r is None else r[0]

    @property
    def positions(self) -> torch.Tensor:
        r = self._read()
        return torch.zeros(0, dtype=torch.long) if r is None else r[2]

    @property
    def doc_ids(self) -> torch.Tensor:
        r = self._read()
        return torch.zeros(0, dtype=torch.long) if r is None else r[3]

    def tensors(self, prefix: str = "") -> dict[str, torch.Tensor]:
        r = self._read()
        return {} if r is None else dict(zip((f"{prefix}{n}" for n in ("keys", "values", "positions", "doc_ids")), r))


class _ShardRows:
    """A Ray memory's values, read as a (N, Dv) tensor is: by an index tensor, whole (``float()``, ``to()``)."""

    device = torch.device("cpu")

    def __init__(self, store: RayStore) -> None:
        self.store = store

    @property
    def shape(self) -> torch.Size:
        return torch.Size((len(self.store), self.store._shape[1] if self.store._shape else 0))

    @property
    def dtype(self) -> torch.dtype:
        return self.store._shape[2] if self.store._shape else torch.float32

    def __len__(self) -> int:
        return len(self.store)

    def __getitem__(self, idx: torch.Tensor) -> torch.Tensor:
        st = self.store
        idx = idx.cpu()
        out = torch.zeros(*idx.shape, self.shape[1], dtype=self.dtype)
        missing = idx >= 0  # -1 (an IVF list short of neighbours): zeros
        if st._found is not None and idx.numel():  # rows the last search fetched
            have, rows = st._found[0].reshape(-1), st._found[1].reshape(-1, self.shape[1])
            order = have.argsort()
            at = torch.searchsorted(have[order], idx).clamp(max=have.numel() - 1)
            hit = missing & (have[order][at] == idx)
            out[hit] = rows[order[at[hit]]]
            missing &= ~hit
        if missing.any():
            shard, row = st._where(idx[missing])
            got = st.shards.call("rows", [(st.name, row[shard == s]) if bool((shard == s).any()) else None
                                          for s in range(st.shards.n)], "reading values")
            part = out[missing]
            for s, rows in enumerate(got):
                if rows is not None:
                    part[shard == s] = rows
            out[missing] = part
        return out

    def _all(self) -> torch.Tensor:
        r = self.store._read()
        return torch.zeros(0, self.shape[1], dtype=self.dtype) if r is None else r[1]

    def float(self) -> torch.Tensor:
        return self._all().float()

    def to(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        return self._all().to(*args, **kwargs)


# ---------------------------------------------------------------------- on disk
def save_sharded(stores: dict[tuple[int, int], RayStore], path: str | os.PathLike, meta: dict[str, Any]) -> Path:
    """A Ray memory's folder: every shard writes its part of every store to its own tensor file; memory.json
    lists them with their sha256, the stores, the configuration (without the cluster's address) and how many
    of each store's entries the cap dropped (where the round-robin deal starts).  One atomic update, as
    ``save_memory``'s."""
    import json

    groups = {id(s.shards) for s in stores.values()}
    if len(groups) != 1:
        raise LcxError("a Ray memory is saved from stores on one set of shards; these are on several")
    shards = next(iter(stores.values())).shards
    names = {f"{layer}.{head}": store for (layer, head), store in stores.items()}

    def write(d: Path) -> None:
        files = [shard_file(i, shards.n) for i in range(shards.n)]
        prefixes = {store.name: f"{name}." for name, store in names.items()}
        sums = shards.call("save", [(prefixes, str(d.resolve() / f)) for f in files], "saving the memory")
        config = replace(next(iter(stores.values())).config, ray_address="")
        info = {"format": 1, "shards": [{"file": f, "sha256": h} for f, h in zip(files, sums)],
                "stores": list(names), "evicted": {name: s.evicted for name, s in names.items()},
                "store_config": asdict(config), **meta}
        (d / MEMORY_META).write_text(json.dumps(info, indent=2))

    return commit_files(path, write)


def load_sharded(path: str | os.PathLike, meta: dict[str, Any], config: StoreConfig) -> dict[tuple[int, int], RayStore]:
    """Read a folder ``save_sharded`` wrote: each shard its own file, checked against its sha256 there (the
    memory's shard count is ``config.shards``: ``memory.check_shards``)."""
    files = meta["shards"]
    stores = {name: RayStore(config) for name in meta["stores"]}
    shards = next(iter(stores.values())).shards
    prefixes = {store.name: f"{name}." for name, store in stores.items()}
    d = Path(path).resolve()
    counts = shards.call("load", [(prefixes, str(d / f["file"]), f["sha256"]) for f in files], "loading the memory")
    problem = next((c for c in counts if isinstance(c, str)), None)
    if problem:
        raise LcxError(problem)
    evicted = meta.get("evicted") or {}
    out = {}
    for name, store in stores.items():
        held = [c[store.name][0] for c in counts]
        store.evicted = int(evicted.get(name, 0))
        store.added = store.evicted + sum(held)
        dealt = [store._dropped(s, store.added) - store._dropped(s, store.evicted) for s in range(shards.n)]
        if held != dealt:
            raise LcxError(f"memory {str(path)!r} is damaged: store {name}'s shards hold {held} entries, not a "
                           f"round-robin deal ({dealt}); rebuild it")
        store._shape = next((c[store.name][1:] for c in counts if c[store.name][0]), None)
        layer, head = map(int, name.split("."))
        out[(layer, head)] = store
    return out
