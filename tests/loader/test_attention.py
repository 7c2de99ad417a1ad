"""Packed varlen attention equals attention over each sample alone."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from loader import block_diagonal_mask, varlen_attention


def per_sample(q, k, v, cu, causal):
    outs = []
    for a, b in zip(cu[:-1].tolist(), cu[1:].tolist(), strict=True):
        qs, ks, vs = (x[a:b].transpose(0, 1)[None] for x in (q, k, v))
        if ks.shape[1] != qs.shape[1]:
            ks = ks.repeat_interleave(qs.shape[1] // ks.shape[1], dim=1)
            vs = vs.repeat_interleave(qs.shape[1] // vs.shape[1], dim=1)
        outs.append(F.scaled_dot_product_attention(qs, ks, vs, is_causal=causal)[0].transpose(0, 1))
    return torch.cat(outs)


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("kv_heads", [4, 2])
def test_packed_equals_per_sample(causal, kv_heads):
    torch.manual_seed(0)
    cu = torch.tensor([0, 5, 6, 19, 40], dtype=torch.int32)
    q = torch.randn(40, 4, 16)
    k, v = torch.randn(40, kv_heads, 16), torch.randn(40, kv_heads, 16)
    packed = varlen_attention(q, k, v, cu, max_seqlen=21, causal=causal)
    torch.testing.assert_close(packed, per_sample(q, k, v, cu, causal), atol=1e-5, rtol=1e-5)


def test_block_diagonal_mask_is_additive():
    inf = float("-inf")
    mask = block_diagonal_mask(torch.tensor([0, 2, 3], dtype=torch.int32))
    assert mask.dtype == torch.float32
    assert mask.tolist() == [[0, inf, inf], [0, 0, inf], [inf, inf, 0]]
    assert block_diagonal_mask(torch.tensor([0, 2, 3]), causal=False)[0].tolist() == [0, 0, inf]


def test_block_diagonal_mask_blocks_when_added_to_scores():
    """Eager attention adds the mask to the scores: a blocked key must get zero weight."""
    torch.manual_seed(1)
    cu = torch.tensor([0, 3, 7], dtype=torch.int32)
    scores = torch.randn(7, 7)
    weights = torch.softmax(scores + block_diagonal_mask(cu), dim=-1)
    assert weights[3:, :3].abs().max() == 0 and weights[:3, 3:].abs().max() == 0
    assert torch.triu(weights, diagonal=1).abs().max() == 0
    torch.testing.assert_close(weights.sum(-1), torch.ones(7))
