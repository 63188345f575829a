"""The mask tables every attention kernel reads (``contract.py`` names their fields), built on the GPU
in two or three launches (docs/DESIGN.md §5.6).

From a call's masks (segment ids, ranks, query positions) the launcher (``kernels.mask_tables``)
builds, per batch row:

* KEYS ``(B, KEY_FIELDS, K padded)``: each key's segment code (the rank of its id among the distinct
  ids of the row's keys) and its rank, or with packed keys its rank code (the number of the row's key
  ranks below it) shifted over the segment code;
* ROWS ``(B, M, ROW_FIELDS)``: each query row's position code, segment code (-1 when no key has its
  id), rank (or rank code), the caller's row and its count of leading keys seen whole, with the rows
  sorted by position (padding rows last) and each whole group of ROW_GROUP rows reordered so that the
  skew's reads hit distinct banks (``ROW_GROUP_ORDERS``).

Every figure is a count over a batch row's keys or rows, so nothing is sorted: a program takes a block
of BLOCK_ROWS rows or keys and loops over the batch row's keys (or rows) in blocks of BLOCK_KEYS,
O(M·K + K² + M²) compares per batch row, spread over ``cdiv(M, BLOCK_ROWS) + cdiv(K, BLOCK_ROWS)``
programs. (In PyTorch the same took four
sorts and ~75 small ops a call: ~1.5-1.9 ms of host time per call on an H100's host, bench/NOTES.md.)
Sync-free, so a CUDA graph may capture it.
"""

from __future__ import annotations

import triton
import triton.language as tl

from . import contract
from .rel_attention import (INT32_MAX, INT32_MIN, KEY_FIELDS, KEY_RANK, KEY_SEG, ROW_CODE, ROW_FIELDS, ROW_FREE,
                            ROW_OWN_KEY, ROW_POS_SHIFT, ROW_RANK, ROW_SEG, ROW_SRC)

ROW_GROUP = tl.constexpr(contract.ROW_GROUP)
KEY_RANK_SHIFT = tl.constexpr(contract.KEY_RANK_SHIFT)
PACKED_PAD_KEY = tl.constexpr(contract.PACKED_PAD_KEY)
# a packed row's rank code 1: every key of code 0 is below it
RANK_CODE_ONE = tl.constexpr(1 << contract.KEY_RANK_SHIFT)

# Rows or keys a program owns, and keys or rows per step of its counting loops: (32, 128) compares a
# step, 32 per thread at four warps, in int64 for segment ids and positions (at (64, 128) the
# segment ids' loops spilled on sm_90: bench/NOTES.md). Key programs that owned 128 keys and
# stepped 32 made the longest loops: at 1x8192 keys, 64 programs of 512 steps (H200: 0.29 ms, the
# segment-id pass 0.13 ms more; bench/NOTES.md "2026-11-29 (7)").
BLOCK_ROWS = 32
BLOCK_KEYS = 128
# Groups of ROW_GROUP rows a program of the reordering kernel moves.
GROUPS_PER_PROGRAM = 16


def _best_row_group_orders() -> tuple:
    """For each pattern of position parities of ROW_GROUP rows sorted by position (bit s: row s's
    parity), the order of those rows that keeps the first and the last in place (a tile's position
    range stays its first and last row's) and gives the most pairs (s, s + ROW_GROUP/2) opposite
    parities. Why: the skew's gather reads one window element per lane, and the lanes of one read
    hold the rows r and r + ROW_GROUP/2 of such a group at columns that differ by their positions'
    difference: of the same parity they read the same banks (a 2-way conflict), of opposite parity
    other banks. Greedy and optimal: the two pairs with a fixed end take a middle row of the other
    parity where one is left (each such take costs the free pairs at most the one it gains), then the
    free pairs match the remaining rows of opposite parities."""
    group = contract.ROW_GROUP
    half, last = group // 2, group - 1
    orders = []
    for pattern in range(2**group):
        parity = [(pattern >> s) & 1 for s in range(group)]
        left = {p: [s for s in range(1, last) if parity[s] == p] for p in (0, 1)}
        slots = {0: 0, last: last}
        for slot, partner in ((half, 0), (half - 1, last)):  # the pairs (0, half) and (half - 1, last)
            want = 1 - parity[partner]
            slots[slot] = (left[want] or left[1 - want]).pop(0)
        rest = []  # the free pairs (s, s + half), s = 1 .. half - 2, opposite parities first
        while left[0] and left[1]:
            rest += [left[0].pop(0), left[1].pop(0)]
        rest += left[0] + left[1]
        for s in range(1, half - 1):
            slots[s], slots[s + half] = rest.pop(0), rest.pop(0)
        orders.append(tuple(slots[s] for s in range(group)))
    return tuple(orders)


