"""Every attention mask of the model, compact where possible: O(L) ranks instead of O(L^2) masks.

Key ``j`` is visible to query ``i`` iff ``k_rank[j] < q_rank[i]``, or ``self_visible`` and ``j`` is the
query's own position (docs/DESIGN.md §2). Memory keys carry ``INT32_MIN`` (always visible), padding
keys ``INT32_MAX``. ``build_attention_inputs`` turns transformers' arguments (``attention_mask``,
``perm_mask``, ``target_mapping``, ``token_type_ids``, mems) into the typed ``AttentionInputs`` every
layer passes to the op: ranks where the inputs allow it (padding, causal ``"uni"``, permutation ranks),
a dense mask only for a ``perm_mask`` (or ``same_length``), each launch's masks prepared once per
forward (``xlnet_fast.attention.prepare_masks``: checked, and with the Triton backend's tables).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor
from torch.nn import functional as F

from .attention.args import check_values
from .attention.prepared import PreparedMasks, prepare_masks, prepare_two_stream_masks
from .kernel_contract import contract

# Rank sentinels: a key of rank INT32_MIN is visible to every query (memory), one of rank INT32_MAX
# to none (padding); a query row of rank INT32_MIN sees nothing. The kernels' own values.
INT32_MIN, INT32_MAX = contract.INT32_MIN, contract.INT32_MAX


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


def causal_masks(batch: int, qlen: int, mlen: int, device, span: int | None = None,
                 backend: str = "auto") -> PreparedMasks:
    """Causal attention over ``mlen`` memory keys and ``qlen`` current keys (Transformer-XL): query
    ``i`` sees keys ``j <= mlen + i`` — as ranks, O(L). With ``span`` it sees only its last ``span``
    keys, ``mlen + i - span < j <= mlen + i`` (Transformer-XL's ``same_length``): a dense ``(B, M, K)``
    mask, since a lower bound is no rank comparison. Prepared for ``backend`` (``prepare_masks``)."""
    K = mlen + qlen
    if span is None:
        ar = torch.arange(qlen, dtype=torch.int32, device=device).expand(batch, qlen)
        return prepare_masks(batch, qlen, K, device=device, q_rank=ar + 1, k_rank=with_memory(ar, mlen), backend=backend)
    i = torch.arange(qlen, device=device)[:, None]
    j = torch.arange(K, device=device)[None, :]
    blocked = (j > mlen + i) | (j <= mlen + i - span)
    return prepare_masks(batch, qlen, K, device=device, attn_mask=blocked.expand(batch, qlen, K), backend=backend)


# --------------------------------------------------------------------------------------------------
# The typed record the layers receive
# --------------------------------------------------------------------------------------------------


@dataclass
class AttentionInputs:
    """What every layer of one forward passes to the op besides q/k/v/k_r and the weights: the masks
    of each launch it makes, prepared once for all layers (``xlnet_fast.attention.prepare_masks``).

    Three ways to run the query stream: none (``content`` only); on its target rows together with
    the content stream in one ``rel_attention_two_stream`` launch (``joint``; ``content`` is then
    None); or in a launch of its own (``query``), on its target rows or, for a general
    ``target_mapping (B, P, L)``, on all L positions mapped in and out by the layer as transformers
    does. ``target_rows``: P, the query stream's rows. ``k_r_index (B,)`` picks each row's bi_data
    position embedding; ``blocked_g (B, P)`` marks query rows that see no key, given transformers'
    uniform average (``XLNetModel.average_blocked_rows``).
    """

    qlen: int
    content: PreparedMasks | None
    has_segments: bool = False
    joint: PreparedMasks | None = None
    query: PreparedMasks | None = None
    target_rows: int = 0
    target_mapping: Tensor | None = None
    k_r_index: Tensor | None = None
    blocked_g: Tensor | None = None

    @property
    def has_query_stream(self) -> bool:
        return self.query is not None or self.joint is not None


@dataclass
class _Visibility:
    """One forward's masks before they are split by stream: dense ``(B, L, K)`` blocked-key masks
    (``dense_h`` for the content stream, which sees its own key; ``dense_g`` for the query stream),
    or ranks ``rank_q (B, L)`` / ``rank_k (B, K)``; all None when every key is visible."""

    dense_h: Tensor | None = None
    dense_g: Tensor | None = None
    rank_q: Tensor | None = None
    rank_k: Tensor | None = None


@dataclass
class MaskSpec:
    """The arguments of one forward that decide its masks (transformers' names and conventions)."""

    batch: int
    seq_len: int
    mlen: int
    attn_type: str = "bi"  # "uni": causal
    same_length: bool = False
    bi_data: bool = False
    padding: Tensor | None = None  # (B, L) bool, True = padding
    perm_mask: Tensor | None = None  # (B, L, L), > 0 = blocked
    target_mapping: Tensor | None = None  # (B, P, L) float
    token_type_ids: Tensor | None = None  # (B, L) int
    q_rank: Tensor | None = None  # (B, L) int
    k_rank: Tensor | None = None  # (B, L) int
    target_pos: Tensor | None = None  # (B, P) int, negative = padding row
    separate_query_launch: bool = False  # e.g. to get the query stream's attention probabilities
    average_blocked_rows: bool = False
    backend: str = "auto"  # the masks are prepared for it (the Triton backend's tables)


def _dense_blocked(s: MaskSpec, device) -> Tensor:
    """(B, L, K) True where the query stream may not look (transformers' ``attn_mask``)."""
    L, mlen = s.seq_len, s.mlen
    i = torch.arange(L, device=device)[:, None]
    j = torch.arange(mlen + L, device=device)[None, :]
    blocked = torch.zeros(s.batch, L, mlen + L, dtype=torch.bool, device=device)
    if s.attn_type == "uni":
        blocked |= j > mlen + i
        if s.same_length:
            blocked |= (j < i) & (j < L)
    if s.padding is not None:
        blocked[:, :, mlen:] |= s.padding[:, None, :]
    if s.perm_mask is not None:
        blocked[:, :, mlen:] |= s.perm_mask > 0
    return blocked


def _int32_ranks(name: str, ranks: Tensor) -> Tensor:
    """The model's ranks (any integer dtype) as the op's int32; int64 values past int32 are an error
    (a check of values), not wrapped into another rank or a sentinel."""
    if ranks.dtype == torch.int64 and ranks.numel():
        low, high = ranks.min(), ranks.max()
        check_values((low >= INT32_MIN) & (high <= INT32_MAX),
                     f"{name} values must fit in int32 [{INT32_MIN}, {INT32_MAX}], got [{{}}, {{}}]", low, high)
    return ranks.to(torch.int32)


def _visibility(s: MaskSpec, device) -> _Visibility:
    """Ranks where the inputs allow it (padding, causal "uni", the caller's ranks), a dense mask for a
    ``perm_mask`` (or ``same_length``)."""
    B, L = s.batch, s.seq_len
    uni = s.attn_type == "uni"
    if s.perm_mask is not None or (uni and s.same_length):
        blocked = _dense_blocked(s, device)
        j = torch.arange(s.mlen + L, device=device)[None, :]
        own = j == s.mlen + torch.arange(L, device=device)[:, None]
        return _Visibility(dense_h=blocked & ~own, dense_g=blocked)
    if s.q_rank is not None:
        rank_q, rank_k = _int32_ranks("q_rank", s.q_rank), _int32_ranks("k_rank", s.k_rank)
    elif uni:  # causal: key j visible to query i iff j <= i
        ar = torch.arange(L, dtype=torch.int32, device=device).expand(B, L)
        rank_q, rank_k = ar + 1, ar
    elif s.padding is not None:
        rank_q = torch.ones(B, L, dtype=torch.int32, device=device)
        rank_k = torch.zeros(B, L, dtype=torch.int32, device=device)
    else:
        return _Visibility()
    return _Visibility(rank_q=rank_q, rank_k=with_memory(block_padding(rank_k, s.padding), s.mlen))


def one_hot_targets(target_mapping: Tensor, blocked_rows: Tensor | None = None) -> tuple[Tensor | None, bool | None]:
    """``(target_pos, any_blocked)``: (B, P) target positions if ``target_mapping`` is one-hot rows
    (or empty rows, -1) with no position targeted twice, else None; with ``blocked_rows (B, L)``
    (positions whose query-stream row sees no key), whether a targeted position is one of them, else
    None. Decided on the device and read together: the one host read of the forward that gets
    transformers' dense ``target_mapping`` (the answers pick the launches; none on meta tensors)."""
    tm = target_mapping
    rows, cols = tm.sum(-1), tm.sum(-2)
    checks = [((tm == 0) | (tm == 1)).all() & (rows <= 1).all() & (cols <= 1).all()]
    if blocked_rows is not None:
        checks.append((blocked_rows & (cols > 0)).any())
    # on the meta device there are no values to read: taken as one-hot with no blocked target (the
    # shapes are the same either way; the launches are those of a pretraining batch)
    answers = [True, False] if tm.is_meta else torch.stack(checks).tolist()
    if not answers[0]:
        return None, None
    pos = tm.argmax(-1)
    return torch.where(rows > 0, pos, torch.full_like(pos, -1)), (answers[1] if blocked_rows is not None else None)


def _rows_without_keys(dense_g: Tensor | None, rank_q: Tensor | None, rank_k: Tensor | None) -> Tensor | None:
    """(B, M) True for the query-stream rows that see no key at all (dense ``(B, M, K)`` blocked mask,
    or ranks without the own-key exception); None when every row sees some key."""
    if dense_g is not None:
        return dense_g.all(-1)
    if rank_q is not None:
        return rank_k.min(-1).values[:, None] >= rank_q
    return None


def _segments(s: MaskSpec) -> dict:
    """The segment ids of the current rows and of the keys (memory keys: segment 0)."""
    if s.token_type_ids is None:
        return {}
    ids = s.token_type_ids
    if ids.dtype not in (torch.int32, torch.int64):  # any integer or bool, as transformers takes them
        ids = ids.long()
    return dict(q_seg=ids, k_seg=F.pad(ids, (s.mlen, 0)))


def _query_on_targets(inputs: AttentionInputs, vis: _Visibility, target_pos: Tensor, s: MaskSpec, device,
                      any_blocked: bool | None = None) -> None:
    """The query stream on its target rows only: in the content stream's launch, or (``separate``)
    in a launch of its own at ``q_pos = target_pos``. ``any_blocked``: whether a target row sees no
    key, where read already (False: no uniform average to take in every layer)."""
    rows = target_pos.long().clamp(min=0)
    K = s.mlen + s.seq_len
    dense_g = rank_q = None
    if vis.dense_g is not None:
        dense_g = vis.dense_g.gather(1, rows[..., None].expand(-1, -1, vis.dense_g.shape[-1]))
    elif vis.rank_q is not None:
        rank_q = vis.rank_q.gather(1, rows)
    if s.average_blocked_rows:
        blocked = _rows_without_keys(dense_g, rank_q, vis.rank_k)
        inputs.blocked_g = None if blocked is None or any_blocked is False else blocked & (target_pos >= 0)
    inputs.target_rows = target_pos.shape[1]
    segments = _segments(s)
    if not s.separate_query_launch:
        inputs.joint = prepare_two_stream_masks(
            s.batch, s.seq_len, K, device=device, target_pos=target_pos, attn_mask=vis.dense_h, attn_mask_g=dense_g,
            q_rank=vis.rank_q, k_rank=vis.rank_k, backend=s.backend, **segments)
        return
    inputs.content = _content(vis, s, device)
    if segments:
        segments["q_seg"] = segments["q_seg"].gather(1, rows)
    inputs.query = prepare_masks(  # ranks: a target row does not see its own key
        s.batch, target_pos.shape[1], K, device=device, attn_mask=dense_g, q_rank=rank_q,
        k_rank=None if rank_q is None else vis.rank_k, self_visible=rank_q is None, q_pos=target_pos,
        qlen=s.seq_len, backend=s.backend, **segments)


def _query_on_all_rows(inputs: AttentionInputs, vis: _Visibility, s: MaskSpec, device) -> None:
    """A general ``target_mapping``: the query stream runs on all L positions, mapped in and out by
    the layer, as transformers does."""
    inputs.target_mapping = s.target_mapping
    inputs.target_rows = s.target_mapping.shape[1]
    inputs.query = prepare_masks(s.batch, s.seq_len, s.mlen + s.seq_len, device=device, attn_mask=vis.dense_g,
                                 q_rank=vis.rank_q, k_rank=vis.rank_k, self_visible=vis.rank_q is None,
                                 backend=s.backend, **_segments(s))
    if s.average_blocked_rows:
        inputs.blocked_g = _rows_without_keys(vis.dense_g, vis.rank_q, vis.rank_k)


def _content(vis: _Visibility, s: MaskSpec, device) -> PreparedMasks:
    """The content stream's masks for a launch of its own."""
    return prepare_masks(s.batch, s.seq_len, s.mlen + s.seq_len, device=device, attn_mask=vis.dense_h,
                         q_rank=vis.rank_q, k_rank=vis.rank_k, backend=s.backend, **_segments(s))


def build_attention_inputs(s: MaskSpec, device) -> AttentionInputs:
    """The masks of one forward, by launch (see ``AttentionInputs``), prepared once for every layer."""
    vis = _visibility(s, device)
    inputs = AttentionInputs(qlen=s.seq_len, content=None, has_segments=s.token_type_ids is not None)
    if s.bi_data:  # the second half of the rows reads the text backwards: the negated positions
        inputs.k_r_index = (torch.arange(s.batch, device=device) >= s.batch // 2).long()
    target_pos, any_blocked = s.target_pos, None
    if target_pos is None and s.target_mapping is not None and not s.separate_query_launch:
        blocked_rows = vis.dense_g.all(-1) if s.average_blocked_rows and vis.dense_g is not None else None
        target_pos, any_blocked = one_hot_targets(s.target_mapping, blocked_rows)
    if target_pos is not None:
        _query_on_targets(inputs, vis, target_pos, s, device, any_blocked)
        return inputs
    inputs.content = _content(vis, s, device)
    if s.target_mapping is not None:
        _query_on_all_rows(inputs, vis, s, device)
    return inputs
