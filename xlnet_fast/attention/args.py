"""The op's argument record and the one validation of its contract (docs/DESIGN.md §4).

``AttnArgs`` holds every argument of the op after the dense tensors ``q, k, v, k_r, r_w_bias,
r_r_bias``; its fields, in order, are the ``torch.library`` schema (``op.py`` derives it from them), so
the record, the schema and the autograd plumbing cannot disagree. ``validate`` checks a call's
arguments before any launch and returns the record both backends receive; the masks it takes
checked already, prepared once for many calls (``prepared.py``), or raw.

Checks of tensor values (positions below ``qlen``, token ids in the vocabulary) go through
``check_values``: a ``ValueError`` where reading a value costs nothing (CPU tensors), an assertion on
the device on a GPU, where reading it would stall the host on the GPU (a sync) and break CUDA-graph
capture; ``XLNET_FAST_CHECK_VALUES=1`` makes them host-side ``ValueError``s there too (debugging).
"""

from __future__ import annotations

import math
import os
import typing
from dataclasses import dataclass, field, fields

import torch
from torch import Tensor

FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
INDEX_DTYPES = (torch.int32, torch.int64)
DENSE_ARGS = ("q", "k", "v", "k_r", "r_w_bias", "r_r_bias")  # the op's leading, always-present tensors


@dataclass(slots=True)
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
    # a second source of query rows: q holds rows [0, L), q_g rows [L, M) (rel_attention_two_stream's
    # query stream, not concatenated to q); None: q holds all M rows
    q_g: Tensor | None = field(default=None, kw_only=True)
    # the Triton backend's tables for these masks (kernels.mask_tables), when prepared beforehand
    rows_table: Tensor | None = field(default=None, kw_only=True)
    keys_table: Tensor | None = field(default=None, kw_only=True)

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


# devices torch.autocast knows nothing of (asking it about them raises): never under autocast
NO_AUTOCAST_DEVICES = ("meta",)


def autocast_dtype(device_type: str) -> torch.dtype | None:
    """The dtype ``torch.autocast`` takes matrix products in on ``device_type`` now, or None where it
    is off (or knows no such device: a model on the meta device runs as without autocast)."""
    if device_type in NO_AUTOCAST_DEVICES or not torch.is_autocast_enabled(device_type):
        return None
    return torch.get_autocast_dtype(device_type)


def host_value_checks(device: torch.device) -> bool:
    """Whether checks of tensor values on ``device`` read the values on the host (``check_values``)."""
    if torch.compiler.is_compiling():
        return False
    return device.type == "cpu" or os.environ.get("XLNET_FAST_CHECK_VALUES", "0") == "1"


def check_values(ok: Tensor, message: str, *values: Tensor) -> None:
    """Raise ``ValueError(message)`` unless ``ok`` (a bool tensor, one element) holds, where the host
    reads values for free (``host_value_checks``), ``message``'s ``{}`` filled with ``values``;
    elsewhere assert it on the device: no host sync, capturable in a CUDA graph, traced by
    torch.compile (a failed device assertion stops the process with a CUDA error; rerun with
    XLNET_FAST_CHECK_VALUES=1 for the message with its values)."""
    if host_value_checks(ok.device):
        if not bool(ok):
            raise ValueError(message.format(*(int(v) for v in values)))
    else:
        torch._assert_async(ok, "xlnet_fast: " + message.format(*("(on the device)" for _ in values)))


def check_positions(q_pos: Tensor, qlen: int, name: str = "q_pos") -> None:
    """``name``'s values (positions) must be < qlen (negative = padding row): a check of values
    (``check_values``)."""
    if q_pos.numel():
        top = q_pos.max()
        check_values(top < qlen, f"{name} values must be < qlen = {qlen}, got max {{}}", top)


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