# (2**ROW_GROUP, ROW_GROUP): the launcher keeps it on each device as the ORDERS table
ROW_GROUP_ORDERS = _best_row_group_orders()


@triton.jit
def _first_ids_kernel(KSEG, FIRST, K, stride_sb, stride_sn, BLOCK_N: tl.constexpr, BLOCK_STEP: tl.constexpr):
    """FIRST (B, K) int32: 1 where key j is the first of its batch row's keys with its segment id (the
    segment codes count those below an id). BLOCK_N keys a program, compared with BLOCK_STEP a step."""
    b = tl.program_id(1).to(tl.int64)
    j = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    ids = tl.load(KSEG + b * stride_sb + j * stride_sn, mask=j < K, other=0)
    earlier = tl.zeros([BLOCK_N], dtype=tl.int32)
    for n0 in range(0, K, BLOCK_STEP):
        other = n0 + tl.arange(0, BLOCK_STEP)
        other_ids = tl.load(KSEG + b * stride_sb + other * stride_sn, mask=other < K, other=0)
        same = (other_ids[None, :] == ids[:, None]) & (other[None, :] < j[:, None])
        earlier += tl.sum(same.to(tl.int32), axis=1)
    tl.store(FIRST + b * K + j, (earlier == 0).to(tl.int32), mask=j < K)


@triton.jit
def _ids_below(ids, KSEG, FIRST, b, K, stride_sb, stride_sn, BLOCK_STEP: tl.constexpr):
    """For each of ``ids`` (its block's segment ids): the number of distinct ids among batch row
    ``b``'s keys below it (its code), and whether a key has it."""
    below = tl.zeros(ids.shape, dtype=tl.int32)
    found = tl.zeros(ids.shape, dtype=tl.int32)
    for n0 in range(0, K, BLOCK_STEP):
        keys = n0 + tl.arange(0, BLOCK_STEP)
        key_ids = tl.load(KSEG + b * stride_sb + keys * stride_sn, mask=keys < K, other=0)
        first = tl.load(FIRST + b * K + keys, mask=keys < K, other=0) != 0
        below += tl.sum(((key_ids[None, :] < ids[:, None]) & first[None, :]).to(tl.int32), axis=1)
        found += tl.sum(((key_ids[None, :] == ids[:, None]) & (keys < K)[None, :]).to(tl.int32), axis=1)
    return below, found > 0


