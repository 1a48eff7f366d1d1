"""Key/value memory stores: one interface, several search backends.

A store holds (key, value) vectors of ONE attention layer and ONE KV head,
with metadata per entry (absolute position, document id).  Methods keep a dict
of stores keyed by (layer, kv_head).  ``search`` returns the top-k entries by
inner product for each query.

Backends (``make_store(kind, ...)``):
    torch       exact, dense matmul + topk (a half-precision model's candidates picked in its precision where
                that pays, then scored in float32: top_inner_products); best for small memories
    faiss-flat  exact inner product (IndexFlatIP)
    faiss-ivf   approximate: inverted lists (nlist, nprobe); trains on the first entries.  Inner
                product search is run as nearest-neighbour search on keys extended by one coordinate
                (Bachrach et al. 2014), which IVF's k-means clusters well; see FaissStore
    faiss-hnsw  approximate: HNSW graph (M, ef_search)
    faiss-gpu   faiss-flat on a GPU, when faiss was built with CUDA and a GPU is present
    ray         the entries dealt round-robin over ``shards`` Ray actors, each holding a store of
                ``shard_kind`` (one of the above but faiss-gpu); a search asks every shard and merges the
                top-k (ray_memory.py)

An entry cap (``max_entries``) evicts the oldest entries first (FIFO: FoT's
memory is a sliding history; the oldest context is the least relevant).  Eviction
removes them from the index in place (flat: compacted; IVF: by id, lists kept, no
retraining); HNSW and faiss-gpu, which cannot delete, are rebuilt from the kept entries.
Stores save to safetensors (vectors + metadata) + JSON, with a sha256 of the
tensor file checked on load.

Entries live where their keys come from (a model on a GPU: a torch store searches there); FAISS
stores keep theirs on the CPU.  Search answers on the store's device; callers move them.
"""

from __future__ import annotations

import copy
import functools
import hashlib
import importlib.util
import json
import os
import re
from abc import ABC, abstractmethod
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch
from safetensors.torch import load_file, save_file

from lcx.errors import LcxError
from lcx.io import commit_files, read_json_file, recover

KINDS = ("torch", "faiss-flat", "faiss-ivf", "faiss-hnsw", "faiss-gpu", "ray")
SHARD_KINDS = ("torch", "faiss-flat", "faiss-ivf", "faiss-hnsw")  # what a Ray shard can hold


@dataclass
class StoreConfig:
    kind: str = "torch"
    max_entries: int = 0  # 0 = unbounded
    nlist: int = 256  # faiss-ivf: inverted lists
    nprobe: int = 16  # faiss-ivf: lists visited per query
    ivf_train: int = 0  # faiss-ivf: entries searched exactly before the lists are trained (at least nlist)
    hnsw_m: int = 32  # faiss-hnsw: graph degree
    ef_search: int = 128  # faiss-hnsw: search breadth
    ef_construction: int = 200  # faiss-hnsw: build breadth
    shards: int = 1  # ray: actors the entries are dealt over
    shard_kind: str = "faiss-flat"  # ray: the store each shard holds
    ray_address: str = ""  # ray: a running cluster (host:port, ray://host:port, auto); "" = $RAY_ADDRESS, else local

    def validate(self) -> None:
        if self.kind not in KINDS:
            raise LcxError(f"unknown memory backend {self.kind!r}; choose one of {', '.join(KINDS)}")
        if self.kind == "ray":
            if self.shards < 1:
                raise LcxError(f"a Ray memory needs shards >= 1 (one actor each), got {self.shards}")
            if self.shard_kind not in SHARD_KINDS:
                raise LcxError(f"a Ray memory's shards hold a {', '.join(SHARD_KINDS)} store, got {self.shard_kind!r}")
            if not ray_installed():
                raise LcxError("memory backend 'ray' needs Ray: pip install 'lcx[dist]' (or pick a one-process "
                               f"backend: {', '.join(k for k in KINDS if k != 'ray')})")
        if min(self.nlist, self.nprobe) < 1 or self.ivf_train < 0:
            raise LcxError(f"faiss-ivf needs nlist >= 1, nprobe >= 1, ivf_train >= 0; got {self.nlist}, {self.nprobe}, {self.ivf_train}")
        if self.max_entries < 0:
            raise LcxError(f"max_entries must be >= 0 (0 = unbounded), got {self.max_entries}")

    def in_process(self) -> "StoreConfig":
        """This configuration held by one process: a Ray memory's shard store (with the cap), else itself."""
        return replace(self, kind=self.shard_kind, shards=1) if self.kind == "ray" else self


