"""Duplicate group ids: equal captions (and images) hash equal, different ones differ."""

from __future__ import annotations

import pytest
import torch

from infclip.data.dedup import group_ids


def test_equal_rows_equal_ids_and_distinct_rows_distinct_ids():
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, 49408, (200, 77), generator=g)
    tokens[5] = tokens[17]  # a duplicated caption
    tokens[40, -1] = tokens[41, -1] + 1  # a near-duplicate: one token apart
    tokens[40, :-1] = tokens[41, :-1]
    ids = group_ids(tokens)
    assert ids.dtype == torch.int64 and ids.shape == (200,) and bool((ids >= 0).all())
    assert ids[5] == ids[17] and ids[40] != ids[41]
    assert torch.unique(ids).numel() == 199
    assert torch.equal(group_ids(tokens.int()), ids)  # the dtype of the token ids does not matter
    assert torch.equal(group_ids(tokens[[17, 5]]), ids[[17, 5]])  # per row: any batch, any rank


def test_caption_and_image_key():
    tokens = torch.zeros(4, 8, dtype=torch.int64)  # one caption four times
    images = torch.zeros(4, 3, 5, 5, dtype=torch.uint8)
    images[2, 0, 0, 0] = 1  # one image differs by one byte
    ids = group_ids(tokens, images)
    assert ids[0] == ids[1] == ids[3] and ids[2] != ids[0]
    assert bool((group_ids(tokens) == group_ids(tokens)[0]).all())
    assert not bool((group_ids(tokens) == ids).all())  # the image bytes are part of the key


def test_bad_inputs_are_refused():
    with pytest.raises(ValueError, match="integer"):
        group_ids(torch.zeros(2, 3))
    with pytest.raises(ValueError, match="token ids must be in"):
        group_ids(torch.full((2, 3), -1))
    with pytest.raises(ValueError, match="uint8 with one row per token row"):
        group_ids(torch.zeros(2, 3, dtype=torch.int64), torch.zeros(3, 4, dtype=torch.uint8))
