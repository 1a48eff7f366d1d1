"""Writing result files: atomically (temp file + rename), so a crash never leaves half a file."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
from pathlib import Path
from typing import Any, Callable, Iterator

#: ``commit_files`` writes a new set of files here first ...
STAGING = ".lcx-staging"
#: ... and renames the finished folder to this name: the commit point (``recover`` rolls it forward).
COMMIT = ".lcx-commit"


def token_counts(text: str) -> list[int]:
    """Comma-separated token counts, ``K`` = 1024 (``"4096,8K,0.5k"`` -> ``[4096, 8192, 512]``).

    Raises ``ValueError`` naming the bad item (callers turn it into their own usage error)."""
    out = []
    for item in (x.strip() for x in text.split(",")):
        if not item:
            continue
        try:
            n = int(float(item[:-1]) * 1024) if item.lower().endswith("k") else int(item)
        except (ValueError, OverflowError):  # OverflowError: infK
            raise ValueError(f"{item!r} is not a token count (e.g. 4096 or 8K)") from None
        if n <= 0:
            raise ValueError(f"{item!r}: token counts must be positive")
        out.append(n)
    if not out:
        raise ValueError(f"{text!r} holds no token count (e.g. 4096,8K)")
    return out


def token_label(n: int) -> str:
    """A token count as ``token_counts`` reads it back: ``8K`` for 8192, ``4000`` for 4000 (never a rounded K)."""
    return f"{n // 1024}K" if n >= 1024 and n % 1024 == 0 else str(n)


def read_json_file(path: str | os.PathLike[str], fix: str) -> Any:
    """A JSON file lcx wrote, or a clear error naming it (``fix``: what the user should do)."""
    from lcx.errors import LcxError

    p = Path(path)
    if not p.exists():
        raise LcxError(f"{str(p)!r} is missing; {fix}")
    try:
        return json.loads(p.read_text())
    except (ValueError, UnicodeDecodeError) as e:
        raise LcxError(f"{str(p)!r} is corrupted or truncated ({e}); {fix}") from None


def check_safetensors(path: str | os.PathLike[str], fix: str) -> None:
    """Refuse a safetensors file whose header is damaged or whose data the file no longer covers
    (truncation), naming it; reads only the header."""
    from safetensors import safe_open

    from lcx.errors import LcxError

    p = Path(path)
    if not p.exists():
        raise LcxError(f"{str(p)!r} is missing; {fix}")
    try:
        with safe_open(str(p), "pt"):
            pass
    except Exception as e:  # safetensors raises its own SafetensorError (and OSError for unreadable files)
        raise LcxError(f"{str(p)!r} is corrupted or truncated ({str(e).splitlines()[0]}); {fix}") from None


def load_safetensors(path: str | os.PathLike[str], fix: str) -> dict[str, Any]:
    """``safetensors.torch.load_file`` with ``check_safetensors``'s clear error."""
    from safetensors.torch import load_file

    check_safetensors(path, fix)
    return load_file(str(path))


def write_text(text: str, path: Path) -> Path:
    """Write ``text`` to ``path`` atomically (a temporary file, then a rename)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)
    return path


def write_json(obj: Any, path: Path) -> Path:
    return write_text(json.dumps(obj, indent=2, default=str), path)


@contextlib.contextmanager
def file_lock(path: Path, on_wait: Callable[[], None] | None = None) -> Iterator[None]:
    """Hold an exclusive lock on the file ``path`` (created if missing) across processes (POSIX ``flock``);
    ``on_wait`` is called once if another process holds it.  A no-op where ``fcntl`` is missing."""
    try:
        import fcntl
    except ImportError:  # Windows
        yield
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as fh:
        try:
            fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            if on_wait is not None:
                on_wait()
            fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


@contextlib.contextmanager
def accumulated_runs(path: Path) -> Iterator[dict[str, Any]]:
    """The ``runs`` (by label) of a results JSON that keeps every run so far, under a lock held until the
    block that adds to them has written the file: runs into one ``--out`` at once never drop each other's."""
    with file_lock(path.with_name(f".{path.name}.lock")):
        yield json.loads(path.read_text()).get("runs", {}) if path.exists() else {}


def _fsync_tree(folder: Path) -> None:
    for f in folder.iterdir():
        with open(f, "rb") as fh:
            os.fsync(fh.fileno())
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def commit_files(folder: str | os.PathLike[str], write: Callable[[Path], None]) -> Path:
    """Replace a set of files in ``folder`` as one atomic update.

    ``write(staging)`` writes the new files (flat, no sub-folders) into a staging folder.  Once they
    are all on disk the staging folder is renamed to ``.lcx-commit`` (one atomic rename: the commit
    point), then its files are moved over the old ones.  A crash before the commit point leaves the
    previous files untouched; a crash after it is rolled forward by ``recover``, which every reader
    calls first.  Other files in ``folder`` (checkpoints, metrics) are left alone.
    """
    out = Path(folder)
    out.mkdir(parents=True, exist_ok=True)
    recover(out, drop_staging=True)
    staging = out / STAGING
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir()
    write(staging)
    nested = [p.name for p in staging.iterdir() if p.is_dir()]
    if nested:
        raise ValueError(f"commit_files writes flat folders; {staging} got sub-folders {nested}")
    _fsync_tree(staging)
    os.replace(staging, out / COMMIT)
    recover(out)
    return out