def ray_installed() -> bool:
    """Whether Ray can be imported here (it is imported only when a Ray memory is made)."""
    try:
        return importlib.util.find_spec("ray") is not None
    except (ImportError, ValueError):
        return False


def bytes_per_store(config: StoreConfig, entries: int, key_dim: int, value_dim: int, value_size: int) -> int:
    """An upper bound on the bytes one store of ``config`` holding ``entries`` takes: float32 keys, values
    (``value_size`` bytes each), positions and document ids in ``_Rows`` (capacity doubles: up to as much
    again spare, 256 rows at least), plus the FAISS index's own copy of the keys (faiss-ivf: extended by one
    coordinate, with ids; faiss-hnsw: with ~2 x hnsw_m graph links each; faiss-gpu: on the GPU; ray: its shards'
    stores together, counted as one)."""
    if config.kind == "ray":
        return bytes_per_store(config.in_process(), entries, key_dim, value_dim, value_size)
    rows = (2 * entries + 256) * (4 * key_dim + value_size * value_dim + 16)
    index = {"torch": 0, "faiss-gpu": 0, "faiss-flat": 4 * key_dim, "faiss-ivf": 4 * (key_dim + 1) + 8,
             "faiss-hnsw": 4 * key_dim + 3 * config.hnsw_m * 4}[config.kind]
    return rows + entries * index


#: queries in all an exact search over several KV heads' keys scores in one product (a served decode step);
#: more are scored one head at a time: a prefill's block of queries would hold every head's scores at once
SEARCH_BATCH = 64


def search_bytes(config: StoreConfig, queries: int, entries: int, key_dim: int) -> int:
    """An upper bound on what one exact search of ``queries`` queries over a store of ``config`` holding
    ``entries`` allocates (``top_inner_products``): float32 scores against every entry it searches exactly, or
    the half candidate step's keys and scores in half precision, and each thread's top-k buffer.  Exact: the
    torch backend, faiss-ivf until its lists are trained (a Ray memory: in each shard); FAISS's own index
    searches (blocks of a few MiB) are not counted."""
    shards = config.shards if config.kind == "ray" else 1
    config = config.in_process()
    trains = max(config.nlist, config.ivf_train)
    exact = {"torch": entries, "faiss-ivf": min(entries, shards * trains)}.get(config.kind, 0)
    return (max(4 * queries, 2 * queries + 2 * key_dim) + 16 * torch.get_num_threads()) * exact


class _Rows:
    """Rows appended in amortised O(1) (capacity doubles) and dropped from the front in O(1).

    A memory grows by one window at a time; ``torch.cat`` per append would copy the whole
    memory each time (quadratic in its size)."""

    def __init__(self, data: torch.Tensor | None = None) -> None:
        self.buf, self.start, self.end = data, 0, 0 if data is None else data.shape[0]

    def view(self) -> torch.Tensor | None:
        return None if self.buf is None else self.buf[self.start:self.end]

    def append(self, x: torch.Tensor) -> None:
        n = x.shape[0]
        if self.buf is None or self.end + n > self.buf.shape[0]:
            live = self.view()
            size = 0 if live is None else live.shape[0]
            buf = x.new_empty((max(2 * (size + n), 256),) + tuple(x.shape[1:]))
            if size:
                buf[:size] = live
            self.buf, self.start, self.end = buf, 0, size
        self.buf[self.end:self.end + n] = x
        self.end += n

    def drop_front(self, n: int) -> None:
        self.start += n

    def __deepcopy__(self, memo: dict) -> "_Rows":
        """The live rows only (a copy does not keep the spare capacity)."""
        live = self.view()
        return _Rows(None if live is None else live.clone())


