"""`lcx memory build`'s indexing: documents one at a time, in this process or on Ray workers, journaled.

Every document is indexed on its own (``FoT.ingest``: its entries never depend on another document's), so
documents can be indexed in any order and on any worker, and the memory is assembled in document order at the
end: the same entries as one process indexing them in turn.  Each finished document's entries are written to
``OUT/.build/doc-I.safetensors`` and listed, with their sha256, in ``OUT/.build/build.json`` before the next
result is taken, so a killed build started again with the same inputs indexes only what was not finished.
Workers (``workers >= 1``) are Ray actors that each load the model; they receive a document's text and return
its entries (the driver writes every file, so workers need no shared file system); the cluster is the one
fot's Ray memory joins (``-o fot.ray_address``, $RAY_ADDRESS, else a local Ray).
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch
from safetensors.torch import save_file

from lcx.errors import LcxError
from lcx.io import load_safetensors, read_json_file, write_json
from lcx.plugins.fot.memory import _sha256, make_store

BUILD_DIR = ".build"
JOURNAL = "build.json"
#: Options that do not change a memory's entries (where they are held; training only): a build resumed with
#: other values of these produces the same entries.
_NOT_ENTRIES = ("shards", "ray_address", "mode", "d", "w", "segments", "train_k", "bank", "bank_k", "d_schedule")


@dataclass
class Indexed:
    """One document's entries: per (layer, KV head) the tensors of ``MemoryStore.tensors``."""

    doc_id: int
    tokens: int
    tensors: dict[str, torch.Tensor]


def worker_options(fot) -> dict[str, Any]:
    """fot's options for indexing one document in a process: a Ray memory's shard store held here."""
    options = fot.to_options()
    options.update(backend=fot.store_config().in_process().kind, shards=1, ray_address="")
    return options


def index_one(session, fot, text: str, doc_id: int, progress: bool = False) -> Indexed:
    """Index one document into an empty memory and return its entries (the memory is emptied again)."""
    ids = session.tokenizer(text, add_special_tokens=False, return_tensors="pt")["input_ids"]
    fot._stores = None
    try:
        tokens = fot.ingest(session.run, ids, doc_id, progress=progress)
        tensors: dict[str, torch.Tensor] = {}
        for (layer, head), store in fot.stores_for_saving().items():
            tensors.update(store.tensors(f"{layer}.{head}."))
    finally:
        fot._stores = None
    return Indexed(doc_id, tokens, tensors)


@contextlib.contextmanager
def _held_here(fot):
    """fot with a Ray memory's shard store held in this process (as a worker indexes): a document's own entries
    need no round trips."""
    saved = fot.backend, fot.shards, fot.ray_address
    fot.backend, fot.shards, fot.ray_address = fot.store_config().in_process().kind, 1, ""
    try:
        yield
    finally:
        fot.backend, fot.shards, fot.ray_address = saved


class _Indexer:
    """A Ray worker: the model loaded once, documents indexed one per call."""

    def __init__(self, model: str, options: dict[str, Any], adapter: str | None, device: str | None,
                 dtype: str | None, limits: Any, threads: int) -> None:
        from lcx.session import open_session

        torch.set_num_threads(max(1, min(threads, len(os.sched_getaffinity(0)))))  # Ray starts an actor with one
        self.session = open_session(model, ["fot"], {"fot": options}, adapter, device=device, dtype=dtype)
        self.session.run.limits = limits  # the command's, not this worker's environment's
        self.fot = self.session.run.method("fot")

    def ready(self) -> int:
        return os.getpid()

    def index(self, text: str, doc_id: int) -> Indexed:
        return index_one(self.session, self.fot, text, doc_id)


