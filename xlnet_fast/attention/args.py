"""The op's argument record and the one validation of its contract (docs/DESIGN.md §4).

``AttnArgs`` holds every argument of the op after the dense tensors ``q, k, v, k_r, r_w_bias,
r_r_bias``; its fields, in order, are the ``torch.library`` schema (``op.py`` derives it from them), so
the record, the schema and the autograd plumbing cannot disagree. ``validate`` checks a call's
arguments before any launch and returns the record both backends receive.
"""

from __future__ import annotations

import math
import typing
from dataclasses import dataclass, field, fields

import torch
from torch import Tensor

FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
INDEX_DTYPES = (torch.int32, torch.int64)
DENSE_ARGS = ("q", "k", "v", "k_r", "r_w_bias", "r_r_bias")  # the op's leading, always-present tensors


@dataclass
class AttnArgs:
    """Everything but the dense tensors, validated. Shapes as in ``rel_attention``'s docstring."""

    r_s_bias: Tensor | None  # (H, D): with the next three, the segment term (all or none)
    seg_embed: Tensor | None  # (2, H, D)
    q_seg: Tensor | None  # (B, M) int
    k_seg: Tensor | None  # (B, K) int
    attn_mask: Tensor | None  # (B, M, K) bool, True = blocked
    q_rank: Tensor | None  # (B, M) int32
    k_rank: Tensor | None  # (B, K) int32
    q_pos: Tensor | None  # (B, M) int; negative = padding row; None: arange(M)
    qlen: int  # keys [K - qlen, K) are the current segment, [0, K - qlen) the memory
    self_rows: int  # query rows [0, self_rows) also see their own key (rank masks)
    # every position 0..qlen-1 has a row (two-stream launches): the Triton backend may then take
    # every position-sorted tile as banded (docs/DESIGN.md §5); the eager backend ignores it
    rows_cover_qlen: bool = field(default=False, kw_only=True)
    scale: float
    dropout_p: float
    seed: Tensor | None  # () int64, drawn per call when dropout_p > 0

    @property
    def has_segments(self) -> bool:
        return self.seg_embed is not None


_SCHEMA_TYPES = {"Tensor | None": "Tensor?", "int": "int", "bool": "bool", "float": "float"}


def schema_fields() -> list[tuple[str, str]]:
    """``(name, schema type)`` of each ``AttnArgs`` field, in order."""
    hints = typing.get_type_hints(AttnArgs)
    names = [f.name for f in fields(AttnArgs)]
    return [(n, _SCHEMA_TYPES[_type_name(hints[n])]) for n in names]


def _type_name(hint) -> str:
    if hint in (int, bool, float):
        return hint.__name__
    if set(typing.get_args(hint)) == {Tensor, type(None)}:
        return "Tensor | None"
    raise TypeError(f"AttnArgs field type {hint} has no schema type")


# --------------------------------------------------------------------------------------------------
# Checks shared by the op and the model (which reuses them for its own inputs)
# --------------------------------------------------------------------------------------------------


def describe_shape(shape) -> str:
    return "(" + ", ".join("*" if s is None else str(s) for s in shape) + ")"


