"""Fused Triton kernels for XLNet relative attention (installed as ``xlnet_fast.kernels``).

The backend interface used by ``xlnet_fast.attention``: ``available()``, ``check_supported(...)``,
``forward(q, k, v, k_r, r_w_bias, r_r_bias, args) -> (out, lse)`` and
``backward(dout, q, k, v, k_r, r_w_bias, r_r_bias, args, out, lse) -> 8 gradients``.
"""

from __future__ import annotations

import torch

from . import contract  # an attribute of the package even when xlnet_fast loaded it first (kernel_contract.py)
from .contract import (E_FIELDS, INT32_MAX, INT32_MIN, KEY_FIELDS, KEY_PAD, KEY_RANK, KEY_SEG, LOG2E,
                       MASK_DENSE, MASK_NONE, MASK_RANKS, ROW_CODE, ROW_FIELDS, ROW_OWN_KEY, ROW_POS_SHIFT, ROW_RANK,
                       ROW_SEG, ROW_SRC, interpreting)

_IMPORT_ERROR: str | None = None
try:
    import triton

    from . import operands as _operands
    from . import rel_attention as _k
except Exception as exc:  # pragma: no cover - depends on the install
    _IMPORT_ERROR = f"{type(exc).__name__}: {exc}"

SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
# every kernel has a config that fits Hopper's shared memory up to this head dim (bench.compile_report)
MAX_HEAD_DIM = 128


def available() -> tuple[bool, str]:
    """(usable, reason) for the Triton backend."""
    if _IMPORT_ERROR is not None:
        return False, f"triton is not importable ({_IMPORT_ERROR})"
    version = tuple(int(x) for x in triton.__version__.split(".")[:2])
    if version < (3, 3):
        return False, f"triton {triton.__version__} is older than 3.3"
    return True, f"triton {triton.__version__}"


def dropout_threshold(dropout_p: float) -> int:
    """The kernels drop a score when its random byte is below this: ``round(256 p)``, at most 255. The
    dropout rate they apply is ``threshold / 256`` (within 1/512 of ``p``; FlashAttention-2 rounds
    the same way) and kept values are scaled by ``1 / (1 - threshold / 256)``, so the expectation is
    unchanged."""
    return min(round(dropout_p * 256), 255)


def _keep_scale(dropout_p: float) -> float:
    return 1.0 / (1.0 - dropout_threshold(dropout_p) / 256)


def check_supported(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_r: torch.Tensor) -> None:
    """Raise ``ValueError`` for inputs the kernels do not handle (called before any launch)."""
    if q.dtype not in SUPPORTED_DTYPES:
        raise ValueError(f"the Triton backend supports {[str(d) for d in SUPPORTED_DTYPES]}, got q.dtype={q.dtype}")
    B, _, H, D = q.shape
    if B * H > contract.MAX_BATCH_HEADS:
        raise ValueError(f"the Triton backend launches one program row per batch row and head, at most "
                         f"{contract.MAX_BATCH_HEADS} (CUDA's grid limit), got B * H = {B} * {H} = {B * H}")
    if D > MAX_HEAD_DIM:
        raise ValueError(f"the Triton backend supports head dims up to {MAX_HEAD_DIM}, got D={D} "
                         "(its backward needs more shared memory than a Hopper SM has beyond that)")


def _dot_dtype(dtype: torch.dtype):
    import triton.language as tl

    if dtype == torch.bfloat16 and interpreting():
        # triton's CPU interpreter computes bf16 dots wrongly (numpy has no bf16): use fp32
        # operands there; on a GPU the dots take bf16 operands with fp32 accumulation.
        return tl.float32
    return {torch.float16: tl.float16, torch.bfloat16: tl.bfloat16, torch.float32: tl.float32}[dtype]


def fp32_precision() -> str:
    """How the kernels multiply fp32 inputs on a GPU, following torch's own switch for fp32 matmuls:
    ``"tf32"`` where torch allows TF32 (``torch.backends.cuda.matmul.allow_tf32``, i.e.
    ``torch.set_float32_matmul_precision("high")`` or ``"medium"``), else ``"tf32x3"`` (the default
    ``"highest"``): three TF32 products per dot, about fp32's accuracy on the tensor cores. Plain
    fp32 FMA dots are never used: they leave the kernels 32 registers and tens of KB of spill."""
    return "tf32" if torch.backends.cuda.matmul.allow_tf32 else "tf32x3"