class Journal:
    """``OUT/.build``: what a build indexes (``identity``) and the documents finished so far."""

    def __init__(self, out: Path, identity: dict[str, Any]) -> None:
        self.dir, self.identity = out / BUILD_DIR, identity
        self.done: dict[int, dict[str, Any]] = {}

    @property
    def path(self) -> Path:
        return self.dir / JOURNAL

    def open(self, note: Callable[[str], None]) -> None:
        """Continue the unfinished build of the same inputs found here (its damaged parts redone), else start one."""
        if self.path.exists():
            old = read_json_file(self.path, f"delete {str(self.dir)!r} or pass --overwrite to start over")
            if not isinstance(old, dict) or old.get("identity") != self.identity:
                what = _first_difference(old.get("identity") if isinstance(old, dict) else None, self.identity)
                raise LcxError(f"{str(self.dir.parent)!r} holds an unfinished build of other inputs ({what}); pass "
                               f"--overwrite to start over, or rerun the build's own command to finish it")
            for key, entry in (old.get("done") or {}).items():
                part = self.dir / str(entry.get("file", ""))
                if part.is_file() and _sha256(part) == entry.get("sha256"):
                    self.done[int(key)] = entry
                else:
                    note(f"document {key}'s indexed entries ({part.name}) are missing or damaged: indexing it again")
            if self.done:
                note(f"resuming an unfinished build: {len(self.done)} of {len(self.identity['documents'])} "
                     f"document(s) already indexed")
        self.dir.mkdir(parents=True, exist_ok=True)
        self._write()

    def record(self, item: Indexed) -> None:
        """Write a finished document's entries, then list it (a crash between the two only loses that document)."""
        name = f"doc-{item.doc_id}.safetensors"
        save_file(item.tensors, str(self.dir / name))
        self.done[item.doc_id] = {"file": name, "sha256": _sha256(self.dir / name), "tokens": item.tokens}
        self._write()

    def entries(self, doc_id: int) -> dict[str, torch.Tensor]:
        return load_safetensors(self.dir / self.done[doc_id]["file"], "run the build again to index it anew")

    def _write(self) -> None:
        write_json({"format": 1, "identity": self.identity, "done": {str(k): v for k, v in sorted(self.done.items())}},
                   self.path)

    def remove(self) -> None:
        shutil.rmtree(self.dir, ignore_errors=True)


def _first_difference(old: Any, new: dict[str, Any]) -> str:
    if not isinstance(old, dict):
        return "its journal is not one lcx wrote"
    for key in new:
        if old.get(key) != new[key]:
            return f"{key} differ" if key.endswith("s") else f"{key} differs"
    return "its journal differs"


def identity(session, fot, documents: list[dict[str, str]], adapter: dict | None) -> dict[str, Any]:
    """What a build's entries depend on: the model's weights, fot's inference options (not where the memory is
    held), the adapter's weights, the dtype and every document's text, in order (not the paths they came by)."""
    from lcx.adapters.peft_bridge import base_identity

    model = {k: v for k, v in base_identity(session.model).items() if k != "name_or_path"}
    options = {k: v for k, v in worker_options(fot).items() if k not in _NOT_ENTRIES}
    return {"model": {**model, "weights_sample_sha256": _weights_sample(session.model)}, "options": options,
            "adapter": adapter and adapter.get("sha256"), "dtype": session.run.dtype,
            "documents": [hashlib.sha256(d["text"].encode()).hexdigest() for d in documents]}


def _weights_sample(model) -> str:
    """sha256 over the first values of every weight tensor: another checkpoint of the same architecture differs
    here (the embedding fingerprint alone misses a fine-tune that kept the embeddings)."""
    h = hashlib.sha256()
    for name, t in model.state_dict().items():
        h.update(name.encode())
        h.update(t.detach().flatten()[:64].float().cpu().numpy().tobytes())
    return h.hexdigest()


def index_documents(session, fot, documents: list[dict[str, str]], lengths: list[int], journal: Journal,
                    workers: int, *, model: str, adapter: str | None, device: str | None, progress: bool) -> None:
    """Index every document the journal does not list yet (``lengths``: their tokens, for the progress bar): in
    this process (``workers`` 0) or on Ray workers."""
    from tqdm.auto import tqdm

    todo = [i for i in range(len(documents)) if i not in journal.done]
    if not todo:
        return
    size = {i: lengths[i] for i in todo}
    bar = tqdm(total=sum(size.values()), desc="indexing", unit="tok", disable=not progress)
    bar.set_postfix_str(f"{len(journal.done)}/{len(documents)} docs")

    def finished(item: Indexed) -> None:
        journal.record(item)
        bar.update(size[item.doc_id])
        bar.set_postfix_str(f"{len(journal.done)}/{len(documents)} docs")

    try:
        if workers == 0:
            with _held_here(fot):
                for i in todo:
                    finished(index_one(session, fot, documents[i]["text"], i, progress=progress))
        else:
            _on_ray(fot, documents, todo, workers, finished, model=model, adapter=adapter, device=device,
                    dtype=session.run.dtype, limits=session.run.limits)
    finally:
        bar.close()