@dataclass
class PreparedMasks:
    """The masks of ``rows`` query rows over ``keys`` keys of a batch, checked (shapes as in
    ``rel_attention``'s docstring; ``self_rows``: how many leading rows also see their own key;
    ``rows_cover_qlen``: every position has a row, as in a two-stream call), and the Triton
    backend's ``rows_table``/``keys_table`` when it will run the calls (else None)."""

    batch: int
    rows: int
    keys: int
    device: torch.device
    qlen: int
    self_rows: int
    rows_cover_qlen: bool = False
    q_seg: Tensor | None = None
    k_seg: Tensor | None = None
    attn_mask: Tensor | None = None
    q_rank: Tensor | None = None
    k_rank: Tensor | None = None
    q_pos: Tensor | None = None
    rows_table: Tensor | None = None
    keys_table: Tensor | None = None

    @property
    def has_segments(self) -> bool:
        return self.q_seg is not None

    def check_call(self, B: int, M: int, K: int, device: torch.device) -> None:
        """A call's q (B, M query rows) and k (K keys) on ``device`` match these masks."""
        if (B, M, K) != (self.batch, self.rows, self.keys):
            raise ValueError(f"masks were prepared for batch {self.batch}, {self.rows} query rows and {self.keys} "
                             f"keys, the call has {B}, {M} and {K}")
        if device != self.device:
            raise ValueError(f"masks are on {self.device} but q is on {device}")


def check_masks(B: int, M: int, K: int, device, *, q_seg=None, k_seg=None, attn_mask=None, q_rank=None,
                k_rank=None, q_pos=None, qlen=None, self_visible=True, self_rows=None,
                rows_cover_qlen=False, positions_name="q_pos") -> PreparedMasks:
    """The masks of M query rows over K keys (``rel_attention``'s keywords), checked; no tables.
    ``positions_name``: what a position out of range is called (the caller's argument q_pos came
    from)."""
    device = torch.device(device)
    if (q_seg is None) != (k_seg is None):
        raise ValueError("the segment term needs r_s_bias, seg_embed, q_seg and k_seg; missing "
                         f"{['k_seg' if k_seg is None else 'q_seg']}")
    if q_seg is not None:
        check_index_tensor("q_seg", q_seg, (B, M), device)
        check_index_tensor("k_seg", k_seg, (B, K), device)
    qlen = M if qlen is None else qlen
    if not isinstance(qlen, int) or isinstance(qlen, bool):
        raise TypeError(f"qlen must be an int, got {type(qlen).__name__}")
    if not 1 <= qlen <= K:
        raise ValueError(f"qlen must be in [1, K={K}], got {qlen}")
    if q_pos is None:
        if M > qlen:
            raise ValueError(f"without q_pos, M = {M} query rows need qlen >= M, got qlen = {qlen}")
    else:
        check_index_tensor("q_pos", q_pos, (B, M), device)
        check_positions(q_pos, qlen, positions_name)
    if attn_mask is not None and (q_rank is not None or k_rank is not None):
        raise ValueError("pass either attn_mask or q_rank/k_rank, not both")
    if attn_mask is not None:
        check_tensor("attn_mask", attn_mask, 3, (B, M, K), (torch.bool,), device)
    if (q_rank is None) != (k_rank is None):
        raise ValueError("q_rank and k_rank must be given together")
    if q_rank is not None:
        check_index_tensor("q_rank", q_rank, (B, M), device, (torch.int32,))
        check_index_tensor("k_rank", k_rank, (B, K), device, (torch.int32,))
    if not isinstance(self_visible, bool):
        raise TypeError(f"self_visible must be a bool, got {type(self_visible).__name__}")
    if self_rows is None:
        self_rows = M if self_visible else 0
    elif not 0 <= self_rows <= M:
        raise ValueError(f"self_rows must be in [0, M={M}], got {self_rows}")
    return PreparedMasks(batch=B, rows=M, keys=K, device=torch.device(device), qlen=qlen, self_rows=self_rows,
                         rows_cover_qlen=rows_cover_qlen, q_seg=q_seg, k_seg=k_seg, attn_mask=attn_mask,
                         q_rank=q_rank, k_rank=k_rank, q_pos=q_pos)