def _input_precision(dtype: torch.dtype) -> str:
    if dtype != torch.float32 or interpreting():
        return "ieee"  # 16-bit inputs multiply exactly; the interpreter computes in numpy
    return fp32_precision()


def _block_d(D: int) -> int:
    return max(16, triton.next_power_of_2(D))


def _segment_codes(q_seg: torch.Tensor, k_seg: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Segment ids (B, M) and (B, K), any integers -> codes, per batch row: a key's code is the
    rank of its id among the distinct ids of that row's keys, a query's is its id's code, or -1 when
    no key has it. Equal ids get equal codes and different ids different ones, so the kernels compare
    codes (narrowing the ids to int32 would merge ids that differ above bit 31). Sync-free."""
    ids, order = torch.sort(k_seg.long(), dim=1)
    new_id = torch.ones_like(ids, dtype=torch.bool)
    new_id[:, 1:] = ids[:, 1:] != ids[:, :-1]
    code_sorted = new_id.long().cumsum(1) - 1
    k_codes = torch.empty_like(code_sorted).scatter_(1, order, code_sorted)
    q_ids = q_seg.long().contiguous()
    at = torch.searchsorted(ids, q_ids).clamp(max=ids.shape[1] - 1)
    q_codes = torch.where(ids.gather(1, at) == q_ids, code_sorted.gather(1, at), -1)
    return q_codes, k_codes


def _rows_table(a, B: int, M: int, device, q_codes=None) -> tuple[torch.Tensor, bool]:
    """(B, M, ROW_FIELDS) int32: per tile row its code (2 * position + sees-own-key), segment code
    (``q_codes``, see ``_segment_codes``), rank and the caller's row; rows ordered by position (a
    content row before the target rows at its position, padding rows last, repeating the last real
    position, with rank INT32_MIN) so that tiles are banded. Also whether every tile is banded by
    construction: the content stream (row i at position i) and launches whose rows cover every
    position (two-stream)."""
    rows = torch.zeros((B, M, ROW_FIELDS), dtype=torch.int32, device=device)
    caller = torch.arange(M, device=device, dtype=torch.int64).expand(B, M)
    own = (caller < a.self_rows).long()
    if a.q_pos is None:
        pos, order = caller, caller
    else:
        # q_pos below zero (any int64) is a padding row: clamp before narrowing to int32
        pos = a.q_pos.long().clamp(min=-1)
        key = torch.where(pos >= 0, pos * 2 + (1 - own), torch.full_like(pos, 2 * a.qlen + 2))
        order = torch.sort(key, dim=1, stable=True).indices
    take = lambda t: t.gather(1, order) if a.q_pos is not None else t  # noqa: E731
    p_sorted, own_sorted = take(pos), take(own)
    real = p_sorted >= 0
    last_real = p_sorted.cummax(dim=1).values.clamp(min=0)
    code = torch.where(real, (p_sorted << ROW_POS_SHIFT) | own_sorted * ROW_OWN_KEY, last_real << ROW_POS_SHIFT)
    rows[..., ROW_CODE] = code.to(torch.int32)
    if q_codes is not None:
        rows[..., ROW_SEG] = take(q_codes).to(torch.int32)
    # ranks: without a rank mask every real row sees every real key (rank 0 > the keys' -1)
    rank = take(a.q_rank.long()) if a.q_rank is not None else torch.zeros_like(p_sorted)
    rows[..., ROW_RANK] = torch.where(real, rank, INT32_MIN).to(torch.int32)
    rows[..., ROW_SRC] = order.to(torch.int32)
    return rows, a.q_pos is None or a.rows_cover_qlen


def _keys_table(a, B: int, K: int, device, k_codes=None) -> torch.Tensor:
    """(B, KEY_FIELDS, K padded to KEY_PAD) int32: segment code (``k_codes``, see ``_segment_codes``)
    and rank of each key, one row per field; the padding keys have rank INT32_MAX (never visible),
    the real ones -1 without a rank mask."""
    padded = triton.cdiv(K, KEY_PAD) * KEY_PAD
    keys = torch.zeros((B, KEY_FIELDS, padded), dtype=torch.int32, device=device)
    keys[:, KEY_RANK, K:] = INT32_MAX
    keys[:, KEY_RANK, :K] = a.k_rank if a.k_rank is not None else -1
    if k_codes is not None:
        keys[:, KEY_SEG, :K] = k_codes.to(torch.int32)
    return keys


def _dot_torch_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype of the query operands the launcher prepares (the kernels' dot operands)."""
    return torch.float32 if dtype == torch.bfloat16 and interpreting() else dtype