def _on_ray(fot, documents, todo, workers, finished, *, model, adapter, device, dtype, limits) -> None:
    """Deal documents to ``workers`` Ray actors, a new one to each actor as it finishes one (longest first)."""
    from lcx.plugins.fot.ray_memory import START_TIMEOUT_S, connect

    ray = connect(fot.ray_address)
    free = int(ray.cluster_resources().get("CPU", 0))
    if workers > free:
        raise LcxError(f"--workers {workers}: the Ray cluster has {free} CPU(s), one per worker; use --workers "
                       f"{max(free, 1)} or a larger cluster")
    actor = ray.remote(num_cpus=1, max_restarts=0)(_Indexer)
    options, threads = worker_options(fot), max(1, free // workers)  # the cluster's cores, shared out
    pool = [actor.remote(model, options, str(adapter) if adapter else None, device, dtype, limits, threads)
            for _ in range(workers)]
    try:
        started, _ = ray.wait([a.ready.remote() for a in pool], num_returns=workers, timeout=START_TIMEOUT_S)
        if len(started) < workers:
            raise LcxError(f"{workers - len(started)} of {workers} Ray worker(s) did not start within "
                           f"{START_TIMEOUT_S} s (no free CPU for them, or a node without lcx: `ray status`)")
        for ref in started:
            _get(ray, ref, "starting", "")
        queue = sorted(todo, key=lambda i: -len(documents[i]["text"]))
        running: dict[Any, tuple[int, int]] = {}  # ref -> (worker, doc)

        def give(w: int) -> None:
            if queue:
                i = queue.pop(0)
                running[pool[w].index.remote(documents[i]["text"], i)] = (w, i)

        for w in range(workers):
            give(w)
        while running:
            ready, _ = ray.wait(list(running), num_returns=1)
            w, i = running.pop(ready[0])
            finished(_get(ray, ready[0], f"indexing document {i} ({documents[i]['source']!r})", f" {w}"))
            give(w)
    finally:
        for a in pool:
            ray.kill(a)


def check_fits(run, fot, entries: int) -> None:
    """Refuse, before indexing, a memory over the entry limit or larger than the free memory where it is held."""
    from lcx.limits import LimitError, _gib, _where, available_memory

    limits = run.limits
    n = min(entries, fot.max_entries) if fot.max_entries else entries
    if n > limits.max_memory_entries:
        raise LimitError(f"the documents have {entries:,} tokens: the memory would hold {n:,} entries per layer and "
                         f"KV head, over the limit of {limits.max_memory_entries:,}; cap it with -o fot.max_entries=N "
                         f"(the oldest are evicted), or raise the limit with --max-memory-entries "
                         f"(or LCX_MAX_MEMORY_ENTRIES)")
    need = fot.memory_bytes(run, n)  # none for a Ray memory on a cluster elsewhere
    cpu = torch.device("cpu")  # the documents' entries are assembled in this machine's RAM
    have = available_memory(cpu)
    if need > limits.ram_fraction * have:
        raise LimitError(f"the memory of {n:,} entries per layer and KV head needs {_gib(need)} on {_where(cpu)}, "
                         f"more than the {_gib(limits.ram_fraction * have)} it has free; index fewer documents, cap "
                         f"it with -o fot.max_entries=N, or hold it on the shards of a Ray cluster (-o fot.backend=ray "
                         f"-o fot.shards=N -o fot.ray_address=HOST:PORT)")


def _get(ray, ref, what: str, worker: str) -> Any:
    """A worker's answer; its own error (an ``LcxError``: a limit, a bad document) as it is, a worker that died
    as an error saying the finished documents are kept."""
    try:
        return ray.get(ref)
    except ray.exceptions.RayTaskError as e:
        if isinstance(e.cause, LcxError):
            raise LcxError(str(e.cause)) from None
        raise LcxError(f"Ray worker{worker} failed {what}: {type(e.cause).__name__}: {e.cause}") from None
    except ray.exceptions.RayError as e:
        raise LcxError(f"Ray worker{worker} died {what} ({type(e).__name__}); the documents finished are kept: "
                       f"run the command again to index the rest") from None


def assemble(journal: Journal, n_documents: int, config) -> dict[tuple[int, int], Any]:
    """The memory: every document's entries added in document order into stores of ``config``."""
    stores: dict[tuple[int, int], Any] = {}
    scratch = make_store(kind="torch")  # only reads the part back: no index to build
    for doc_id in range(n_documents):
        tensors = journal.entries(doc_id)
        names = sorted({tuple(map(int, k.split(".")[:2])) for k in tensors})
        for layer, head in names:
            scratch.load_tensors(tensors, f"{layer}.{head}.")
            target = stores.setdefault((layer, head), make_store(config))
            target.add(scratch.keys, scratch.values, scratch.positions, doc_id)
        del tensors
    scratch.clear()
    return stores
