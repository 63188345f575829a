"""Masks prepared once for many calls of the op: checked once, and with the Triton backend's tables.

The op's masks (segments, ranks or a dense mask, query positions) depend on the inputs of a model's
forward, not on its layers: ``prepare_masks`` / ``prepare_two_stream_masks`` check them and build
what the kernels read (``xlnet_fast.kernels.mask_tables``, on the GPU, behind the op
``xlnet_fast::mask_tables``: rows sorted by position, key ranks and segment codes) once, and every
layer passes the result (``masks=``) to ``rel_attention`` / ``rel_attention_two_stream``, forward
and backward (the tables are saved for the backward like any input). A call given raw mask keywords
prepares them itself, for that call only. No host sync: the checks of values (positions) go through
``args.check_values``. The record itself, ``PreparedMasks``, and its checks live with the op's other
arguments (``args.py``).
"""

from __future__ import annotations

import torch
from torch import Tensor

from ..kernel_contract import contract
from . import backends
from .args import PreparedMasks, check_index_tensor, check_masks, check_tensor


def mask_tables_impl(q_seg, k_seg, attn_mask, q_rank, k_rank, q_pos, batch: int, rows: int, keys: int, qlen: int,
                     self_rows: int, device: torch.device) -> tuple[Tensor, Tensor]:
    """The op ``xlnet_fast::mask_tables``: ``kernels.mask_tables`` of these masks."""
    from .. import kernels

    masks = PreparedMasks(batch=batch, rows=rows, keys=keys, device=device, qlen=qlen, self_rows=self_rows,
                          q_seg=q_seg, k_seg=k_seg, attn_mask=attn_mask, q_rank=q_rank, k_rank=k_rank, q_pos=q_pos)
    return kernels.mask_tables(masks, batch, rows, keys, device)