def _query_operands(q, r_w_bias, r_r_bias, a, rows) -> dict:
    """The query side every kernel reads, per row in the kernels' order (by position), computed
    once here rather than per tile (``operands._query_operands_kernel``, one pass over q):
    ``QW = (q + r_w_bias) * scale * log2(e)`` and ``QR`` likewise with ``r_r_bias`` as (B, H, M, D)
    in the dot dtype, and ``E`` (B, H, M, E_FIELDS) fp32, the segment scores: ``(q + r_s_bias) *
    scale * log2(e)`` dotted with ``seg_embed[0]`` and with ``seg_embed[1] - seg_embed[0]``."""
    B, M, H, D = q.shape
    dot = _dot_torch_dtype(q.dtype)
    qw = torch.empty((B, H, M, D), dtype=dot, device=q.device)
    qr = torch.empty_like(qw)
    e = torch.empty((B, H, M, E_FIELDS), dtype=torch.float32, device=q.device)
    segments = a.seg_embed is not None
    r_s, seg = (a.r_s_bias.contiguous(), a.seg_embed.contiguous()) if segments else (r_w_bias, r_w_bias)
    _operands._query_operands_kernel[(triton.cdiv(M, _operands.ROWS_PER_PROGRAM), B * H)](
        q, rows, r_w_bias.contiguous(), r_r_bias.contiguous(), r_s, seg, qw, qr, e, *q.stride(), M, H,
        a.scale * LOG2E, SEGMENTS=segments, HEAD_DIM=D, BLOCK_D=_block_d(D), BLOCK_M=_operands.ROWS_PER_PROGRAM)
    return dict(QW=qw, QR=qr, E=e)


def _grad_operands(dout, out, lse, args: dict, dropout_p: float) -> dict:
    """The backward's row operands in the kernels' order (``operands._grad_operands_kernel``, one
    pass over dO and O): ``DO`` (B, H, M, D) in the dot dtype, dO times the dropout keep scale (dP
    and dV take it: 1 / (1 - rate) applied once here, not per score); ``DELTA`` (B, H, M) fp32,
    rowsum(dO * O); ``LSE2`` (B, H, M) fp32, the lse in base 2 less the same-segment term that the
    recomputed scores leave out."""
    B, M, H, D = dout.shape
    do = torch.empty((B, H, M, D), dtype=args["QW"].dtype, device=dout.device)
    delta = torch.empty((B, H, M), dtype=torch.float32, device=dout.device)
    lse2 = torch.empty_like(delta)
    _operands._grad_operands_kernel[(triton.cdiv(M, _operands.ROWS_PER_PROGRAM), B * H)](
        dout, out, lse.contiguous(), args["ROWS"], args["E"], do, lse2, delta, *dout.stride(), *out.stride(), M, H,
        _keep_scale(dropout_p), HEAD_DIM=D, BLOCK_D=args["BLOCK_D"], BLOCK_M=_operands.ROWS_PER_PROGRAM)
    return dict(DO=do, LSE2=lse2, DELTA=delta)


def _int32_rows(t: torch.Tensor, name: str) -> torch.Tensor:
    """The kernels address rows within a batch row with int32 offsets (the batch offset is int64):
    a view whose row stride pushes them past 2**31 (e.g. a seq-first view of a huge batch) is made
    contiguous first."""
    if t.shape[1] * t.stride(1) + t.shape[2] * t.stride(2) < 2**31:
        return t
    t = t.contiguous()
    if t.shape[1] * t.stride(1) >= 2**31:
        raise ValueError(f"{name} has {t.shape[1]} rows of {t.stride(1)} elements: more than 2**31 per batch row")
    return t


