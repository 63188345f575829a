"""Permutation-LM data: text -> token shard on disk -> XLNet pretraining batches (docs/DESIGN.md §7).

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

import hashlib
import json
import os
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch

from ..masks import local_perm
from .errors import UsageError
from .tokenizer import CLS_ID, EOD_ID, SEG_A, SEG_B, SEG_CLS, SEP_ID, SPECIAL_TOKENS, XLNetTokenizer

if TYPE_CHECKING:
    from .prepare import TokenShards


# --------------------------------------------------------------------------------------------------
# Corpus -> token shard
# --------------------------------------------------------------------------------------------------


JSONL_SUFFIXES = (".jsonl", ".ndjson")  # JSON lines, whatever the case of the suffix (.JSONL, .NDJSON)


def is_jsonl(path: str | os.PathLike) -> bool:
    """Whether a data file is read as JSON lines (one record with a ``text`` field per line) rather
    than as plain text."""
    return os.path.splitext(os.fspath(path))[1].lower() in JSONL_SUFFIXES


def decode_line(path: str, lineno: int, raw: bytes) -> str:
    """One line of a UTF-8 file as text; other bytes are an error naming the file and line."""
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise UsageError(f"{path}:{lineno}: not UTF-8 text (byte {raw[exc.start]:#04x} at column "
                         f"{exc.start + 1})") from None


def _decoded_lines(path: str) -> Iterator[tuple[int, str]]:
    """``(line number, text)`` of a UTF-8 file; other bytes are an error naming the file and line."""
    with open(path, "rb") as f:
        for lineno, raw in enumerate(f, 1):
            yield lineno, decode_line(path, lineno, raw)


def jsonl_record(path: str, lineno: int, line: str) -> tuple[str, object]:
    """The ``text`` and the document key (``book`` or ``doc``) of one ``.jsonl`` line."""
    try:
        rec = json.loads(line)
    except json.JSONDecodeError as exc:
        raise UsageError(f"{path}:{lineno}: invalid JSON ({exc.msg} at column {exc.colno})") from None
    if not isinstance(rec, dict) or "text" not in rec:
        raise UsageError(f"{path}:{lineno}: expected a JSON object with a 'text' field")
    if not isinstance(rec["text"], str):
        raise UsageError(f"{path}:{lineno}: 'text' must be a string, got {type(rec['text']).__name__}")
    return rec["text"], rec.get("book", rec.get("doc"))


def _jsonl_documents(path: str) -> Iterator[list[str]]:
    doc: list[str] = []
    current = None
    for lineno, line in _decoded_lines(path):
        if not line.strip():
            continue
        text, key = jsonl_record(path, lineno, line)
        if key != current and doc:
            yield doc
            doc = []
        current = key
        doc.append(text)
    if doc:
        yield doc


def _text_documents(path: str) -> Iterator[list[str]]:
    doc: list[str] = []
    for _, line in _decoded_lines(path):
        if line.strip():
            doc.append(line.strip())
        elif doc:
            yield doc
            doc = []
    if doc:
        yield doc


def iter_documents(paths: Iterable[str | os.PathLike]) -> Iterator[list[str]]:
    """Documents as lists of text lines. ``.jsonl``/``.ndjson`` (any case): one record per line with a
    string ``text`` field; a new ``book`` (or ``doc``) value starts a new document. Other files: plain
    text, a blank line ends a document. Files must be UTF-8; a bad line raises ``UsageError`` naming the
    file and line."""
    for path in paths:
        path = os.fspath(path)
        yield from (_jsonl_documents(path) if is_jsonl(path) else _text_documents(path))


def iter_lines(paths: Iterable[str | os.PathLike]) -> Iterator[str]:
    for doc in iter_documents(paths):
        yield from doc


def check_readable(paths: Iterable[str | os.PathLike]) -> None:
    """``UsageError`` naming the first path that is not a readable regular file."""
    for p in map(os.fspath, paths):
        if not os.path.exists(p):
            raise UsageError(f"data file not found: {p}")
        if not os.path.isfile(p):
            raise UsageError(f"data file is not a regular file: {p}")
        try:
            with open(p, "rb"):
                pass
        except OSError as exc:
            raise UsageError(f"data file cannot be read: {p} ({exc.strerror})") from None


def check_corpus(paths: Iterable[str | os.PathLike]) -> None:
    """Read every file once: readable, UTF-8, valid records, and some text in each file; the first
    problem is a ``UsageError`` naming the file (and line)."""
    paths = [os.fspath(p) for p in paths]
    check_readable(paths)
    for p in paths:
        has_text = False
        for line in iter_lines([p]):  # to the end: every line is checked
            has_text = has_text or bool(line.strip())
        if not has_text:
            raise UsageError(f"{p}: no text (the file is empty or holds only blank lines)")


def file_digest(path: str) -> str:
    """sha256 of the file's bytes (streamed) and of how it is parsed (``.jsonl`` or plain text)."""
    h = hashlib.sha256(b"jsonl:" if is_jsonl(path) else b"text:")
    try:
        with open(path, "rb") as f:
            for chunk in iter(lambda: f.read(1 << 20), b""):
                h.update(chunk)
    except OSError as exc:
        raise UsageError(f"data file cannot be read: {path} ({exc.strerror})") from None
    return h.hexdigest()


