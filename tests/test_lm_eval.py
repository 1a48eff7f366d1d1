"""The `lcx` model of lm-evaluation-harness answers its three request types as lcx's own paths do."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("lm_eval")

from lcx.generation import generate, score_tail  # noqa: E402
from tests.helpers import make_tiny_model_dir  # noqa: E402


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return make_tiny_model_dir(tmp_path_factory.mktemp("m") / "llama", max_position_embeddings=256)


@pytest.fixture(scope="module")
def lm(tiny_dir):
    from lcx.integrations.lm_eval import LcxLM

    # streaming with a short window: the prompts below are longer than it, so the stack's plan is exercised
    model = LcxLM(model=str(tiny_dir), method="streaming", dtype="float32", batch_size=1,
                  **{"streaming.window": 96, "streaming.chunk": 32})
    yield model
    model.close()


def req(*args):
    return SimpleNamespace(args=args)


TEXT = "The quick brown fox jumps over the lazy dog. " * 8  # 360 characters: past the 96-token window


def test_registered_under_lcx_in_lm_evals_registry():
    from lm_eval.api.registry import get_model

    from lcx.integrations.lm_eval import LcxLM

    assert get_model("lcx") is LcxLM


def test_loglikelihood_is_lcxs_own_score_of_the_continuation(lm):
    tok = lm.tokenizer
    (ll, greedy), = lm.loglikelihood([req(TEXT.strip(), " A cat.")], disable_tqdm=True)
    ctx, cont = tok(TEXT.strip())["input_ids"], tok(" A cat.", add_special_tokens=False)["input_ids"]
    assert len(ctx) > 96
    own = score_tail(lm.run, torch.tensor([ctx + cont]), len(cont))
    assert ll == pytest.approx(-own["nll_sum"], rel=1e-6) and ll < 0
    assert greedy == (own["correct"] == own["count"])
    # a context ending in a space: lm-eval's convention moves the space onto the continuation
    (ll2, _), = lm.loglikelihood([req(TEXT + "A", " cat.")], disable_tqdm=True)
    (ll3, _), = lm.loglikelihood([req(TEXT + "A ", "cat.")], disable_tqdm=True)
    assert ll2 == pytest.approx(ll3, rel=1e-6)


def test_loglikelihood_rolling_scores_every_token_after_the_eos(lm):
    tok = lm.tokenizer
    ll, = lm.loglikelihood_rolling([req(TEXT)], disable_tqdm=True)
    ids = tok(TEXT, add_special_tokens=False)["input_ids"]
    own = score_tail(lm.run, torch.tensor([[tok.eos_token_id] + ids]), len(ids))
    assert ll == pytest.approx(-own["nll_sum"], rel=1e-6)


def test_generate_until_is_lcx_generate_cut_at_the_stop_string(lm):
    tok = lm.tokenizer
    ids = torch.tensor([tok(TEXT)["input_ids"]])
    full = tok.decode(generate(lm.run, ids, max_new_tokens=12)[0], skip_special_tokens=True)
    out, = lm.generate_until([req(TEXT, {"max_gen_toks": 12, "until": []})], disable_tqdm=True)
    assert out == full and len(out) > 0
    stop = full[3:5]
    cut, = lm.generate_until([req(TEXT, {"max_gen_toks": 12, "until": [stop]})], disable_tqdm=True)
    assert cut == full.split(stop)[0] and stop not in cut


def test_lm_evals_ruler_task_runs_offline_through_the_lcx_model(tiny_dir, tmp_path, monkeypatch):
    """lm-eval's own niah_single_1 (its generator, its scoring) through `lcx eval lm-eval`."""
    from click.testing import CliRunner

    from lcx.cli import main

    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("LCX_DTYPE", "float32")
    out = tmp_path / "lm-eval"
    r = CliRunner().invoke(main, ["eval", "lm-eval", "run", "--model", "lcx", "--tasks", "niah_single_1",
                                  "--model_args", f"model={tiny_dir},method=vanilla,tokenizer={tiny_dir}",
                                  "--metadata", json.dumps({"max_seq_lengths": [1024]}), "--limit", "2",
                                  "--gen_kwargs", "max_gen_toks=4", "--output_path", str(out)])
    assert r.exit_code == 0, r.output
    results = [json.loads(p.read_text()) for p in out.rglob("results*.json")]
    assert results and "niah_single_1" in results[0]["results"]
    assert "1024,none" in results[0]["results"]["niah_single_1"]


def test_a_known_models_folder_is_passed_on_as_the_tokenizer_lm_evals_ruler_tasks_load(tmp_path, monkeypatch):
    from lcx.cli.evaluation import _with_tokenizer
    from lcx.models import model_dir

    monkeypatch.setenv("LCX_HOME", str(tmp_path))
    args = ["run", "--model", "lcx", "--model_args", "model=smollm2-135m,method=fot", "--tasks", "niah_single_1"]
    assert _with_tokenizer(args) == args  # not pulled: lm-eval says what it cannot load
    model_dir("smollm2-135m").mkdir(parents=True)
    assert _with_tokenizer(args)[4] == f"model=smollm2-135m,method=fot,tokenizer={model_dir('smollm2-135m')}"
    spaced = ["run", "--model_args", "model=smollm2-135m", "method=fot"]  # lm-eval also takes space-separated pairs
    assert _with_tokenizer(spaced)[-1] == f"method=fot,tokenizer={model_dir('smollm2-135m')}"
    for given in (["--model_args", "model=smollm2-135m,tokenizer=/x"], ["--model_args", "model=/some/dir"], ["run"]):
        assert _with_tokenizer(given) == given


def test_lm_evals_own_models_stay_found_once_lcx_is_registered():
    from lm_eval.api.registry import get_model

    import lcx.integrations.lm_eval  # noqa: F401

    assert get_model("local-completions").__name__ == "LocalCompletionsAPI"
