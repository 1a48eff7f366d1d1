"""lcx's multi-LoRA ops for vLLM's CPU path (`lcx.integrations.vllm.lora`) against vLLM's own PyTorch ops:
the same result for every token that names an adapter, none for a token of slot -1 (vLLM's ops give it
the last slot's adapter), and installed into the CPU punica wrapper by lcx's plugin."""

from __future__ import annotations

import pytest
import torch

from lcx.integrations.vllm import lora as ours

theirs = pytest.importorskip("vllm.lora.ops.torch_ops")

SLOTS, IN, RANK, OUT = 3, 24, 8, 40


def _case(seed: int, indices: list[int]):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(len(indices), IN, generator=g)
    a = torch.randn(SLOTS, 1, RANK, IN, generator=g)  # shrink weights: [slots, 1, rank, in]
    b = torch.randn(SLOTS, 1, OUT, RANK, generator=g)  # expand weights: [slots, 1, out, rank]
    h = torch.randn(len(indices), RANK, generator=g)
    return x, a, b, h, torch.tensor(indices)


@pytest.mark.parametrize("indices", [[0] * 7, [2, 0, 1, 1, 2, 0, 0], [1], [2, 2, 0]])
def test_every_token_with_an_adapter_gets_what_vllms_ops_give(indices):
    x, a, b, h, idx = _case(0, indices)
    want, got = torch.zeros(len(indices), RANK), torch.zeros(len(indices), RANK)
    theirs.bgmv_shrink(x, a, want, idx, 0.5)
    ours.bgmv_shrink(x, a, got, idx, 0.5)
    torch.testing.assert_close(got, want)
    base = torch.randn(len(indices), OUT + 5)
    for add in (True, False):
        want, got = base.clone(), base.clone()
        theirs.bgmv_expand(h, b, want, idx, add)
        ours.bgmv_expand(h, b, got, idx, add)
        torch.testing.assert_close(got, want)
        want, got = base.clone(), base.clone()
        theirs.bgmv_expand_slice(h, b, want, idx, 3, OUT, add)
        ours.bgmv_expand_slice(h, b, got, idx, 3, OUT, add)
        torch.testing.assert_close(got, want)


def test_prefill_ops_expand_each_sequences_adapter_to_its_tokens():
    # three sequences of 3, 1 and 4 tokens on slots 1, 0, 2
    seq = dict(b_seq_start_loc=torch.tensor([0, 3, 4]), seq_len_tensor=torch.tensor([3, 1, 4]),
               lora_indices_tensor=torch.tensor([1, 0, 2]), batches=3, max_seq_length=4, token_nums=8)
    x, a, b, h, _ = _case(1, [0] * 8)
    want, got = torch.zeros(8, RANK), torch.zeros(8, RANK)
    theirs.sgmv_shrink(x, a, want, *seq.values(), 2.0)
    ours.sgmv_shrink(x, a, got, *seq.values(), 2.0)
    torch.testing.assert_close(got, want)
    base = torch.randn(8, OUT)
    want, got = base.clone(), base.clone()
    theirs.sgmv_expand(h, b, want, *seq.values(), True)
    ours.sgmv_expand(h, b, got, *seq.values(), True)
    torch.testing.assert_close(got, want)
    want, got = torch.zeros(8, OUT + 2), torch.zeros(8, OUT + 2)
    theirs.sgmv_expand_slice(h, b, want, *seq.values(), 2, OUT, False)
    ours.sgmv_expand_slice(h, b, got, *seq.values(), 2, OUT, False)
    torch.testing.assert_close(got, want)
    # token 3 (the 1-token sequence, slot 0) by hand
    torch.testing.assert_close(got[3, 2:], b[0, 0] @ h[3])


def test_a_token_of_slot_minus_one_gets_no_adapter():
    """vLLM's GPU kernels skip slot -1 ("no LoRA"); its CPU ops index the last slot with it."""
    x, a, b, h, idx = _case(2, [-1, 0, -1, 2])
    got = torch.full((4, RANK), 7.0)
    ours.bgmv_shrink(x, a, got, idx, 1.0)
    assert torch.equal(got[[0, 2]], torch.zeros(2, RANK))
    torch.testing.assert_close(got[1], a[0, 0] @ x[1])
    base = torch.randn(4, OUT)
    out = base.clone()
    ours.bgmv_expand(h, b, out, idx, True)
    assert torch.equal(out[[0, 2]], base[[0, 2]])  # added nothing
    torch.testing.assert_close(out[3], base[3] + b[2, 0] @ h[3])
    # what vLLM 0.32's own op does with it: the last slot's adapter (the reason lcx replaces it)
    theirs_out = torch.zeros(4, RANK)
    theirs.bgmv_shrink(x, a, theirs_out, idx, 1.0)
    torch.testing.assert_close(theirs_out[0], a[SLOTS - 1, 0] @ x[0])
    # all tokens without an adapter: nothing at all
    only = torch.full((3, RANK), 7.0)
    ours.bgmv_shrink(x[:3], a, only, torch.tensor([-1, -1, -1]), 1.0)
    assert torch.equal(only, torch.zeros(3, RANK))


def test_the_plugin_installs_them_in_the_cpu_wrapper():
    from vllm.lora.punica_wrapper import punica_cpu

    from lcx.integrations.vllm import register

    register()  # what vLLM calls in each of its processes
    assert all(getattr(punica_cpu, name) is getattr(ours, name) for name in ours.OPS)


def test_lcx_vllm_lora_ops_vllm_keeps_vllms_own(monkeypatch):
    from vllm.lora.punica_wrapper import punica_cpu

    monkeypatch.setenv(ours.OPS_ENV, "vllm")
    for name in ours.OPS:  # as vLLM ships them; restored after the test
        monkeypatch.setattr(punica_cpu, name, getattr(theirs, name))
    assert not ours.install()
    assert punica_cpu.bgmv_shrink is theirs.bgmv_shrink
