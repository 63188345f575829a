"""Rank masks equal the original XLNet masks."""

import torch
from helpers.reference import original_local_perm

from xlnet_fast import INT32_MAX, INT32_MIN, local_perm
from xlnet_fast.masks import block_padding, with_memory

SEP, CLS = 4, 3


def dense_from_ranks(q_rank, k_rank, self_visible):
    blocked = ~(k_rank[None, :] < q_rank[:, None])
    if self_visible:
        blocked &= ~torch.eye(len(q_rank), dtype=torch.bool)
    return blocked


def test_ranks_equal_original_perm_mask_and_non_target_mask():
    for seed in range(20):
        g = torch.Generator().manual_seed(seed)
        L, perm_size = 12, [3, 4, 6, 12][seed % 4]
        inputs = torch.randint(5, 30, (L,), generator=g)
        inputs[5], inputs[-1] = SEP, CLS
        is_masked = torch.rand(L, generator=g) < 0.3
        q_rank, k_rank, is_target = local_perm(inputs, is_masked, perm_size, SEP, CLS,
                                               generator=torch.Generator().manual_seed(seed))
        order = torch.randperm(perm_size, generator=torch.Generator().manual_seed(seed))
        perm_mask, target = original_local_perm(inputs, is_masked, perm_size, order, SEP, CLS)
        assert torch.equal(is_target, target)
        assert torch.equal(dense_from_ranks(q_rank, k_rank, self_visible=False), perm_mask)
        # content stream: original non_tgt_mask = perm_mask with the diagonal cleared
        non_tgt = perm_mask & ~torch.eye(L, dtype=torch.bool)
        assert torch.equal(dense_from_ranks(q_rank, k_rank, self_visible=True), non_tgt)


def test_memory_and_padding_ranks():
    k = torch.tensor([[0, 1, 2]], dtype=torch.int32)
    padded = block_padding(k, torch.tensor([[True, False, False]]))
    assert padded.tolist() == [[INT32_MAX, 1, 2]]
    full = with_memory(padded, 2)
    assert full.tolist() == [[INT32_MIN, INT32_MIN, INT32_MAX, 1, 2]]
    assert with_memory(k, 0) is k
