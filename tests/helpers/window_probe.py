"""A probe kernel for the skew windows' shared-memory order (kernels/rel_attention.py, kernel v4):
flatten a window the kernels' way and read it back at skewed columns, as their gathers do."""

import triton
import triton.language as tl

from xlnet_fast.kernels import rel_attention as ra


@triton.jit
def skewed_read_kernel(WINDOW, LAG, OUT, ROWS: tl.constexpr, COLS: tl.constexpr, N: tl.constexpr,
                       HALF: tl.constexpr):
    """OUT[0, i, j] = WINDOW[i, j + LAG[i]] (0 where that column is outside the window) for a (ROWS,
    COLS) WINDOW, through ``_flatten_window`` and ``_skewed_index``; OUT[1] through ``_window_index``
    (HALF: in the groups of 16-bit windows)."""
    rows = tl.arange(0, ROWS)
    window = tl.load(WINDOW + rows[:, None] * COLS + tl.arange(0, COLS)[None, :])
    flat = ra._flatten_window(window, ROWS, COLS, HALF)
    lag = tl.load(LAG + rows)[:, None]
    cols = tl.arange(0, N)[None, :]
    inside = (cols + lag >= 0) & (cols + lag < COLS)
    out = OUT + rows[:, None] * N + cols
    index = tl.where(inside, ra._skewed_index(rows[:, None], cols, lag, COLS, HALF), 0)
    got = tl.reshape(tl.gather(flat, tl.reshape(index, [ROWS * N]), axis=0), [ROWS, N])
    tl.store(out, tl.where(inside, got, 0.0))
    index = tl.where(inside, ra._window_index(rows[:, None], cols + lag, COLS, HALF), 0)
    got = tl.reshape(tl.gather(flat, tl.reshape(index, [ROWS * N]), axis=0), [ROWS, N])
    tl.store(out + ROWS * N, tl.where(inside, got, 0.0))