def _check_dense(q, q_g, k, v, k_r, r_w_bias, r_r_bias, r_s_bias, seg_embed, bias_autocast: bool) -> None:
    """The dense tensors. Biases (and seg_embed) in q's dtype; with ``bias_autocast`` (under
    torch.autocast, where a model's bias parameters stay float32 while its projections come out in
    the autocast dtype) in any float dtype: the op takes them in q's dtype (as a cast would)."""
    check_tensor("q", q, 4)
    B, L, H, D = q.shape
    if D < 1:
        raise ValueError(f"q must have a head dim D >= 1, got shape {tuple(q.shape)}")
    if q.dtype not in FLOAT_DTYPES + (torch.float64,):
        raise TypeError(f"q must be float32, bfloat16 or float16 (float64 for eager), got {q.dtype}")
    like = dict(dtypes=(q.dtype,), device=q.device)
    if q_g is not None:
        check_tensor("q_g", q_g, 4, (B, None, H, D), **like)
    check_tensor("k", k, 4, (B, None, H, D), **like)
    check_tensor("v", v, 4, (B, k.shape[1], H, D), **like)
    check_tensor("k_r", k_r, 4, (None, None, H, D), **like)
    if k_r.shape[0] not in (1, B):
        raise ValueError(f"k_r must have batch dim 1 or B={B}, got {k_r.shape[0]}")
    bias = dict(dtypes=FLOAT_DTYPES + (torch.float64,) if bias_autocast else (q.dtype,), device=q.device)
    check_tensor("r_w_bias", r_w_bias, 2, (H, D), **bias)
    check_tensor("r_r_bias", r_r_bias, 2, (H, D), **bias)
    if (r_s_bias is None) != (seg_embed is None):
        raise ValueError("the segment term needs r_s_bias, seg_embed, q_seg and k_seg; missing "
                         f"{['r_s_bias' if r_s_bias is None else 'seg_embed']}")
    if r_s_bias is not None:
        check_tensor("r_s_bias", r_s_bias, 2, (H, D), **bias)
        check_tensor("seg_embed", seg_embed, 3, (2, H, D), **bias)
    for name, t in (("q", q), ("q_g", q_g), ("k", k), ("v", v), ("k_r", k_r)):
        if t is not None and t.stride(-1) != 1:
            raise ValueError(f"{name} must have a contiguous last dim (stride 1), got strides {t.stride()}")
    if k_r.shape[1] < k.shape[1] + 1:
        raise ValueError(f"k_r needs at least K + 1 = {k.shape[1] + 1} rows, got R = {k_r.shape[1]}")


def _check_dropout(dropout_p) -> float:
    if not isinstance(dropout_p, (int, float)) or not 0.0 <= dropout_p < 1.0:
        raise ValueError(f"dropout_p must be a float in [0, 1), got {dropout_p!r}")
    return float(dropout_p)


def validate(q, k, v, k_r, r_w_bias, r_r_bias, *, r_s_bias=None, seg_embed=None, q_seg=None, k_seg=None,
             attn_mask=None, q_rank=None, k_rank=None, q_pos=None, qlen=None, self_visible=True, self_rows=None,
             scale=None, dropout_p=0.0, rows_cover_qlen=False, q_g=None, masks=None,
             bias_autocast=False) -> AttnArgs:
    """Check every argument of ``rel_attention`` (before any launch) and return its record; the seed
    is left None (drawn per call by the op). ``self_rows``: how many leading query rows also see their
    own key (``rel_attention_two_stream``: the content rows); default all rows if ``self_visible``.
    ``q_g``: more query rows after q's (the query stream of a two-stream call). ``masks``: the masks
    prepared beforehand (``PreparedMasks``, ``prepared.py``), instead of the mask keywords.

    With prepared masks, a call whose arguments have the kinds, shapes, strides, dtypes and devices
    of one that passed (every check looks at no more), and the same scalars, is not checked again
    (``_PASSED``): a model's layers make the same call, ~20 µs of checks each (bench/NOTES.md)."""
    dense = (q, q_g, k, v, k_r, r_w_bias, r_r_bias, r_s_bias, seg_embed)
    check_prepared(masks)
    signature = None
    if masks is not None and self_rows is None and qlen is None and self_visible is True and not any(
            t is not None for t in (q_seg, k_seg, attn_mask, q_rank, k_rank, q_pos)):
        signature = (_layouts(dense), bias_autocast, scale, dropout_p, rows_cover_qlen, masks.batch, masks.rows,
                     masks.keys, masks.device, masks.q_seg is None)
        if signature in _PASSED:
            return AttnArgs(r_s_bias=r_s_bias, seg_embed=seg_embed, q_seg=masks.q_seg, k_seg=masks.k_seg,
                            attn_mask=masks.attn_mask, q_rank=masks.q_rank, k_rank=masks.k_rank, q_pos=masks.q_pos,
                            qlen=masks.qlen, self_rows=masks.self_rows, scale=_PASSED[signature],
                            dropout_p=float(dropout_p), seed=None, rows_cover_qlen=masks.rows_cover_qlen, q_g=q_g,
                            rows_table=masks.rows_table, keys_table=masks.keys_table)
    a = _validate(*dense, q_seg=q_seg, k_seg=k_seg, attn_mask=attn_mask, q_rank=q_rank, k_rank=k_rank, q_pos=q_pos,
                  qlen=qlen, self_visible=self_visible, self_rows=self_rows, scale=scale, dropout_p=dropout_p,
                  rows_cover_qlen=rows_cover_qlen, masks=masks, bias_autocast=bias_autocast)
    if signature is not None:
        if len(_PASSED) >= _PASSED_LIMIT:
            _PASSED.clear()
        _PASSED[signature] = a.scale
    return a


