"""Permutation-LM data: a token stream (prepared shards, ``prepare.py``) -> XLNet pretraining batches
(docs/DESIGN.md §7).

Each batch row is a contiguous token stream, read ``reuse_len`` tokens further every step, so the
mems a row carries to the next step cover the text that precedes it. A record is
``[reuse | A | <sep> | B | <sep> | <cls>]`` (segments 0, 0, 0, 1, 1, 2); B is A's continuation or,
with probability 1/2, text from elsewhere. Spans of whole words are masked (``num_predict`` in all,
span length n in 1..5 with p ∝ 1/n, context ``n * alpha / beta`` around each); the factorization order
is the original ``_local_perm`` over ``perm_size`` blocks, for the reuse half and the rest separately,
and the reuse half cannot see the rest. Batches carry compact masks — ranks and target positions —
never L×L masks. With ``bi_data`` the second half of the rows reads the first half's streams reversed.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from ..masks import local_perm
from .errors import UsageError
from .prepare import TokenShards
from .tokenizers import tokenizer_digest, tokenizer_source
from .tokenizer import CLS_ID, SEG_A, SEG_B, SEG_CLS, SEP_ID, SPECIAL_TOKENS, XLNetTokenizer


# --------------------------------------------------------------------------------------------------
# Masking and permutation (one record)
# --------------------------------------------------------------------------------------------------


def sample_span_mask(rng: np.random.Generator, is_start: np.ndarray, seg: np.ndarray, goal: int,
                     alpha: float = 6.0, beta: float = 1.0, max_gram: int = 5) -> np.ndarray:
    """The original ``_sample_mask`` with whole-word n-grams: True at masked positions of ``seg``.

    ``is_start[token]`` says whether a piece starts a word. Spans: n ~ p ∝ 1/n, then a context of
    ``n * alpha // beta`` tokens split randomly left/right of the span; tops up with single tokens
    until ``goal`` positions are masked.
    """
    L = len(seg)
    mask = np.zeros(L, dtype=bool)
    if goal <= 0 or L == 0:
        return mask
    ngrams = np.arange(1, max_gram + 1)
    pvals = 1.0 / ngrams
    pvals /= pvals.sum()
    n_pred, cur = 0, 0
    while cur < L and n_pred < goal:
        n = min(int(rng.choice(ngrams, p=pvals)), goal - n_pred)
        ctx = int(n * alpha // beta)
        l_ctx = int(rng.integers(ctx)) if ctx > 0 else 0
        r_ctx = ctx - l_ctx
        beg = cur + l_ctx
        while beg < L and not is_start[seg[beg]]:
            beg += 1
        if beg >= L:
            break
        end, words = beg + 1, 1  # end: start of the (n+1)-th word
        while end < L:
            if is_start[seg[end]]:
                words += 1
                if words > n:
                    break
            end += 1
        if end >= L:
            break
        mask[beg:end] = True
        n_pred += end - beg
        cur = end + r_ctx
    while n_pred < goal and not mask.all():
        i = int(rng.integers(L))
        if not mask[i]:
            mask[i] = True
            n_pred += 1
    return mask


def record_ranks(tokens: np.ndarray, is_masked: np.ndarray, reuse_len: int, perm_size: int,
                 rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``_local_perm`` on the reuse half and on the rest, joined so that the rest sees every reuse
    token and the reuse half sees none of the rest. Returns q_rank, k_rank (int32) and is_target."""
    parts = []
    offset = 0
    for lo, hi in ((0, reuse_len), (reuse_len, len(tokens))):
        if hi == lo:
            continue
        g = torch.Generator().manual_seed(int(rng.integers(2**62)))
        q, k, t = local_perm(torch.from_numpy(tokens[lo:hi].astype(np.int64)),
                             torch.from_numpy(is_masked[lo:hi]), perm_size, SEP_ID, CLS_ID, generator=g)
        parts.append((q.numpy() + offset, k.numpy() + offset, t.numpy()))
        # every rank of the rest exceeds every query rank of the reuse half (<= reuse_len)
        offset = reuse_len + 2
    q_rank, k_rank, is_target = (np.concatenate(x) for x in zip(*parts))
    return q_rank.astype(np.int32), k_rank.astype(np.int32), is_target


# --------------------------------------------------------------------------------------------------
# Batches
# --------------------------------------------------------------------------------------------------


