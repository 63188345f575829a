"""What the kernels (``rel_attention.py``) and their callers (the launcher ``__init__.py``,
``xlnet_fast.masks``) agree on: sentinels, modes and the fields of the tables the launcher builds for
the kernels. The table fields are defined here only; both sides read them by these names.

Plain Python values, and the standard library only: ``xlnet_fast`` reads this module without
importing torch, triton or the kernels (``xlnet_fast/kernel_contract.py``).
"""

import os

# Rank sentinels (int32): a key of rank INT32_MIN is visible to every query (memory), one of rank
# INT32_MAX to none (padding); a query row of rank INT32_MIN sees nothing (padding rows).
INT32_MIN = -(2**31)
INT32_MAX = 2**31 - 1

# The kernels' softmax is in base 2: the launcher folds scale * LOG2E into the query operands.
LOG2E = 1.4426950408889634

# Masking modes (the MASKING constexpr): no mask beyond the ranks' defaults, a dense bool mask, ranks.
MASK_NONE = 0
MASK_DENSE = 1
MASK_RANKS = 2

# Per-row int32 fields of the ROWS table (B, M, ROW_FIELDS), rows sorted by position with padding
# rows last: code; segment code (the ids ranked per batch row); rank (INT32_MIN for a padding row);
# the caller's row; how many leading keys the row sees all of (every key before that count has a
# rank below the row's; 0 for a padding row): the forward runs the whole key tiles that every real
# row of its tile sees without the visibility test, as FlashAttention masks only diagonal tiles.
ROW_FIELDS = 5
# Then each whole group of ROW_GROUP rows (one MMA accumulator's lanes hold ROW_GROUP consecutive
# tile rows, lane // 4) is reordered within itself, its first and last row kept, so that the skew's
# reads hit distinct shared-memory banks (tables.ROW_GROUP_ORDERS): a tile's first and last
# rows still hold its lowest and highest position.
ROW_GROUP = 8
ROW_CODE = 0
ROW_SEG = 1
ROW_RANK = 2
ROW_SRC = 3
ROW_FREE = 4
# code = position << ROW_POS_SHIFT | sees_own_key (a padding row repeats the last real position
# without the bit, so a tile's first and last rows give its position range).
ROW_POS_SHIFT = 1
ROW_OWN_KEY = 1

# Per-key int32 fields of the KEYS table (B, KEY_FIELDS, K padded to KEY_PAD), one row per field so
# that a key tile's ids load as vectors: segment code; rank (keys past the end: INT32_MAX, never
# visible; so key tiles load it unmasked).
KEY_PAD = 128
KEY_FIELDS = 2
KEY_SEG = 0
KEY_RANK = 1
# Calls of at most PACKED_KEYS_MAX keys pack a key's rank and segment code into KEY_RANK, so that
# a key tile's score pass loads one vector instead of two: KEY_RANK = rank code << KEY_RANK_SHIFT |
# segment code, where a rank's code is the number of its batch row's key ranks below it (key j is
# visible to query i iff code(k_rank[j]) < code(q_rank[i]); codes <= K), and ROW_RANK holds the
# row's code << KEY_RANK_SHIFT (a padding row: INT32_MIN still). Keys past the end: PACKED_PAD_KEY
# (a code above every row's). Segment codes are below K too, so both fit 16 bits.
KEY_RANK_SHIFT = 16
KEY_SEG_MASK = (1 << KEY_RANK_SHIFT) - 1
PACKED_KEYS_MAX = 2**15 - 2
PACKED_PAD_KEY = (PACKED_KEYS_MAX + 1) << KEY_RANK_SHIFT


def packed_keys(n_keys: int) -> bool:
    """Whether a call of ``n_keys`` keys packs ranks and segment codes (see PACKED_KEYS_MAX)."""
    return n_keys <= PACKED_KEYS_MAX


# Per-row fp32 segment scores of the E table (B, H, M, E_FIELDS), rows in ROWS order:
# (q + r_s_bias) . seg_embed[0] and (q + r_s_bias) . (seg_embed[1] - seg_embed[0]), scaled like q.
E_FIELDS = 2
E_SAME = 0
E_DELTA = 1


# The kernels launch one program row per (batch row, head): at most CUDA's limit on a grid's second
# dimension.
MAX_BATCH_HEADS = 65535


def interpreting() -> bool:
    """Whether Triton runs the kernels in its CPU interpreter (``TRITON_INTERPRET=1``)."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"
