"""Fixtures of the serving tests (tests/serve/harness.py has the rest)."""

from __future__ import annotations

import pytest

from .harness import MODEL, close_sessions


@pytest.fixture(scope="session")
def tok():
    from transformers import AutoTokenizer

    from lcx.models import resolve_model_path

    return AutoTokenizer.from_pretrained(str(resolve_model_path(MODEL)))


@pytest.fixture(scope="module", autouse=True)
def _close_sessions():
    """The HF sessions a module opened are closed when its tests end (each holds a copy of the model)."""
    yield
    close_sessions()