@dataclass
class DataConfig:
    seq_len: int = 512
    reuse_len: int = 256
    num_predict: int = 85
    perm_size: int = 256
    mask_alpha: float = 6.0
    mask_beta: float = 1.0
    bi_data: bool = False
    seed: int = 0

    def check(self, name: Callable[[str], str] = str) -> None:
        """``UsageError`` when no record fits the layout; ``name`` renders a field's name in the
        message (the CLI passes its flag names)."""
        L, reuse, ps = self.seq_len, self.reuse_len, self.perm_size
        if L < 6:
            raise UsageError(f"{name('seq_len')} must be at least 6 (reuse, A, B and <sep> <sep> <cls>), got {L}")
        if not 1 <= reuse <= L - 5:
            raise UsageError(f"{name('reuse_len')} must be in [1, {name('seq_len')} - 5] = [1, {L - 5}] "
                             f"(A and B need a token each besides <sep> <sep> <cls>), got {reuse}")
        if ps < 1 or reuse % ps or (L - reuse) % ps:
            raise UsageError(f"{name('perm_size')} ({ps}) must divide {name('reuse_len')} ({reuse}) and "
                             f"{name('seq_len')} - {name('reuse_len')} ({L - reuse})")
        if not 1 <= self.num_predict <= L:
            raise UsageError(f"{name('num_predict')} must be in [1, {name('seq_len')}] = [1, {L}], "
                             f"got {self.num_predict}")


def _token_stream(tokens, tokenizer: XLNetTokenizer):
    """``tokens`` as something ``PretrainBatches`` indexes: an array, or ``TokenShards`` checked
    against the tokenizer."""
    if isinstance(tokens, (str, os.PathLike)):
        tokens = TokenShards(tokens)
    if isinstance(tokens, TokenShards):
        if tokens.tokenizer_sha256 != tokenizer_digest(tokenizer):
            raise UsageError(f"{tokens.directory} was prepared with another tokenizer than "
                             f"{tokenizer_source(tokenizer)} "
                             f"(its own is in {tokens.tokenizer_dir()})")
        return tokens
    if not isinstance(tokens, np.ndarray) or tokens.ndim != 1 or tokens.dtype.kind not in "iu":
        raise TypeError(f"tokens must be a 1-d integer array, TokenShards or a prepared directory, got "
                        f"{type(tokens).__name__}")
    return tokens


