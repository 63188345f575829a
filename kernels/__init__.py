"""Fused Triton kernels for XLNet relative attention (installed as ``xlnet_fast.kernels``).

The backend interface used by ``xlnet_fast.attention``: ``available()``, ``check_supported(...)``,
``forward(q, k, v, k_r, r_w_bias, r_r_bias, args) -> (out, lse)`` and
``backward(dout, q, k, v, k_r, r_w_bias, r_r_bias, args, out, lse) -> 8 gradients``.
"""

from __future__ import annotations

import contextlib
import functools
from typing import NamedTuple

import torch
import torch.nn.functional as F

from . import contract  # an attribute of the package even when xlnet_fast loaded it first (kernel_contract.py)
from . import launch
from .contract import (E_FIELDS, INT32_MAX, INT32_MIN, KEY_FIELDS, KEY_PAD, KEY_RANK, KEY_SEG, LOG2E,
                       MASK_DENSE, MASK_NONE, MASK_RANKS, ROW_CODE, ROW_FIELDS, ROW_GROUP, ROW_OWN_KEY, ROW_POS_SHIFT,
                       ROW_FREE, ROW_RANK, ROW_SEG, ROW_SRC, interpreting)

_IMPORT_ERROR: str | None = None
try:
    import triton
    from triton.runtime import _allocation as _triton_allocation

    from . import operands as _operands
    from . import rel_attention as _k
    from . import tables as _table_kernels
except Exception as exc:  # pragma: no cover - depends on the install
    _IMPORT_ERROR = f"{type(exc).__name__}: {exc}"

SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
# Whether the kernels run in triton's interpreter: fixed when triton decorated them, at this import
INTERPRETED = interpreting()
# every kernel has a config that fits Hopper's shared memory up to this head dim (bench.compile_report)
MAX_HEAD_DIM = 128
# The backward keeps dS (B*H, M, K, the dot dtype) from the dK/dV kernel when it takes at most this
# many bytes and at most 1 / STORED_DS_DEVICE_SHARE of the GPU's memory (``_stored_ds_limit``): the dQ
# kernel (and the deterministic dk_r kernel) then read it instead of recomputing the scores, which
# costs dQ twice the time per score (bench/NOTES.md, kernel v4 steps 2 and 3; "H100 after the packed
# key fields"). 16k tokens at 16 heads (8.8 GB) are kept on a 141 GB H200, recomputed on an 80 GB
# H100 (at 8 GiB the H200 recomputed them too: dQ 20 ms at 1x16 16384/384, 2x the time per score of
# 4x16 4096/384, bench/NOTES.md "2026-11-29 (7)"). Read when a call shape's plan is made: after
# changing it, ``clear_launches()`` re-plans the shapes seen. Rows of DS start 16-element aligned.
STORED_DS_BYTES = 2**34
STORED_DS_DEVICE_SHARE = 16
DS_ROW_ALIGN = 16
# On these arch families (Hopper) the forward and dQ kernels read their tiles through tensor
# descriptors (TMA: the copy engine fills shared memory, no per-element addresses or registers;
# bench/NOTES.md, kernel v4 step 4) where the tensors allow it (``_tma_loads``). The interpreter
# runs that path too. Not sm_100 (triton 3.6 fails to compile dQ's 64x64w8s2 with them) nor
# sm_120 (its 64x64 forward spills with dropout: issue 20's best build falls to 32x64, 1.42x).
# ``pointer_loads()`` turns it off: the path of other GPUs and unaligned tensors (tests; the
# ``xlnet_fast_pointers`` benchmark provider, which times both paths on one GPU).
TMA_ARCH_FAMILIES = (90,)
TMA_LOADS = True
# The deterministic dk_r kernel has a program per (tile of k_r rows, head), each summing over every
# batch row sharing that k_r: 352 programs at B32 H16 512/384 on an H100's 264 resident blocks, two
# waves for 1.33 of work (1.59 ms; bench/NOTES.md). The batch rows are split over more programs, up
# to this many per multiprocessor (~4 waves at two resident blocks), each writing its own fp32
# partial sums, added in a fixed order (``_dkr_splits``). Read when a call shape's plan is made.
DKR_PROGRAMS_PER_SM = 8
INTERPRETER_MULTIPROCESSORS = 1  # the interpreter's CPU "device" in that count


@functools.cache
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

    if dtype == torch.bfloat16 and INTERPRETED:
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
    if dtype != torch.float32 or INTERPRETED:
        return "ieee"  # 16-bit inputs multiply exactly; the interpreter computes in numpy
    return fp32_precision()


def _block_d(D: int) -> int:
    return max(16, triton.next_power_of_2(D))