def _launch_args(q, k, v, k_r, r_w_bias, r_r_bias, a) -> dict:
    """Keyword arguments every kernel takes, by name."""
    k, v, k_r = (_int32_rows(t, n) for t, n in ((k, "k"), (v, "v"), (k_r, "k_r")))
    B, M, H, D = q.shape
    K, R = k.shape[1], k_r.shape[1]
    q_codes, k_codes = _segment_codes(a.q_seg, a.k_seg) if a.seg_embed is not None else (None, None)
    rows, banded_only = _rows_table(a, B, M, q.device, q_codes)
    if a.attn_mask is not None:
        mask = a.attn_mask if a.attn_mask.stride(-1) == 1 else a.attn_mask.contiguous()
        mask = mask.view(torch.uint8)
        masking, stride_mb, stride_mm = MASK_DENSE, mask.stride(0), mask.stride(1)
    else:
        mask = rows  # never read
        masking = MASK_RANKS if a.q_rank is not None else MASK_NONE
        stride_mb = stride_mm = 0
    seed = int(a.seed.item()) if a.seed is not None else 0
    keep_threshold = dropout_threshold(a.dropout_p)
    return dict(
        **_query_operands(q, r_w_bias, r_r_bias, a, rows), ROWS=rows, K=k, V=v, KR=k_r,
        KEYS=_keys_table(a, B, K, q.device, k_codes), MASK=mask,
        stride_kb=k.stride(0), stride_kn=k.stride(1), stride_kh=k.stride(2),
        stride_vb=v.stride(0), stride_vn=v.stride(1), stride_vh=v.stride(2),
        stride_rb=k_r.stride(0) if k_r.shape[0] > 1 else 0, stride_rr=k_r.stride(1), stride_rh=k_r.stride(2),
        stride_mb=stride_mb, stride_mm=stride_mm,
        H=H, M=M, N_KEYS=K, R=R, qlen=a.qlen, qk_scale=a.scale * LOG2E,
        seed=seed, keep_threshold=keep_threshold,
        SEGMENTS=a.seg_embed is not None, MASKING=masking, BANDED_ONLY=banded_only,
        CHECK_R=R < K + a.qlen, DROPOUT=keep_threshold > 0, HEAD_DIM=D, BLOCK_D=_block_d(D),
        DOT_DTYPE=_dot_dtype(q.dtype), INPUT_PRECISION=_input_precision(q.dtype),
    )




_TUNED = {"fwd": "fwd_kernel_tuned", "dkdv": "bwd_kv_kernel_tuned", "dq": "bwd_q_kernel_tuned"}
_FIXED_CONFIGS: dict = {}


def _run(role: str, grid, kwargs: dict, deterministic: bool) -> None:
    """Launch kernel ``role``: at the interpreter's small tiles under TRITON_INTERPRET; in
    deterministic mode at the first of the device's candidates that launches (timing could pick
    another config in another run, and with it another order of float sums); else at the
    autotuner's choice."""
    fn = _k.KERNELS[role]
    if interpreting():
        fn[grid](**kwargs, **_k.INTERPRETER_TILES)
    elif _k.compile_target() is not None:  # the compile report records every candidate of its arch
        for config in _k.configs_for(_k.compile_target(), kwargs["HEAD_DIM"], role):
            fn[grid](**kwargs, **config.all_kwargs())
    elif deterministic or role not in _TUNED:
        key = (role, kwargs["QW"].device.index) + tuple(kwargs.get(name) for name in _k.TUNE_KEY)
        if key not in _FIXED_CONFIGS:
            _FIXED_CONFIGS[key] = _k.first_launchable(role, fn, kwargs)
        fn[grid](**kwargs, **_FIXED_CONFIGS[key].all_kwargs())
    else:
        getattr(_k, _TUNED[role])[grid](**kwargs)


def _tile_sizes(name: str) -> list:
    """Every BLOCK_M or BLOCK_N a launch may pick (the interpreter's, else any config's)."""
    if interpreting():
        return [_k.INTERPRETER_TILES[name]]
    return [c.kwargs[name] for c in _k.all_configs()]


def _smallest_tile(name: str) -> int:
    """The smallest BLOCK_M or BLOCK_N any config may pick: partial-sum tables are sized for it."""
    return min(_tile_sizes(name))