class PretrainBatches:
    """Deterministic, resumable batches for one rank.

    ``global_rows`` streams split the token stream into contiguous parts (with ``bi_data``, the second
    half of the rows are the first half's streams reversed); this rank reads rows
    ``[rank * rows, (rank + 1) * rows)``. Every row has its own position and random generator, so the
    batches of a rank do not depend on the number of ranks.
    """

    def __init__(self, tokens: np.ndarray | TokenShards | str | os.PathLike, tokenizer: XLNetTokenizer,
                 cfg: DataConfig, rows: int, rank: int = 0, world_size: int = 1) -> None:
        """``tokens``: the token stream, as one 1-d array of ids or prepared data (``TokenShards`` or
        its directory, from ``prepare_corpus``; it must be ``tokenizer``'s)."""
        c = cfg
        c.check()
        tokens = _token_stream(tokens, tokenizer)
        if rows < 1:
            raise UsageError(f"rows (the batch size per rank) must be positive, got {rows}")
        self.cfg, self.tokens, self.rows = c, tokens, rows
        self.global_rows = rows * world_size
        if c.bi_data and self.global_rows % 2:
            raise UsageError(f"bi_data needs an even global batch, got {self.global_rows}")
        n_streams = self.global_rows // 2 if c.bi_data else self.global_rows
        self.stream_len = len(tokens) // n_streams
        if self.stream_len < c.seq_len * 2:
            raise UsageError(f"corpus too small: {len(tokens)} tokens for {n_streams} streams (rows) of at "
                             f"least 2 x seq_len = {2 * c.seq_len}: use more text, fewer rows or a shorter seq_len")
        self.n_streams = n_streams
        self.row_ids = list(range(rank * rows, (rank + 1) * rows))
        vocab = tokenizer.vocab_size
        # a span may start at a word start or at a special token
        self.is_start = np.array([tokenizer.sp.IdToPiece(i).startswith("\u2581") or i < len(SPECIAL_TOKENS)
                                  for i in range(vocab)], dtype=bool)
        self.pos = {r: 0 for r in self.row_ids}
        self.rngs = {r: np.random.default_rng([c.seed, r]) for r in self.row_ids}

    def _stream(self, row: int, start: int, length: int) -> np.ndarray:
        """``length`` tokens of row ``row``'s stream from ``start`` (wrapping around)."""
        s = row % self.n_streams
        reverse = self.cfg.bi_data and row >= self.n_streams
        base = s * self.stream_len
        idx = (start + np.arange(length)) % self.stream_len
        if reverse:
            idx = self.stream_len - 1 - idx
        return np.asarray(self.tokens[base + idx], dtype=np.int64)

    def _record(self, row: int) -> dict[str, np.ndarray]:
        c, rng = self.cfg, self.rngs[row]
        pos = self.pos[row]
        rest = c.seq_len - c.reuse_len - 3
        a_len = int(rng.integers(1, rest))
        b_len = rest - a_len
        reuse_a = self._stream(row, pos, c.reuse_len + a_len)
        if rng.random() < 0.5:
            b = self._stream(row, pos + c.reuse_len + a_len, b_len)
        else:  # B from a random place of the corpus
            start = int(rng.integers(len(self.tokens) - b_len))
            b = np.asarray(self.tokens[start:start + b_len], dtype=np.int64)
        tokens = np.concatenate([reuse_a, [SEP_ID], b, [SEP_ID, CLS_ID]])
        seg = np.concatenate([np.full(c.reuse_len + a_len + 1, SEG_A), np.full(b_len + 1, SEG_B), [SEG_CLS]])
        reuse_goal = int(round(c.num_predict * c.reuse_len / c.seq_len))
        mask = np.concatenate([
            sample_span_mask(rng, self.is_start, tokens[:c.reuse_len], reuse_goal, c.mask_alpha, c.mask_beta),
            sample_span_mask(rng, self.is_start, tokens[c.reuse_len:], c.num_predict - reuse_goal,
                             c.mask_alpha, c.mask_beta)])
        q_rank, k_rank, is_target = record_ranks(tokens, mask, c.reuse_len, c.perm_size, rng)
        target_pos = np.flatnonzero(is_target)[: c.num_predict]
        pad = c.num_predict - len(target_pos)
        self.pos[row] = pos + c.reuse_len
        return dict(input_ids=tokens, token_type_ids=seg, q_rank=q_rank, k_rank=k_rank,
                    target_pos=np.concatenate([target_pos, np.full(pad, -1)]),
                    labels=np.concatenate([tokens[target_pos], np.full(pad, -100)]))

    def next_batch(self) -> dict[str, torch.Tensor]:
        """``input_ids``, ``token_type_ids`` (B, L); ``q_rank``, ``k_rank`` (B, L) int32;
        ``target_pos`` (B, num_predict) (-1 = padding); ``labels`` (B, num_predict) (-100 = padding)."""
        recs = [self._record(r) for r in self.row_ids]
        out = {k: torch.from_numpy(np.stack([r[k] for r in recs])) for k in recs[0]}
        for k in ("q_rank", "k_rank"):
            out[k] = out[k].to(torch.int32)
        return out

    def state_dict(self) -> dict:
        return {"pos": dict(self.pos), "rng": {r: g.bit_generator.state for r, g in self.rngs.items()}}

    def row_state(self, row: int) -> dict:
        """Row ``row``'s position and generator (JSON values): what a checkpoint keeps of it."""
        return {"pos": int(self.pos[row]), "rng": self.rngs[row].bit_generator.state}

    def load_row_states(self, states: dict[int, dict]) -> None:
        """``row_state`` values of this rank's rows, by global row."""
        self.load_state_dict({"pos": {r: states[r]["pos"] for r in self.row_ids},
                              "rng": {r: states[r]["rng"] for r in self.row_ids}})

    def load_state_dict(self, state: dict) -> None:
        for r in self.row_ids:
            self.pos[r] = int(state["pos"][r])
            self.rngs[r].bit_generator.state = state["rng"][r]


def model_on_batch(model, batch: dict[str, torch.Tensor], mems, use_mems: bool):
    """``model`` (an ``XLNetLMHeadModel``, maybe wrapped by DDP/FSDP/compile) on one ``next_batch``
    batch: the two-stream forward with the batch's compact masks; ``.logits`` is ``(B, num_predict,
    vocab)`` over the target rows, ``.mems`` the new memory. Training and evaluation both call it."""
    return model(batch["input_ids"], token_type_ids=batch["token_type_ids"], q_rank=batch["q_rank"],
                 k_rank=batch["k_rank"], target_pos=batch["target_pos"], mems=mems, use_mems=use_mems)