def corpus_digest(paths: Iterable[str | os.PathLike]) -> str:
    """A digest of the files' contents in the given order (the order of the token stream)."""
    return combine_digests(file_digest(os.fspath(p)) for p in paths)


def combine_digests(file_digests: Iterable[str]) -> str:
    """``corpus_digest`` from the files' ``file_digest`` values, in order."""
    h = hashlib.sha256()
    for d in file_digests:
        h.update(d.encode())
    return h.hexdigest()


def corpus_fingerprint(paths: Iterable[str | os.PathLike], extra: str = "") -> str:
    """A short cache key from the files' contents (not their names, sizes or times) and ``extra``."""
    return hashlib.sha256(f"{extra}:{corpus_digest(paths)}".encode()).hexdigest()[:16]


def _cached_tokens(out_path: str, fingerprint: str) -> np.memmap | None:
    meta_path = out_path + ".json"
    if not (os.path.exists(out_path) and os.path.exists(meta_path)):
        return None
    try:
        with open(meta_path) as f:
            meta = json.load(f)
    except (OSError, ValueError):
        return None
    if meta.get("fingerprint") != fingerprint or os.path.getsize(out_path) != 4 * meta.get("num_tokens", -1):
        return None
    return np.memmap(out_path, dtype=np.int32, mode="r")


def build_token_file(paths: list[str], tokenizer: XLNetTokenizer, out_path: str,
                     fingerprint: str | None = None) -> np.memmap:
    """Encode the corpus into an int32 token file (written streaming; ``<eod>`` ends each document).
    Reuses an existing file built from the same contents with the same tokenizer model; ``fingerprint``
    (of both) is computed when not given."""
    if fingerprint is None:
        with open(tokenizer.model_file, "rb") as f:
            fingerprint = corpus_fingerprint(paths, extra=hashlib.sha256(f.read()).hexdigest())
    cached = _cached_tokens(out_path, fingerprint)
    if cached is not None:
        return cached
    os.makedirs(os.path.dirname(os.path.abspath(out_path)), exist_ok=True)
    tmp = f"{out_path}.tmp{os.getpid()}"
    n = 0
    with open(tmp, "wb") as f:
        for doc in iter_documents(paths):
            ids: list[int] = []
            for line in doc:
                ids.extend(tokenizer.encode(line, add_special_tokens=False))
            ids.append(EOD_ID)
            np.asarray(ids, dtype=np.int32).tofile(f)
            n += len(ids)
    if n == 0:
        os.remove(tmp)
        raise UsageError(f"no text found in {[os.fspath(p) for p in paths]}")
    os.replace(tmp, out_path)
    meta_tmp = f"{out_path}.json.tmp{os.getpid()}"
    with open(meta_tmp, "w") as f:
        json.dump({"fingerprint": fingerprint, "num_tokens": n, "sources": [os.fspath(p) for p in paths],
                   "vocab_size": tokenizer.vocab_size}, f)
    os.replace(meta_tmp, out_path + ".json")
    return np.memmap(out_path, dtype=np.int32, mode="r")


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
    from .prepare import TokenShards, tokenizer_digest

    if isinstance(tokens, (str, os.PathLike)):
        tokens = TokenShards(tokens)
    if isinstance(tokens, TokenShards):
        if tokens.tokenizer_sha256 != tokenizer_digest(tokenizer):
            raise UsageError(f"{tokens.directory} was prepared with another tokenizer than {tokenizer.model_file} "
                             f"(its own is in {tokens.tokenizer_dir()})")
        return tokens
    if not isinstance(tokens, np.ndarray) or tokens.ndim != 1 or tokens.dtype.kind not in "iu":
        raise TypeError(f"tokens must be a 1-d integer array, TokenShards or a prepared directory, got "
                        f"{type(tokens).__name__}")
    return tokens


class PretrainBatches:
    """Deterministic, resumable batches for one rank.

    ``global_rows`` streams split the token file into contiguous parts (with ``bi_data``, the second
    half of the rows are the first half's streams reversed); this rank reads rows
    ``[rank * rows, (rank + 1) * rows)``. Every row has its own position and random generator, so the
    batches of a rank do not depend on the number of ranks.
    """

    def __init__(self, tokens: np.ndarray | TokenShards | str | os.PathLike, tokenizer: XLNetTokenizer,
                 cfg: DataConfig, rows: int, rank: int = 0, world_size: int = 1) -> None:
        """``tokens``: the token stream, as one array (``build_token_file``) or prepared data
        (``TokenShards`` or its directory, from ``prepare_corpus``; it must be ``tokenizer``'s)."""
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
