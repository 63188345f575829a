"""Compact (rank) attention masks: O(L) instead of O(L^2).

Key ``j`` is visible to query ``i`` iff ``k_rank[j] < q_rank[i]``, or ``self_visible`` and ``j`` is the
query's own position. Memory keys carry ``INT32_MIN`` (always visible), padding keys ``INT32_MAX``.
"""

from __future__ import annotations

import torch
from torch import Tensor

from .ops import INT32_MAX, INT32_MIN


def local_perm(
    inputs: Tensor, is_masked: Tensor, perm_size: int, sep_id: int, cls_id: int,
    generator: torch.Generator | None = None,
) -> tuple[Tensor, Tensor, Tensor]:
    """The original XLNet ``_local_perm`` as ranks. ``inputs``/``is_masked`` are ``(L,)``.

    Positions are permuted within blocks of ``perm_size`` (the same shuffle for every block).
    Returns ``q_rank, k_rank`` (int32, ``(L,)``) and ``is_target`` (bool): with
    ``rev = perm_order`` for masked or functional tokens and ``-1`` for the rest, ``k_rank = rev`` and
    ``q_rank = rev`` for targets, ``rev + 1`` otherwise. The content stream uses
    ``self_visible=True``, the query stream ``False``; together these equal the original
    ``perm_mask`` (``q_rank[i] <= k_rank[j]`` blocks) and its ``non_tgt_mask``.
    """
    L = inputs.shape[0]
    if L % perm_size != 0:
        raise ValueError(f"perm_size ({perm_size}) must divide the sequence length ({L})")
    # index = reshape(transpose(shuffle_rows(transpose(reshape(arange(L), [-1, perm_size])))), [-1])
    order = torch.randperm(perm_size, generator=generator)
    index = torch.arange(L).reshape(-1, perm_size).T[order].T.reshape(-1)
    func = (inputs == sep_id) | (inputs == cls_id)
    masked_or_func = is_masked | func
    rev = torch.where(masked_or_func, index, torch.full_like(index, -1))
    is_target = masked_or_func & ~func
    q_rank = torch.where(is_target, rev, rev + 1)
    return q_rank.to(torch.int32), rev.to(torch.int32), is_target


def with_memory(k_rank: Tensor, mlen: int) -> Tensor:
    """Prepend ``mlen`` always-visible memory keys to ``k_rank (B, L)``."""
    if mlen == 0:
        return k_rank
    mem = torch.full((k_rank.shape[0], mlen), INT32_MIN, dtype=torch.int32, device=k_rank.device)
    return torch.cat([mem, k_rank], dim=1)


def block_padding(k_rank: Tensor, padding: Tensor | None) -> Tensor:
    """Padding keys (``padding (B, L)`` True) become never visible (except to themselves)."""
    if padding is None:
        return k_rank
    return torch.where(padding, torch.full_like(k_rank, INT32_MAX), k_rank)