def _tables_fake(q_seg, k_seg, attn_mask, q_rank, k_rank, q_pos, batch: int, rows: int, keys: int, qlen: int,
                 self_rows: int, device: torch.device) -> tuple[Tensor, Tensor]:
    padded = -(-keys // contract.KEY_PAD) * contract.KEY_PAD
    return (torch.empty((batch, rows, contract.ROW_FIELDS), dtype=torch.int32, device=device),
            torch.empty((batch, contract.KEY_FIELDS, padded), dtype=torch.int32, device=device))


# The tables as an op of its own, so that torch.compile traces a model's forward through it (the
# kernels' launches are opaque to it) and takes its shapes from the fake; attn_mask is not read,
# only whether there is one (every key tile is then tested)
_tables_op = torch.library.custom_op(
    "xlnet_fast::mask_tables", mask_tables_impl, mutates_args=(),
    schema="(Tensor? q_seg, Tensor? k_seg, Tensor? attn_mask, Tensor? q_rank, Tensor? k_rank, Tensor? q_pos, "
           "int batch, int rows, int keys, int qlen, int self_rows, Device device) -> (Tensor, Tensor)")
_tables_op.register_fake(_tables_fake)


def triton_tables(a, batch: int, rows: int, keys: int, device) -> tuple[Tensor, Tensor]:
    """The Triton backend's ROWS and KEYS tables (``xlnet_fast.kernels.mask_tables``) of the masks of
    ``a`` (a ``PreparedMasks`` or the op's record) for ``batch`` batch rows, ``rows`` query rows and
    ``keys`` keys on ``device``."""
    masks = (a.q_seg, a.k_seg, a.attn_mask, a.q_rank, a.k_rank, a.q_pos)
    if backends.through_dispatcher(masks):
        return torch.ops.xlnet_fast.mask_tables(*masks, batch, rows, keys, a.qlen, a.self_rows, torch.device(device))
    from .. import kernels

    return kernels.mask_tables(a, batch, rows, keys, device)


def _with_tables(masks: PreparedMasks, backend: str) -> PreparedMasks:
    """``masks`` with the Triton backend's tables when ``backend`` resolves to it on their device."""
    if masks.rows_table is None and backends.resolve_backend(backend, masks.device) == "triton":
        masks.rows_table, masks.keys_table = triton_tables(masks, masks.batch, masks.rows, masks.keys, masks.device)
    return masks


def prepare_masks(batch: int, rows: int, keys: int, *, device, q_seg: Tensor | None = None,
                  k_seg: Tensor | None = None, attn_mask: Tensor | None = None, q_rank: Tensor | None = None,
                  k_rank: Tensor | None = None, self_visible: bool = True, q_pos: Tensor | None = None,
                  qlen: int | None = None, backend: str = "auto") -> PreparedMasks:
    """``rel_attention``'s masks for calls with ``batch`` batch rows, ``rows`` query rows and ``keys``
    keys on ``device``, checked once and, where ``backend`` runs the Triton kernels on that device,
    with their tables; pass the result as ``rel_attention(..., masks=...)`` to every call that has
    these masks (e.g. each layer of a model's forward). Keywords as in ``rel_attention``."""
    return _with_tables(check_masks(batch, rows, keys, device, q_seg=q_seg, k_seg=k_seg, attn_mask=attn_mask,
                                    q_rank=q_rank, k_rank=k_rank, q_pos=q_pos, qlen=qlen, self_visible=self_visible),
                        backend)


def prepare_two_stream_masks(batch: int, qlen: int, keys: int, *, device, target_pos: Tensor,
                             q_seg: Tensor | None = None, k_seg: Tensor | None = None,
                             attn_mask: Tensor | None = None, attn_mask_g: Tensor | None = None,
                             q_rank: Tensor | None = None, k_rank: Tensor | None = None,
                             backend: str = "auto") -> PreparedMasks:
    """``rel_attention_two_stream``'s masks (its keywords; ``qlen`` = L, the content rows), checked and
    prepared once: the content rows (one per position, each also seeing its own key) followed by the
    query stream's target rows at ``target_pos (B, P)`` (negative = padding row), which take their
    segments and ranks from their positions."""
    device = torch.device(device)
    check_index_tensor("target_pos", target_pos, (batch, None), device)
    L, P = qlen, target_pos.shape[1]
    if (attn_mask is None) != (attn_mask_g is None):
        raise ValueError("attn_mask and attn_mask_g must be given together")
    if attn_mask is not None:  # each under its own name, before they are joined
        check_tensor("attn_mask", attn_mask, 3, (batch, L, keys), (torch.bool,), device)
        check_tensor("attn_mask_g", attn_mask_g, 3, (batch, P, keys), (torch.bool,), device)
    # gathered in range whatever target_pos holds: check_masks checks its values (as positions)
    at = target_pos.long().clamp(0, max(L - 1, 0))
    q_pos = torch.cat([torch.arange(L, device=device).expand(batch, L), target_pos.long()], dim=1)
    if q_seg is not None:
        check_index_tensor("q_seg", q_seg, (batch, L), device)
        q_seg = torch.cat([q_seg, q_seg.gather(1, at)], dim=1)
    if q_rank is not None:
        check_index_tensor("q_rank", q_rank, (batch, L), device, (torch.int32,))
        q_rank = torch.cat([q_rank, q_rank.gather(1, at)], dim=1)
    if attn_mask is not None:
        attn_mask = torch.cat([attn_mask, attn_mask_g], dim=1)
    # the content rows (the first L) see their own key, the target rows do not; every position
    # 0..L-1 has a content row, so the kernels may take every tile as banded
    return _with_tables(check_masks(batch, L + P, keys, device, q_seg=q_seg, k_seg=k_seg,
                                    attn_mask=attn_mask, q_rank=q_rank, k_rank=k_rank, q_pos=q_pos, qlen=L, self_rows=L,
                                    rows_cover_qlen=True, positions_name="target_pos"), backend)
