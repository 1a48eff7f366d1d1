"""A third-party method with a served attention form, from its own package (tests/thirdparty/lcx-band-method:
its own pyproject.toml, pip-installed here, found through the `lcx.methods` entry point), served by `lcx serve`
inside vLLM's attention with the tokens of lcx's own path — no line of lcx written for it."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from lcx.evals.passkey import build_prompt_ids
from lcx.registry import reset_registry

from .harness import MODEL, NEW, SERVING, hf_tokens, server_starting

pytestmark = SERVING
PACKAGE = Path(__file__).resolve().parents[1] / "thirdparty" / "lcx-band-method"
WIDTH = 256


@pytest.fixture(scope="module")
def band_site(tmp_path_factory) -> Path:
    """The package pip-installed (no deps, no build isolation) into a private folder: never into the shared venv."""
    site = tmp_path_factory.mktemp("band") / "site"
    proc = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--disable-pip-version-check", "--no-input",
                           "--no-deps", "--no-build-isolation", "--no-compile", "--target", str(site), str(PACKAGE)],
                          capture_output=True, text=True, cwd=site.parent)
    assert proc.returncode == 0, proc.stderr
    eps = next(site.glob("lcx_band_method-*.dist-info")) / "entry_points.txt"
    assert "band = lcx_band_method:plugin" in eps.read_text()
    return site


@pytest.fixture
def band_installed(band_site, monkeypatch):
    """This process and the server's see the package (and only through its entry point)."""
    monkeypatch.syspath_prepend(str(band_site))
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(band_site), *filter(None, [os.environ.get("PYTHONPATH")])]))
    monkeypatch.delenv("LCX_PLUGINS", raising=False)
    reset_registry()
    yield
    reset_registry()


def test_a_third_party_method_is_served_inside_vllms_attention_with_lcx_generates_tokens(
        band_installed, tmp_path_factory, tok):
    """A 1,500-token passkey prompt, the key 1,300 tokens back: the bare model reads it; with band (each query
    reads the last 256 tokens) lcx's path cannot, and the server answers band's tokens, not the bare model's."""
    from lcx.registry import registry

    assert registry().plugin_of("band") == "band" and registry().get("band").serving == "attention"
    key = 48213
    ids = build_prompt_ids(tok, 1500, 0.1, key)
    bare = hf_tokens(ids)
    want = hf_tokens(ids, ["band"], {"band": {"width": WIDTH}})
    with server_starting(["--method", "band", "-o", f"band.width={WIDTH}", "--max-model-len", "2048"],
                         tmp_path_factory.mktemp("band-serve")) as starting:
        s = starting.wait_ready()
        assert s.ready["methods"] == ["band"]
        got = s.complete(MODEL, ids.tolist(), NEW)
    assert "lcx: band answers vLLM's attention" in s.log_path.read_text()  # lcx's attention, not vLLM's own
    assert got == want
    assert str(key) in tok.decode(bare) and got != bare  # the method is what the server ran
