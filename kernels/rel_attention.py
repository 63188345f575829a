"""Fused XLNet relative attention in Triton: forward and backward (FlashAttention-2 scheme).

Per (query tile, key tile) the score tile is built in registers and never written out
(docs/DESIGN.md §2 and §5):

* content term ``(q + r_w_bias) . k`` — one ``tl.dot``;
* relative term ``bd[i, j] = (q_i + r_r_bias) . k_r[qlen + j - p_i]`` — the shift is done on the fly.
  ``raw = q_r @ k_r[w0 : w0 + 2*BLOCK_N]^T`` is the product with a *window* of k_r rows; row i of the
  tile reads ``raw[i, qlen + j - p_i - w0]``. Flattened row-major, that is the element at
  ``i * 2*BLOCK_N + (qlen + j - p_i - w0)``: the original reshape ``rel_shift`` as an index identity.
  One 1-D ``tl.gather`` on the flattened window reads it through shared memory straight into the
  accumulator's layout (a 2-D gather along rows would be re-laid out through shared memory and back).
  The window is flattened in an order that spreads its rows over the banks (``_flatten_window``).
  With 16-bit inputs the window is rounded to bf16 first (``_skew_window``): bd is the bf16 value
  of its fp32 product, as transformers' products under autocast;
* segment term — two per-row scalars ``(q + r_s_bias) . seg_embed[0/1]`` picked by segment equality;
* masks — ranks (``k_rank[j] < q_rank[i]``, or the row's own key when its self bit is set), a dense
  bool tile, padding rows (negative position), k_r rows past the end ("uni"). The forward runs the
  leading key tiles that every real row of its query tile sees (``ROW_FREE``: XLNet's memory keys, a
  causal tile's past) in a loop without the rank test where the launcher says it pays (``FREE_TILES``).

Banded tiles. The launcher orders the query rows by position (``ROWS`` maps tile rows to the caller's
rows; see ``ROW_GROUP``), so a tile's positions usually span fewer than BLOCK_M values (always for the content
stream and for two-stream launches, where every position has a content row). Then, with the window
anchored at the tile's last position ``p_hi`` (``w0 = qlen + n0 - p_hi``), the gather index
``(j - n0) + (p_hi - p_i)`` is the same for every key tile, and consecutive key tiles' windows overlap
by BLOCK_N rows: each key tile multiplies only the new half and carries the previous one (3 dots per
tile instead of FlashAttention's 2). Tiles spanning more positions (sparse query-stream rows) take the
general path: windows of 2*BLOCK_N k_r rows until the tile's span is covered.

Softmax is online in base 2 with fp32 statistics; ``scale * log2(e)`` is folded into the query
operands. Attention dropout draws 16 keep/drop decisions per Philox4x32-7 call (one byte each,
compared with ``round(256 p)``, as FlashAttention-2) for the two rows and eight columns one thread of
the MMA accumulator holds (``_dropout_keep``), by launch row, regenerated in backward.
Backward: ``delta = rowsum(dO * O)``, one kernel per key tile (dK, dV) and one per query tile (dQ,
dk_r by fp32 atomics — one BLOCK_N-row tile per key tile thanks to the same carry — and the
per-tile sums that give the bias and seg_embed gradients). The segment gradient needs each row's
dS summed over the keys of another segment: dK/dV sums its dS tile per segment code on the tensor
cores, against a one-hot of its key tile's codes, in key tiles of 64 or more (the launcher ranks
segment ids into dense codes; a batch row with more than 15 ids gets the rest from a second,
mostly idle, launch: ``FIX_UP``).
``deterministic=True`` replaces the dk_r atomics by a kernel that owns a tile of k_r rows. Where
the launcher keeps dS (``STORED_DS_BYTES``), the dK/dV kernel stores it and the dQ and dk_r
kernels read it instead of recomputing the scores.
Tiles come through pointers, or with ``TMA`` (the launcher's choice: Hopper, aligned
tensors) through tensor descriptors built per program (``_row_source``): the forward's k, v, k_r,
the dQ kernel's k, k_r and stored dS, and its dk_r sums as TMA reductions (``TMA_REDUCE``).
"""

from __future__ import annotations

import contextlib
from typing import NamedTuple

import triton
import triton.language as tl

from . import contract

# The values the launcher shares (contract.py, where the table fields are described) as constexprs.
LOG2E = tl.constexpr(contract.LOG2E)
INT32_MIN = tl.constexpr(contract.INT32_MIN)
INT32_MAX = tl.constexpr(contract.INT32_MAX)
MASK_DENSE = tl.constexpr(contract.MASK_DENSE)
ROW_FIELDS = tl.constexpr(contract.ROW_FIELDS)
ROW_CODE = tl.constexpr(contract.ROW_CODE)
ROW_SEG = tl.constexpr(contract.ROW_SEG)
ROW_RANK = tl.constexpr(contract.ROW_RANK)
ROW_SRC = tl.constexpr(contract.ROW_SRC)
ROW_FREE = tl.constexpr(contract.ROW_FREE)
ROW_POS_SHIFT = tl.constexpr(contract.ROW_POS_SHIFT)
ROW_OWN_KEY = tl.constexpr(contract.ROW_OWN_KEY)
KEY_PAD = tl.constexpr(contract.KEY_PAD)
KEY_FIELDS = tl.constexpr(contract.KEY_FIELDS)
KEY_SEG = tl.constexpr(contract.KEY_SEG)
KEY_RANK = tl.constexpr(contract.KEY_RANK)
KEY_SEG_MASK = tl.constexpr(contract.KEY_SEG_MASK)
E_FIELDS = tl.constexpr(contract.E_FIELDS)
E_SAME = tl.constexpr(contract.E_SAME)
E_DELTA = tl.constexpr(contract.E_DELTA)
# Column sums that give the bias gradients, per (b*h, tile) in (B*H, tiles, BLOCK_D) tables: the dQ
# kernel's of dq (PART; r_w_bias and r_r_bias both shift q), the dK/dV kernel's of dS K (PARTK; the
# r_w_bias part alone).
# Ones that multiply dS^T into its column sums on the tensor cores (the narrowest MMA width).
COLSUM_WIDTH = tl.constexpr(16)
# Segments (the launcher's dense codes per batch row): dK/dV sums a dS tile per code on the tensor
# cores, times a one-hot (BLOCK_N, SEG_COLUMNS) of its key tile's codes below SEG_CODES and a last
# column of ones (the row totals); rows of larger codes get their same-code sums from a second
# launch of the kernel (FIX_UP), whose programs do nothing unless their key tile has such codes.
SEG_CODES = tl.constexpr(15)
SEG_COLUMNS = tl.constexpr(16)
# Key tiles narrower than this compare per score instead (measured: bench/NOTES.md, 2026-11-25).
SEG_PRODUCT_KEYS = tl.constexpr(64)
# Dropout: Philox4x32 rounds (FlashAttention-2's), and the column group whose four calls per pair of
# rows (m, m + 8) give its 64 decisions (one call: 16 bytes, both rows, the 8 columns of one MMA lane).
PHILOX_ROUNDS = tl.constexpr(7)
DROPOUT_GROUP = tl.constexpr(32)


# --------------------------------------------------------------------------------------------------
# Shared pieces
# --------------------------------------------------------------------------------------------------


class QueryTile(NamedTuple):
    """A query tile's rows (in the launcher's order): ``(BLOCK_M,)`` metadata and the
    ``(BLOCK_M, BLOCK_D)`` query operands."""

    pos: tl.tensor  # position; a padding row repeats the last real one
    row_ok: tl.tensor  # a real row
    seg: tl.tensor  # segment code (the row index without segments: never read)
    rank: tl.tensor  # permutation rank; INT32_MIN on padding rows (they see nothing)
    own_col: tl.tensor  # the key column the row also sees (its own key), or -1
    src_row: tl.tensor  # the caller's row
    q_w: tl.tensor  # (q + r_w_bias) * qk_scale, the dot dtype
    q_r: tl.tensor  # (q + r_r_bias) * qk_scale
    e_delta: tl.tensor  # segment score difference, other minus same segment (0 without segments)


@triton.jit
def _query_tile(QW, QR, E, rows_base, bh_rows, rows, offs_d, M, N_KEYS, qlen,
                HEAD_DIM: tl.constexpr, SEGMENTS: tl.constexpr):
    """The ``QueryTile`` of launch rows ``rows``, read from the ROWS table and the operands the
    launcher prepared (biases and ``qk_scale`` folded in). ``bh_rows`` = (b * H + h) * M."""
    row_in = rows < M
    meta = rows_base + rows * ROW_FIELDS
    code = tl.load(meta + ROW_CODE, mask=row_in, other=0)
    src_row = tl.load(meta + ROW_SRC, mask=row_in, other=0)
    rank_q = tl.load(meta + ROW_RANK, mask=row_in, other=INT32_MIN)
    row_ok = row_in & (rank_q != INT32_MIN)
    pos = code >> ROW_POS_SHIFT
    own_col = tl.where((code & ROW_OWN_KEY) == ROW_OWN_KEY, N_KEYS - qlen + pos, -1)
    tile = (bh_rows + rows)[:, None] * HEAD_DIM + offs_d[None, :]
    in_tile = row_in[:, None] & (offs_d < HEAD_DIM)[None, :]
    q_w = tl.load(QW + tile, mask=in_tile, other=0.0)
    q_r = tl.load(QR + tile, mask=in_tile, other=0.0)
    if SEGMENTS:
        seg_q = tl.load(meta + ROW_SEG, mask=row_in, other=0)
        e_delta = tl.load(E + (bh_rows + rows) * E_FIELDS + E_DELTA, mask=row_in, other=0.0)
    else:
        seg_q = rows
        e_delta = tl.zeros(rows.shape, tl.float32)
    return QueryTile(pos, row_ok, seg_q, rank_q, own_col, src_row, q_w, q_r, e_delta)


# Skew windows go through shared memory: tl.gather stores its source there in flat order, and reads
# it back per element. Stored row after row, a window's rows are a multiple of 128 B apart, so the
# rows one warp stores at once (an MMA accumulator's lane quad holds 8 consecutive columns of a
# row; a warp, 8 rows) all fall in the same banks: 4-way conflicts for fp32, 8-way for 16-bit. The
# windows are flattened instead as (row // G, column // 8, row % G, column % 8): G rows' groups of 8
# columns side by side, G rows of 8 columns making 128 bytes: G = 4 for fp32 (WINDOW_ROWS), 8 for
# 16-bit elements (HALF_WINDOW_ROWS). A warp's stores and its skewed reads of 8 rows then fall in
# distinct banks (bench/NOTES.md, kernel v4; 16-bit windows in 4-row groups conflicted 2-way). That
# is for windows of MMA results. A tile loaded from memory (the stored dS) comes in a layout where a
# thread holds 8 consecutive columns of a row and 8 threads a row's 64: row-major, its 16-byte stores and the dQ
# kernel's gather (along a row's columns) are conflict-free; in the order above both went 4-way
# (bench/NOTES.md, kernel v4 step 3).
WINDOW_ROWS = tl.constexpr(4)
HALF_WINDOW_ROWS = tl.constexpr(8)
WINDOW_COLS = tl.constexpr(8)
WINDOW_SHIFT = tl.constexpr(3)  # log2(WINDOW_COLS)


