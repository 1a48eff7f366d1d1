"""visible_mask: the columns of the keys a subset cache kept, taken as slices of the base mask."""

import pytest
import torch

from lcx.masking import kept_positions, visible_mask


@pytest.mark.parametrize("runs", [[(0, 3), (9, 20)], [(0, 0), (4, 20)], [(0, 20)], [(2, 5), (7, 8), (15, 19)]])
@pytest.mark.parametrize("kind", ["bool", "additive"])
def test_the_kept_columns_are_the_base_masks_columns_at_those_positions(runs, kind):
    g = torch.Generator().manual_seed(0)
    base = torch.rand(2, 1, 5, 20, generator=g) > 0.5
    if kind == "additive":
        base = torch.zeros(base.shape).masked_fill(~base, torch.finfo(torch.float32).min)
    kept = kept_positions(runs)
    got = visible_mask(base, runs, 20, 5, "sdpa", torch.float32)
    assert got.shape == (2, 1, 5, len(kept))
    assert torch.equal(got, base[..., kept])


def test_without_a_base_mask_it_is_causal_over_the_kept_positions():
    runs = [(0, 2), (6, 10)]  # keys at 0, 1, 6, 7, 8, 9; queries at 8, 9
    got = visible_mask(None, runs, 10, 2, "sdpa", torch.float32)
    assert got.tolist() == [[[[True, True, True, True, True, False], [True, True, True, True, True, True]]]]
    eager = visible_mask(None, runs, 10, 2, "eager", torch.float32)
    assert torch.equal(eager == 0, got)