def _dot_torch_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype of the query operands the launcher prepares (the kernels' dot operands)."""
    return torch.float32 if dtype == torch.bfloat16 and INTERPRETED else dtype


def _rows_past_int32(geometry: tuple) -> bool:
    """The kernels address rows within a batch row with int32 offsets (the batch offset is int64):
    whether a (B, rows, H, D) view's (``_geometry``) row and head strides push them past 2**31 (e.g. a
    seq-first view of a huge batch)."""
    return geometry[1] * geometry[5] + geometry[2] * geometry[6] >= 2**31


def _int32_rows(t: torch.Tensor, name: str) -> torch.Tensor:
    """``t`` contiguous where its offsets pass int32 (``_rows_past_int32``); an error where they
    still do."""
    if not _rows_past_int32(_geometry(t)):
        return t
    t = t.contiguous()
    if t.shape[1] * t.stride(1) >= 2**31:
        raise ValueError(f"{name} has {t.shape[1]} rows of {t.stride(1)} elements: more than 2**31 per batch row")
    return t


def _plan(q, k, v, k_r, r_w_bias, r_r_bias, a, mask, grads=None) -> tuple:
    """``(k, v, k_r, shape, plan)`` of a call: its key (``_Shape``) and what follows from it
    (``_static_args``); k, v, k_r made contiguous first where their offsets pass int32."""
    shape = _shape(q, a.q_g, k, v, k_r, r_w_bias, r_r_bias, a, mask)
    if grads is not None:
        shape = shape._replace(grads=grads)
    plan = _static_args(shape)
    if plan["rows_past_int32"]:  # rare: made contiguous, a call of another shape
        k, v, k_r = _int32_rows(k, "k"), _int32_rows(v, "v"), _int32_rows(k_r, "k_r")
        return _plan(q, k, v, k_r, r_w_bias, r_r_bias, a, mask, grads)
    return k, v, k_r, shape, plan


def _device_guard(device) -> contextlib.AbstractContextManager:
    """What a call's launches run under. Triton launches on its driver's current device (that
    device's stream, its loaded binaries, the descriptors' scratch from ``_scratch``), not on the
    tensors': a call on another GPU's tensors (e.g. a layer of a model that transformers'
    ``device_map`` placed on cuda:1 while cuda:0 stays current) makes their device current for its
    launches, as FlashAttention's device guard does, and the previous one current again after."""
    device = torch.device(device)
    if INTERPRETED or device.type != "cuda" or device.index is None:
        return contextlib.nullcontext()
    if device.index == torch.cuda.current_device():
        return contextlib.nullcontext()
    return torch.cuda.device(device.index)


@contextlib.contextmanager
def _unfilled():
    """Inside, new tensors are not filled. ``torch.utils.deterministic.fill_uninitialized_memory``
    (on by default) makes torch fill every tensor it allocates while deterministic algorithms are on
    (NaN, an integer's largest value), so that a read of memory nobody wrote gives the same result
    each run; on a GPU that is one kernel per tensor. The kernels write every element they read back
    and every element of the results they return, so the fills did nothing but cost: ~30 launches and
    ~0.42 of the 6.2 ms of a deterministic fwd+bwd on an H200 (32x16 512/384, D=128; bench/NOTES.md).
    The setting is process-wide: it is the caller's again on the way out, and an allocation another
    thread makes meanwhile is not filled either."""
    torch.utils.deterministic.fill_uninitialized_memory = False
    try:
        yield
    finally:
        torch.utils.deterministic.fill_uninitialized_memory = True


def _allocations() -> contextlib.AbstractContextManager:
    """What a call's allocations run under: ``_unfilled`` where torch would fill them, else nothing."""
    if torch.are_deterministic_algorithms_enabled() and torch.utils.deterministic.fill_uninitialized_memory:
        return _unfilled()
    return contextlib.nullcontext()


# --------------------------------------------------------------------------------------------------
# The mask tables (built once per set of masks: docs/DESIGN.md §5.6)
# --------------------------------------------------------------------------------------------------


_ROW_GROUP_ORDERS: dict = {}


def _row_group_orders(device) -> torch.Tensor:
    """``tables.ROW_GROUP_ORDERS`` (2**ROW_GROUP, ROW_GROUP) int32 on ``device``, made once per device
    (before a CUDA graph captures a call: a copy from the host)."""
    orders = _ROW_GROUP_ORDERS.get(device)
    if orders is None:
        orders = torch.tensor(_table_kernels.ROW_GROUP_ORDERS, dtype=torch.int32, device=device)
        _ROW_GROUP_ORDERS[device] = orders
    return orders


def mask_tables(a, B: int, M: int, K: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """The ROWS (B, M, ROW_FIELDS) and KEYS (B, KEY_FIELDS, K padded to KEY_PAD) int32 tables every
    kernel of a call reads, from the masks of ``a`` (``q_seg``, ``k_seg``, ``q_rank``, ``k_rank``,
    ``q_pos``, ``qlen``, ``self_rows``; with ``attn_mask`` every key tile is tested): built once per
    set of masks and reused by every call that has them (the model's layers, forward and backward),
    in two launches, three with segments (``tables.py``). No host sync."""
    with _device_guard(device), _allocations():
        return _mask_tables(a, B, M, K, device)


def _mask_tables(a, B: int, M: int, K: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    padded = triton.cdiv(K, KEY_PAD) * KEY_PAD
    rows = torch.empty((B, M, ROW_FIELDS), dtype=torch.int32, device=device)
    keys = torch.empty((B, KEY_FIELDS, padded), dtype=torch.int32, device=device)
    if B == 0:
        return rows, keys
    sorted_rows = torch.empty_like(rows)
    inputs = dict(QSEG=a.q_seg, KSEG=a.k_seg, QRANK=a.q_rank, KRANK=a.k_rank, QPOS=a.q_pos)
    strides = {}
    for name, t in inputs.items():  # an absent input: a pointer never read, strides 0
        inputs[name] = t if t is not None else rows
        strides.update(zip(_TABLE_STRIDES[name], t.stride() if t is not None else (0, 0)))
    first = rows
    blocks = dict(BLOCK_M=_table_kernels.BLOCK_ROWS, BLOCK_N=_table_kernels.BLOCK_KEYS)
    if a.q_seg is not None:
        first = torch.empty((B, K), dtype=torch.int32, device=device)
        _launch_table_kernel("_first_ids_kernel", (triton.cdiv(K, blocks["BLOCK_M"]), B),
                             dict(KSEG=inputs["KSEG"], FIRST=first),
                             dict(K=K, stride_sb=strides["stride_ksb"], stride_sn=strides["stride_ksn"],
                                  BLOCK_N=blocks["BLOCK_M"], BLOCK_STEP=blocks["BLOCK_N"]))
    n_row_programs = triton.cdiv(M, blocks["BLOCK_M"])
    _launch_table_kernel(
        "_tables_kernel", (n_row_programs + triton.cdiv(padded, blocks["BLOCK_M"]), B),
        dict(inputs, FIRST=first, SORTED=sorted_rows, KEYS=keys),
        dict(strides, M=M, K=K, K_PADDED=padded, qlen=a.qlen, self_rows=a.self_rows, n_row_programs=n_row_programs,
             SEGMENTS=a.q_seg is not None, RANKS=a.q_rank is not None, POSITIONS=a.q_pos is not None,
             PACKED_KEYS=contract.packed_keys(K), FREE=a.attn_mask is None, **blocks))
    if M:
        groups = triton.cdiv(M, ROW_GROUP)
        _launch_table_kernel("_row_groups_kernel", (triton.cdiv(groups, _table_kernels.GROUPS_PER_PROGRAM), B),
                             dict(SORTED=sorted_rows, ORDERS=_row_group_orders(device), ROWS=rows),
                             dict(M=M, GROUPS=_table_kernels.GROUPS_PER_PROGRAM))
    return rows, keys


# the table kernels' stride arguments per input tensor (batch row, row or key)
_TABLE_STRIDES = dict(QSEG=("stride_qsb", "stride_qsm"), KSEG=("stride_ksb", "stride_ksn"),
                      QRANK=("stride_qrb", "stride_qrm"), KRANK=("stride_krb", "stride_krn"),
                      QPOS=("stride_pb", "stride_pm"))
_TABLE_LAUNCHES: dict = {}


def _launch_table_kernel(name: str, grid: tuple, tensors: dict, scalars: dict) -> None:
    """Launch table kernel ``name``; past its first launch with the same ``scalars``, grid, and
    dtypes and 16-byte alignment of ``tensors`` (what triton specialises a binary on), bound
    (``launch.py``: ~100 µs of the JIT's argument handling saved per launch)."""
    key = (name, grid, tuple(scalars.items()),
           tuple((n, t.device, t.dtype, t.data_ptr() % 16 == 0) for n, t in tensors.items()))
    bound = _TABLE_LAUNCHES.get(key)
    if bound is not None:
        bound(tensors)
        return
    fn = getattr(_table_kernels, name)
    compiled = fn[grid](**tensors, **scalars)
    bound = None if INTERPRETED else launch.bind(fn, compiled, grid, {**tensors, **scalars}, tensors, None)
    if bound is not None:
        if len(_TABLE_LAUNCHES) >= _TABLE_LAUNCHES_LIMIT:
            _TABLE_LAUNCHES.clear()
        _TABLE_LAUNCHES[key] = bound


_TABLE_LAUNCHES_LIMIT = 1024


def _tables(a, B: int, M: int, K: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    if a.rows_table is not None:
        return a.rows_table, a.keys_table
    return mask_tables(a, B, M, K, device)


def _dense_mask(a):
    """The dense mask as the kernels read it (uint8, unit last stride), or None."""
    if a.attn_mask is None:
        return None
    mask = a.attn_mask if a.attn_mask.stride(-1) == 1 else a.attn_mask.contiguous()
    return mask.view(torch.uint8)


# --------------------------------------------------------------------------------------------------
# A call's shape and the kernels' arguments that follow from it
# --------------------------------------------------------------------------------------------------


class _Shape(NamedTuple):
    """The key of a call: everything its launches' non-tensor arguments, and the binaries triton
    picks for them, depend on (shapes, strides, dtypes, flags, the 16-byte alignment of the caller's
    tensors). ``_static_args`` computes the arguments from it alone; launches are bound per key
    (``launch.py``)."""

    device: int | None
    dtype: torch.dtype  # q's
    bias_dtypes: tuple  # r_w_bias, r_r_bias, r_s_bias, seg_embed (None without segments)
    q: tuple  # shape and strides
    q_g: tuple | None
    k: tuple
    v: tuple
    k_r: tuple
    mask: tuple | None  # strides of the dense (B, M, K) mask
    qlen: int
    scale: float
    dropout_p: float
    masking: int
    banded_only: bool
    tf32: bool
    aligned: bool | tuple
    arch: int | None  # what the call compiles for (``_call_arch``)
    tma: bool  # tiles through tensor descriptors (``_tma_loads``)
    tiles: tuple | None  # the interpreter's tile sizes (tests change them), which size the tables
    grads: tuple | None = None  # backward: dO's and dO_g's shapes and strides, alignment, deterministic


def _geometry(t: torch.Tensor | None) -> tuple | None:
    return None if t is None else (*t.shape, *t.stride())


def _aligned(*tensors) -> bool | tuple:
    """True when every tensor given (None: absent) starts at a 16-byte boundary (the usual case, one
    test), else which ones do."""
    ptrs = [t.data_ptr() for t in tensors if t is not None]
    combined = 0
    for ptr in ptrs:
        combined |= ptr
    if not combined & 15:
        return True
    return tuple(t is None or t.data_ptr() % 16 == 0 for t in tensors)


def _shape(q, q_g, k, v, k_r, r_w_bias, r_r_bias, a, mask) -> _Shape:
    segments = a.seg_embed is not None
    keys = _geometry(k), _geometry(v), _geometry(k_r)
    aligned = _aligned(q, q_g, k, v, k_r, mask, r_w_bias, r_r_bias, a.r_s_bias, a.seg_embed)
    arch = _call_arch(q.device)
    return _Shape(
        q.device.index, q.dtype,
        (r_w_bias.dtype, r_r_bias.dtype, a.r_s_bias.dtype if segments else None, a.seg_embed.dtype if segments else None),
        _geometry(q), _geometry(q_g), *keys,
        None if mask is None else (mask.stride(0), mask.stride(1)),
        a.qlen, a.scale, a.dropout_p,
        MASK_DENSE if mask is not None else MASK_RANKS if a.q_rank is not None else MASK_NONE,
        a.q_pos is None or a.rows_cover_qlen, q.dtype == torch.float32 and _input_precision(q.dtype) == "tf32",
        aligned, arch, _tma_loads(arch, k.element_size(), aligned is True or all(aligned[2:5]), *keys),
        (_k.INTERPRETER_TILES["BLOCK_M"], _k.INTERPRETER_TILES["BLOCK_N"]) if INTERPRETED else None)


_ARCHS: dict = {}


def _call_arch(device) -> int | None:
    """The arch a call's kernels compile for: the compile report's (``compiling_for``), else the
    device's (looked up once per device); None in the interpreter."""
    if INTERPRETED:
        return None
    arch = _k.compile_target()
    if arch is None:
        arch = _ARCHS.get(device.index)
        if arch is None:
            arch = _ARCHS[device.index] = _k._device_arch(device)
    return arch


def _tma_loads(arch: int | None, itemsize: int, aligned: bool, *geometries) -> bool:
    """Whether the kernels read k, v and k_r tiles through tensor descriptors: unless
    ``pointer_loads()`` is on, on TMA_ARCH_FAMILIES (and in the interpreter), when each (batch
    row, head) slice of all three starts 16-byte aligned (``aligned``: the tensors do) with its rows
    a multiple of 16 bytes apart and unit last stride (what TMA requires). ``geometries``: k's, v's
    and k_r's ``_geometry``, of ``itemsize``-byte elements."""
    if not TMA_LOADS or not aligned or (arch is not None and _k.arch_family(arch) not in TMA_ARCH_FAMILIES):
        return False
    return _tma_strides(itemsize, geometries)


@functools.cache
def _tma_strides(itemsize: int, geometries: tuple) -> bool:
    """``_tma_loads``' stride rule, per call shape (k_r's batch stride is unused when it has one
    batch row)."""
    for i, (batch, *_, stride_b, stride_n, stride_h, stride_d) in enumerate(geometries):
        strides = (stride_n, stride_h) if i == 2 and batch == 1 else (stride_b, stride_n, stride_h)
        if stride_d != 1 or any(stride * itemsize % 16 for stride in strides):
            return False
    return True


@contextlib.contextmanager
def pointer_loads():
    """Inside (the call and its backward), the kernels read every tile through pointers, as on
    GPUs outside TMA_ARCH_FAMILIES."""
    global TMA_LOADS
    saved, TMA_LOADS = TMA_LOADS, False
    try:
        yield
    finally:
        TMA_LOADS = saved


_STATIC: dict = {}


def _static_args(shape: _Shape) -> dict:
    """Per kernel role, its arguments other than tensors (and a few sizes the launcher uses), from
    the call's shape alone; computed once per shape."""
    cached = _STATIC.get(shape)
    if cached is not None:
        return cached
    B, L, H, D = shape.q[:4]
    M = L + (shape.q_g[1] if shape.q_g is not None else 0)
    Br, R = shape.k_r[:2]
    K = shape.k[1]
    segments = shape.bias_dtypes[2] is not None
    threshold = dropout_threshold(shape.dropout_p)
    block_d = _block_d(D)
    k_stride, v_stride, r_stride = shape.k[4:], shape.v[4:], shape.k_r[4:]
    attn = dict(
        stride_kb=k_stride[0], stride_kn=k_stride[1], stride_kh=k_stride[2],
        stride_vb=v_stride[0], stride_vn=v_stride[1], stride_vh=v_stride[2],
        stride_rb=r_stride[0] if Br > 1 else 0, stride_rr=r_stride[1], stride_rh=r_stride[2],
        stride_mb=shape.mask[0] if shape.mask else 0, stride_mm=shape.mask[1] if shape.mask else 0,
        H=H, M=M, N_KEYS=K, R=R, qlen=shape.qlen, qk_scale=shape.scale * LOG2E, keep_threshold=threshold,
        SEGMENTS=segments, MASKING=shape.masking, BANDED_ONLY=shape.banded_only, CHECK_R=R < K + shape.qlen,
        PACKED_KEYS=contract.packed_keys(K),
        DROPOUT=threshold > 0, HEAD_DIM=D, BLOCK_D=block_d, DOT_DTYPE=_dot_dtype(shape.dtype),
        INPUT_PRECISION=_input_precision(shape.dtype))
    q_g = shape.q_g[4:] if shape.q_g is not None else shape.q[4:]
    rows = dict(M=M, L=L, H=H, SEGMENTS=segments, HEAD_DIM=D, BLOCK_D=block_d, BLOCK_M=_operands.ROWS_PER_PROGRAM)
    out_strides = (M * H * D, H * D, D, 1)  # the forward's output, allocated contiguous
    n_m_tiles = triton.cdiv(M, _smallest_tile("BLOCK_M"))
    n_n_tiles = triton.cdiv(K, _smallest_tile("BLOCK_N"))
    dkr_rows = _dkr_rows(R, shape.qlen, K)
    dkr_elements = Br * R * H * D
    n_convert = triton.cdiv(dkr_elements, _operands.FINISH_BLOCK)
    finish_step = _operands.FINISH_STEP // block_d  # rows per step of the finishing kernel's sums
    finish_chunk = max(_operands.FINISH_CHUNK_ROWS, finish_step)  # both powers of two
    dkr_splits = _dkr_splits(B // Br, triton.cdiv(R, max(_tile_sizes("BLOCK_N"))) * Br * H, shape.device)
    static = dict(
        sizes=dict(B=B, L=L, M=M, H=H, D=D, K=K, Br=Br, R=R, n_m_tiles=n_m_tiles, n_n_tiles=n_n_tiles,
                   dkr_rows=dkr_rows, dkr_splits=dkr_splits, device=shape.device),
        qops=dict(rows, qk_scale=shape.scale * LOG2E, **_strides("q", shape.q[4:]), **_strides("g", q_g)),
        fwd=dict(attn, TMA=shape.tma, keep_scale=_keep_scale(shape.dropout_p), stride_ob=out_strides[0],
                 stride_om=out_strides[1], stride_oh=out_strides[2],
                 # q_r from registers pays on wgmma (sm_90) only: on mma.sync it cost sm_120's and sm_80's
                 # forward registers and spills (bench/NOTES.md, kernel v4 step 4)
                 Q_R_REGISTERS=shape.arch is None or _k.arch_family(shape.arch) == 90,
                 FREE_TILES=_runs_free_key_tiles(shape.arch, block_d, shape.dtype.itemsize)),
        # the dK/dV kernel's keys are its program's: it reads their segment codes from KEY_SEG (valid
        # with packed tables too); taken from the packed field per query tile, sm_90's 64x64w4s1
        # went 180 -> 300 B of spill
        dkdv=dict(attn, n_n_tiles=n_n_tiles, ds_pitch=0, STORE_DS=False, PACKED_KEYS=False),
        dq=dict(attn, stride_dkrb=dkr_rows * H * D if Br > 1 else 0, n_m_tiles=n_m_tiles, n_n_tiles=n_n_tiles,
                ds_pitch=0, FROM_DS=False, LOAD_COLUMNS=False, TMA=shape.tma, n_dkr_rows=dkr_rows,
                # triton's interpreter has no descriptor reductions: its dk_r atomics are per element
                TMA_REDUCE=shape.tma and not INTERPRETED),
        dkr=dict({n: val for n, val in attn.items() if n != "BANDED_ONLY"}, stride_dkrb=dkr_rows * H * D if Br > 1 else 0,
                 stride_dkrs=Br * dkr_rows * H * D if dkr_splits > 1 else 0, batch_per_kr=B // Br,
                 batch_per_split=triton.cdiv(B // Br, dkr_splits), ds_pitch=0, FROM_DS=False),
        finish=dict(**_strides("q", shape.q[4:]), **_strides("g", q_g), n_dkr=dkr_elements, dkr_rows=dkr_rows, R=R,
                    M=M, L=L, H=H, n_m_tiles=n_m_tiles, n_n_tiles=n_n_tiles, n_convert=n_convert,
                    SEGMENTS=segments, HEAD_DIM=D, BLOCK_D=block_d, BLOCK=_operands.FINISH_BLOCK,
                    ROWS_STEP=finish_step, CHUNK_ROWS=finish_chunk, n_chunks=triton.cdiv(M, finish_chunk)),
        heads=dict(B=B, H=H, n_chunks=triton.cdiv(M, finish_chunk), scale=shape.scale, SEGMENTS=segments,
                   HEAD_DIM=D, BLOCK_D=block_d, B_STEP=_operands.HEADS_B_STEP),
    )
    static["dkdv"]["FIX_UP"] = False
    static["fixup"] = dict(static["dkdv"], FIX_UP=True)
    static["bound"] = {}  # (role, deterministic) -> the role's launch bound at this shape (launch.py)
    static["tile_counts"] = {}  # (role, deterministic) -> the tiles its launch ran at, cover M or K in
    static["rows_past_int32"] = any(_rows_past_int32(g) for g in (shape.k, shape.v, shape.k_r))
    if shape.grads is not None:
        dout, dout_g = shape.grads[0], shape.grads[1] or shape.grads[0]
        static["gops"] = dict(rows, BLOCK_M=_operands.grad_rows_per_program(block_d), qk_scale=shape.scale * LOG2E,
                              keep_scale=_keep_scale(shape.dropout_p), n_clear=Br * dkr_rows * H * D,
                              **_strides("q", shape.q[4:]), **_strides("qg", q_g), **_strides("g", dout[4:]),
                              **_strides("h", dout_g[4:]), **_strides("o", out_strides))
        static["dq"]["DKR_ATOMIC"] = not shape.grads[3]
        # dS kept for the dQ and dk_r kernels when small enough (the FIX_UP launch stores none); else
        # they recompute it, each a role of its own (its own autotuning, configs and records)
        # the recomputing dQ reads its tiles through pointers: with descriptors its best spill-free
        # build (32x32w4s1, mma.sync) paid 1.37x for dropout on sm_90 (bench/NOTES.md, kernel v4 step 4)
        # its segment codes from KEY_SEG as dK/dV's: the packed field's read cost triton 3.9's sm_90
        # 32x32w4s1 (its best spill-free build) 72 -> 88 B of spill, for 2% at 64x64w4s2
        static["dq_recompute"] = dict(static["dq"], TMA=False, TMA_REDUCE=False, PACKED_KEYS=False)
        static["dkr_recompute"] = dict(static["dkr"])
        ds_pitch = triton.cdiv(K, DS_ROW_ALIGN) * DS_ROW_ALIGN
        if B * H * M * ds_pitch * _dot_torch_dtype(shape.dtype).itemsize <= _stored_ds_limit(shape.device):
            static["dkdv"].update(STORE_DS=True, ds_pitch=ds_pitch)
            static["dq"].update(FROM_DS=True, ds_pitch=ds_pitch,
                                LOAD_COLUMNS=_loads_column_numbers(shape.arch, shape.grads[3],
                                                                   _dot_torch_dtype(shape.dtype).itemsize))
            static["dkr"].update(FROM_DS=True, ds_pitch=ds_pitch)
    _STATIC[shape] = static
    return static


def _multiprocessors(device_index: int | None) -> int:
    """The multiprocessors of CUDA device ``device_index``; INTERPRETER_MULTIPROCESSORS for None."""
    if device_index is None:
        return INTERPRETER_MULTIPROCESSORS
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def _dkr_splits(batch_per_kr: int, programs: int, device_index: int | None) -> int:
    """Into how many groups the deterministic dk_r kernel splits the ``batch_per_kr`` batch rows
    sharing a k_r, for its ``programs`` unsplit programs (at the largest BLOCK_N) to reach
    DKR_PROGRAMS_PER_SM per multiprocessor: a function of the shape and the device only, so the
    order of its sums is too. No empty group."""
    wanted = max(1, min(batch_per_kr, triton.cdiv(DKR_PROGRAMS_PER_SM * _multiprocessors(device_index), programs)))
    return triton.cdiv(batch_per_kr, triton.cdiv(batch_per_kr, wanted))


def _runs_free_key_tiles(arch: int | None, block_d: int, itemsize: int) -> bool:
    """Whether the forward runs the key tiles every real row of its query tile sees in a loop of
    their own, without the visibility test (``FREE_TILES``; always in the interpreter, which checks
    both ways): where the time model, the spills outside the key loops priced in, predicts a gain at
    the pretraining shape (6 of 14 key tiles free; bench/NOTES.md, 2026-11-29): 16-bit inputs at
    BLOCK_D <= 64 on every GPU and at 128 on sm_90 and sm_100 (+1.4%). Not at 128 on the mma.sync
    GPUs (sm_80/86/89/120: within 0.4% either way, and their spill-free builds kept), nor with fp32
    (sm_90's TF32 pick 3% slower with it; sm_80's a wash, its spill-free build lost)."""
    if arch is None:
        return True
    return itemsize == 2 and (block_d <= 64 or _k.arch_family(arch) in (90, 100))


def _loads_column_numbers(arch: int | None, deterministic: bool, itemsize: int) -> bool:
    """Whether the dQ kernel reading the kept dS (of ``itemsize``-byte elements) loads its unskew's
    column numbers (``_tile_columns``; always in the interpreter, which checks both ways): where the
    compile records show it pays, with 16-bit dS on sm_90 (64x64w4s2r168: 48 -> 44 B-eq/score) and
    sm_100 (64x64w8s2: 50 -> 40), but not in sm_100's deterministic dQ, which then keeps the loaded
    index in registers (100 -> 155, half the resident warps). The mma.sync GPUs' 32-column tiles
    lose (their gather's reads conflict more; sm_80's spill-free D=128 builds spilled), and so does
    fp32 dS (sm_90 64x64w4s2: 228 -> 271 B-eq): bench/NOTES.md."""
    if arch is None:
        return True
    family = _k.arch_family(arch)
    return itemsize == 2 and (family == 90 or (family == 100 and not deterministic))


_COLUMN_NUMBERS: dict = {}


def _column_numbers(device) -> torch.Tensor:
    """int16 0, 1, ..., ``COLUMN_NUMBERS`` of them, on ``device`` (made once per device): where the
    dQ kernel reads a tile's column numbers from (``_tile_columns``)."""
    table = _COLUMN_NUMBERS.get(device)
    if table is None:
        table = _COLUMN_NUMBERS[device] = torch.arange(_k.COLUMN_NUMBERS.value, dtype=torch.int16, device=device)
    return table


def _stored_ds_limit(device_index: int | None) -> int:
    """The most bytes of dS the backward keeps on this device (STORED_DS_BYTES): on a GPU also at
    most 1 / STORED_DS_DEVICE_SHARE of its memory (an 80 GB H100: 4.9 GiB, a 24 GB card: 1.5)."""
    if device_index is None:  # the interpreter's CPU tensors
        return STORED_DS_BYTES
    total = torch.cuda.get_device_properties(device_index).total_memory
    return min(STORED_DS_BYTES, total // STORED_DS_DEVICE_SHARE)


def _strides(prefix: str, strides) -> dict:
    return {f"stride_{prefix}{axis}": s for axis, s in zip("bmhd", strides)}


# --------------------------------------------------------------------------------------------------
# Launching
# --------------------------------------------------------------------------------------------------


_TUNED = {"fwd": "fwd_kernel_tuned", "dkdv": "bwd_kv_kernel_tuned", "dq": "bwd_q_kernel_tuned",
          "dq_recompute": "bwd_q_kernel_tuned"}
_FIXED_CONFIGS: dict = {}
_PLAIN = {"qops": "_query_operands_kernel", "gops": "_grad_operands_kernel", "finish": "_grad_finish_kernel",
          "heads": "_grad_heads_kernel"}


def _scratch(size: int, alignment: int, stream):
    """Global memory for the tensor descriptors a kernel builds (128 bytes each per program), from
    torch's caching allocator on the current device (in stream order, as the launch)."""
    return torch.empty(size, dtype=torch.int8, device="cuda")


def _ensure_scratch_allocator() -> None:
    """Kernels that build tensor descriptors need triton's allocator for their scratch at every
    launch. Set ours where none is (triton's default raises); one set by the caller is kept. It is
    per thread (a context variable): autograd runs the backward on a thread of its own."""
    if isinstance(_triton_allocation._allocator.get(), _triton_allocation.NullAllocator):
        triton.set_allocator(_scratch)


@functools.cache
def _canonical_cache_keys() -> None:
    """Hash every kernel and helper of ours until the hashes stop changing: once per process,
    before its first compiled launch. Triton 3.6 (3.9 no longer) adds a called helper's global
    constants to its caller's hash only when that helper was hashed before, so the key of a binary in
    triton's on-disk cache depended on the order in which a process first launched the kernels
    (with another order, another process missed the cache and compiled again; so did the
    campaign's binaries compiled ahead, ``bench.compiler.precompile``). Hashed to a fixpoint, the
    keys are the same whatever a process launches first (one more helper level settles per pass)."""
    functions = [f for module in (_k, _operands, _table_kernels) for f in vars(module).values()
                 if isinstance(f, triton.runtime.JITFunction)]
    hashes = None
    for _ in range(len(functions) + 1):
        for f in functions:
            f.hash = None
        before, hashes = hashes, [f.cache_key for f in functions]
        if hashes == before:
            return


def _run(role: str, grid, plan: dict, tensors: dict, deterministic: bool, config=None) -> dict:
    """Launch kernel ``role`` with its arguments of the call's ``plan`` (``_static_args``) and
    ``tensors``; return its tile sizes (BLOCK_M, BLOCK_N). Attention kernels run at the interpreter's
    small tiles under TRITON_INTERPRET; in deterministic mode at the first of the device's
    candidates that launches (timing could pick another config in another run, and with it another
    order of float sums); at ``config`` when given (the FIX_UP launch takes its dK/dV launch's); else
    at the autotuner's choice. Past its first launch at the call's shape a kernel is launched bound
    (``launch.py``): its tensors only."""
    if plan[role].get("TMA") and not INTERPRETED:
        _ensure_scratch_allocator()
    bound = plan["bound"].get((role, deterministic))
    if bound is not None:
        bound(tensors)
        return bound.tiles
    if not INTERPRETED:
        _canonical_cache_keys()
    kwargs = {**plan[role], **tensors}
    if role in _PLAIN:
        fn = getattr(_operands, _PLAIN[role])
        compiled, tiles = fn[grid](**kwargs), {}
        if INTERPRETED:
            return tiles
    else:
        fn = _k.KERNELS[role]
        if INTERPRETED:
            fn[grid](**kwargs, **_k.INTERPRETER_TILES)
            return _k.INTERPRETER_TILES
        if _k.compile_target() is not None:  # the compile report records every candidate of its arch
            for candidate in _k.configs_for(_k.compile_target(), kwargs["HEAD_DIM"], role):
                fn[grid](**kwargs, **candidate.all_kwargs())
            return {}
        if config is None and (deterministic or role not in _TUNED):
            key = (role, plan["sizes"]["device"]) + tuple(kwargs.get(name) for name in _k.TUNE_KEY + ["TMA"])
            if key not in _FIXED_CONFIGS:
                _FIXED_CONFIGS[key] = _k.first_launchable(role, fn, kwargs)
            config = _FIXED_CONFIGS[key]
        if config is not None:
            compiled = fn[grid](**kwargs, **config.all_kwargs())
        else:
            tuned = getattr(_k, _TUNED[role])
            tuned[grid](**kwargs)
            config = tuned.best_config
            compiled = fn.warmup(**kwargs, **config.all_kwargs(), grid=grid)
        kwargs.update(config.all_kwargs())
        tiles = config
    bound = launch.bind(fn, compiled, grid, kwargs, tensors, tiles)
    if bound is not None:
        plan["bound"][(role, deterministic)] = bound
    return tiles


def clear_launches() -> None:
    """Forget the call shapes' arguments and bound launches, the mask tables' included (the next
    launch of each goes through triton's JIT again)."""
    _STATIC.clear()
    _TABLE_LAUNCHES.clear()


_CONFIG_TILES: dict = {}


def _tile_sizes(name: str) -> list:
    """Every BLOCK_M or BLOCK_N a launch may pick (the interpreter's, which tests change, else any
    config's)."""
    if INTERPRETED:
        return [_k.INTERPRETER_TILES[name]]
    if name not in _CONFIG_TILES:
        _CONFIG_TILES[name] = [c.kwargs[name] for c in _k.all_configs()]
    return _CONFIG_TILES[name]


def _smallest_tile(name: str) -> int:
    """The smallest BLOCK_M or BLOCK_N any config may pick: partial-sum tables are sized for it."""
    return min(_tile_sizes(name))


def _query_operands(q, q_g, r_w_bias, r_r_bias, a, rows, static) -> tuple[dict, dict]:
    """The query side every kernel reads, per row in the kernels' order (by position), computed
    once per call rather than per tile: ``QW = (q + r_w_bias) * scale * log2(e)`` and ``QR``
    likewise with ``r_r_bias`` as (B, H, M, D) in the dot dtype, and ``E`` (B, H, M, E_FIELDS) fp32,
    the segment scores: ``(q + r_s_bias) * scale * log2(e)`` dotted with ``seg_embed[0]`` and with
    ``seg_embed[1] - seg_embed[0]``. Returns them unwritten, and the tensors of the pass that writes
    them (one over q and q_g: the forward's ``operands._query_operands_kernel``, the backward's
    ``_grad_operands_kernel``)."""
    sz = static["sizes"]
    B, M, H, D = sz["B"], sz["M"], sz["H"], sz["D"]
    qw = torch.empty((B, H, M, D), dtype=_dot_torch_dtype(q.dtype), device=q.device)
    qr = torch.empty((B, H, M, D), dtype=qw.dtype, device=q.device)
    e = torch.empty((B, H, M, E_FIELDS), dtype=torch.float32, device=q.device)
    segments = a.seg_embed is not None
    operands = dict(QW=qw, QR=qr, E=e)
    return operands, dict(operands, Q=q, Q_G=q_g if q_g is not None else q, ROWS=rows, RW=r_w_bias, RR=r_r_bias,
                          RS=a.r_s_bias if segments else r_w_bias, SEG=a.seg_embed if segments else r_w_bias)


def _contiguous_biases(r_w_bias, r_r_bias, a):
    """The (H, D) biases and (2, H, D) seg_embed as the kernels read them: contiguous."""
    if a.seg_embed is not None and not (a.r_s_bias.is_contiguous() and a.seg_embed.is_contiguous()):
        import dataclasses

        a = dataclasses.replace(a, r_s_bias=a.r_s_bias.contiguous(), seg_embed=a.seg_embed.contiguous())
    return r_w_bias.contiguous(), r_r_bias.contiguous(), a


def _attention_tensors(q_ops: dict, rows, keys, k, v, k_r, mask, a) -> dict:
    """The tensors every attention kernel takes (those of the query side, tables, keys, masks)."""
    return dict(q_ops, ROWS=rows, K=k, V=v, KR=k_r, KEYS=keys, MASK=mask if mask is not None else rows,
                SEED=a.seed if a.seed is not None else rows)


def _scoreless(q, a) -> bool:
    """Whether a call has no score at all (no batch row, head or query row): nothing to launch; its
    results are empty, its gradients zeros (as the eager backend's)."""
    B, L, H, _ = q.shape
    return B * H * (L + (a.q_g.shape[1] if a.q_g is not None else 0)) == 0


def forward(q, k, v, k_r, r_w_bias, r_r_bias, a):
    """Fused forward. ``q`` holds the caller's rows [0, L) and ``a.q_g`` (when given) the rest.
    Returns ``out (B, M, H, D)`` in q's dtype and ``lse (B, H, M)`` float32."""
    with _device_guard(q.device), _allocations():
        return _forward(q, k, v, k_r, r_w_bias, r_r_bias, a)


def _forward(q, k, v, k_r, r_w_bias, r_r_bias, a):
    if _scoreless(q, a):
        B, L, H, D = q.shape
        M = L + (a.q_g.shape[1] if a.q_g is not None else 0)
        return q.new_empty((B, M, H, D)), q.new_empty((B, H, M), dtype=torch.float32)
    r_w_bias, r_r_bias, a = _contiguous_biases(r_w_bias, r_r_bias, a)
    mask = _dense_mask(a)
    k, v, k_r, shape, static = _plan(q, k, v, k_r, r_w_bias, r_r_bias, a, mask)
    sz = static["sizes"]
    B, M, H, D = sz["B"], sz["M"], sz["H"], sz["D"]
    rows, keys = _tables(a, B, M, sz["K"], q.device)
    out = torch.empty((B, M, H, D), dtype=q.dtype, device=q.device)
    lse = torch.empty((B, H, M), dtype=torch.float32, device=q.device)
    q_ops, q_pass = _query_operands(q, a.q_g, r_w_bias, r_r_bias, a, rows, static)
    _run("qops", (triton.cdiv(M, _operands.ROWS_PER_PROGRAM), B * H), static, q_pass, False)
    _run("fwd", lambda meta: (triton.cdiv(M, meta["BLOCK_M"]), B * H), static,
         dict(_attention_tensors(q_ops, rows, keys, k, v, k_r, mask, a), OUT=out, LSE=lse),
         torch.are_deterministic_algorithms_enabled())
    return out, lse


def _dkr_rows(R: int, qlen: int, K: int) -> int:
    """Rows of the kernels' fp32 dk_r sums: R and room for the dQ kernel, which adds whole windows of
    k_r rows without a row mask: row ``qlen + j - position`` for key j, windows of up to 2 * BLOCK_N
    rows starting below R or at most ``qlen + K + BLOCK_N`` (positions >= -1). The rows past R receive
    zeros (their scores are masked)."""
    return max(R, qlen + K) + 2 * max(_tile_sizes("BLOCK_N"))


def _dkr_buffer(Br: int, R: int, qlen: int, K: int, H: int, D: int, device) -> torch.Tensor:
    """The kernels' fp32 dk_r sums (Br, ``_dkr_rows``, H, D), uninitialised: the backward's row
    operands kernel clears them before the dQ kernel adds to them."""
    return torch.empty((Br, _dkr_rows(R, qlen, K), H, D), dtype=torch.float32, device=device)


def _tile_count(plan: dict, role: str, deterministic: bool, tiles, name: str, total: int, default: int) -> int:
    """How many tiles of kind ``name`` of ``tiles`` (the config ``role``'s launch ran at, or the
    interpreter's tile sizes) cover ``total``, kept in the plan; ``default`` (the tables' room) when
    the launch picked no single config (the compile report's launches)."""
    counts = plan["tile_counts"]
    key = (role, deterministic)
    if key not in counts:
        size = tiles.kwargs.get(name) if hasattr(tiles, "kwargs") else tiles.get(name)
        counts[key] = triton.cdiv(total, size) if size else default
    return counts[key]


def backward(dout, q, k, v, k_r, r_w_bias, r_r_bias, a, out, lse, dout_g=None, deterministic: bool | None = None):
    """Fused backward: gradients for q (all M rows, q_g's after q's), k, v, k_r, r_w_bias, r_r_bias,
    r_s_bias, seg_embed. ``dout`` is the gradient of out's rows [0, L) and ``dout_g`` (with ``a.q_g``)
    of the rest.

    ``deterministic`` (default: ``torch.are_deterministic_algorithms_enabled()``) computes dk_r in a
    kernel that owns each tile of k_r rows (reading the kept dS, or recomputing it) instead of with
    fp32 atomics.
    """
    if deterministic is None:
        deterministic = torch.are_deterministic_algorithms_enabled()
    with _device_guard(q.device), _allocations():
        return _backward(dout, q, k, v, k_r, r_w_bias, r_r_bias, a, out, lse, dout_g, deterministic)


def _backward(dout, q, k, v, k_r, r_w_bias, r_r_bias, a, out, lse, dout_g, deterministic: bool):
    if _scoreless(q, a):
        B, L, H, D = q.shape
        M = L + (a.q_g.shape[1] if a.q_g is not None else 0)
        return (q.new_zeros((B, M, H, D)), torch.zeros_like(k), torch.zeros_like(v), torch.zeros_like(k_r),
                torch.zeros_like(r_w_bias), torch.zeros_like(r_r_bias),
                torch.zeros_like(a.r_s_bias if a.seg_embed is not None else r_w_bias),
                (a.seg_embed if a.seg_embed is not None else r_w_bias).new_zeros((2, H, D)))
    r_w_bias, r_r_bias, a = _contiguous_biases(r_w_bias, r_r_bias, a)
    mask = _dense_mask(a)
    k, v, k_r, shape, static = _plan(q, k, v, k_r, r_w_bias, r_r_bias, a, mask,
                                     grads=(_geometry(dout), _geometry(dout_g), _aligned(dout, dout_g, out), deterministic))
    sz = static["sizes"]
    B, L, M, H, D, K, Br, R = (sz[n] for n in ("B", "L", "M", "H", "D", "K", "Br", "R"))
    segments = a.seg_embed is not None
    rows, keys = _tables(a, B, M, K, q.device)
    q_ops, q_pass = _query_operands(q, a.q_g, r_w_bias, r_r_bias, a, rows, static)
    device = q.device
    # the backward's row operands (and seg_embed[1] - seg_embed[0] for the dQ kernel)
    grad_io = dict(DO=torch.empty((B, H, M, D), dtype=q_ops["QW"].dtype, device=device),
                   LSE2=torch.empty((B, H, M), dtype=torch.float32, device=device),
                   DELTA=torch.empty((B, H, M), dtype=torch.float32, device=device))
    # what a plan never reads or writes (segments off, dS not kept) gets a word of its own: a
    # placeholder that aliased a tensor in use would be cleared by an autotuner's reset_to_zero (the
    # dK/dV kernel's GP was DELTA once: the first call at each tuning key had delta = 0)
    unused = torch.empty(1, dtype=torch.float32, device=device)
    seg_delta = torch.empty((H, D), dtype=torch.float32, device=device) if segments else unused
    dkr_sums = _dkr_buffer(Br, R, a.qlen, K, H, D, device)
    # the query operands again (not kept by the forward), in the same pass
    _run("gops", (triton.cdiv(M, static["gops"]["BLOCK_M"]), B * H), static,
         dict(q_pass, DOUT=dout, DOUT_G=dout_g if dout_g is not None else dout, OUT=out, LSE=lse, SEGD=seg_delta,
              DKR_SUMS=dkr_sums, **grad_io), False)
    dq = torch.empty((B, M, H, D), dtype=q.dtype, device=device)
    dk = torch.empty((B, K, H, D), dtype=k.dtype, device=device)
    dv = torch.empty((B, K, H, D), dtype=v.dtype, device=device)
    # per-tile partial sums, room for the smallest tiles any config may pick; the kernels fill the
    # first cdiv(M or K, their tile) rows, which are the ones read (none needs zeroing)
    part = torch.empty((B * H, sz["n_m_tiles"], static["fwd"]["BLOCK_D"]), dtype=torch.float32, device=device)
    part_k = torch.empty((B * H, sz["n_n_tiles"], static["fwd"]["BLOCK_D"]), dtype=torch.float32, device=device)
    g_parts = torch.empty((B * H, sz["n_n_tiles"], M), dtype=torch.float32, device=device) if segments else unused
    attn = _attention_tensors(q_ops, rows, keys, k, v, k_r, mask, a)
    # dS, kept for the dQ and dk_r kernels when the plan says so (else a placeholder never read)
    ds_pitch = static["dq"]["ds_pitch"]
    ds = torch.empty((B * H, M, ds_pitch), dtype=q_ops["QW"].dtype, device=device) if ds_pitch else unused
    kv_tensors = dict(attn, **grad_io, DK=dk, DV=dv, GP=g_parts, PARTK=part_k, DS=ds)
    kv_grid = lambda meta: (triton.cdiv(K, meta["BLOCK_N"]), B * H)  # noqa: E731
    kv_tiles = _run("dkdv", kv_grid, static, kv_tensors, deterministic)
    n_kv_tiles = _tile_count(static, "dkdv", deterministic, kv_tiles, "BLOCK_N", K, sz["n_n_tiles"])
    if segments:
        # rows of segment codes the dK/dV kernel's one-hot has no column for (a batch row with more
        # than SEG_CODES segment ids): nearly every program returns at once; at the dK/dV launch's
        # config, so that both fill the same tiles of GP
        _run("fixup", kv_grid, static, kv_tensors, deterministic,
             config=kv_tiles if hasattr(kv_tiles, "kwargs") else None)
    # g_diff (B, H, M), kernel row order: each row's sum of dS over keys of another segment (the dQ
    # kernel sums GP's n_kv_tiles per-tile sums)
    g_diff = torch.empty((B, H, M), dtype=torch.float32, device=device) if segments else g_parts
    dq_role = "dq" if ds_pitch else "dq_recompute"
    q_tiles = _run(dq_role, lambda meta: (triton.cdiv(M, meta["BLOCK_M"]), B * H), static,
                   dict(attn, **grad_io, DQ=dq, DKR=dkr_sums, PART=part, GP=g_parts, G=g_diff, SEGD=seg_delta,
                        DS=ds, COLUMNS=_column_numbers(device), n_gp=n_kv_tiles), deterministic)
    if deterministic:
        # each group of batch rows its own fp32 sums, then their sum in a fixed order (_dkr_splits)
        splits = sz["dkr_splits"]
        partials = dkr_sums if splits == 1 else torch.empty((splits, *dkr_sums.shape), dtype=torch.float32,
                                                            device=device)
        _run("dkr" if ds_pitch else "dkr_recompute", lambda meta: (triton.cdiv(R, meta["BLOCK_N"]), Br * H, splits),
             static, dict(attn, **grad_io, DKR=partials, DS=ds), deterministic)
        if splits > 1:
            torch.sum(partials[:, :, :R], dim=0, out=dkr_sums[:, :R])
    # the gradients of k_r, the biases and seg_embed, each in its parameter's dtype
    grads = dict(DKR=torch.empty((Br, R, H, D), dtype=k_r.dtype, device=device),
                 DRW=torch.empty((H, D), dtype=r_w_bias.dtype, device=device),
                 DRR=torch.empty((H, D), dtype=r_r_bias.dtype, device=device),
                 DRS=torch.empty((H, D), dtype=(a.r_s_bias if segments else r_w_bias).dtype, device=device),
                 DSEG=torch.empty((2, H, D), dtype=(a.seg_embed if segments else r_w_bias).dtype, device=device))
    # per (batch row, head, chunk of rows) sums, then per head their sum over batch rows and chunks
    # (one program per head summing every batch row was the backward's fourth-slowest kernel; one per
    # batch row and head 5% of the fwd+bwd at 1x16 8192: bench/NOTES.md)
    n_shares = B * H * static["finish"]["n_chunks"]
    sums = torch.empty((n_shares, _operands.FINISH_PARTS.value, static["finish"]["BLOCK_D"]), dtype=torch.float32,
                       device=device)
    _run("finish", (static["finish"]["n_convert"] + n_shares,), static,
         dict(DKR=grads["DKR"], DKR_SUMS=dkr_sums, PART=part, PARTK=part_k, G=g_diff, ROWS=rows, Q=q,
              Q_G=a.q_g if a.q_g is not None else q, SUMS=sums,
              n_m_used=_tile_count(static, dq_role, deterministic, q_tiles, "BLOCK_M", M, sz["n_m_tiles"]),
              n_n_used=n_kv_tiles), False)
    _run("heads", (H,), static, dict({n: grads[n] for n in ("DRW", "DRR", "DRS", "DSEG")}, SUMS=sums, Q=q,
                                     RS=a.r_s_bias if segments else r_w_bias, SEGD=seg_delta), False)
    return dq, dk, dv, grads["DKR"], grads["DRW"], grads["DRR"], grads["DRS"], grads["DSEG"]


def dropout_mask(seed, B: int, H: int, M: int, K: int, dropout_p: float, device,
                 block: int | None = None, record=None) -> torch.Tensor:
    """The keep mask (B, H, M, K) bool that the kernels apply with ``seed`` (an int below 2**48, or the
    op's seed tensor) and ``dropout_p`` to query row m and key k: for tests and debugging. The kernels draw it by launch row (the rows sorted by
    position, ``ROWS``); ``record``: the op's validated arguments of the call
    (``xlnet_fast.attention.args.validate``) to get it by the caller's rows instead. ``block``: the
    tile it is drawn with (16 or a multiple of 32; the mask does not depend on it)."""
    keep = torch.empty((B * H, M, K), dtype=torch.uint8, device=device)
    tile = block or (16 if INTERPRETED else 64)
    seed = torch.as_tensor(seed, dtype=torch.int64).to(device)
    with _device_guard(keep.device):
        _k._dropout_mask_kernel[(triton.cdiv(M, tile), triton.cdiv(K, tile), B * H)](
            keep, seed, dropout_threshold(dropout_p), M, K, BLOCK_M=tile, BLOCK_N=tile)
    keep = keep.view(B, H, M, K).bool()
    if record is not None:
        caller = _tables(record, B, M, K, device)[0][..., ROW_SRC].long()  # (B, M)
        keep = torch.empty_like(keep).scatter_(2, caller[:, None, :, None].expand(B, H, M, K), keep)
    return keep