@triton.jit
def _tables_kernel(
    QSEG, KSEG, FIRST, QRANK, KRANK, QPOS, SORTED, KEYS,
    M, K, K_PADDED, qlen, self_rows, n_row_programs,
    stride_qsb, stride_qsm, stride_ksb, stride_ksn, stride_qrb, stride_qrm, stride_krb, stride_krn,
    stride_pb, stride_pm,
    SEGMENTS: tl.constexpr, RANKS: tl.constexpr, POSITIONS: tl.constexpr, PACKED_KEYS: tl.constexpr,
    FREE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    """Programs [0, n_row_programs) write BLOCK_M rows each to SORTED (B, M, ROW_FIELDS), the ROWS
    table sorted by position before ``_row_groups_kernel`` reorders its groups; the rest BLOCK_M keys
    each (padding included) to KEYS (B, KEY_FIELDS, K_PADDED). Both count over BLOCK_N keys or rows a
    step. FIRST: ``_first_ids_kernel``'s (with SEGMENTS)."""
    b = tl.program_id(1).to(tl.int64)
    pid = tl.program_id(0)
    if pid < n_row_programs:
        _row_fields(QSEG, KSEG, FIRST, QRANK, KRANK, QPOS, SORTED, b, pid * BLOCK_M + tl.arange(0, BLOCK_M), M, K,
                    qlen, self_rows, stride_qsb, stride_qsm, stride_ksb, stride_ksn, stride_qrb, stride_qrm,
                    stride_krb, stride_krn, stride_pb, stride_pm, SEGMENTS, RANKS, POSITIONS, PACKED_KEYS, FREE,
                    BLOCK_M, BLOCK_N)
    else:
        _key_fields(KSEG, FIRST, KRANK, KEYS, b, (pid - n_row_programs) * BLOCK_M + tl.arange(0, BLOCK_M), K,
                    K_PADDED, stride_ksb, stride_ksn, stride_krb, stride_krn, SEGMENTS, RANKS, PACKED_KEYS,
                    BLOCK_M, BLOCK_N)


@triton.jit
def _row_fields(QSEG, KSEG, FIRST, QRANK, KRANK, QPOS, SORTED, b, rows, M, K, qlen, self_rows,
                stride_qsb, stride_qsm, stride_ksb, stride_ksn, stride_qrb, stride_qrm, stride_krb, stride_krn,
                stride_pb, stride_pm, SEGMENTS: tl.constexpr, RANKS: tl.constexpr, POSITIONS: tl.constexpr,
                PACKED_KEYS: tl.constexpr, FREE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """Batch row ``b``'s query ``rows`` (BLOCK_M): counts over its keys, then (with POSITIONS) over
    its rows; each row's fields stored at its place in position order."""
    row_in = rows < M
    rank_below = tl.zeros([BLOCK_M], dtype=tl.int32)
    first_unseen = tl.full([BLOCK_M], K, dtype=tl.int32)  # the first key not below the row's rank
    if RANKS:
        q_rank = tl.load(QRANK + b * stride_qrb + rows * stride_qrm, mask=row_in, other=0)
        for n0 in range(0, K, BLOCK_N):
            keys = n0 + tl.arange(0, BLOCK_N)
            k_rank = tl.load(KRANK + b * stride_krb + keys * stride_krn, mask=keys < K, other=INT32_MAX)
            below = (k_rank[None, :] < q_rank[:, None]) & (keys < K)[None, :]
            rank_below += tl.sum(below.to(tl.int32), axis=1)
            if FREE:
                unseen = tl.where(below, K, keys[None, :])  # keys past K: past K anyway
                first_unseen = tl.minimum(first_unseen, tl.min(unseen, axis=1))
    if SEGMENTS:
        q_ids = tl.load(QSEG + b * stride_qsb + rows * stride_qsm, mask=row_in, other=0)
        seg_code, seg_found = _ids_below(q_ids, KSEG, FIRST, b, K, stride_ksb, stride_ksn, BLOCK_N)
        seg_code = tl.where(seg_found, seg_code, -1)
    else:
        seg_code = tl.zeros([BLOCK_M], dtype=tl.int32)
    if POSITIONS:
        # a stable sort by (position, a target row after the content row), padding rows last, as
        # each row's count of the rows sorted before it; padding rows take the last real position
        pos = tl.maximum(tl.load(QPOS + b * stride_pb + rows * stride_pm, mask=row_in, other=-1).to(tl.int64), -1)
        order_key = tl.where(pos < 0, 2 * qlen + 2, pos * 2 + (rows >= self_rows))
        dest = tl.zeros([BLOCK_M], dtype=tl.int32)
        last_real = tl.zeros([BLOCK_M], dtype=tl.int64)
        for m0 in range(0, M, BLOCK_N):
            others = m0 + tl.arange(0, BLOCK_N)
            other_pos = tl.load(QPOS + b * stride_pb + others * stride_pm, mask=others < M, other=-1).to(tl.int64)
            other_pos = tl.maximum(other_pos, -1)
            other_key = tl.where(other_pos < 0, 2 * qlen + 2, other_pos * 2 + (others >= self_rows))
            before = (other_key[None, :] < order_key[:, None]) | (
                (other_key[None, :] == order_key[:, None]) & (others[None, :] < rows[:, None]))
            dest += tl.sum((before & (others < M)[None, :]).to(tl.int32), axis=1)
            last_real = tl.maximum(last_real, tl.max(other_pos, axis=0))
        real = pos >= 0
        pos_code = tl.where(real, pos, last_real).to(tl.int32)
    else:
        dest = rows
        real = rows >= 0
        pos_code = rows
    own_key = ((rows < self_rows) & real).to(tl.int32) * ROW_OWN_KEY
    if RANKS and PACKED_KEYS:
        rank = rank_below << KEY_RANK_SHIFT
    elif RANKS:
        rank = q_rank
    elif PACKED_KEYS:  # every real row sees every real key (codes 0)
        rank = tl.full([BLOCK_M], RANK_CODE_ONE, dtype=tl.int32)
    else:  # every real row sees every real key: rank 0 against the keys' -1
        rank = tl.zeros([BLOCK_M], dtype=tl.int32)
    if FREE:
        free = tl.where(real, first_unseen, 0)
    else:  # a dense mask: the forward tests every key tile
        free = tl.zeros([BLOCK_M], dtype=tl.int32)
    out = SORTED + (b * M + dest) * ROW_FIELDS
    tl.store(out + ROW_CODE, (pos_code << ROW_POS_SHIFT) | own_key, mask=row_in)
    tl.store(out + ROW_SEG, seg_code, mask=row_in)
    tl.store(out + ROW_RANK, tl.where(real, rank, INT32_MIN), mask=row_in)
    tl.store(out + ROW_SRC, rows, mask=row_in)
    tl.store(out + ROW_FREE, free, mask=row_in)


@triton.jit
def _key_fields(KSEG, FIRST, KRANK, KEYS, b, keys, K, K_PADDED, stride_ksb, stride_ksn, stride_krb, stride_krn,
                SEGMENTS: tl.constexpr, RANKS: tl.constexpr, PACKED_KEYS: tl.constexpr, BLOCK_M: tl.constexpr,
                BLOCK_N: tl.constexpr):
    """Batch row ``b``'s ``keys`` (BLOCK_M, the padding keys past K included): counts over its keys,
    BLOCK_N a step."""
    key_in = keys < K
    if SEGMENTS:
        k_ids = tl.load(KSEG + b * stride_ksb + keys * stride_ksn, mask=key_in, other=0)
        seg_code, _ = _ids_below(k_ids, KSEG, FIRST, b, K, stride_ksb, stride_ksn, BLOCK_N)
    else:
        seg_code = tl.zeros([BLOCK_M], dtype=tl.int32)
    if RANKS:
        k_rank = tl.load(KRANK + b * stride_krb + keys * stride_krn, mask=key_in, other=0)
    if PACKED_KEYS:
        rank_below = tl.zeros([BLOCK_M], dtype=tl.int32)
        if RANKS:
            for n0 in range(0, K, BLOCK_N):
                others = n0 + tl.arange(0, BLOCK_N)
                other_rank = tl.load(KRANK + b * stride_krb + others * stride_krn, mask=others < K, other=INT32_MAX)
                below = (other_rank[None, :] < k_rank[:, None]) & (others < K)[None, :]
                rank_below += tl.sum(below.to(tl.int32), axis=1)
        rank = tl.where(key_in, (rank_below << KEY_RANK_SHIFT) | seg_code, PACKED_PAD_KEY)
    elif RANKS:
        rank = tl.where(key_in, k_rank, INT32_MAX)
    else:
        rank = tl.where(key_in, -1, INT32_MAX)
    out = KEYS + b * KEY_FIELDS * K_PADDED + keys
    tl.store(out + KEY_SEG * K_PADDED, tl.where(key_in, seg_code, 0), mask=keys < K_PADDED)
    tl.store(out + KEY_RANK * K_PADDED, rank, mask=keys < K_PADDED)


@triton.jit
def _row_groups_kernel(SORTED, ORDERS, ROWS, M, GROUPS: tl.constexpr):
    """ROWS (B, M, ROW_FIELDS): SORTED's rows with each whole group of ROW_GROUP reordered by the
    ORDERS entry (``ROW_GROUP_ORDERS``) of its rows' position parities; the rows after the last whole
    group as they are."""
    b = tl.program_id(1).to(tl.int64)
    group = tl.program_id(0) * GROUPS + tl.arange(0, GROUPS)
    s = tl.arange(0, ROW_GROUP)
    slot = group[:, None] * ROW_GROUP + s[None, :]  # (GROUPS, ROW_GROUP)
    slot_in = slot < M
    code = tl.load(SORTED + (b * M + slot) * ROW_FIELDS + ROW_CODE, mask=slot_in, other=0)
    pattern = tl.sum(((code >> ROW_POS_SHIFT) & 1) << s[None, :], axis=1)
    order = tl.load(ORDERS + pattern[:, None] * ROW_GROUP + s[None, :])
    whole = (group[:, None] + 1) * ROW_GROUP <= M
    source = tl.where(whole, group[:, None] * ROW_GROUP + order, slot)
    for field in tl.static_range(ROW_FIELDS):
        value = tl.load(SORTED + (b * M + source) * ROW_FIELDS + field, mask=slot_in, other=0)
        tl.store(ROWS + (b * M + slot) * ROW_FIELDS + field, value, mask=slot_in)


# every kernel here, in launch order (bench.compile_report reports them beside the attention kernels)
KERNELS = (_first_ids_kernel, _tables_kernel, _row_groups_kernel)