def check_tensor(name: str, t, ndim: int, shape: tuple | None = None, dtypes=None, device=None,
                 device_owner: str = "q") -> None:
    """``t`` is a tensor with ``ndim`` dims, the given sizes (None: any), a dtype of ``dtypes`` and on
    ``device`` (that of ``device_owner``); else a TypeError/ValueError naming ``name``."""
    if not isinstance(t, Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dim() != ndim:
        raise ValueError(f"{name} must have {ndim} dims, got shape {tuple(t.shape)}")
    if shape is not None and any(want is not None and got != want for got, want in zip(t.shape, shape)):
        raise ValueError(f"{name} must have shape {describe_shape(shape)}, got {tuple(t.shape)}")
    if dtypes is not None and t.dtype not in dtypes:
        raise TypeError(f"{name} must have dtype in {[str(d) for d in dtypes]}, got {t.dtype}")
    if device is not None and t.device != device:
        raise ValueError(f"{name} is on {t.device} but {device_owner} is on {device}")


def check_index_tensor(name: str, t, shape: tuple, device, dtypes=INDEX_DTYPES) -> None:
    check_tensor(name, t, len(shape), shape, dtypes, device)


def check_positions(q_pos: Tensor, qlen: int) -> None:
    """q_pos values must be < qlen (negative = padding row). A data-dependent check: eagerly a
    ValueError; under torch.compile (no host sync there) an assertion on the device."""
    if not q_pos.numel():
        return
    if torch.compiler.is_compiling():
        torch._assert_async(q_pos.max() < qlen, "xlnet_fast: q_pos values must be < qlen")
    elif int(q_pos.max()) >= qlen:
        raise ValueError(f"q_pos values must be < qlen = {qlen}, got max {int(q_pos.max())}")


def resolve_scale(scale, D: int) -> float:
    """The softmax scale: ``1/sqrt(D)`` when None; else a finite number."""
    if scale is None:
        return 1.0 / math.sqrt(D)
    if not isinstance(scale, (int, float)) or isinstance(scale, bool):
        raise TypeError(f"scale must be a float, got {type(scale).__name__}")
    if not math.isfinite(scale):
        raise ValueError(f"scale must be finite, got {scale}")
    return float(scale)


# --------------------------------------------------------------------------------------------------
# The contract
# --------------------------------------------------------------------------------------------------


def _check_dense(q, k, v, k_r, r_w_bias, r_r_bias) -> None:
    check_tensor("q", q, 4)
    B, M, H, D = q.shape
    if D < 1:
        raise ValueError(f"q must have a head dim D >= 1, got shape {tuple(q.shape)}")
    if q.dtype not in FLOAT_DTYPES + (torch.float64,):
        raise TypeError(f"q must be float32, bfloat16 or float16 (float64 for eager), got {q.dtype}")
    like = dict(dtypes=(q.dtype,), device=q.device)
    check_tensor("k", k, 4, (B, None, H, D), **like)
    check_tensor("v", v, 4, (B, k.shape[1], H, D), **like)
    check_tensor("k_r", k_r, 4, (None, None, H, D), **like)
    if k_r.shape[0] not in (1, B):
        raise ValueError(f"k_r must have batch dim 1 or B={B}, got {k_r.shape[0]}")
    check_tensor("r_w_bias", r_w_bias, 2, (H, D), **like)
    check_tensor("r_r_bias", r_r_bias, 2, (H, D), **like)
    for name, t in (("q", q), ("k", k), ("v", v), ("k_r", k_r)):
        if t.stride(-1) != 1:
            raise ValueError(f"{name} must have a contiguous last dim (stride 1), got strides {t.stride()}")


def _check_segments(q, k, r_s_bias, seg_embed, q_seg, k_seg) -> None:
    parts = {"r_s_bias": r_s_bias, "seg_embed": seg_embed, "q_seg": q_seg, "k_seg": k_seg}
    given = [n for n, t in parts.items() if t is not None]
    if not given:
        return
    if len(given) != len(parts):
        raise ValueError("the segment term needs r_s_bias, seg_embed, q_seg and k_seg; missing "
                         f"{[n for n in parts if n not in given]}")
    B, M, H, D = q.shape
    like = dict(dtypes=(q.dtype,), device=q.device)
    check_tensor("r_s_bias", r_s_bias, 2, (H, D), **like)
    check_tensor("seg_embed", seg_embed, 3, (2, H, D), **like)
    check_index_tensor("q_seg", q_seg, (B, M), q.device)
    check_index_tensor("k_seg", k_seg, (B, k.shape[1]), q.device)


def _check_query_rows(q, k, k_r, q_pos, qlen) -> int:
    """The query rows' positions against the keys and k_r; returns qlen (default M)."""
    B, M = q.shape[:2]
    K, R = k.shape[1], k_r.shape[1]
    qlen = M if qlen is None else qlen
    if not isinstance(qlen, int) or isinstance(qlen, bool):
        raise TypeError(f"qlen must be an int, got {type(qlen).__name__}")
    if not 1 <= qlen <= K:
        raise ValueError(f"qlen must be in [1, K={K}], got {qlen}")
    if R < K + 1:
        raise ValueError(f"k_r needs at least K + 1 = {K + 1} rows, got R = {R}")
    if q_pos is None:
        if M > qlen:
            raise ValueError(f"without q_pos, M = {M} query rows need qlen >= M, got qlen = {qlen}")
    else:
        check_index_tensor("q_pos", q_pos, (B, M), q.device)
        check_positions(q_pos, qlen)
    return qlen


def _check_masks(q, k, attn_mask, q_rank, k_rank) -> None:
    B, M = q.shape[:2]
    K = k.shape[1]
    if attn_mask is not None and (q_rank is not None or k_rank is not None):
        raise ValueError("pass either attn_mask or q_rank/k_rank, not both")
    if attn_mask is not None:
        check_tensor("attn_mask", attn_mask, 3, (B, M, K), (torch.bool,), q.device)
    if (q_rank is None) != (k_rank is None):
        raise ValueError("q_rank and k_rank must be given together")
    if q_rank is not None:
        check_index_tensor("q_rank", q_rank, (B, M), q.device, (torch.int32,))
        check_index_tensor("k_rank", k_rank, (B, K), q.device, (torch.int32,))


def _check_dropout(dropout_p) -> float:
    if not isinstance(dropout_p, (int, float)) or not 0.0 <= dropout_p < 1.0:
        raise ValueError(f"dropout_p must be a float in [0, 1), got {dropout_p!r}")
    return float(dropout_p)


def validate(q, k, v, k_r, r_w_bias, r_r_bias, *, r_s_bias=None, seg_embed=None, q_seg=None, k_seg=None,
             attn_mask=None, q_rank=None, k_rank=None, q_pos=None, qlen=None, self_visible=True, self_rows=None,
             scale=None, dropout_p=0.0, rows_cover_qlen=False) -> AttnArgs:
    """Check every argument of ``rel_attention`` (before any launch) and return its record; the seed
    is left None (drawn per call by the op). ``self_rows``: how many leading query rows also see their
    own key (``rel_attention_two_stream``: the content rows); default all rows if ``self_visible``."""
    _check_dense(q, k, v, k_r, r_w_bias, r_r_bias)
    _check_segments(q, k, r_s_bias, seg_embed, q_seg, k_seg)
    qlen = _check_query_rows(q, k, k_r, q_pos, qlen)
    _check_masks(q, k, attn_mask, q_rank, k_rank)
    if not isinstance(self_visible, bool):
        raise TypeError(f"self_visible must be a bool, got {type(self_visible).__name__}")
    if self_rows is None:
        self_rows = q.shape[1] if self_visible else 0
    elif not 0 <= self_rows <= q.shape[1]:
        raise ValueError(f"self_rows must be in [0, M={q.shape[1]}], got {self_rows}")
    return AttnArgs(r_s_bias=r_s_bias, seg_embed=seg_embed, q_seg=q_seg, k_seg=k_seg, attn_mask=attn_mask,
                    q_rank=q_rank, k_rank=k_rank, q_pos=q_pos, qlen=qlen,
                    self_rows=self_rows, scale=resolve_scale(scale, q.shape[3]),
                    dropout_p=_check_dropout(dropout_p), seed=None, rows_cover_qlen=rows_cover_qlen)