def _dkr_buffer(Br: int, R: int, qlen: int, K: int, H: int, D: int, device) -> torch.Tensor:
    """The kernels' fp32 dk_r sums (Br, rows, H, D), zeroed; rows >= R are room for the dQ kernel,
    which adds whole windows of k_r rows without a row mask: row ``qlen + j - position`` for key j,
    windows of up to 2 * BLOCK_N rows starting below R or at most ``qlen + K + BLOCK_N`` (positions
    >= -1). The rows past R receive zeros (their scores are masked)."""
    rows = max(R, qlen + K) + 2 * max(_tile_sizes("BLOCK_N"))
    return torch.zeros((Br, rows, H, D), dtype=torch.float32, device=device)


def forward(q, k, v, k_r, r_w_bias, r_r_bias, a):
    """Fused forward. Returns ``out (B, M, H, D)`` in q's dtype and ``lse (B, H, M)`` float32."""
    B, M, H, D = q.shape
    out = torch.empty((B, M, H, D), dtype=q.dtype, device=q.device)
    lse = torch.empty((B, H, M), dtype=torch.float32, device=q.device)
    args = _launch_args(q, k, v, k_r, r_w_bias, r_r_bias, a)
    _run("fwd", lambda meta: (triton.cdiv(M, meta["BLOCK_M"]), B * H),
         dict(args, keep_scale=_keep_scale(a.dropout_p), OUT=out, LSE=lse, stride_ob=out.stride(0),
              stride_om=out.stride(1), stride_oh=out.stride(2)),
         torch.are_deterministic_algorithms_enabled())
    return out, lse