def check_prepared(masks) -> None:
    """``masks=`` is None or what ``prepare_masks`` / ``prepare_two_stream_masks`` return."""
    if masks is not None and not isinstance(masks, PreparedMasks):
        raise TypeError("masks must be the PreparedMasks that xlnet_fast.prepare_masks or "
                        f"prepare_two_stream_masks returns (or None), got {type(masks).__name__}")


# signature of a call's arguments (``validate``) -> its resolved scale: arguments that passed
_PASSED: dict = {}
_PASSED_LIMIT = 4096


def _layouts(tensors) -> tuple:
    """What ``validate``'s checks read of each tensor (None: absent)."""
    return tuple(None if t is None else (type(t), t.shape, t.stride(), t.dtype, t.device) for t in tensors)


def _validate(q, q_g, k, v, k_r, r_w_bias, r_r_bias, r_s_bias, seg_embed, *, q_seg, k_seg, attn_mask, q_rank,
              k_rank, q_pos, qlen, self_visible, self_rows, scale, dropout_p, rows_cover_qlen, masks,
              bias_autocast) -> AttnArgs:
    """``validate``'s checks, all of them."""
    _check_dense(q, q_g, k, v, k_r, r_w_bias, r_r_bias, r_s_bias, seg_embed, bias_autocast)
    B, M, K = q.shape[0], q.shape[1] + (q_g.shape[1] if q_g is not None else 0), k.shape[1]
    raw = dict(q_seg=q_seg, k_seg=k_seg, attn_mask=attn_mask, q_rank=q_rank, k_rank=k_rank, q_pos=q_pos)
    if masks is None:
        masks = check_masks(B, M, K, q.device, qlen=qlen, self_visible=self_visible, self_rows=self_rows,
                            rows_cover_qlen=rows_cover_qlen, **raw)
    else:
        given = [name for name, t in raw.items() if t is not None]
        if given or qlen is not None or self_rows is not None or self_visible is not True:
            given += [n for n, t in (("qlen", qlen), ("self_rows", self_rows)) if t is not None]
            raise ValueError(f"pass the masks prepared (masks=) or as keywords, not both: got masks and "
                             f"{given + ([] if self_visible is True else ['self_visible'])}")
        masks.check_call(B, M, K, q.device)
    if (masks.q_seg is None) != (seg_embed is None):
        missing = ["r_s_bias", "seg_embed"] if seg_embed is None else ["q_seg", "k_seg"]
        raise ValueError(f"the segment term needs r_s_bias, seg_embed, q_seg and k_seg; missing {missing}")
    return AttnArgs(r_s_bias=r_s_bias, seg_embed=seg_embed, q_seg=masks.q_seg, k_seg=masks.k_seg,
                    attn_mask=masks.attn_mask, q_rank=masks.q_rank, k_rank=masks.k_rank, q_pos=masks.q_pos,
                    qlen=masks.qlen, self_rows=masks.self_rows, scale=resolve_scale(scale, q.shape[3]),
                    dropout_p=_check_dropout(dropout_p), seed=None, rows_cover_qlen=masks.rows_cover_qlen,
                    q_g=q_g, rows_table=masks.rows_table, keys_table=masks.keys_table)