class MemoryStore(ABC):
    """Keys (N, D) and values (N, Dv) with positions and document ids; oldest-first eviction."""

    def __init__(self, config: StoreConfig) -> None:
        config.validate()
        self.config = config
        self._set(None, None, torch.zeros(0, dtype=torch.long), torch.zeros(0, dtype=torch.long))
        self.evicted = 0  # entries dropped by the cap, for reporting

    def _set(self, keys, values, positions, doc_ids) -> None:
        self._rows = {"keys": _Rows(keys), "values": _Rows(values), "positions": _Rows(positions), "doc_ids": _Rows(doc_ids)}

    keys = property(lambda self: self._rows["keys"].view(), doc="(N, D) float32 keys, oldest first")
    values = property(lambda self: self._rows["values"].view(), doc="(N, Dv) values")
    positions = property(lambda self: self._rows["positions"].view() if len(self) else torch.zeros(0, dtype=torch.long))
    doc_ids = property(lambda self: self._rows["doc_ids"].view() if len(self) else torch.zeros(0, dtype=torch.long))

    def __len__(self) -> int:
        r = self._rows["keys"]
        return r.end - r.start

    # ------------------------------------------------------------------ writing
    def add(self, keys: torch.Tensor, values: torch.Tensor, positions: torch.Tensor, doc_id: int | torch.Tensor = 0) -> None:
        """Append entries; with a cap, drop the oldest beyond it."""
        if keys.ndim != 2 or values.ndim != 2 or keys.shape[0] != values.shape[0]:
            raise LcxError(f"memory.add needs keys (N, D) and values (N, Dv); got {tuple(keys.shape)} and {tuple(values.shape)}")
        if len(self) and keys.shape[1] != self.keys.shape[1]:
            raise LcxError(f"key dimension {keys.shape[1]} differs from the memory's {self.keys.shape[1]}")
        n = keys.shape[0]
        doc = doc_id.long().cpu() if torch.is_tensor(doc_id) else torch.full((n,), int(doc_id), dtype=torch.long)
        where = self._device(keys)
        k = keys.detach().float().to(where).contiguous()
        # the rows are copied into the memory's own buffers (callers may reuse theirs); metadata stays on the CPU
        for name, x in (("keys", k), ("values", values.detach().to(where)), ("positions", positions.long().cpu()), ("doc_ids", doc)):
            self._rows[name].append(x)
        cap = self.config.max_entries
        if cap and len(self) > cap:
            drop = len(self) - cap
            self.evicted += drop
            for r in self._rows.values():
                r.drop_front(drop)
            self._evict_front(drop, k)
        else:
            self._index_add(k)

    def drop_oldest(self, n: int) -> None:
        """Forget the ``n`` oldest entries, as the cap does (a Ray memory's shards are told so by their owner)."""
        n = min(n, len(self))
        if n <= 0:
            return
        self.evicted += n
        for r in self._rows.values():
            r.drop_front(n)
        self._evict_front(n, self.keys[:0])

    def clear(self, doc_id: int | None = None) -> None:
        """Forget everything, or only the entries of one document."""
        if doc_id is None or not len(self):
            self._set(None, None, torch.zeros(0, dtype=torch.long), torch.zeros(0, dtype=torch.long))
        else:
            keep = self.doc_ids != doc_id
            on = keep.to(self.keys.device)
            self._set(self.keys[on], self.values[on], self.positions[keep], self.doc_ids[keep])
        self._rebuild()

    # ------------------------------------------------------------------ reading
    def search(self, queries: torch.Tensor, k: int,
               select_dtype: torch.dtype | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Top-``k`` inner products: scores (Q, k') and entry indices (Q, k'), k' = min(k, len).  ``select_dtype``:
        a half precision the caller's model runs in, which an exact search may pick its candidates in
        (``top_inner_products``); the scores returned are float32 either way."""
        if k <= 0:
            raise LcxError(f"k must be > 0, got {k}")
        k = min(k, len(self))
        if k == 0:
            return torch.zeros(queries.shape[0], 0), torch.zeros(queries.shape[0], 0, dtype=torch.long)
        return self._search(queries.detach().float().to(self.keys.device).contiguous(), k, select_dtype)

    def _device(self, keys: torch.Tensor) -> torch.device:
        """Where the entries live: with the first keys added (the model's device); FAISS indexes read CPU arrays."""
        return self.keys.device if len(self) else keys.device

    # ------------------------------------------------------------------ backend
    @abstractmethod
    def _index_add(self, keys: torch.Tensor) -> None: ...

    @abstractmethod
    def _rebuild(self) -> None: ...

    def _evict_front(self, n: int, added: torch.Tensor) -> None:
        """The index after ``added`` joined and the ``n`` oldest entries left (the rows already did)."""
        self._rebuild()

    @abstractmethod
    def _search(self, queries: torch.Tensor, k: int,
                select_dtype: torch.dtype | None = None) -> tuple[torch.Tensor, torch.Tensor]: ...

    # ------------------------------------------------------------------ persistence
    def tensors(self, prefix: str = "") -> dict[str, torch.Tensor]:
        if not len(self):
            return {}
        return {f"{prefix}keys": self.keys.cpu().contiguous(), f"{prefix}values": self.values.cpu().contiguous(),
                f"{prefix}positions": self.positions, f"{prefix}doc_ids": self.doc_ids}

    def load_tensors(self, t: dict[str, torch.Tensor], prefix: str = "") -> None:
        self.clear()
        if f"{prefix}keys" in t:
            self._set(t[f"{prefix}keys"], t[f"{prefix}values"], t[f"{prefix}positions"], t[f"{prefix}doc_ids"])
            self._rebuild()


class TorchStore(MemoryStore):
    """Exact search by dense matmul (the reference every other backend is tested against)."""

    def _index_add(self, keys: torch.Tensor) -> None:
        pass

    def _rebuild(self) -> None:
        pass

    def _search(self, queries: torch.Tensor, k: int,
                select_dtype: torch.dtype | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        return top_inner_products(queries, self.keys, k, select_dtype)


# where the half candidate step pays on a CPU (bench/half_candidates.py, in a real prefill and alone): below
# HALF_MIN_QUERIES queries or HALF_MIN_KEYS keys converting the keys costs more than the half product saves, and
# it needs HALF_MIN_SCORES scores (queries x keys) unless the memory holds HALF_ANY_KEYS keys
HALF_MIN_QUERIES, HALF_MIN_KEYS, HALF_MIN_SCORES, HALF_ANY_KEYS = 4, 3072, 1 << 21, 8192


def half_pays(queries: int, keys: int) -> bool:
    """Whether picking candidates in a fast half precision beats float32 on a CPU for ``queries`` x ``keys``."""
    return (queries >= HALF_MIN_QUERIES and keys >= HALF_MIN_KEYS
            and (queries * keys >= HALF_MIN_SCORES or keys >= HALF_ANY_KEYS))


def top_inner_products(queries: torch.Tensor, keys: torch.Tensor, k: int, select_dtype: torch.dtype | None = None,
                       pays: Callable[[int, int], bool] = half_pays) -> tuple[torch.Tensor, torch.Tensor]:
    """Each query's (Q, D) top-``k`` float32 inner products with ``keys`` (N, D), best first, and their rows;
    batched where both carry a leading dimension (queries (B, Q, D), keys (B, N, D): each batch's own keys).
    With a half ``select_dtype`` where it ``pays(Q, N)`` (on a CPU; a GPU's crossover is not measured), the
    k + ``spare`` best scores in it are the candidates and only those are scored in float32: the same top-k
    unless its rounding outweighs the gap between the k-th score and the (k + spare)-th, at the half product's
    speed."""
    if not takes_half_step(queries.shape[-2], keys.shape[-2], k, select_dtype, keys.device, pays):
        top = (queries @ keys.transpose(-1, -2)).topk(k, dim=-1)
        return top.values, top.indices
    spare = _spare(k)
    cand = (queries.to(select_dtype) @ keys.to(select_dtype).transpose(-1, -2)).topk(k + spare, dim=-1).indices
    rows = keys[cand] if keys.dim() == 2 else keys[torch.arange(keys.shape[0], device=keys.device)[:, None, None], cand]
    exact = (rows @ queries[..., None])[..., 0]  # (..., Q, k + spare)
    top = exact.topk(k, dim=-1)
    return top.values, cand.gather(-1, top.indices)


def takes_half_step(queries: int, keys: int, k: int, select_dtype: torch.dtype | None, device: torch.device,
                    pays: Callable[[int, int], bool] = half_pays) -> bool:
    """Whether ``top_inner_products`` picks its candidates in ``select_dtype`` for ``queries`` x ``keys``."""
    return (keys > k + _spare(k) and _fast_half(select_dtype, device)
            and (device.type != "cpu" or pays(queries, keys)))


def _spare(k: int) -> int:
    return max(8, k // 4)  # a topk's cost grows with its k: a few spare candidates, not 2k


@functools.cache  # read once per dtype and device: a search runs per block of queries, per layer and KV head
def _fast_half(dtype: torch.dtype | None, device: torch.device) -> bool:
    """Whether a ``dtype`` matrix product beats float32 on ``device``: fp16 on a GPU, bf16 where it is native
    (elsewhere a half-precision product is emulated, slower than float32)."""
    from lcx.models import native_bf16

    return (dtype == torch.float16 and device.type == "cuda") or (dtype == torch.bfloat16 and native_bf16(device))


def faiss_gpu_available() -> bool:
    """Whether the ``faiss-gpu`` backend can run here: faiss built with CUDA, and a GPU it sees."""
    try:
        import faiss
    except ImportError:
        return False
    return hasattr(faiss, "StandardGpuResources") and faiss.get_num_gpus() > 0


def _faiss_gpu_missing(faiss: Any) -> str:
    """Why faiss-gpu cannot run here, and the fix."""
    from importlib import metadata

    if hasattr(faiss, "StandardGpuResources"):
        return "memory backend 'faiss-gpu': faiss has CUDA but sees no GPU here; use 'torch' or 'faiss-flat'"
    try:
        gpu = metadata.version("faiss-gpu")
    except metadata.PackageNotFoundError:
        return ("memory backend 'faiss-gpu' needs faiss built with CUDA (pip install 'lcx[gpu]', then "
                "pip uninstall -y faiss-cpu && pip install --force-reinstall --no-deps faiss-gpu); "
                "use 'torch' or 'faiss-flat' without one")
    return (f"memory backend 'faiss-gpu': faiss-gpu {gpu} is installed but faiss-cpu's module is the one "
            "imported (both install 'faiss'); pip uninstall -y faiss-cpu && pip install --force-reinstall "
            "--no-deps faiss-gpu")


class FaissStore(MemoryStore):
    """FAISS index over the keys; entry i of the store is row i of the index.

    faiss-ivf does not cluster raw keys under inner product: an inner-product quantizer assigns each key
    to the centroid of largest norm along it, so rare keys (a passkey among 64K filler keys) land in lists
    that their queries do not probe (recall measured in results/fot/passkey-64k/recall).  Keys become
    ``[k, sqrt(R^2 - |k|^2)]`` and queries ``[q, 0]``, so ``|q' - k'|^2 = |q|^2 + R^2 - 2 q.k``: the nearest
    key is the largest inner product, and the lists are plain L2 k-means cells.  R is twice the largest norm seen at
    training, so later keys up to that norm keep the identity; scores are recomputed exactly."""

    IVF_NORM_MARGIN = 2.0

    def _device(self, keys: torch.Tensor) -> torch.device:
        return torch.device("cpu")  # FAISS reads numpy arrays (faiss-gpu copies them to its GPU itself)

    def __init__(self, config: StoreConfig) -> None:
        super().__init__(config)
        self.index: Any = None
        self._id_base = 0  # IVF keeps ids on removal: index id = entry index + _id_base
        self._r2 = 0.0  # faiss-ivf: R^2 of the extending coordinate (set when the lists are trained)

    def __deepcopy__(self, memo: dict) -> "FaissStore":
        """A copy with its own index (FAISS objects do not deep-copy; clone_index copies lists and graph)."""
        import faiss

        new = type(self).__new__(type(self))
        memo[id(self)] = new
        for name, value in self.__dict__.items():
            if name not in ("index", "_quantizer", "_gpu_res"):
                setattr(new, name, copy.deepcopy(value, memo))
        new.index = None
        if self.index is not None:
            if self.config.kind == "faiss-gpu":
                new._rebuild()
            else:
                new.index = faiss.clone_index(self.index)  # the clone owns its quantizer
        return new

    def _make_index(self, d: int) -> Any:
        import faiss

        c = self.config
        if c.kind == "faiss-flat":
            return faiss.IndexFlatIP(d)
        if c.kind == "faiss-gpu":
            if not faiss_gpu_available():
                raise LcxError(_faiss_gpu_missing(faiss))
            self._gpu_res = faiss.StandardGpuResources()
            return faiss.index_cpu_to_gpu(self._gpu_res, 0, faiss.IndexFlatIP(d))
        if c.kind == "faiss-hnsw":
            index = faiss.IndexHNSWFlat(d, c.hnsw_m, faiss.METRIC_INNER_PRODUCT)
            index.hnsw.efConstruction = c.ef_construction
            index.hnsw.efSearch = c.ef_search
            return index
        quantizer = faiss.IndexFlatL2(d + 1)  # on extended keys (see the class docstring)
        index = faiss.IndexIVFFlat(quantizer, d + 1, c.nlist, faiss.METRIC_L2)
        index.nprobe = c.nprobe
        self._quantizer = quantizer  # the IVF index does not own it: keep it alive
        return index

    def _index_add(self, keys: torch.Tensor) -> None:
        if self.index is None or (self.config.kind == "faiss-ivf" and not self.index.is_trained):
            self._rebuild()
        elif self.config.kind == "faiss-ivf":  # explicit ids: after removals, ntotal no longer is the next id
            first = self._id_base + self.index.ntotal
            self.index.add_with_ids(self._extend(keys), np.arange(first, first + keys.shape[0], dtype=np.int64))
        else:
            self.index.add(keys.numpy())

    def _evict_front(self, n: int, added: torch.Tensor) -> None:
        import faiss

        kind = self.config.kind
        # HNSW graphs and FAISS's GPU indexes have no removal: those are rebuilt from the kept entries
        untrained_ivf = kind == "faiss-ivf" and self.index is not None and not self.index.is_trained
        if self.index is None or kind in ("faiss-hnsw", "faiss-gpu") or untrained_ivf:
            return self._rebuild()
        self._index_add(added)
        if kind == "faiss-ivf":  # ids are kept: remove the oldest by id, remember the offset
            self.index.remove_ids(faiss.IDSelectorRange(self._id_base, self._id_base + n))
            self._id_base += n
        else:  # flat: removal compacts, ids stay entry indices
            self.index.remove_ids(faiss.IDSelectorRange(0, n))

    def _rebuild(self) -> None:
        self.index = None
        self._id_base = 0
        if not len(self):
            return
        d = self.keys.shape[1]
        index = self._make_index(d)
        x = self.keys.numpy()
        if self.config.kind == "faiss-ivf":
            if len(self) < max(self.config.nlist, self.config.ivf_train):  # exact until there are enough to train
                self.index = None
                return
            self._r2 = float((self.keys.norm(dim=1).max() * self.IVF_NORM_MARGIN) ** 2)
            x = self._extend(self.keys)
            index.train(x)
        index.add(x)
        self.index = index

    def _extend(self, keys: torch.Tensor) -> np.ndarray:
        """faiss-ivf's keys with the coordinate that turns inner product into L2 distance."""
        extra = (self._r2 - keys.pow(2).sum(1, keepdim=True)).clamp(min=0).sqrt()
        return torch.cat([keys, extra], dim=1).numpy()

    def _search(self, queries: torch.Tensor, k: int,
                select_dtype: torch.dtype | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        if self.index is None:  # IVF before training: exact fallback
            return top_inner_products(queries, self.keys, k, select_dtype)
        ivf = self.config.kind == "faiss-ivf"
        if ivf:
            queries = torch.cat([queries, queries.new_zeros(queries.shape[0], 1)], dim=1)
        scores, idx = self.index.search(queries.numpy(), k)
        idx = torch.from_numpy(idx).long()
        if self._id_base:
            idx = torch.where(idx >= 0, idx - self._id_base, idx)
        if not ivf:
            return torch.from_numpy(scores), idx
        # L2 distances -> the exact inner products, best first; lists may hold fewer than k (id -1)
        found = idx >= 0
        ip = torch.einsum("qd,qkd->qk", queries[:, :-1], self.keys[idx.clamp(min=0)])
        ip = ip.masked_fill(~found, float("-inf"))
        order = ip.argsort(dim=1, descending=True)
        return ip.gather(1, order), idx.gather(1, order)


class UnionStore:
    """A shared memory read by many, plus one reader's own entries on top: what a served request sees of a
    document memory (``lcx serve --memory``).  Reads as one store whose entries are the shared ones then the
    own ones (the order lcx's multi-document mode appends them in); writes go to the own store only, so the
    shared memory never changes.  Search is exact over the union: each part's top-k, merged."""

    def __init__(self, shared: MemoryStore, own: MemoryStore) -> None:
        self.shared, self.own = shared, own

    def __len__(self) -> int:
        return len(self.shared) + len(self.own)

    def add(self, keys: torch.Tensor, values: torch.Tensor, positions: torch.Tensor, doc_id: int | torch.Tensor = 0) -> None:
        self.own.add(keys, values, positions, doc_id)

    @property
    def keys(self) -> torch.Tensor:
        """(N, D) keys, shared then own: a copy (only fot's dense mode reads every key)."""
        parts = [x for x in (self.shared.keys, self.own.keys) if x is not None and len(x)]
        return torch.cat([x.to(parts[-1].device) for x in parts])

    @property
    def values(self) -> "_UnionRows":
        """Indexable like a (N, Dv) tensor without copying the shared memory: ``values[idx]`` gathers."""
        return _UnionRows(self.shared.values, self.own.values)

    def search(self, queries: torch.Tensor, k: int,
               select_dtype: torch.dtype | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        parts = [(store, offset) for store, offset in ((self.shared, 0), (self.own, len(self.shared))) if len(store)]
        if not parts:
            return self.own.search(queries, k)  # empty: the store's own empty answer
        if len(parts) == 1:
            scores, idx = parts[0][0].search(queries, k, select_dtype)
            return scores, idx + parts[0][1]
        found = [store.search(queries, k, select_dtype) for store, _ in parts]  # each on its store's device
        scores = torch.cat([f[0].to(queries.device) for f in found], dim=1)
        idx = torch.cat([f[1].to(queries.device) + offset for f, (_, offset) in zip(found, parts)], dim=1)
        top = scores.topk(min(k, scores.shape[1]), dim=1)
        return top.values, idx.gather(1, top.indices)


class _UnionRows:
    """Rows of two tensors read as their concatenation, gathered by index without building it."""

    def __init__(self, first: torch.Tensor, second: torch.Tensor) -> None:
        self.first, self.second = first, second

    def __getitem__(self, idx: torch.Tensor) -> torch.Tensor:
        if self.second is None:  # an empty store has no rows yet
            return self.first[idx.to(self.first.device)]
        if self.first is None:
            return self.second[idx.to(self.second.device)]
        n = self.first.shape[0]
        out = torch.empty(*idx.shape, self.first.shape[1], dtype=self.first.dtype, device=idx.device)
        low = idx < n
        out[low] = self.first[idx[low].to(self.first.device)].to(idx.device)
        out[~low] = self.second[(idx[~low] - n).to(self.second.device)].to(idx.device)
        return out

    def float(self) -> torch.Tensor:
        parts = [x for x in (self.first, self.second) if x is not None]
        return torch.cat([x.to(parts[-1].device) for x in parts]).float()


def make_store(config: StoreConfig | None = None, **kwargs: Any) -> MemoryStore:
    config = config or StoreConfig(**kwargs)
    config.validate()
    if config.kind == "ray":
        from lcx.plugins.fot.ray_memory import RayStore

        return RayStore(config)  # type: ignore[return-value]  # the same interface, entries held by Ray actors
    return TorchStore(config) if config.kind == "torch" else FaissStore(config)


# ---------------------------------------------------------------------- a whole memory on disk
MEMORY_TENSORS = "memory.safetensors"
MEMORY_META = "memory.json"


def save_memory(stores: dict[tuple[int, int], MemoryStore], path: str | os.PathLike, meta: dict[str, Any]) -> Path:
    """Write every (layer, head) store: tensors to safetensors, metadata + sha256 to JSON, as one atomic
    update (a crash leaves the previous memory, or the new one once committed; never a mix).  A Ray memory
    writes a tensor file per shard instead, each with its sha256 (``ray_memory.save_sharded``)."""
    any_store = next(iter(stores.values()), None)
    if any_store is not None and any_store.config.kind == "ray":
        from lcx.plugins.fot.ray_memory import save_sharded

        return save_sharded(stores, path, meta)  # type: ignore[arg-type]
    tensors: dict[str, torch.Tensor] = {}
    for (layer, head), store in stores.items():
        tensors.update(store.tensors(f"{layer}.{head}."))

    def write(d: Path) -> None:
        save_file(tensors, str(d / MEMORY_TENSORS))
        info = {"format": 1, "sha256": _sha256(d / MEMORY_TENSORS), "stores": [f"{l}.{h}" for l, h in stores],
                "store_config": asdict(any_store.config) if any_store else None, **meta}
        (d / MEMORY_META).write_text(json.dumps(info, indent=2))

    return commit_files(path, write)


def check_shards(path: str | os.PathLike, meta: dict, config: StoreConfig) -> None:
    """A sharded memory (``meta``: its memory.json) is read only into a Ray memory of as many shards: each
    shard reads its own file (dealing it again would pull every entry through one process)."""
    files = meta.get("shards")
    if files is None:
        return
    if config.kind != "ray":
        raise LcxError(f"memory {str(path)!r} is sharded over {len(files)} Ray actors; read it with "
                       f"-o fot.backend=ray -o fot.shards={len(files)}")
    if len(files) != config.shards:
        raise LcxError(f"memory {str(path)!r} is sharded over {len(files)} Ray actors, and -o fot.shards="
                       f"{config.shards} asks for {config.shards}; read it with -o fot.shards={len(files)}, or "
                       f"rebuild it with {config.shards} shards")


def load_memory(path: str | os.PathLike, config: StoreConfig | None = None) -> tuple[dict[tuple[int, int], MemoryStore], dict]:
    """Read a memory written by ``save_memory`` into stores of ``config`` (default: as it was saved); every
    tensor file must match its recorded sha256.  A one-file memory can be read into a Ray memory (dealt over
    its shards); a sharded one only into a Ray memory of as many shards (each reads its own file)."""
    meta = check_memory_files(path, checksums=False)
    cfg = config or StoreConfig(**(meta.get("store_config") or {}))
    check_shards(path, meta, cfg)
    if meta.get("shards") is not None:
        from lcx.plugins.fot.ray_memory import load_sharded

        return load_sharded(path, meta, cfg), meta  # type: ignore[return-value]
    _check_sha256(Path(path) / MEMORY_TENSORS, meta.get("sha256"))
    tensors = load_file(str(Path(path) / MEMORY_TENSORS))
    stores = {}
    for name in meta["stores"]:
        layer, head = map(int, name.split("."))
        store = make_store(cfg)
        store.load_tensors(tensors, f"{name}.")
        stores[(layer, head)] = store
    return stores, meta


def check_memory_files(path: str | os.PathLike, checksums: bool = True) -> dict:
    """A memory folder's metadata, once its files are whole: an interrupted save finished (``recover``),
    memory.json of the shape ``save_memory`` writes, the tensor file (a Ray memory's: one per shard) there
    and, with ``checksums``, matching its recorded sha256."""
    d = Path(path)
    if d.is_dir():
        recover(d)  # finish a save that a crash interrupted after its commit point
    meta_path = d / MEMORY_META
    if not meta_path.exists() or (not (d / MEMORY_TENSORS).exists() and not _lists_shards(meta_path)):
        raise LcxError(f"{str(d)!r} is not an lcx memory folder (needs {MEMORY_META} and {MEMORY_TENSORS}); "
                       f"build one with `lcx memory build`")
    meta = read_json_file(meta_path, "rebuild the memory")
    _check_memory_meta(meta, meta_path)
    files = [(d / s["file"], s["sha256"]) for s in meta["shards"]] if "shards" in meta \
        else [(d / MEMORY_TENSORS, meta.get("sha256"))]
    for f, sha in files:
        if not f.exists():
            raise LcxError(f"memory file {str(f)!r} is missing (its {MEMORY_META} lists it); rebuild the memory")
        if checksums:
            _check_sha256(f, sha)
    return meta


def _lists_shards(meta_path: Path) -> bool:
    try:
        return "shards" in json.loads(meta_path.read_text())
    except (ValueError, TypeError, OSError):
        return False


def _check_sha256(path: Path, sha256: Any) -> None:
    if _sha256(path) != sha256:
        raise LcxError(f"memory file {str(path)!r} is corrupted or truncated (checksum mismatch); rebuild it")


def _check_memory_meta(meta: Any, path: Path) -> None:
    """memory.json has the shape ``save_memory`` writes (the checksum covers only the tensors): else one line
    naming the file, not a KeyError or ValueError from the reading code."""
    stores = meta.get("stores") if isinstance(meta, dict) else None
    bad = next((n for n in stores if not (isinstance(n, str) and re.fullmatch(r"\d+\.\d+", n))), None) \
        if isinstance(stores, list) else None
    problem = None
    if not isinstance(meta, dict):
        problem = "it is not a JSON object"
    elif not isinstance(stores, list) or not stores:
        problem = "'stores' must be a non-empty list of \"layer.head\" names"
    elif bad is not None:
        problem = f"store name {bad!r} is not \"layer.head\""
    elif not isinstance(meta.get("model", {}), dict):
        problem = "'model' must be an object (the model it was built with)"
    elif "shards" in meta and not _shard_list(meta["shards"]):
        problem = "'shards' must be a non-empty list of {\"file\": \"memory-shard-I-of-N.safetensors\", \"sha256\": ...}"
    if problem:
        raise LcxError(f"memory file {str(path)!r} is damaged: {problem}; rebuild the memory with `lcx memory build`")


def shard_file(i: int, n: int) -> str:
    """The tensor file of shard ``i`` of ``n`` in a Ray memory's folder."""
    return f"memory-shard-{i}-of-{n}.safetensors"


def _shard_list(shards: Any) -> bool:
    """A Ray memory's list of shard files: shard i of n named ``shard_file(i, n)`` (no other path), a sha256 each."""
    return isinstance(shards, list) and bool(shards) and all(
        isinstance(s, dict) and s.get("file") == shard_file(i, len(shards)) and isinstance(s.get("sha256"), str)
        for i, s in enumerate(shards))


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            h.update(block)
    return h.hexdigest()


def recall_at_k(exact_idx: torch.Tensor, approx_idx: torch.Tensor) -> float:
    """Share of the exact top-k found by an approximate search (per query, averaged)."""
    hits = [len(set(a.tolist()) & set(e.tolist())) / max(e.numel(), 1) for e, a in zip(exact_idx, approx_idx)]
    return float(np.mean(hits)) if hits else 1.0