def recover(folder: str | os.PathLike[str], drop_staging: bool = False) -> None:
    """Finish what a crashed ``commit_files`` left in ``folder``: move a committed update into place
    (and, for the writer, drop an unfinished staging folder).  Idempotent; a no-op on a clean folder."""
    out = Path(folder)
    commit = out / COMMIT
    if commit.is_dir():
        for f in sorted(commit.iterdir()):
            try:
                os.replace(f, out / f.name)
            except FileNotFoundError:  # moved by a concurrent recover
                pass
        try:
            commit.rmdir()
        except OSError:
            pass
    if drop_staging and (out / STAGING).exists():
        shutil.rmtree(out / STAGING, ignore_errors=True)


def pyplot():
    """matplotlib's pyplot on the file-only Agg backend (no display on our machines)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def save_figure(fig: Any, path: Path, title: str | None = None) -> Path:
    """Title, tighten, write atomically as PNG and close ``fig``."""
    if title:
        fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.stem + ".tmp.png")
    fig.savefig(tmp, dpi=120)
    os.replace(tmp, path)
    pyplot().close(fig)
    return path


_MISSING = object()


def _matches(old: Any, new: Any, defaults: Any) -> bool:
    """``old == new``, except that a dict key ``old`` lacks matches when ``new`` holds its default."""
    if isinstance(old, dict) and isinstance(new, dict):
        defaults = defaults if isinstance(defaults, dict) else {}
        return all(_matches(old[k], new[k], defaults.get(k)) if k in old else
                   (k in defaults and new[k] == defaults[k]) for k in new) and set(old) <= set(new)
    if isinstance(old, list) and isinstance(new, list):
        defaults = defaults if isinstance(defaults, list) and len(defaults) == len(new) else [None] * len(new)
        return len(old) == len(new) and all(_matches(o, n, d) for o, n, d in zip(old, new, defaults))
    return old == new


def _differences(old: dict[str, Any], new: dict[str, Any], defaults: dict[str, Any], prefix: str = "") -> list[str]:
    """The keys (dotted into nested dicts, e.g. ``config.haystack``) where ``old`` does not match ``new``."""
    out = []
    for k in sorted(set(old) | set(new)):
        o, n, d = old.get(k, _MISSING), new.get(k), defaults.get(k) if isinstance(defaults, dict) else None
        if _matches(o, n, d):
            continue
        if isinstance(o, dict) and isinstance(n, dict):
            out += _differences(o, n, d if isinstance(d, dict) else {}, f"{prefix}{k}.") or [f"{prefix}{k}"]
        else:
            out.append(f"{prefix}{k}")
    return out


class Journal:
    """Append-only JSON-lines record of finished samples, so a long evaluation can be resumed.

    The first line holds a ``fingerprint`` (model, methods, options, grid); ``resume=True`` reuses
    the recorded samples only when it matches, and a last line cut short by a crash is ignored.
    Without ``resume`` the journal starts afresh.  ``defaults`` (the fingerprint's shape, e.g. each
    method's default options) lets a journal written before an option existed match: a key the
    journal lacks counts as equal when the new value is its default, which by design changes nothing.
    """

    def __init__(self, path: Path, fingerprint: dict[str, Any], resume: bool = False,
                 defaults: dict[str, Any] | None = None, read_only: bool = False) -> None:
        self.path = Path(path)
        self.read_only = read_only  # another run's journal, read: never repaired or appended to
        self.fingerprint = json.loads(json.dumps(fingerprint, default=str))
        self.defaults = json.loads(json.dumps(defaults or {}, default=str))
        self.records: dict[str, dict[str, Any]] = {}
        self.head: dict[str, Any] | None = None  # the resumed journal's own fingerprint
        if resume and self.path.exists():
            self._read()
        else:
            write_text(json.dumps({"fingerprint": self.fingerprint}) + "\n", self.path)  # atomic: never half a header
        self.reused = len(self.records)

    def _read(self) -> None:
        from lcx.errors import LcxError

        lines = self.path.read_text().splitlines()
        try:
            head = json.loads(lines[0])["fingerprint"] if lines else None
        except (ValueError, KeyError, TypeError):
            head = None
        self.head = head
        if head is None:  # a crash while the header was written, or not a journal
            raise LcxError(f"cannot resume from {self.path}: its first line is not a journal header (empty or "
                           f"damaged); drop --resume to start afresh or choose another --out")
        if not _matches(head, self.fingerprint, self.defaults):
            diff = _differences(head, self.fingerprint, self.defaults)
            was = (head or {}).get("dtype", self.defaults.get("dtype"))
            hint = (f"; its samples were computed in {was}: pass --dtype {was} to resume them"
                    if "dtype" in diff and was else "")
            raise LcxError(f"cannot resume from {self.path}: it was written for a different run "
                           f"(differs in: {', '.join(diff) or 'header'}){hint}; drop --resume to start afresh "
                           f"or choose another --out")
        good = 1
        for line in lines[1:]:
            try:
                rec = json.loads(line)
                self.records[rec["id"]] = rec
                good += 1
            except (ValueError, KeyError, TypeError):
                break  # a line cut short by a crash: everything after it is redone
        if good < len(lines) and not self.read_only:  # rewrite without the damaged tail, so appends stay parseable
            write_text("\n".join(lines[:good]) + "\n", self.path)

    def get(self, sample_id: str) -> dict[str, Any] | None:
        return self.records.get(sample_id)

    def append(self, sample_id: str, record: dict[str, Any]) -> None:
        if self.read_only:
            raise RuntimeError(f"{self.path} is open read-only")
        rec = {"id": sample_id, **record}
        with self.path.open("a") as f:
            f.write(json.dumps(rec, default=str) + "\n")
            f.flush()
            os.fsync(f.fileno())
        self.records[sample_id] = rec