def backward(dout, q, k, v, k_r, r_w_bias, r_r_bias, a, out, lse, deterministic: bool | None = None):
    """Fused backward: gradients for q, k, v, k_r, r_w_bias, r_r_bias, r_s_bias, seg_embed.

    ``deterministic`` (default: ``torch.are_deterministic_algorithms_enabled()``) computes dk_r in a
    kernel that owns each tile of k_r rows instead of with fp32 atomics.
    """
    if deterministic is None:
        deterministic = torch.are_deterministic_algorithms_enabled()
    B, M, H, D = q.shape
    K, Br, R = k.shape[1], k_r.shape[0], k_r.shape[1]
    args = _launch_args(q, k, v, k_r, r_w_bias, r_r_bias, a)
    block_d = args["BLOCK_D"]
    grad_io = _grad_operands(dout, out, lse, args, a.dropout_p)
    dq = torch.empty((B, M, H, D), dtype=q.dtype, device=q.device)
    dk = torch.empty((B, K, H, D), dtype=k.dtype, device=q.device)
    dv = torch.empty((B, K, H, D), dtype=v.dtype, device=q.device)
    dkr = _dkr_buffer(Br, R, a.qlen, K, H, D, q.device)
    stride_dkrb = dkr.stride(0) if Br > 1 else 0
    # room for the partial sums of the smallest tiles any config may pick (zeroed, unused rest)
    n_m_tiles = triton.cdiv(M, _smallest_tile("BLOCK_M"))
    n_n_tiles = triton.cdiv(K, _smallest_tile("BLOCK_N"))
    part = torch.zeros((B * H, n_m_tiles, block_d), dtype=torch.float32, device=q.device)
    part_k = torch.zeros((B * H, n_n_tiles, block_d), dtype=torch.float32, device=q.device)
    segments = a.seg_embed is not None
    g_parts = torch.zeros((B * H, n_n_tiles, M) if segments else (1,), dtype=torch.float32, device=q.device)

    kv_args = dict(args, **grad_io, DK=dk, DV=dv, GP=g_parts, PARTK=part_k, n_n_tiles=n_n_tiles)
    _run("dkdv", lambda meta: (triton.cdiv(K, meta["BLOCK_N"]), B * H), kv_args, deterministic)
    if segments:
        # rows of segment codes the dK/dV kernel's one-hot has no column for (a batch row with more
        # than SEG_CODES segment ids): nearly every program returns at once; a fixed config, as
        # the autotuner would zero GP to time it
        _run("fixup", lambda meta: (triton.cdiv(K, meta["BLOCK_N"]), B * H), dict(kv_args, FIX_UP=True), True)
    # g_diff (B, H, M), kernel row order: each row's sum of dS over keys of another segment
    g_diff = g_parts.sum(1).view(B, H, M) if segments else g_parts
    seg_delta = (a.seg_embed[1] - a.seg_embed[0]).float().contiguous() if segments else g_parts
    _run("dq", lambda meta: (triton.cdiv(M, meta["BLOCK_M"]), B * H),
         dict(args, **grad_io, DQ=dq, DKR=dkr, PART=part, G=g_diff, SEGD=seg_delta, stride_dkrb=stride_dkrb,
              n_m_tiles=n_m_tiles, DKR_ATOMIC=not deterministic), deterministic)
    if deterministic:
        det_args = {name: val for name, val in args.items() if name != "BANDED_ONLY"}
        _run("dkr", lambda meta: (triton.cdiv(R, meta["BLOCK_N"]), Br * H),
             dict(det_args, **grad_io, DKR=dkr, stride_dkrb=stride_dkrb, batch_per_kr=B // Br), deterministic)

    # the kernels differentiate the log2-domain scores: bring the scale back (docs/DESIGN.md §3)
    scale = float(a.scale)
    # both biases shift q: the column sums of dQ (before the segment term) are the sum of their
    # gradients, and the dK/dV kernel's sum_ij dS_ij k_j is r_w_bias's
    dr_w = part_k.view(B, H, n_n_tiles, block_d).sum((0, 2))[:, :D] * scale
    dr_r = part.view(B, H, n_m_tiles, block_d).sum((0, 2))[:, :D] * scale - dr_w
    if segments:
        # over keys of its own segment a row's dS sums to -g_diff; the segment term is
        # scale * (q + r_s_bias) . seg_embed[same or not], with a padding row's q taken as zero:
        # sum over rows of g_diff * (q + r_s_bias), q's rows matched to g_diff's by ROW_SRC
        rows = args["ROWS"]
        g_real = torch.where((rows[..., ROW_RANK] != INT32_MIN)[:, None, :], g_diff, 0.0)
        src_bh = rows[..., ROW_SRC].long()[:, None, :].expand(B, H, M)
        g_caller = torch.empty_like(g_real).scatter_(2, src_bh, g_real)
        dseg_1 = scale * (torch.einsum("bhm,bmhd->hd", g_caller, q.float())
                          + g_real.sum((0, 2))[:, None] * a.r_s_bias.float())
        dr_s = (scale * g_diff.sum((0, 2))[:, None] * seg_delta).to(a.r_s_bias.dtype)
        dseg = torch.stack([-dseg_1, dseg_1]).to(a.seg_embed.dtype)
    else:
        dr_s = torch.zeros_like(r_w_bias)
        dseg = torch.zeros((2, H, D), dtype=r_w_bias.dtype, device=q.device)
    dkr = (dkr[:, :R] / LOG2E).to(k_r.dtype)
    return dq, dk, dv, dkr, dr_w.to(r_w_bias.dtype), dr_r.to(r_r_bias.dtype), dr_s, dseg


def dropout_mask(seed: int, B: int, H: int, M: int, K: int, dropout_p: float, device,
                 block: int | None = None, record=None) -> torch.Tensor:
    """The keep mask (B, H, M, K) bool that the kernels apply with ``seed`` and ``dropout_p`` to query
    row m and key k: for tests and debugging. The kernels draw it by launch row (the rows sorted by
    position, ``ROWS``); ``record``: the op's validated arguments of the call
    (``xlnet_fast.attention.args.validate``) to get it by the caller's rows instead. ``block``: the
    tile it is drawn with (16 or a multiple of 32; the mask does not depend on it)."""
    keep = torch.empty((B * H, M, K), dtype=torch.uint8, device=device)
    tile = block or (16 if interpreting() else 64)
    _k._dropout_mask_kernel[(triton.cdiv(M, tile), triton.cdiv(K, tile), B * H)](
        keep, seed, dropout_threshold(dropout_p), M, K, BLOCK_M=tile, BLOCK_N=tile)
    keep = keep.view(B, H, M, K).bool()
    if record is not None:
        caller = _rows_table(record, B, M, device)[0][..., ROW_SRC].long()  # (B, M)
        keep = torch.empty_like(keep).scatter_(2, caller[:, None, :, None].expand(B, H, M, K), keep)
    return keep