@triton.jit
def _flatten_window(window, ROWS: tl.constexpr, COLS: tl.constexpr, HALF: tl.constexpr = False):
    """A (ROWS, COLS) window as the 1-D tensor ``_window_index`` addresses: groups of WINDOW_ROWS
    rows, of HALF_WINDOW_ROWS for 16-bit elements (HALF)."""
    GROUP_ROWS: tl.constexpr = HALF_WINDOW_ROWS if HALF else WINDOW_ROWS
    grouped = tl.reshape(window, [ROWS // GROUP_ROWS, GROUP_ROWS, COLS // WINDOW_COLS, WINDOW_COLS])
    return tl.reshape(tl.permute(grouped, (0, 2, 1, 3)), [ROWS * COLS])


@triton.jit
def _window_row(row, COLS: tl.constexpr, HALF: tl.constexpr):
    """Where row ``row`` of a window of COLS columns starts in ``_flatten_window``'s order."""
    GROUP_ROWS: tl.constexpr = HALF_WINDOW_ROWS if HALF else WINDOW_ROWS
    return (row // GROUP_ROWS) * (GROUP_ROWS * COLS) + (row % GROUP_ROWS) * WINDOW_COLS


@triton.jit
def _window_col(col, HALF: tl.constexpr):
    """Column ``col >= 0``'s offset from its row's start: one shift and one multiply-add."""
    GROUP_ROWS: tl.constexpr = HALF_WINDOW_ROWS if HALF else WINDOW_ROWS
    return col + (col >> WINDOW_SHIFT) * ((GROUP_ROWS - 1) * WINDOW_COLS)


@triton.jit
def _window_index(row, col, COLS: tl.constexpr, HALF: tl.constexpr = False):
    """Flat index of element (row, col >= 0) of a window of COLS columns flattened by ``_flatten_window``."""
    return _window_row(row, COLS, HALF) + _window_col(col, HALF)


@triton.jit
def _skewed_index(row, col, lag, COLS: tl.constexpr, HALF: tl.constexpr = False):
    """``_window_index(row, col + lag, COLS, HALF)`` for ``col >= 0`` and ``col + lag >= 0``
    (operands broadcast: ``row`` and ``lag`` per window row, ``col`` per column), with the carry out
    of the low column bits made explicit: in a thread's registers ``col % 8`` takes two values, so
    what varies per element folds into the loads' constant offsets."""
    GROUP_ROWS: tl.constexpr = HALF_WINDOW_ROWS if HALF else WINDOW_ROWS
    carry = ((col & (WINDOW_COLS - 1)) + (lag & (WINDOW_COLS - 1))) >> WINDOW_SHIFT
    return ((_window_row(row, COLS, HALF) + _window_col(lag, HALF))
            + (_window_col(col, HALF) + carry * ((GROUP_ROWS - 1) * WINDOW_COLS)))


@triton.jit
def _flatten(window, ROWS: tl.constexpr, COLS: tl.constexpr, ROW_MAJOR: tl.constexpr, HALF: tl.constexpr = False):
    """A (ROWS, COLS) window as a gather's 1-D source: row-major (tiles loaded from memory), else
    in ``_flatten_window``'s order (MMA results; HALF: 16-bit elements)."""
    if ROW_MAJOR:
        return tl.reshape(window, [ROWS * COLS])
    else:
        return _flatten_window(window, ROWS, COLS, HALF)


@triton.jit
def _flat_index(row, col, lag, COLS: tl.constexpr, ROW_MAJOR: tl.constexpr, HALF: tl.constexpr = False):
    """Index of element (row, col + lag) of a window of COLS columns in ``_flatten``'s order."""
    if ROW_MAJOR:
        return row * COLS + col + lag
    else:
        return _skewed_index(row, col, lag, COLS, HALF)


@triton.jit
def _padded_keys(N_KEYS):
    """The KEYS table's row length: N_KEYS rounded up to KEY_PAD."""
    return tl.cdiv(N_KEYS, KEY_PAD) * KEY_PAD


@triton.jit
def _band(pos, rows_base, m0, M, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BD_BF16: tl.constexpr):
    """The tile's first and last positions (rows sorted by position, groups of 8 keeping their first
    and last, padding rows repeating the last real one: two scalar loads), whether banded, the loop-invariant
    flat gather index of a banded tile: row i, key column jj reads window column
    ``jj + (p_hi - p_i)`` of a (BLOCK_M, 2*BLOCK_N) window (``BD_BF16``: a 16-bit one, see
    ``_skew_window``). That column stays inside the window when the tile's positions span at most
    BLOCK_N + 1 values: that is what banded means."""
    p_lo = tl.load(rows_base + m0 * ROW_FIELDS + ROW_CODE) >> ROW_POS_SHIFT
    p_hi = tl.load(rows_base + (tl.minimum(m0 + BLOCK_M, M) - 1) * ROW_FIELDS + ROW_CODE) >> ROW_POS_SHIFT
    banded = p_hi - p_lo <= BLOCK_N
    # rows past M (masked) may have any position: keep their index in range
    lag = tl.minimum(tl.maximum(p_hi - pos, 0), BLOCK_N)
    flat_idx = _skewed_index(tl.arange(0, BLOCK_M)[:, None], tl.arange(0, BLOCK_N)[None, :], lag[:, None], 2 * BLOCK_N,
                             BD_BF16)
    return p_hi, p_lo, banded, lag, flat_idx


@triton.jit
def _load_rows(base, stride_row, first, n_rows, offs_d, ROWS: tl.constexpr, HEAD_DIM: tl.constexpr):
    """Rows ``first .. first + ROWS`` of a (n_rows, D) matrix (zeros outside [0, n_rows))."""
    r = first + tl.arange(0, ROWS)
    ok = (r >= 0) & (r < n_rows)
    # in-row offsets are int32: the launcher keeps (rows * row stride) below 2**31
    return tl.load(base + r[:, None] * stride_row + offs_d[None, :],
                   mask=ok[:, None] & (offs_d < HEAD_DIM)[None, :], other=0.0)


@triton.jit
def _row_source(base, n_rows, stride_row, ROWS: tl.constexpr, BLOCK_D: tl.constexpr, HEAD_DIM: tl.constexpr,
                TMA: tl.constexpr):
    """What ``_rows`` reads tiles of ROWS rows of a (n_rows, HEAD_DIM) matrix from: with TMA a
    tensor descriptor (the copy engine fills shared memory, zeros outside the matrix, no address
    arithmetic or registers per element), else the base pointer."""
    if TMA:
        return tl.make_tensor_descriptor(base, shape=[n_rows, HEAD_DIM], strides=[stride_row, 1],
                                         block_shape=[ROWS, BLOCK_D])
    else:
        return base


@triton.jit
def _rows(source, stride_row, first, n_rows, offs_d, ROWS: tl.constexpr, HEAD_DIM: tl.constexpr,
          TMA: tl.constexpr):
    """``_load_rows`` from a ``_row_source``: rows ``first .. first + ROWS`` (zeros outside)."""
    if TMA:
        return source.load([first, 0])
    else:
        return _load_rows(source, stride_row, first, n_rows, offs_d, ROWS, HEAD_DIM)


@triton.jit
def _skew_pair(raw_lo, raw_hi, flat_idx, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BD_BF16: tl.constexpr):
    """bd (BLOCK_M, BLOCK_N) from a window given as two (BLOCK_M, BLOCK_N) halves."""
    window = tl.reshape(tl.permute(tl.join(raw_lo, raw_hi), (0, 2, 1)), [BLOCK_M, 2 * BLOCK_N])
    return _skew_window(window, flat_idx, BLOCK_M, BLOCK_N, BD_BF16)


@triton.jit
def _skew_window(raw, flat_idx, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BD_BF16: tl.constexpr):
    """bd (BLOCK_M, BLOCK_N) fp32 from a (BLOCK_M, 2*BLOCK_N) fp32 window. ``BD_BF16`` (16-bit
    inputs): the window rounded to bf16 first, as transformers' position products are under
    autocast. It goes to shared memory in half the bytes (the skew's stores: sm_90's forward 8 -> 4
    B-eq/score), its reads conflict-free in 8-row groups (bench/NOTES.md, "the position products
    in bf16")."""
    if BD_BF16:
        raw = raw.to(tl.bfloat16)
    flat = _flatten_window(raw, BLOCK_M, 2 * BLOCK_N, BD_BF16)
    return tl.reshape(tl.gather(flat, tl.reshape(flat_idx, [BLOCK_M * BLOCK_N]), axis=0),
                      [BLOCK_M, BLOCK_N]).to(tl.float32)


@triton.jit
def _bd_general(query, kr_base, stride_rr, p_hi, p_lo, n0, qlen, R, offs_d,
                BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr,
                DOT_DTYPE: tl.constexpr, INPUT_PRECISION: tl.constexpr, BD_BF16: tl.constexpr):
    """bd for a tile whose positions span BLOCK_M or more values: windows of 2*BLOCK_N k_r rows
    from ``qlen + n0 - p_hi`` until every row's range is covered."""
    local = tl.arange(0, BLOCK_M)
    jj = tl.arange(0, BLOCK_N)
    bd = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
    c_first = qlen + n0 - p_hi
    c_end = tl.minimum(qlen + n0 + BLOCK_N - p_lo, R)
    for c0 in range(c_first, c_end, 2 * BLOCK_N):
        kr = _load_rows(kr_base, stride_rr, c0, R, offs_d, 2 * BLOCK_N, HEAD_DIM)
        raw = tl.dot(query.q_r, tl.trans(kr.to(DOT_DTYPE)), input_precision=INPUT_PRECISION)
        lag = qlen + n0 - c0 - query.pos  # window column of key column 0, per row (may be negative)
        col = lag[:, None] + jj[None, :]
        inside = (col >= 0) & (col < 2 * BLOCK_N) & query.row_ok[:, None]
        flat_idx = tl.where(inside, _skewed_index(local[:, None], jj[None, :], lag[:, None], 2 * BLOCK_N,
                                                  BD_BF16), 0)
        bd += tl.where(inside, _skew_window(raw, flat_idx, BLOCK_M, BLOCK_N, BD_BF16), 0.0)
    return bd


@triton.jit
def _finish_scores(s, query, keys_base, mask_base, stride_mm, n0, N_KEYS, qlen, R, SEGMENTS: tl.constexpr,
                   MASKING: tl.constexpr, CHECK_R: tl.constexpr, PACKED_KEYS: tl.constexpr,
                   BLOCK_N: tl.constexpr, ALL_VISIBLE: tl.constexpr = False):
    """Add the segment term to ``ac + bd`` (already scaled, log2 domain) and mask: -inf where a key
    is not visible. The segment term's per-row part for same-segment keys is left out: a constant
    per row does not change the softmax (the launcher's lse adds it back). ``PACKED_KEYS``: the
    segment codes read from the rank field's low bits (tables packed: contract.PACKED_KEYS_MAX),
    one vector a tile instead of two; else from KEY_SEG, which holds them in either table. The rank
    field compares as it is: packed, the rows' ranks are codes shifted alike. ``ALL_VISIBLE``: a key
    tile every real row of the tile sees (``_free_tiles_end``): the segment term only."""
    cols = n0 + tl.arange(0, BLOCK_N)
    rank_k = tl.load(keys_base + KEY_RANK * _padded_keys(N_KEYS) + cols)  # dropped where unread
    if SEGMENTS:
        if PACKED_KEYS:  # one vector a tile instead of two (sm_90 forward 64x64w4s2: 30.5 -> 28.2 B-eq/score)
            seg_k = rank_k & KEY_SEG_MASK
        else:
            seg_k = tl.load(keys_base + KEY_SEG * _padded_keys(N_KEYS) + cols)
        s += tl.where(query.seg[:, None] != seg_k[None, :], query.e_delta[:, None], 0.0)
    if ALL_VISIBLE:
        return s
    # ranks are always there: padding rows have rank INT32_MIN, keys past the end INT32_MAX
    # per-row bounds moved to the tile's columns first (once per row): each score then compares its
    # column against them (sm_90's pipelined forward: 24.4 -> 20.4 inst/score against cols == own_col)
    tile_cols = tl.arange(0, BLOCK_N)
    visible = (rank_k[None, :] < query.rank[:, None]) | (tile_cols[None, :] == (query.own_col - n0)[:, None])
    if MASKING == MASK_DENSE:
        blocked = tl.load(mask_base + query.src_row[:, None] * stride_mm + cols[None, :], mask=visible, other=1)
        visible = visible & (blocked == 0)
    if CHECK_R:  # k_r row qlen + col - pos must be < R
        visible = visible & (tile_cols[None, :] < (R - qlen - n0 + query.pos)[:, None])
    return tl.where(visible, s, float("-inf"))


@triton.jit
def _load_seed(SEED, DROPOUT: tl.constexpr):
    """The call's dropout seed: 48 bits (int64) in device memory, drawn there per call, so that a
    CUDA graph that captured the call draws a new one at every replay; 0 without dropout (unread)."""
    if DROPOUT:
        return tl.load(SEED)
    else:
        return 0


@triton.jit
def _philox_bytes(seed, pair0, call0, pid_bh, N_PAIRS: tl.constexpr, N_CALLS: tl.constexpr):
    """(N_PAIRS, N_CALLS, 2, 2, 2, 2) bytes (int32): the Philox4x32-7 output for key 0 and counter
    (call0 + c, pair0 + p, batch * H + head + 2**16 * seed bits 32..47, seed bits 0..31); byte
    u = 8 r + 4 w + 2 b + e (dims r, w, b, e), little-endian over the four words (word 2 r + w, its
    byte 2 b + e). The seed rides in the counter rather than the key: the key schedule stays
    constants (bench/NOTES.md); batch * H + head < 2**16 (CUDA's grid limit, checked at launch)."""
    zero = tl.zeros((N_PAIRS, N_CALLS), tl.uint32)
    c0 = zero + tl.expand_dims((tl.arange(0, N_CALLS) + call0).to(tl.uint32), 0)
    c1 = zero + tl.expand_dims((tl.arange(0, N_PAIRS) + pair0).to(tl.uint32), 1)
    stream = pid_bh.to(tl.uint32) | (((seed >> 32) & 0xFFFF).to(tl.uint32) << 16)
    x0, x1, x2, x3 = tl.philox(0, c0, c1, zero + stream, zero + (seed & 0xFFFFFFFF).to(tl.uint32),
                               n_rounds=PHILOX_ROUNDS)
    # join(join(a, c), join(b, d)) orders a, b, c, d along two new minor dims
    words = tl.join(tl.join(x0, x2), tl.join(x1, x3))
    return tl.join(tl.join(words & 0xFF, (words >> 16) & 0xFF), tl.join((words >> 8) & 0xFF, words >> 24)).to(tl.int32)


@triton.jit
def _dropout_keep(seed, pid_bh, m_start, n0, keep_threshold, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """Keep mask (BLOCK_M, BLOCK_N) of launch rows ``m_start ..`` and key columns ``n0 ..``: element
    (m, j) keeps when byte ``8 * ((m % 16) // 8) + 2 * ((j % 32) // 8) + j % 2`` of the call at counter
    ``(4 * (j // 32) + (j % 8) // 2, 8 * (m // 16) + m % 8)`` is at least ``keep_threshold`` =
    round(256 p). An MMA accumulator thread holds rows m, m + 8 and columns 8k + 2t + {0, 1} for one
    t: one call gives it both rows of a 32-column group, in its registers where the warps are stacked
    along the rows (wgmma, 64-row tiles); 32-row mma.sync tiles set their warps side by side along
    the keys and get the bytes through shared memory (bench/NOTES.md, kernel v3 change 8)."""
    tl.static_assert(BLOCK_M % 16 == 0)
    N_PAIRS: tl.constexpr = BLOCK_M // 2
    if BLOCK_N >= DROPOUT_GROUP:
        N_CALLS: tl.constexpr = BLOCK_N // 8
        b = _philox_bytes(seed, m_start // 2, (n0 // DROPOUT_GROUP) * 4, pid_bh, N_PAIRS, N_CALLS)
        # (a, i, g, t, r, k_hi, k_lo, e) -> (a, r, i, g, k_hi, k_lo, t, e): row 16 a + 8 r + i,
        # column 32 g + 8 (2 k_hi + k_lo) + 2 t + e
        b = tl.reshape(b, (BLOCK_M // 16, 8, BLOCK_N // DROPOUT_GROUP, 4, 2, 2, 2, 2))
        b = tl.permute(b, (0, 4, 1, 2, 5, 6, 3, 7))
        return tl.reshape(b, (BLOCK_M, BLOCK_N)) >= keep_threshold
    else:
        # narrow (interpreter) tiles: draw the tile's 32-column group and keep its half
        b = _philox_bytes(seed, m_start // 2, (n0 // DROPOUT_GROUP) * 4, pid_bh, N_PAIRS, 4)
        b = tl.permute(tl.reshape(b, (BLOCK_M // 16, 8, 4, 2, 2, 2, 2)), (0, 3, 1, 5, 2, 6, 4))
        lo, hi = tl.split(tl.reshape(b, (BLOCK_M, BLOCK_N, 2)))
        b = tl.where((n0 // BLOCK_N) % 2 == 1, hi, lo)
        return b >= keep_threshold


@triton.jit
def _softmax_step(s, m_i, l_i):
    """Online softmax in base 2: probabilities of this tile, the rescale of the running sums, and
    the new row max and sum. Rows that have seen no visible key keep m = -inf and p = 0."""
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp2(m_i - m_safe)
    prob = tl.exp2(s - m_safe[:, None])
    return prob, alpha, m_new, l_i * alpha + tl.sum(prob, axis=1)


# --------------------------------------------------------------------------------------------------
# Forward
# --------------------------------------------------------------------------------------------------


@triton.jit
def _attend(s, acc, m_i, l_i, v_src, stride_vn, n0, N_KEYS, offs_d, seed, pid_bh, m_start, keep_threshold,
            DROPOUT: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
            DOT_DTYPE: tl.constexpr, INPUT_PRECISION: tl.constexpr, TMA: tl.constexpr):
    """One key tile of the forward after its scores: online softmax, dropout, acc += P V (the kept
    probabilities unscaled: the kernel scales the output by 1 / (1 - rate) once)."""
    prob, alpha, m_i, l_i = _softmax_step(s, m_i, l_i)
    if DROPOUT:
        keep = _dropout_keep(seed, pid_bh, m_start, n0, keep_threshold, BLOCK_M, BLOCK_N)
        prob = tl.where(keep, prob, 0.0)
    v = _rows(v_src, stride_vn, n0, N_KEYS, offs_d, BLOCK_N, HEAD_DIM, TMA)
    acc = acc * alpha[:, None] + tl.dot(prob.to(DOT_DTYPE), v.to(DOT_DTYPE), input_precision=INPUT_PRECISION)
    return acc, m_i, l_i


@triton.jit
def _free_tiles_end(rows_base, rows, row_ok, N_KEYS, MASKING: tl.constexpr, CHECK_R: tl.constexpr,
                    FREE_TILES: tl.constexpr, BLOCK_N: tl.constexpr):
    """The end of the leading whole key tiles that every real row of the tile sees (the least of
    their ROW_FREE counts, rounded down to BLOCK_N): the forward runs them without the visibility
    test, as FlashAttention masks only its diagonal tiles (XLNet's memory keys: 384 of 896 at the
    pretraining shape; a causal tile's keys before its first row; all but the last without rank masks).
    0 (one loop, every tile tested) with a dense mask, k_r rows to check, or not FREE_TILES (launcher's)."""
    if not FREE_TILES or MASKING == MASK_DENSE or CHECK_R:
        return 0
    free = tl.load(rows_base + rows * ROW_FIELDS + ROW_FREE, mask=row_ok, other=INT32_MAX)
    return tl.minimum(tl.min(free, axis=0), N_KEYS) // BLOCK_N * BLOCK_N


@triton.jit
def _fwd_key_tiles(acc, m_i, l_i, raw_lo, query, q_r, k_src, kr_src, v_src, stride_kn, stride_rr, stride_vn, kr_base,
                   keys_base, mask_base, stride_mm, lo, hi, p_hi, p_lo, flat_idx, N_KEYS, qlen, R, offs_d,
                   seed, pid_bh, m_start, keep_threshold,
                   BANDED: tl.constexpr, ALL_VISIBLE: tl.constexpr, SEGMENTS: tl.constexpr, MASKING: tl.constexpr,
                   CHECK_R: tl.constexpr, PACKED_KEYS: tl.constexpr, DROPOUT: tl.constexpr,
                   HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, DOT_DTYPE: tl.constexpr,
                   INPUT_PRECISION: tl.constexpr, TMA: tl.constexpr, BD_BF16: tl.constexpr):
    """The forward's key tiles ``lo .. hi`` (multiples of BLOCK_N): scores, then ``_attend``.
    ``BANDED``: bd from the window of the carried lower half ``raw_lo`` (returned for the next tiles)
    and a new upper half; else from ``_bd_general``. ``ALL_VISIBLE``: tiles every real row sees."""
    for n0 in range(lo, hi, BLOCK_N):
        k = _rows(k_src, stride_kn, n0, N_KEYS, offs_d, BLOCK_N, HEAD_DIM, TMA)
        if BANDED:
            kr_hi = _rows(kr_src, stride_rr, qlen + n0 - p_hi + BLOCK_N, R, offs_d, BLOCK_N, HEAD_DIM, TMA)
            raw_hi = tl.dot(q_r, tl.trans(kr_hi.to(DOT_DTYPE)), input_precision=INPUT_PRECISION)
            bd = _skew_pair(raw_lo, raw_hi, flat_idx, BLOCK_M, BLOCK_N, BD_BF16)
            raw_lo = raw_hi
        else:
            bd = _bd_general(query, kr_base, stride_rr, p_hi, p_lo, n0, qlen, R, offs_d,
                             BLOCK_M, BLOCK_N, HEAD_DIM, DOT_DTYPE, INPUT_PRECISION, BD_BF16)
        # the content term accumulates onto the relative one: the window is dead by then
        s = tl.dot(query.q_w, tl.trans(k.to(DOT_DTYPE)), bd, input_precision=INPUT_PRECISION)
        s = _finish_scores(s, query, keys_base, mask_base, stride_mm, n0, N_KEYS, qlen, R, SEGMENTS, MASKING,
                           CHECK_R, PACKED_KEYS, BLOCK_N, ALL_VISIBLE)
        acc, m_i, l_i = _attend(s, acc, m_i, l_i, v_src, stride_vn, n0, N_KEYS, offs_d, seed, pid_bh, m_start,
                                keep_threshold, DROPOUT, HEAD_DIM, BLOCK_M, BLOCK_N, DOT_DTYPE, INPUT_PRECISION, TMA)
    return acc, m_i, l_i, raw_lo


@triton.jit
def _fwd_kernel(
    QW, QR, E, ROWS, K, V, KR, KEYS, MASK, OUT, LSE,
    stride_kb, stride_kn, stride_kh, stride_vb, stride_vn, stride_vh, stride_rb, stride_rr, stride_rh,
    stride_mb, stride_mm, stride_ob, stride_om, stride_oh,
    H, M, N_KEYS, R, qlen, qk_scale, SEED, keep_threshold, keep_scale,
    SEGMENTS: tl.constexpr, MASKING: tl.constexpr, BANDED_ONLY: tl.constexpr, CHECK_R: tl.constexpr,
    PACKED_KEYS: tl.constexpr, FREE_TILES: tl.constexpr,
    DROPOUT: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr, DOT_DTYPE: tl.constexpr, INPUT_PRECISION: tl.constexpr, NUM_WARPS: tl.constexpr,
    TMA: tl.constexpr = False, Q_R_REGISTERS: tl.constexpr = False,
):
    """One query tile of one (batch row, head): OUT (B, M, H, D) at the caller's rows, scaled by
    ``keep_scale`` (dropout's 1 / (1 - rate)), and LSE (B, H, M) the natural-log log-sum-exp of the
    scaled scores (+inf on a row with no visible key). Rows in the launcher's order (ROWS)."""
    pid_m = tl.program_id(0)
    pid_bh = tl.program_id(1)
    b = (pid_bh // H).to(tl.int64)
    h = pid_bh % H
    # base pointers of this (batch row, head), offset once
    bh_rows = pid_bh.to(tl.int64) * M
    rows_base = ROWS + b * M * ROW_FIELDS
    k_base = K + b * stride_kb + h * stride_kh
    v_base = V + b * stride_vb + h * stride_vh
    kr_base = KR + b * stride_rb + h * stride_rh
    keys_base = KEYS + b * _padded_keys(N_KEYS) * KEY_FIELDS
    mask_base = MASK + b * stride_mb
    offs_d = tl.arange(0, BLOCK_D)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    seed = _load_seed(SEED, DROPOUT)
    BD_BF16: tl.constexpr = KR.dtype.element_ty != tl.float32  # 16-bit inputs: bd rounded to bf16 (_skew_window)
    k_src = _row_source(k_base, N_KEYS, stride_kn, BLOCK_N, BLOCK_D, HEAD_DIM, TMA)
    v_src = _row_source(v_base, N_KEYS, stride_vn, BLOCK_N, BLOCK_D, HEAD_DIM, TMA)
    kr_src = _row_source(kr_base, R, stride_rr, BLOCK_N, BLOCK_D, HEAD_DIM, TMA)

    # 1. query side: the launcher's operands (bias and scale folded in), per-row metadata
    query = _query_tile(
        QW, QR, E, rows_base, bh_rows, rows, offs_d, M, N_KEYS, qlen, HEAD_DIM, SEGMENTS)
    p_hi, p_lo, banded, lag, flat_idx = _band(query.pos, rows_base, pid_m * BLOCK_M, M, BLOCK_M, BLOCK_N, BD_BF16)
    if BANDED_ONLY:  # a tile spans at most BLOCK_M positions: banded when that fits the window
        if BLOCK_M <= BLOCK_N:
            banded = True
    q_r = query.q_r
    if Q_R_REGISTERS:
        # the position product's q_r from registers (wgmma's A operand there): triton leaves an operand
        # loaded from memory in shared memory and reads it again at every product (2 B-eq/score); a
        # value computed in registers it uses from there. The multiply by a runtime 1 (exact) is that value.
        q_r = (q_r.to(tl.float32) * (keep_scale / keep_scale)).to(DOT_DTYPE)

    m_i = tl.full((BLOCK_M,), float("-inf"), tl.float32)
    l_i = tl.zeros((BLOCK_M,), tl.float32)
    acc = tl.zeros((BLOCK_M, BLOCK_D), tl.float32)
    # the key tiles before free_end every real row of the tile sees: no visibility test there
    free_end = _free_tiles_end(rows_base, rows, query.row_ok, N_KEYS, MASKING, CHECK_R, FREE_TILES, BLOCK_N)
    if banded:
        # 2. banded tiles: carry the lower half of each k_r window to the next key tile
        kr_lo = _rows(kr_src, stride_rr, qlen - p_hi, R, offs_d, BLOCK_N, HEAD_DIM, TMA)
        raw_lo = tl.dot(q_r, tl.trans(kr_lo.to(DOT_DTYPE)), input_precision=INPUT_PRECISION)
        acc, m_i, l_i, raw_lo = _fwd_key_tiles(
            acc, m_i, l_i, raw_lo, query, q_r, k_src, kr_src, v_src, stride_kn, stride_rr, stride_vn, kr_base,
            keys_base, mask_base, stride_mm, 0, free_end, p_hi, p_lo, flat_idx, N_KEYS, qlen, R, offs_d,
            seed, pid_bh, pid_m * BLOCK_M, keep_threshold, True, True, SEGMENTS, MASKING, CHECK_R,
            PACKED_KEYS, DROPOUT, HEAD_DIM, BLOCK_M, BLOCK_N, DOT_DTYPE, INPUT_PRECISION, TMA, BD_BF16)
        acc, m_i, l_i, raw_lo = _fwd_key_tiles(
            acc, m_i, l_i, raw_lo, query, q_r, k_src, kr_src, v_src, stride_kn, stride_rr, stride_vn, kr_base,
            keys_base, mask_base, stride_mm, free_end, N_KEYS, p_hi, p_lo, flat_idx, N_KEYS, qlen, R, offs_d,
            seed, pid_bh, pid_m * BLOCK_M, keep_threshold, True, False, SEGMENTS, MASKING, CHECK_R,
            PACKED_KEYS, DROPOUT, HEAD_DIM, BLOCK_M, BLOCK_N, DOT_DTYPE, INPUT_PRECISION, TMA, BD_BF16)
    else:
        # 2'. tiles spanning many positions: as many k_r windows as the span needs
        raw_lo = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)  # no window carried on this path (unread)
        acc, m_i, l_i, raw_lo = _fwd_key_tiles(
            acc, m_i, l_i, raw_lo, query, q_r, k_src, kr_src, v_src, stride_kn, stride_rr, stride_vn, kr_base,
            keys_base, mask_base, stride_mm, 0, free_end, p_hi, p_lo, flat_idx, N_KEYS, qlen, R, offs_d,
            seed, pid_bh, pid_m * BLOCK_M, keep_threshold, False, True, SEGMENTS, MASKING, CHECK_R,
            PACKED_KEYS, DROPOUT, HEAD_DIM, BLOCK_M, BLOCK_N, DOT_DTYPE, INPUT_PRECISION, TMA, BD_BF16)
        acc, m_i, l_i, raw_lo = _fwd_key_tiles(
            acc, m_i, l_i, raw_lo, query, q_r, k_src, kr_src, v_src, stride_kn, stride_rr, stride_vn, kr_base,
            keys_base, mask_base, stride_mm, free_end, N_KEYS, p_hi, p_lo, flat_idx, N_KEYS, qlen, R, offs_d,
            seed, pid_bh, pid_m * BLOCK_M, keep_threshold, False, False, SEGMENTS, MASKING, CHECK_R,
            PACKED_KEYS, DROPOUT, HEAD_DIM, BLOCK_M, BLOCK_N, DOT_DTYPE, INPUT_PRECISION, TMA, BD_BF16)

    # 3. normalise; write the rows back to the caller's order (padding rows, which may have summed
    # the tiles every real row sees, see nothing: zeros, lse +inf)
    has_key = (l_i > 0) & query.row_ok
    out = tl.where(has_key[:, None], acc * (keep_scale / tl.where(has_key, l_i, 1.0))[:, None], 0.0)
    out_ptrs = OUT + b * stride_ob + h * stride_oh + query.src_row[:, None].to(tl.int64) * stride_om + offs_d[None, :]
    tl.store(out_ptrs, out.to(OUT.dtype.element_ty), mask=(rows < M)[:, None] & (offs_d < HEAD_DIM)[None, :])
    # natural-log lse of the scaled scores; +inf marks a row with no visible key
    # (the scores left out the same-segment term e_same: a per-row constant, added back here)
    lse2 = m_i + tl.log2(tl.where(has_key, l_i, 1.0))
    if SEGMENTS:
        lse2 += tl.load(E + (bh_rows + rows) * E_FIELDS + E_SAME, mask=rows < M, other=0.0)
    lse = tl.where(has_key, lse2 / LOG2E, float("inf"))
    tl.store(LSE + pid_bh.to(tl.int64) * M + query.src_row, lse, mask=rows < M)


# --------------------------------------------------------------------------------------------------
# Backward
# --------------------------------------------------------------------------------------------------


@triton.jit
def _grad_tile(s, lse2, delta, do, v, seed, pid_bh, m_start, n0, keep_threshold,
               DROPOUT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, DOT_DTYPE: tl.constexpr,
               INPUT_PRECISION: tl.constexpr, KEEP_IN_SIGN: tl.constexpr):
    """From a recomputed score tile (log2 domain): the (dropped) probabilities that multiplied V,
    and dS = P * (dP - delta) with respect to the natural-log scores, unscaled. ``KEEP_IN_SIGN``
    (the dK/dV kernel, which uses both): with dropout the keep mask rides in the sign of P across
    the dP product, one fp32 tile live instead of P and the mask; dQ and dk_r use dS alone and
    keep the plain form, where the sign costs instructions."""
    prob = tl.exp2(s - lse2[:, None])  # lse2 = +inf on rows with no visible key -> 0
    if DROPOUT and KEEP_IN_SIGN:
        keep = _dropout_keep(seed, pid_bh, m_start, n0, keep_threshold, BLOCK_M, BLOCK_N)
        signed = tl.where(keep, prob, -prob)  # P >= 0: the sign is the mask
        dp = tl.dot(do, tl.trans(v.to(DOT_DTYPE)), input_precision=INPUT_PRECISION)
        prob_d = tl.maximum(signed, 0.0)
        # kept: dS = P (dP - delta); dropped: dP = 0, dS = -P delta
        return prob_d, prob_d * dp - tl.abs(signed) * delta[:, None]
    elif DROPOUT:
        dp = tl.dot(do, tl.trans(v.to(DOT_DTYPE)), input_precision=INPUT_PRECISION)
        keep = _dropout_keep(seed, pid_bh, m_start, n0, keep_threshold, BLOCK_M, BLOCK_N)
        return tl.where(keep, prob, 0.0), prob * (tl.where(keep, dp, 0.0) - delta[:, None])
    else:
        dp = tl.dot(do, tl.trans(v.to(DOT_DTYPE)), input_precision=INPUT_PRECISION)
        return prob, prob * (dp - delta[:, None])


COLUMN_NUMBERS = tl.constexpr(128)  # the length of ``_tile_columns``' table: the largest BLOCK_N


@triton.jit
def _tile_columns(COLUMNS, LOADED: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """Column numbers 0 .. BLOCK_N - 1 for a (BLOCK_M, BLOCK_N) index: ``LOADED``, read from
    COLUMNS (int16 0, 1, ..., COLUMN_NUMBERS of them) rather than made by ``tl.arange``. The
    layout triton gives a load holds 8 consecutive columns of a row in each thread, and a gather's
    output keeps its index's layout: a gathered tile then goes to shared memory (the next product's
    operand) in 16-byte stores instead of 2-byte ones (sm_90 dQ: 48 -> 44 B-eq/score; bench/NOTES.md).
    Each row reads the same BLOCK_N values: one cache line's worth, once per program."""
    if LOADED:
        tl.static_assert(BLOCK_N <= COLUMN_NUMBERS)
        return tl.load(COLUMNS + (tl.arange(0, BLOCK_N)[None, :] + tl.zeros((BLOCK_M, 1), tl.int32))).to(tl.int32)
    else:
        return tl.arange(0, BLOCK_N)[None, :]


@triton.jit
def _unskew_join(ds_prev, ds, unskew_idx, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                 ROW_MAJOR: tl.constexpr = False):
    """Inverse of the banded skew for the lower half of a key tile's k_r window: ``out[i, c]`` is
    the dS of the key whose k_r row is window row c: ``ds[i, c - lag_i]`` when ``c >= lag_i``, else
    the previous key tile's ``ds_prev[i, BLOCK_N + c - lag_i]`` (its window's upper half is this
    one's lower half). With ``[ds_prev | ds]`` side by side that is flat column
    ``BLOCK_N + c - lag_i`` (``unskew_idx``) of one gather, in ``_flatten``'s order. A recomputed
    dS in 16 bits stays in fp32's 4-row groups here: the gather gives each lane one element, a warp
    32 consecutive columns of a row, and in 8-row groups a row's 8-column groups are 128 bytes apart
    (sm_90's recomputing dQ: 82.5 -> 86.5 B-eq/score; bench/NOTES.md)."""
    window = tl.reshape(tl.permute(tl.join(ds_prev, ds), (0, 2, 1)), [BLOCK_M, 2 * BLOCK_N])
    window = _flatten(window, BLOCK_M, 2 * BLOCK_N, ROW_MAJOR)
    return tl.reshape(tl.gather(window, unskew_idx, axis=0), [BLOCK_M, BLOCK_N])


@triton.jit
def _unskew_rows(ds, pos, row_ok, n0, c0, qlen, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                 N_OUT: tl.constexpr, TRANSPOSED: tl.constexpr = False, ROW_MAJOR: tl.constexpr = False,
                 HALF: tl.constexpr = False):
    """dS (BLOCK_M, BLOCK_N) over keys -> (BLOCK_M, N_OUT) over k_r rows c0 .. c0 + N_OUT:
    ``out[i, c] = dS[i, j]`` for the j with ``qlen + j - p_i = c0 + c`` (0 if none in this tile);
    ``TRANSPOSED``: (N_OUT, BLOCK_M), gathered in that order (a ``tl.trans`` before the next dot
    would end triton's chain of dots there, see ``_bwd_kr_kernel``). ``ROW_MAJOR``, ``HALF``: see ``_flatten``."""
    flat = _flatten(ds, BLOCK_M, BLOCK_N, ROW_MAJOR, HALF)
    lag = c0 - qlen - n0 + pos  # dS column of output column 0, per row (may be negative)
    if TRANSPOSED:  # output rows are k_r rows, its columns the tile's query rows
        out_col, row = tl.arange(0, N_OUT)[:, None], tl.arange(0, BLOCK_M)[None, :]
        lag, row_ok = lag[None, :], row_ok[None, :]
        shape: tl.constexpr = [N_OUT, BLOCK_M]
    else:
        out_col, row = tl.arange(0, N_OUT)[None, :], tl.arange(0, BLOCK_M)[:, None]
        lag, row_ok = lag[:, None], row_ok[:, None]
        shape: tl.constexpr = [BLOCK_M, N_OUT]
    jj = out_col + lag
    inside = (jj >= 0) & (jj < BLOCK_N) & row_ok
    index = tl.where(inside, _flat_index(row, out_col, lag, BLOCK_N, ROW_MAJOR, HALF), 0)
    got = tl.gather(flat, tl.reshape(index, [BLOCK_M * N_OUT]), axis=0)
    return tl.where(inside, tl.reshape(got, shape), 0.0)


@triton.jit
def _bwd_rows(DO, LSE2, DELTA, bh_rows, rows, row_ok, offs_d, M, HEAD_DIM: tl.constexpr):
    """dO rows, the base-2 lse (less the same-segment term the recomputed scores leave out) and
    delta of a query tile, all prepared by the launcher in the tile's row order."""
    row_in = rows < M
    do = tl.load(DO + (bh_rows + rows)[:, None] * HEAD_DIM + offs_d[None, :],
                 mask=row_in[:, None] & (offs_d < HEAD_DIM)[None, :], other=0.0)
    lse2 = tl.load(LSE2 + bh_rows + rows, mask=row_ok, other=float("inf"))
    delta = tl.load(DELTA + bh_rows + rows, mask=row_ok, other=0.0)
    return do, lse2, delta


@triton.jit
def _stored_ds_tile(DS, bh_rows, ds_pitch, rows, n0, M, N_KEYS, BLOCK_N: tl.constexpr):
    """Pointers into DS (B*H, M, ds_pitch) of launch rows ``rows`` and keys ``n0 ..``, and their
    mask. A scalar base per (batch row, head) and int32 offsets: the launcher keeps M * ds_pitch
    below 2**31."""
    cols = n0 + tl.arange(0, BLOCK_N)
    return ((DS + bh_rows * ds_pitch) + (rows[:, None] * ds_pitch + cols[None, :]),
            (rows < M)[:, None] & (cols < N_KEYS)[None, :])


@triton.jit
def _dkr_atomic(dkr_base, stride_row, first, dsc, q_r, offs_d, ROWS: tl.constexpr,
                HEAD_DIM: tl.constexpr, DOT_DTYPE: tl.constexpr, INPUT_PRECISION: tl.constexpr,
                dkr_src=None, TMA_REDUCE: tl.constexpr = False):
    """dk_r[first : first + ROWS] += dsc^T @ q_r (fp32 atomics; with TMA_REDUCE a reduction by the
    copy engine through ``dkr_src``, a descriptor of tiles of ROWS rows). No row mask: the launcher's
    DKR has room for every window past R (``_dkr_buffer``)."""
    part = tl.dot(tl.trans(dsc.to(DOT_DTYPE)), q_r, input_precision=INPUT_PRECISION)
    if TMA_REDUCE:
        dkr_src.atomic_add([first, 0], part)
        return
    # one scalar base per call and int32 offsets: 64-bit pointers per element kept across the key
    # loop would hold two registers each
    in_tile = tl.arange(0, ROWS)[:, None] * stride_row + offs_d[None, :]
    if offs_d.shape[0] == HEAD_DIM:
        tl.atomic_add((dkr_base + first * stride_row) + in_tile, part, sem="relaxed")
    else:
        tl.atomic_add((dkr_base + first * stride_row) + in_tile, part, mask=(offs_d < HEAD_DIM)[None, :],
                      sem="relaxed")


@triton.jit
def _segment_one_hot(seg_k, DOT_DTYPE: tl.constexpr):
    """(BLOCK_N, SEG_COLUMNS) in the dot dtype: column c < SEG_CODES is 1 where the key's segment
    code is c; the last column is all ones."""
    column = tl.arange(0, SEG_COLUMNS)[None, :]
    return ((seg_k[:, None] == column) | (column == SEG_CODES)).to(DOT_DTYPE)


@triton.jit
def _other_segment_sums(ds, seg_q, one_hot, keys_base, cols, N_KEYS, DOT_DTYPE: tl.constexpr,
                        INPUT_PRECISION: tl.constexpr):
    """A dS tile's row sums over its keys of another segment than the row's, except for rows of code
    SEG_CODES or more: the row total (the FIX_UP launch subtracts their same-code sums). Key tiles
    of SEG_PRODUCT_KEYS or more: per code ``ds @ one_hot``, the total less the column of the row's
    own code; narrower ones: compared per score. (Over all keys a row of dS sums to 0: sum_j p_ij
    dP_ij = dO_i . out_i = delta_i; so the same-segment sum is minus the other-segment one.)"""
    if ds.shape[1] >= SEG_PRODUCT_KEYS:
        ds_dot = ds.to(DOT_DTYPE)
        column = tl.arange(0, SEG_COLUMNS)
        # Triton lays the warps of a chain of dots out by the first it places, along the rows when
        # its rows >= its columns: the product takes the score tile's longer side as its own (a
        # (32, 16) product would put a 32x64 tile's 4 warps along 32 rows, each warp's MMAs repeated)
        if ds.shape[0] >= ds.shape[1]:
            per_code = tl.dot(ds_dot, one_hot, input_precision=INPUT_PRECISION)  # (BLOCK_M, SEG_COLUMNS)
            signed = tl.where(column[None, :] == SEG_CODES, per_code,
                              tl.where(column[None, :] == seg_q[:, None], -per_code, 0.0))
            return tl.sum(signed, axis=1)
        else:
            per_code = tl.dot(tl.trans(one_hot), tl.trans(ds_dot), input_precision=INPUT_PRECISION)
            signed = tl.where(column[:, None] == SEG_CODES, per_code,
                              tl.where(column[:, None] == seg_q[None, :], -per_code, 0.0))
            return tl.sum(signed, axis=0)
    else:
        # the codes loaded per query tile: kept through the loop they would hold registers
        seg_k = tl.load(keys_base + KEY_SEG * _padded_keys(N_KEYS) + cols)
        own = tl.where(seg_q < SEG_CODES, seg_q, -1)  # -1: no key's code, the row total
        return tl.sum(tl.where(own[:, None] != seg_k[None, :], ds, 0.0), axis=1)


# M unspecialized: its divisibility by 16 (the content stream's 512 rows) only moved ptxas's register
# allocation, 32 B of spill at sm_90's 64x64w4s2 that the two-stream build (597 rows) has not
@triton.jit(do_not_specialize=["M"])
def _bwd_kv_kernel(
    QW, QR, E, ROWS, K, V, KR, KEYS, MASK, DO, LSE2, DELTA, DK, DV, GP, PARTK, DS,
    stride_kb, stride_kn, stride_kh, stride_vb, stride_vn, stride_vh, stride_rb, stride_rr, stride_rh,
    stride_mb, stride_mm, H, M, N_KEYS, R, qlen, qk_scale, SEED, keep_threshold, n_n_tiles, ds_pitch,
    SEGMENTS: tl.constexpr, MASKING: tl.constexpr, BANDED_ONLY: tl.constexpr, CHECK_R: tl.constexpr,
    PACKED_KEYS: tl.constexpr,
    DROPOUT: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr, DOT_DTYPE: tl.constexpr, INPUT_PRECISION: tl.constexpr, NUM_WARPS: tl.constexpr,
    STORE_DS: tl.constexpr = False, FIX_UP: tl.constexpr = False,
):
    """One key tile: dK and dV over all query tiles (DK/DV are (B, K, H, D) contiguous); in PARTK
    (B*H, n_n_tiles, BLOCK_D) the tile's part of sum_ij dS_ij k_j (the r_w_bias gradient); with
    segments each query row's sum of dS over this tile's keys of another segment, in GP
    (B*H, n_n_tiles, M) at the kernels' row order (the launcher sums over key tiles).
    ``STORE_DS``: every dS tile also to DS (B*H, M, ds_pitch), rows in the kernels' order, for the
    dQ kernel (its ``FROM_DS``).
    ``FIX_UP`` (a second launch, after the first): only GP's rows of segment code SEG_CODES or more,
    less their same-code sums, from the key tiles that hold such codes; the other programs return."""
    pid_n = tl.program_id(0)
    pid_bh = tl.program_id(1)
    b = (pid_bh // H).to(tl.int64)
    h = pid_bh % H
    bh_rows = pid_bh.to(tl.int64) * M
    rows_base = ROWS + b * M * ROW_FIELDS
    kr_base = KR + b * stride_rb + h * stride_rh
    keys_base = KEYS + b * _padded_keys(N_KEYS) * KEY_FIELDS
    mask_base = MASK + b * stride_mb
    offs_d = tl.arange(0, BLOCK_D)
    seed = _load_seed(SEED, DROPOUT)
    BD_BF16: tl.constexpr = KR.dtype.element_ty != tl.float32  # 16-bit inputs: bd rounded to bf16 (_skew_window)
    n0 = pid_n * BLOCK_N
    cols = n0 + tl.arange(0, BLOCK_N)
    k = _load_rows(K + b * stride_kb + h * stride_kh, stride_kn, n0, N_KEYS, offs_d, BLOCK_N, HEAD_DIM).to(DOT_DTYPE)
    v = _load_rows(V + b * stride_vb + h * stride_vh, stride_vn, n0, N_KEYS, offs_d, BLOCK_N, HEAD_DIM)
    dk = tl.zeros((BLOCK_N, BLOCK_D), tl.float32)
    dv = tl.zeros((BLOCK_N, BLOCK_D), tl.float32)
    # column sums of dS (every row, or column, of the product holds them). Triton gives a chain of
    # mma.sync dots the warp layout of the first it places (see _other_segment_sums): oriented
    # (BLOCK_N, 16), the product puts the warps along the score tile's rows, each warp's 16 rows
    # apart, and along its keys as (16, BLOCK_N). Along the keys where the rows are too few: 32-row
    # tiles of 4 warps did every MMA twice (sm_80 32x32w4s1: 83.5 -> 69.1 inst/score); not on
    # 64-key tiles, where on sm_90 the (BLOCK_N, 16) product is a wgmma (32x64w4s1: 48.2 -> 49.5)
    COLSUMS_ALONG_KEYS: tl.constexpr = (BLOCK_M < 16 * NUM_WARPS) and (BLOCK_N < 64)
    if COLSUMS_ALONG_KEYS:
        ones = tl.full((COLSUM_WIDTH, BLOCK_M), 1.0, DOT_DTYPE)
        col_sums = tl.zeros((COLSUM_WIDTH, BLOCK_N), tl.float32)
    else:
        ones = tl.full((BLOCK_M, COLSUM_WIDTH), 1.0, DOT_DTYPE)
        col_sums = tl.zeros((BLOCK_N, COLSUM_WIDTH), tl.float32)
    m_end = M
    if SEGMENTS:
        seg_k = tl.load(keys_base + KEY_SEG * _padded_keys(N_KEYS) + cols)
        if FIX_UP:
            m_end = tl.where(tl.max(seg_k, axis=0) >= SEG_CODES, M, 0)
        one_hot = _segment_one_hot(seg_k, DOT_DTYPE)  # (unused by narrow tiles and FIX_UP: not compiled)
    for m0 in range(0, m_end, BLOCK_M):
        rows = m0 + tl.arange(0, BLOCK_M)
        query = _query_tile(
            QW, QR, E, rows_base, bh_rows, rows, offs_d, M, N_KEYS, qlen, HEAD_DIM, SEGMENTS)
        p_hi, p_lo, banded, lag, flat_idx = _band(query.pos, rows_base, m0, M, BLOCK_M, BLOCK_N, BD_BF16)
        if BANDED_ONLY:
            if BLOCK_M <= BLOCK_N:
                banded = True
        if banded:
            # one window of 2*BLOCK_N k_r rows anchored at the tile's last position
            kr = _load_rows(kr_base, stride_rr, qlen + n0 - p_hi, R, offs_d, 2 * BLOCK_N, HEAD_DIM)
            raw = tl.dot(query.q_r, tl.trans(kr.to(DOT_DTYPE)), input_precision=INPUT_PRECISION)
            bd = _skew_window(raw, flat_idx, BLOCK_M, BLOCK_N, BD_BF16)
        else:
            bd = _bd_general(query, kr_base, stride_rr, p_hi, p_lo, n0, qlen, R, offs_d,
                             BLOCK_M, BLOCK_N, HEAD_DIM, DOT_DTYPE, INPUT_PRECISION, BD_BF16)
        s = tl.dot(query.q_w, tl.trans(k), bd, input_precision=INPUT_PRECISION)
        s = _finish_scores(s, query, keys_base, mask_base, stride_mm,
                           n0, N_KEYS, qlen, R, SEGMENTS, MASKING, CHECK_R, PACKED_KEYS, BLOCK_N)
        do, lse2, delta = _bwd_rows(DO, LSE2, DELTA, bh_rows, rows, query.row_ok, offs_d, M, HEAD_DIM)
        prob_d, ds = _grad_tile(s, lse2, delta, do, v, seed, pid_bh, m0, n0, keep_threshold,
                                DROPOUT, BLOCK_M, BLOCK_N, DOT_DTYPE, INPUT_PRECISION, KEEP_IN_SIGN=True)
        if STORE_DS:  # for the dQ kernel, in the dot dtype it rounds dS to
            ds_ptrs, ds_ok = _stored_ds_tile(DS, bh_rows, ds_pitch, rows, n0, M, N_KEYS, BLOCK_N)
            tl.store(ds_ptrs, ds.to(DS.dtype.element_ty), mask=ds_ok)
        gp = GP + (pid_bh.to(tl.int64) * n_n_tiles + pid_n) * M + rows
        if FIX_UP:
            # rows whose code the one-hot has no column for: their same-code sums out of the totals
            same = (query.seg[:, None] == seg_k[None, :]) & (query.seg >= SEG_CODES)[:, None]
            tl.atomic_add(gp, -tl.sum(tl.where(same, ds, 0.0), axis=1), mask=rows < M, sem="relaxed")
        else:
            dv += tl.dot(tl.trans(prob_d.to(DOT_DTYPE)), do, input_precision=INPUT_PRECISION)
            ds_t = tl.trans(ds.to(DOT_DTYPE))
            dk += tl.dot(ds_t, query.q_w, input_precision=INPUT_PRECISION)
            if COLSUMS_ALONG_KEYS:
                col_sums = tl.dot(ones, ds.to(DOT_DTYPE), col_sums, input_precision=INPUT_PRECISION)
            else:
                col_sums = tl.dot(ds_t, ones, col_sums, input_precision=INPUT_PRECISION)
            if SEGMENTS:
                tl.store(gp, _other_segment_sums(ds, query.seg, one_hot, keys_base, cols, N_KEYS, DOT_DTYPE,
                                                 INPUT_PRECISION), mask=rows < M)
    if not FIX_UP:
        if COLSUMS_ALONG_KEYS:
            col_sum = tl.sum(col_sums, axis=0) / COLSUM_WIDTH
        else:
            col_sum = tl.sum(col_sums, axis=1) / COLSUM_WIDTH
        # k again from memory: the loaded tile kept in registers through the loop costs a tile of them
        # (rows from a scalar base: pointers shared with the first load would be kept through the loop)
        k_out = _load_rows(K + b * stride_kb + h * stride_kh + n0 * stride_kn, stride_kn, 0, N_KEYS - n0, offs_d,
                           BLOCK_N, HEAD_DIM)
        tl.store(PARTK + (pid_bh.to(tl.int64) * n_n_tiles + pid_n) * BLOCK_D + offs_d,
                 tl.sum(col_sum[:, None] * k_out.to(tl.float32), axis=0))
        # q_w carries qk_scale = scale * log2(e); dK needs scale alone
        out_off = (b * N_KEYS * H + h) * HEAD_DIM + cols[:, None].to(tl.int64) * (H * HEAD_DIM) + offs_d[None, :]
        kv_ok = (cols < N_KEYS)[:, None] & (offs_d < HEAD_DIM)[None, :]
        tl.store(DK + out_off, (dk / LOG2E).to(DK.dtype.element_ty), mask=kv_ok)
        tl.store(DV + out_off, dv.to(DV.dtype.element_ty), mask=kv_ok)


@triton.jit
def _bwd_q_kernel(
    QW, QR, E, ROWS, K, V, KR, KEYS, MASK, DO, LSE2, DELTA, DQ, DKR, PART, GP, G, SEGD, DS, COLUMNS,
    stride_kb, stride_kn, stride_kh, stride_vb, stride_vn, stride_vh, stride_rb, stride_rr, stride_rh,
    stride_mb, stride_mm, stride_dkrb, H, M, N_KEYS, R, qlen, qk_scale, SEED, keep_threshold, n_m_tiles,
    n_n_tiles, n_gp, ds_pitch,
    SEGMENTS: tl.constexpr, MASKING: tl.constexpr, BANDED_ONLY: tl.constexpr, CHECK_R: tl.constexpr,
    PACKED_KEYS: tl.constexpr,
    DROPOUT: tl.constexpr, DKR_ATOMIC: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, DOT_DTYPE: tl.constexpr, INPUT_PRECISION: tl.constexpr,
    NUM_WARPS: tl.constexpr, FROM_DS: tl.constexpr = False, TMA: tl.constexpr = False,
    TMA_REDUCE: tl.constexpr = False, LOAD_COLUMNS: tl.constexpr = False, n_dkr_rows=0,
):
    """One query tile: dQ over all key tiles, dk_r by fp32 atomics (DKR_ATOMIC) into DKR
    (Br, R, H, D) contiguous (``stride_dkrb`` 0 when k_r is shared by the batch), and this tile's
    column sums of dq (before the segment term) in PART (B*H, n_m_tiles, BLOCK_D). With segments,
    each row's sum of dS over keys of another segment: the dK/dV launch's per-key-tile sums GP
    (B*H, n_n_tiles, M), of which it filled the first n_gp tiles, summed here and written to G (B, H, M).
    Gradients here are with respect to the log2-domain operands; the launcher applies the scale.
    ``FROM_DS``: the dS tiles the dK/dV kernel stored (its ``STORE_DS``) are read from DS instead of
    recomputed (the scores, their softmax and dP: three of the loop's six products). ``LOAD_COLUMNS``
    (with ``FROM_DS``): the unskew's column numbers read from COLUMNS (``_tile_columns``)."""
    pid_m = tl.program_id(0)
    pid_bh = tl.program_id(1)
    b = (pid_bh // H).to(tl.int64)
    h = pid_bh % H
    bh_rows = pid_bh.to(tl.int64) * M
    rows_base = ROWS + b * M * ROW_FIELDS
    k_base = K + b * stride_kb + h * stride_kh
    v_base = V + b * stride_vb + h * stride_vh
    kr_base = KR + b * stride_rb + h * stride_rh
    dkr_base = DKR + b * stride_dkrb + h * HEAD_DIM
    keys_base = KEYS + b * _padded_keys(N_KEYS) * KEY_FIELDS
    mask_base = MASK + b * stride_mb
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < HEAD_DIM
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    seed = _load_seed(SEED, DROPOUT)
    BD_BF16: tl.constexpr = KR.dtype.element_ty != tl.float32  # 16-bit inputs: bd rounded to bf16 (_skew_window)
    query = _query_tile(
        QW, QR, E, rows_base, bh_rows, rows, offs_d, M, N_KEYS, qlen, HEAD_DIM, SEGMENTS)
    do, lse2, delta = _bwd_rows(DO, LSE2, DELTA, bh_rows, rows, query.row_ok, offs_d, M, HEAD_DIM)
    p_hi, p_lo, banded, lag, flat_idx = _band(query.pos, rows_base, pid_m * BLOCK_M, M, BLOCK_M, BLOCK_N, BD_BF16)
    if BANDED_ONLY:
        if BLOCK_M <= BLOCK_N:
            banded = True
    dq = tl.zeros((BLOCK_M, BLOCK_D), tl.float32)
    dkr_stride_row = H * HEAD_DIM
    if banded:
        k_src = _row_source(k_base, N_KEYS, stride_kn, BLOCK_N, BLOCK_D, HEAD_DIM, TMA)
        v_src = _row_source(v_base, N_KEYS, stride_vn, BLOCK_N, BLOCK_D, HEAD_DIM, TMA)
        kr_src = _row_source(kr_base, R, stride_rr, BLOCK_N, BLOCK_D, HEAD_DIM, TMA)
        dkr_src = None
        if DKR_ATOMIC and TMA_REDUCE:
            dkr_src = tl.make_tensor_descriptor(dkr_base, shape=[n_dkr_rows, HEAD_DIM], strides=[dkr_stride_row, 1],
                                                block_shape=[BLOCK_N, BLOCK_D])
        if FROM_DS and TMA:
            ds_src = tl.make_tensor_descriptor(DS + bh_rows * ds_pitch, shape=[M, N_KEYS], strides=[ds_pitch, 1],
                                               block_shape=[BLOCK_M, BLOCK_N])
        # the k_r rows of a window's lower half carry from the key tile before (its upper half), and
        # so does dS: the window rows of the lower half read this tile's dS and the previous one's
        kr_lo = _rows(kr_src, stride_rr, qlen - p_hi, R, offs_d, BLOCK_N, HEAD_DIM, TMA).to(DOT_DTYPE)
        # the product of the lower half carries too (one dot per key tile instead of two) where its
        # fp32 tile takes at most 8 registers a thread; measured: 32x32w4 tiles gain (sm_90: 54.5 ->
        # 48.5 inst/score), 32x32w2, 32x64w4 and 64x64 tiles spill more
        CARRY_PRODUCT: tl.constexpr = BLOCK_M * BLOCK_N <= 8 * 32 * NUM_WARPS and not FROM_DS
        # on those tiles past D=64 the k_r rows are read again (from L2) rather than kept through the
        # loop: a (BLOCK_N, D) tile of them is 16 registers a thread at D=128 (sm_80 32x32w4s1: 664 ->
        # 392 B of spill, 3 inst/score fewer; sm_90 176 -> 128 B, 2.6 more). Not on larger tiles: the
        # second load's pipeline buffer took sm_100's 64x64w8s2 past its shared memory (197 -> 246 KB)
        # Reading dS through descriptors past D=64, the lower half is read again too (a TMA fill)
        # instead of carried: a tile the copy engine put in shared memory and the loop carries in
        # registers goes back to shared memory as the next product's operand, and holds its registers
        # (sm_90 D=128 64x64w4s2: 460 -> 224 B of spill, 62 instead of 70 B-eq/score; 32x64w4s1 spill-
        # free on wgmma). At D=64 the extra pipeline buffer (74 -> 82 KB) costs 64x64w4s2r168 its third
        # block, the H200's fastest dQ (bench/NOTES.md, "dQ reads k_r again")
        RELOAD_KR: tl.constexpr = (CARRY_PRODUCT or (FROM_DS and TMA)) and HEAD_DIM > 64
        if CARRY_PRODUCT:
            raw_lo = tl.dot(query.q_r, tl.trans(kr_lo), input_precision=INPUT_PRECISION)
        ds_prev = tl.zeros((BLOCK_M, BLOCK_N), DOT_DTYPE)
        # a loaded dS tile flattens row-major, a recomputed one (an MMA result) bank-spread
        columns = _tile_columns(COLUMNS, FROM_DS and LOAD_COLUMNS, BLOCK_M, BLOCK_N)
        unskew_idx = tl.reshape(_flat_index(tl.arange(0, BLOCK_M)[:, None], columns, BLOCK_N - lag[:, None],
                                            2 * BLOCK_N, FROM_DS), [BLOCK_M * BLOCK_N])
        for n0 in range(0, N_KEYS, BLOCK_N):
            k = _rows(k_src, stride_kn, n0, N_KEYS, offs_d, BLOCK_N, HEAD_DIM, TMA).to(DOT_DTYPE)
            if not (FROM_DS and RELOAD_KR):  # reading dS, the upper half would only be carried: not read
                kr_hi = _rows(kr_src, stride_rr, qlen + n0 - p_hi + BLOCK_N, R, offs_d, BLOCK_N, HEAD_DIM,
                              TMA).to(DOT_DTYPE)
            if RELOAD_KR:
                kr_lo = _rows(kr_src, stride_rr, qlen + n0 - p_hi, R, offs_d, BLOCK_N, HEAD_DIM, TMA).to(DOT_DTYPE)
            if FROM_DS:
                if TMA:
                    ds_cur = ds_src.load([pid_m * BLOCK_M, n0]).to(DOT_DTYPE)
                else:
                    ds_ptrs, ds_ok = _stored_ds_tile(DS, bh_rows, ds_pitch, rows, n0, M, N_KEYS, BLOCK_N)
                    ds_cur = tl.load(ds_ptrs, mask=ds_ok, other=0.0).to(DOT_DTYPE)
            else:
                if not CARRY_PRODUCT:
                    raw_lo = tl.dot(query.q_r, tl.trans(kr_lo), input_precision=INPUT_PRECISION)
                raw_hi = tl.dot(query.q_r, tl.trans(kr_hi), input_precision=INPUT_PRECISION)
                bd = _skew_pair(raw_lo, raw_hi, flat_idx, BLOCK_M, BLOCK_N, BD_BF16)
                s = tl.dot(query.q_w, tl.trans(k), bd, input_precision=INPUT_PRECISION)
                s = _finish_scores(s, query, keys_base, mask_base, stride_mm,
                                   n0, N_KEYS, qlen, R, SEGMENTS, MASKING, CHECK_R, PACKED_KEYS, BLOCK_N)
                v = _rows(v_src, stride_vn, n0, N_KEYS, offs_d, BLOCK_N, HEAD_DIM, TMA)
                _, ds = _grad_tile(s, lse2, delta, do, v, seed, pid_bh, pid_m * BLOCK_M, n0, keep_threshold,
                                   DROPOUT, BLOCK_M, BLOCK_N, DOT_DTYPE, INPUT_PRECISION, KEEP_IN_SIGN=False)
                ds_cur = ds.to(DOT_DTYPE)
            dq = tl.dot(ds_cur, k, dq, input_precision=INPUT_PRECISION)
            dsc = _unskew_join(ds_prev, ds_cur, unskew_idx, BLOCK_M, BLOCK_N, FROM_DS)
            dq = tl.dot(dsc, kr_lo, dq, input_precision=INPUT_PRECISION)
            if DKR_ATOMIC:
                _dkr_atomic(dkr_base, dkr_stride_row, qlen + n0 - p_hi, dsc, query.q_r, offs_d,
                            BLOCK_N, HEAD_DIM, DOT_DTYPE, INPUT_PRECISION, dkr_src, TMA_REDUCE)
            ds_prev = ds_cur
            if not RELOAD_KR:
                kr_lo = kr_hi
            if CARRY_PRODUCT:
                raw_lo = raw_hi
        # the last window's upper half
        if RELOAD_KR:
            kr_lo = _rows(kr_src, stride_rr, qlen + tl.cdiv(N_KEYS, BLOCK_N) * BLOCK_N - p_hi, R, offs_d,
                          BLOCK_N, HEAD_DIM, TMA).to(DOT_DTYPE)
        dsc = _unskew_join(ds_prev, tl.zeros((BLOCK_M, BLOCK_N), DOT_DTYPE), unskew_idx, BLOCK_M, BLOCK_N, FROM_DS)
        dq = tl.dot(dsc, kr_lo, dq, input_precision=INPUT_PRECISION)
        if DKR_ATOMIC:
            _dkr_atomic(dkr_base, dkr_stride_row, qlen + tl.cdiv(N_KEYS, BLOCK_N) * BLOCK_N - p_hi,
                        dsc, query.q_r, offs_d, BLOCK_N, HEAD_DIM, DOT_DTYPE, INPUT_PRECISION, dkr_src, TMA_REDUCE)
    else:
        for n0 in range(0, N_KEYS, BLOCK_N):
            k = _load_rows(k_base, stride_kn, n0, N_KEYS, offs_d, BLOCK_N, HEAD_DIM)
            if FROM_DS:
                ds_ptrs, ds_ok = _stored_ds_tile(DS, bh_rows, ds_pitch, rows, n0, M, N_KEYS, BLOCK_N)
                ds = tl.load(ds_ptrs, mask=ds_ok, other=0.0).to(tl.float32)
            else:
                bd = _bd_general(query, kr_base, stride_rr, p_hi, p_lo, n0, qlen, R, offs_d,
                                 BLOCK_M, BLOCK_N, HEAD_DIM, DOT_DTYPE, INPUT_PRECISION, BD_BF16)
                s = tl.dot(query.q_w, tl.trans(k.to(DOT_DTYPE)), bd, input_precision=INPUT_PRECISION)
                s = _finish_scores(s, query, keys_base, mask_base, stride_mm,
                                   n0, N_KEYS, qlen, R, SEGMENTS, MASKING, CHECK_R, PACKED_KEYS, BLOCK_N)
                v = _load_rows(v_base, stride_vn, n0, N_KEYS, offs_d, BLOCK_N, HEAD_DIM)
                _, ds = _grad_tile(s, lse2, delta, do, v, seed, pid_bh, pid_m * BLOCK_M, n0, keep_threshold,
                                   DROPOUT, BLOCK_M, BLOCK_N, DOT_DTYPE, INPUT_PRECISION, KEEP_IN_SIGN=False)
            dq = tl.dot(ds.to(DOT_DTYPE), k.to(DOT_DTYPE), dq, input_precision=INPUT_PRECISION)
            c_first = qlen + n0 - p_hi
            c_end = tl.minimum(qlen + n0 + BLOCK_N - p_lo, R)
            for c0 in range(c_first, c_end, 2 * BLOCK_N):
                kr = _load_rows(kr_base, stride_rr, c0, R, offs_d, 2 * BLOCK_N, HEAD_DIM)
                dsc = _unskew_rows(ds, query.pos, query.row_ok, n0, c0, qlen, BLOCK_M, BLOCK_N, 2 * BLOCK_N,
                                   ROW_MAJOR=FROM_DS)
                dq = tl.dot(dsc.to(DOT_DTYPE), kr.to(DOT_DTYPE), dq, input_precision=INPUT_PRECISION)
                if DKR_ATOMIC:
                    _dkr_atomic(dkr_base, dkr_stride_row, c0, dsc, query.q_r, offs_d, 2 * BLOCK_N, HEAD_DIM,
                                DOT_DTYPE, INPUT_PRECISION)

    # dQ = scale * (dS K + dS_shifted K_r + g_diff (seg_embed[1] - seg_embed[0])): rows' dS over
    # same-segment keys sum to -g_diff (a row of dS sums to 0); column sums for the bias gradients
    tl.store(PART + (pid_bh.to(tl.int64) * n_m_tiles + pid_m) * BLOCK_D + offs_d, tl.sum(dq, axis=0))
    if SEGMENTS:
        g_diff = tl.zeros((BLOCK_M,), tl.float32)
        gp = GP + pid_bh.to(tl.int64) * n_n_tiles * M + rows
        for t in range(0, n_gp):
            g_diff += tl.load(gp + t * M, mask=rows < M, other=0.0)
        tl.store(G + bh_rows + rows, g_diff, mask=rows < M)  # for the seg_embed and r_s_bias gradients
        seg_delta = tl.load(SEGD + h * HEAD_DIM + offs_d, mask=d_ok, other=0.0)
        dq += g_diff[:, None] * seg_delta[None, :]
    dq_ptrs = DQ + ((b * M + query.src_row[:, None].to(tl.int64)) * H + h) * HEAD_DIM + offs_d[None, :]
    # padding rows too (their gradient is 0)
    tl.store(dq_ptrs, (dq * (qk_scale / LOG2E)).to(DQ.dtype.element_ty), mask=(rows < M)[:, None] & d_ok[None, :])


@triton.jit
def _bwd_kr_kernel(
    QW, QR, E, ROWS, K, V, KR, KEYS, MASK, DO, LSE2, DELTA, DKR, DS,
    stride_kb, stride_kn, stride_kh, stride_vb, stride_vn, stride_vh, stride_rb, stride_rr, stride_rh,
    stride_mb, stride_mm, stride_dkrb, stride_dkrs, H, M, N_KEYS, R, qlen, qk_scale, SEED, keep_threshold,
    batch_per_kr, batch_per_split, ds_pitch,
    SEGMENTS: tl.constexpr, MASKING: tl.constexpr, CHECK_R: tl.constexpr, PACKED_KEYS: tl.constexpr,
    DROPOUT: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    DOT_DTYPE: tl.constexpr, INPUT_PRECISION: tl.constexpr, NUM_WARPS: tl.constexpr,
    FROM_DS: tl.constexpr = False,
):
    """Deterministic dk_r: one tile of BLOCK_N k_r rows owns its gradient and gets every dS tile
    that reads it (over the batch rows sharing this k_r, and all query tiles): recomputed, or with
    ``FROM_DS`` read from DS (B*H, M, ds_pitch), where the dK/dV kernel stored them (``STORE_DS``).
    The batch rows sharing a k_r are split over programs (axis 2): each writes the sum over its
    ``batch_per_split`` rows to its own slice of DKR (``stride_dkrs`` apart), which the launcher
    adds in a fixed order."""
    pid_c = tl.program_id(0)
    pid_brh = tl.program_id(1)
    split = tl.program_id(2)
    br = (pid_brh // H).to(tl.int64)
    h = pid_brh % H
    c0 = pid_c * BLOCK_N
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < HEAD_DIM
    seed = _load_seed(SEED, DROPOUT)
    BD_BF16: tl.constexpr = KR.dtype.element_ty != tl.float32  # 16-bit inputs: bd rounded to bf16 (_skew_window)
    DS_HALF: tl.constexpr = DOT_DTYPE != tl.float32  # recomputed dS unskewed in the dots' 16 bits (_flatten)
    acc = tl.zeros((BLOCK_N, BLOCK_D), tl.float32)
    first_bi = split * batch_per_split
    for bi in range(first_bi, tl.minimum(first_bi + batch_per_split, batch_per_kr)):
        b = br * batch_per_kr + bi
        pid_bh = (b * H + h).to(tl.int32)
        bh_rows = pid_bh.to(tl.int64) * M
        rows_base = ROWS + b * M * ROW_FIELDS
        kr_base = KR + b * stride_rb + h * stride_rh
        keys_base = KEYS + b * _padded_keys(N_KEYS) * KEY_FIELDS
        for m0 in range(0, M, BLOCK_M):
            rows = m0 + tl.arange(0, BLOCK_M)
            query = _query_tile(
                QW, QR, E, rows_base, bh_rows, rows, offs_d, M, N_KEYS, qlen, HEAD_DIM, SEGMENTS)
            if not FROM_DS:
                do, lse2, delta = _bwd_rows(DO, LSE2, DELTA, bh_rows, rows, query.row_ok, offs_d, M, HEAD_DIM)
            p_hi = tl.max(tl.where(query.row_ok, query.pos, -1), axis=0)
            p_lo = tl.min(tl.where(query.row_ok, query.pos, qlen), axis=0)
            # keys j whose k_r row qlen + j - p_i falls in [c0, c0 + BLOCK_N)
            j_lo = tl.maximum(c0 - qlen + p_lo, 0)
            j_hi = tl.minimum(c0 + BLOCK_N - qlen + p_hi, N_KEYS)
            for n0 in range((j_lo // BLOCK_N) * BLOCK_N, j_hi, BLOCK_N):
                if FROM_DS:
                    ds_ptrs, ds_ok = _stored_ds_tile(DS, bh_rows, ds_pitch, rows, n0, M, N_KEYS, BLOCK_N)
                    ds = tl.load(ds_ptrs, mask=ds_ok, other=0.0)
                else:
                    k = _load_rows(K + b * stride_kb + h * stride_kh, stride_kn, n0, N_KEYS, offs_d, BLOCK_N,
                                   HEAD_DIM).to(DOT_DTYPE)
                    v = _load_rows(V + b * stride_vb + h * stride_vh, stride_vn, n0, N_KEYS, offs_d, BLOCK_N,
                                   HEAD_DIM)
                    bd = _bd_general(query, kr_base, stride_rr, p_hi, p_lo, n0, qlen, R, offs_d,
                                     BLOCK_M, BLOCK_N, HEAD_DIM, DOT_DTYPE, INPUT_PRECISION, BD_BF16)
                    s = tl.dot(query.q_w, tl.trans(k), bd, input_precision=INPUT_PRECISION)
                    s = _finish_scores(s, query, keys_base, MASK + b * stride_mb,
                                       stride_mm, n0, N_KEYS, qlen, R, SEGMENTS, MASKING, CHECK_R, PACKED_KEYS, BLOCK_N)
                    _, ds = _grad_tile(s, lse2, delta, do, v, seed, pid_bh, m0, n0, keep_threshold,
                                       DROPOUT, BLOCK_M, BLOCK_N, DOT_DTYPE, INPUT_PRECISION, KEEP_IN_SIGN=False)
                    # rounded to the dots' dtype before the unskew (the same values as after it): the
                    # gather's source in half the bytes, in 8-row groups for 16 bits, where a warp's
                    # lanes read 32 query rows of one k_r row (sm_90 64x64w4s2: 52.1 -> 51.0 B-eq/score)
                    ds = ds.to(DOT_DTYPE)
                # dS over this tile's k_r rows, gathered transposed: with tl.trans before the dot,
                # triton laid the score tile's dots out alone, 4 warps along 32 rows doing every
                # MMA twice (sm_80 32x32w4s1: 72.4 -> 54.8 inst/score)
                dsc_t = _unskew_rows(ds, query.pos, query.row_ok, n0, c0, qlen, BLOCK_M, BLOCK_N, BLOCK_N,
                                     TRANSPOSED=True, ROW_MAJOR=FROM_DS, HALF=DS_HALF)
                acc = tl.dot(dsc_t.to(DOT_DTYPE), query.q_r, acc, input_precision=INPUT_PRECISION)
    c_rows = c0 + tl.arange(0, BLOCK_N)
    dkr_base = DKR + split.to(tl.int64) * stride_dkrs + br * stride_dkrb + h * HEAD_DIM
    tl.store(dkr_base + c_rows[:, None].to(tl.int64) * (H * HEAD_DIM) + offs_d[None, :],
             acc, mask=(c_rows < R)[:, None] & d_ok[None, :])


@triton.jit
def _dropout_mask_kernel(KEEP, SEED, keep_threshold, M, N_KEYS, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """KEEP (B*H, M, N_KEYS) uint8: the keep mask the attention kernels apply, rows in launch order."""
    pid_m, pid_n, pid_bh = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    keep = _dropout_keep(tl.load(SEED), pid_bh, pid_m * BLOCK_M, pid_n * BLOCK_N, keep_threshold, BLOCK_M, BLOCK_N)
    ptrs = KEEP + (pid_bh.to(tl.int64) * M + rows[:, None]) * N_KEYS + cols[None, :]
    tl.store(ptrs, keep.to(tl.uint8), mask=(rows < M)[:, None] & (cols < N_KEYS)[None, :])


# --------------------------------------------------------------------------------------------------
# Autotuning
# --------------------------------------------------------------------------------------------------

# Candidate configs per arch family and kernel, best guess first (at D = 64), named
# BLOCK_M x BLOCK_N, warps, stages, and ``r<N>`` for a register cap; banded tiles need
# BLOCK_M <= BLOCK_N. The autotuner times those that launch on the device (`_prune`).
# `python -m bench.compile_report` compiles every candidate for every arch (registers, spills,
# shared memory, instructions per score against FlashAttention-2 at the same config: bench/NOTES.md).
# Families with mma.sync (sm_80/86/89/120) cap registers at 255: left to itself, ptxas gives some
# of their builds 32 registers and ~30 KB of spill (so does sm_90's 2-warp dQ with fp32's 3xTF32
# dots: that one candidate carries the cap too). The 99 KB-shared-memory GPUs (sm_86/89/120)
# take narrower tiles; sm_100 builds no two-stage dK/dV (triton 3.6's pipeliner fails on it).
# sm_90's 64x64w4s1r168 forward trades 5% more instructions and ~150 B of spill for three blocks
# per SM instead of two (57 KB of shared memory each): on the H200 the forward ran at half the
# FA2 reference's instructions per cycle with 8 warps per SM to its 16 (bench/NOTES.md).
# Its dQ 64x64w4s2r168 does the same for the dQ kernel reading a stored dS (892 B of spill, 12
# warps per SM; the model ranks it first: bench/NOTES.md, kernel v4 step 2). The first candidate is
# what deterministic mode runs: sm_90's forward autotuner chose 64x64w4s2 in 33 of the GPU runs' 36
# D=64 tunings (bench/NOTES.md, "Deterministic mode's forward").
# 128x128 tiles in two warpgroups (sm_90's forward and dK/dV, sm_100's forward) halve the k, v and
# k_r fills per score; with the skew's window in 16 bits they fit in shared memory (sm_90's
# two-stage forward: 193 KB at D=64; it does not fit at D=128). The time model ranks them first at
# 176-936 B of spill: 10% (sm_90 forward), 20% (sm_90 dK/dV), 7-25% (sm_100 forward) below the
# builds it ranked first before; last, so neither the first guess nor deterministic mode's config
# changes until a GPU has timed them (bench/NOTES.md, "128-row tiles").
CANDIDATES = {
    80: {"fwd": ("64x64w4s2r255", "64x64w4s1r255", "32x64w4s1r255", "64x128w8s1r255", "32x32w2s2r255"),
         "dkdv": ("32x32w2s2r255", "64x64w4s1r255", "32x32w4s1r255", "64x64w4s2r255", "32x32w4s2r255"),
         "dq": ("32x32w4s1r255", "64x64w4s1r255", "32x32w4s2r255", "32x32w2s2r255", "64x64w8s2r255"),
         "dkr": ("32x32w4s1r255", "32x32w2s2r255", "32x64w4s1r255", "64x64w4s1r255")},
    86: {"fwd": ("64x64w4s2r255", "64x64w4s1r255", "32x64w4s1r255", "64x128w8s1r255", "32x32w2s2r255"),
         "dkdv": ("32x32w2s2r255", "64x64w4s1r255", "32x32w4s1r255", "32x32w4s2r255"),
         "dq": ("32x32w4s1r255", "32x32w4s2r255", "32x32w2s2r255", "64x64w4s1r255"),
         "dkr": ("32x32w4s1r255", "32x32w2s2r255", "32x64w4s1r255", "32x32w4s2r255")},
    90: {"fwd": ("64x64w4s2", "64x64w4s1", "64x128w4s1", "32x64w4s1", "64x64w4s1r168", "128x128w8s2"),
         "dkdv": ("64x64w4s1", "64x64w4s2", "32x64w4s1", "32x32w2s2", "128x128w8s1"),
         "dq": ("64x64w4s1", "64x64w4s2", "32x64w4s1", "32x32w4s1", "32x32w2s2r255", "64x64w4s2r168"),
         "dkr": ("64x64w4s2", "64x64w4s1", "32x64w4s1", "32x32w4s1")},
    100: {"fwd": ("64x64w4s1", "32x64w4s1", "64x64w4s2", "64x128w8s1", "128x128w8s1"),
          "dkdv": ("64x64w4s1", "32x64w4s1", "64x128w8s1", "32x32w2s2"),
          "dq": ("64x64w8s2", "64x64w4s1", "32x64w4s1r255", "32x32w4s1", "64x128w8s1"),
          "dkr": ("64x64w4s1", "32x64w4s1", "32x32w4s1")},
}
for _family in CANDIDATES.values():  # the dK/dV kernel's FIX_UP launch (see _bwd_kv_kernel)
    _family["fixup"] = _family["dkdv"]
    # the dQ and dk_r kernels recomputing dS (calls whose dS is not kept: kernels.STORED_DS_BYTES)
    _family["dq_recompute"] = _family["dq"]
    _family["dkr_recompute"] = _family["dkr"]
CANDIDATES[120] = CANDIDATES[86]  # RTX 50: the same 99 KB of shared memory and mma.sync
ROLES = ("fwd", "dkdv", "dq", "dkr", "fixup", "dq_recompute", "dkr_recompute")
# Shared memory one block may opt in to, by arch (bytes), and Blackwell's tensor-memory columns: a
# launch above either raises OutOfResources (triton's own check at launch).
SHARED_MEMORY_PER_BLOCK = {80: 166_912, 86: 101_376, 87: 166_912, 89: 101_376, 90: 232_448, 100: 232_448,
                           103: 232_448, 120: 101_376, 121: 101_376}
TMEM_COLUMNS = 512


def arch_family(arch: int) -> int:
    """The arch whose candidate configs serve ``arch`` (80, 86, 90, 100 or 120; below sm_80, 80's)."""
    if arch >= 120:
        return 120
    if arch >= 100:
        return 100
    if arch >= 90:
        return 90
    return 86 if arch in (86, 89) else 80


def shared_memory_limit(arch: int) -> int:
    return SHARED_MEMORY_PER_BLOCK.get(arch, SHARED_MEMORY_PER_BLOCK[arch_family(arch)])


def launchable(arch: int, smem_bytes: int, tmem_columns: int | None = None) -> bool:
    """Whether a binary using this much shared memory (and tensor memory) launches on ``arch``."""
    return smem_bytes <= shared_memory_limit(arch) and (tmem_columns or 0) <= TMEM_COLUMNS


def config_name(config: triton.Config) -> str:
    """``128x64w8s2`` (``...r232`` with a register cap)."""
    kw = config.kwargs
    cap = f"r{config.maxnreg}" if getattr(config, "maxnreg", None) else ""
    return f"{kw['BLOCK_M']}x{kw['BLOCK_N']}w{config.num_warps}s{config.num_stages}{cap}"


def _config(name: str) -> triton.Config:
    """The config named like ``128x64w8s2`` or ``32x32w4s1r255``."""
    tiles, rest = name.split("w")
    block_m, block_n = (int(x) for x in tiles.split("x"))
    warps, rest = rest.split("s")
    stages, _, maxnreg = rest.partition("r")
    # the kernels see their warp count as NUM_WARPS (triton keeps num_warps from the kernel body):
    # some layout choices depend on it
    return triton.Config({"BLOCK_M": block_m, "BLOCK_N": block_n, "NUM_WARPS": int(warps)}, num_warps=int(warps),
                         num_stages=int(stages), maxnreg=int(maxnreg) if maxnreg else None)


# Tiles under the CPU interpreter (small shapes, fast to interpret).
INTERPRETER_TILES = _config("16x16w4s1").all_kwargs()


def all_configs() -> list:
    """Every config any arch may use: the autotuners' full lists (``configs_for`` picks per device)."""
    names = dict.fromkeys(name for roles in CANDIDATES.values() for names in roles.values() for name in names)
    return [_config(name) for name in names]


def configs_for(arch: int, head_dim: int, role: str) -> list:
    """The candidate configs of kernel ``role`` on ``arch``, best guess first; those that do not fit
    the device at ``head_dim`` are dropped at launch (``_prune``) and flagged by the compile report."""
    if role not in ROLES:
        raise ValueError(f"role must be one of {ROLES}, got {role!r}")
    return [_config(name) for name in CANDIDATES[arch_family(arch)][role]]


_TARGET_ARCH: int | None = None


@contextlib.contextmanager
def compiling_for(arch: int):
    """Inside, the autotuners' pruning assumes a device of ``arch`` and does not compile to check
    launchability (``bench.compile_report`` compiles every candidate itself and applies
    ``launchable``)."""
    global _TARGET_ARCH
    saved, _TARGET_ARCH = _TARGET_ARCH, arch
    try:
        yield
    finally:
        _TARGET_ARCH = saved


def compile_target() -> int | None:
    """The arch ``compiling_for`` set, or None."""
    return _TARGET_ARCH


def _device_arch(device) -> int:
    """The arch of the GPU triton compiles for and launches on (its driver's current device, which a
    launch on ``device``'s tensors has current)."""
    from triton.runtime import driver

    return driver.active.get_current_target().arch


def _prune(role: str, fn):
    """``early_config_prune`` for kernel ``role``: the device's candidates among the autotuner's
    configs (all of them if it was pinned to others), then those that launch on the device (each
    compiled: the autotuner would compile it to time it anyway)."""

    def prune(configs, named_args, **kwargs):
        # the autotuner passes its launch options (``grid``, ``warmup``) along with the kernel's
        # arguments: keep the kernel's own, which is what a compile of one config takes
        args = {name: value for name, value in {**named_args, **kwargs}.items() if name in fn.arg_names}
        arch = _TARGET_ARCH if _TARGET_ARCH is not None else _device_arch(args["QW"].device)
        given = {config_name(c): c for c in configs}
        chosen = [given[name] for name in map(config_name, configs_for(arch, args["HEAD_DIM"], role))
                  if name in given] or list(configs)
        if _TARGET_ARCH is not None:
            return chosen
        fits = [c for c in chosen if _launches_on_device(fn, args, c)]
        # none of the device's candidates fits (e.g. the autotuner pinned to configs too large for
        # this call): the first of the others that does
        fits = fits or next(([c] for c in configs if c not in chosen and _launches_on_device(fn, args, c)), [])
        if not fits:
            raise RuntimeError(f"no {role} kernel config fits this GPU (sm_{arch}, HEAD_DIM={args['HEAD_DIM']}): "
                               f"tried {[config_name(c) for c in configs]}")
        return fits

    return prune


def first_launchable(role: str, fn, args: dict) -> triton.Config:
    """The first of the device's candidates for ``role`` that launches: what deterministic mode runs
    (timing would let the config, and with it the order of float sums, vary from run to run)."""
    arch = _device_arch(args["QW"].device)
    for config in configs_for(arch, args["HEAD_DIM"], role):
        if _launches_on_device(fn, args, config):
            return config
    raise RuntimeError(f"no {role} kernel config fits this GPU (sm_{arch}, HEAD_DIM={args['HEAD_DIM']})")


def _launches_on_device(fn, args: dict, config) -> bool:
    """Compile ``fn`` for ``config`` (no launch) and apply triton's launch-time resource checks."""
    from triton.runtime import driver

    kernel = fn.warmup(**args, **config.all_kwargs(), grid=(1,))
    device = driver.active.get_current_device()
    limit = driver.active.utils.get_device_properties(device)["max_shared_mem"]
    tmem = getattr(kernel.metadata, "tmem_size", None)
    return kernel.metadata.shared <= limit and (tmem or 0) <= TMEM_COLUMNS


TUNE_KEY = ["M", "N_KEYS", "HEAD_DIM", "BANDED_ONLY", "MASKING", "SEGMENTS", "DROPOUT", "DOT_DTYPE"]


def _tuned(fn, role: str, key: list, **options):
    return triton.autotune(all_configs(), key=key, prune_configs_by={"early_config_prune": _prune(role, fn)},
                           **options)(fn)


KERNELS = {"fwd": _fwd_kernel, "dkdv": _bwd_kv_kernel, "dq": _bwd_q_kernel, "dkr": _bwd_kr_kernel,
           "fixup": _bwd_kv_kernel, "dq_recompute": _bwd_q_kernel, "dkr_recompute": _bwd_kr_kernel}
fwd_kernel_tuned = _tuned(_fwd_kernel, "fwd", TUNE_KEY + ["TMA"])
# tiles of another BLOCK_N write other entries of GP and PARTK: start each timing from zeros
bwd_kv_kernel_tuned = _tuned(_bwd_kv_kernel, "dkdv", TUNE_KEY + ["STORE_DS"], reset_to_zero=["GP", "PARTK"])
bwd_q_kernel_tuned = _tuned(_bwd_q_kernel, "dq", TUNE_KEY + ["DKR_ATOMIC", "FROM_DS", "TMA"],
                            reset_to_zero=["DKR", "PART"])
# the deterministic dk_r kernel is not timed: deterministic mode runs every kernel at the first
# candidate that launches (kernels.__init__._run)
