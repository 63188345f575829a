"""Corpus-scale tokenization: text files -> a directory of token shards with an index (docs/DESIGN.md §7).

``prepare_corpus`` reads the corpus in chunks of lines, encodes the chunks in worker processes and
writes the results in order, so the output is byte-identical whatever the number of workers and
memory stays bounded whatever the corpus size. The token stream: each document of
``corpus.iter_documents`` as its lines encoded one by one, then the document's end: with a
sentencepiece tokenizer no special token per line and ``<eod>``, with a word-level vocabulary each
line's ``<eos>`` and one more (``tokenizers.py``); ``.jsonl`` documents are runs of records with the
same ``book`` (or ``doc``) value, text documents end at a blank line.

A prepared directory::

    index.json            format, dtype, tokenizer and source hashes, shards; rewritten atomically
                          after each shard, ``"complete": true`` once all is written
    shard-00000.bin       tokens, little-endian uint16 (vocabulary <= 65536) else int32
    shard-00000.docs.bin  little-endian int64: the end (exclusive, within the shard) of every
                          document whose ``<eod>`` is in the shard
    tokenizer/            the tokenizer that encoded it (``tokenizers.load_tokenizer_dir``)
    stat.json             size and modification time of every shard file when it was written or
                          last verified (a shard whose size or time differs is hashed on open)
    prepare.lock          held (``flock``) by the prepare writing the directory

Shards hold at least ``shard_tokens`` tokens (the last one fewer) and end after a whole source line;
the index records where in the sources each ends, so an interrupted prepare resumes after the last
complete shard. A source whose content changed (sha256), another tokenizer or shard size make the
directory out of date: it is prepared again only with ``overwrite`` (``--overwrite``; the cache's
directories always), with a warning saying why, else refused. ``TokenShards`` memory-maps the shards as
one token sequence.

Prepared data is verified when it is opened: always the index (its keys), the tokenizer, every shard
file's presence and size; the sha256 of the shards whose size or modification time differs from
``stat.json`` (a shard changed since it was written, a copied directory), or of every shard when
asked (``verify=True``, ``--verify-data``); and every id read against the vocabulary. Preparing a
directory again checks it the same way, prepares a damaged shard and what follows again, and records
the times of the shards it verified. Errors name the shard.
"""

from __future__ import annotations

import collections
import contextlib
import copy
import dataclasses
import hashlib
import io
import json
import logging
import multiprocessing
import os
import re
import shutil
import sys
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Future, ProcessPoolExecutor

import numpy as np

try:
    import fcntl
except ImportError:  # not POSIX: concurrent prepares of one directory are not serialised
    fcntl = None

from .corpus import check_readable, combine_digests, corpus_digest, decode_line, file_digest, is_jsonl, jsonl_record
from .errors import UsageError, naming_path
from .outputs import PREPARED_DIR, check_output_dir, refuse_earlier_output
from ..transfo_xl.tokenizer import VOCAB_TXT
from .tokenizer import SPIECE_NAME
from .tokenizers import (ALL_TOKENIZER_FILES, Tokenizer, document_end_id, encode_line, from_worker_spec,
                         holds_tokenizer, load_tokenizer_dir, tokenizer_digest, tokenizer_source,
                         worker_spec)

logger = logging.getLogger(__name__)

FORMAT = "xlnet_fast.prepared/1"
INDEX_NAME = "index.json"
TOKENIZER_DIR = "tokenizer"
LOCK_NAME = "prepare.lock"
STAT_NAME = "stat.json"
DEFAULT_SHARD_TOKENS = 1 << 24  # 32 MB per shard as uint16
CHUNK_BYTES = 1 << 19  # source bytes per work item (lines are never split)
UINT16_VOCAB_LIMIT = 1 << 16  # vocabularies up to this size store their ids as uint16
_SHARD_FILE = re.compile(r"shard-(\d{5,})(?:\.docs)?\.bin(?:\.tmp\d+)?")


def shard_name(i: int) -> str:
    return f"shard-{i:05d}.bin"


def docs_name(i: int) -> str:
    return f"shard-{i:05d}.docs.bin"


def token_dtype(vocab_size: int) -> np.dtype:
    """uint16 when every id of the vocabulary fits, else int32 (little-endian either way)."""
    return np.dtype("<u2") if vocab_size <= UINT16_VOCAB_LIMIT else np.dtype("<i4")


def default_workers() -> int:
    """The CPU cores this process may run on."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


# --------------------------------------------------------------------------------------------------
# Reading the sources in chunks
# --------------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Position:
    """A place between two source lines: source ``source`` (an index), ``offset`` bytes and ``line``
    lines of it read, whether a document is open there and (``.jsonl``) the open document's key."""

    source: int = 0
    offset: int = 0
    line: int = 0
    in_document: bool = False
    key: object = None

    def to_json(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_json(cls, record: dict) -> "Position":
        return cls(int(record["source"]), int(record["offset"]), int(record["line"]),
                   bool(record["in_document"]), record.get("key"))


@dataclasses.dataclass
class _Chunk:
    """Whole lines of one source: ``lines[0]`` starts at byte ``offset``, after ``line`` lines."""

    source: int
    path: str
    offset: int
    line: int
    lines: list[bytes]

    @property
    def jsonl(self) -> bool:
        return is_jsonl(self.path)


@dataclasses.dataclass
class _SourceEnd:
    """The end of source ``source`` (closes its open document)."""

    source: int


def _read_chunks(paths: list[str], start: Position, chunk_bytes: int) -> Iterator[_Chunk | _SourceEnd]:
    """The sources from ``start`` on, as chunks of about ``chunk_bytes`` bytes of whole lines."""
    for s in range(start.source, len(paths)):
        offset, line = (start.offset, start.line) if s == start.source else (0, 0)
        with open(paths[s], "rb") as f:
            f.seek(offset)
            while lines := f.readlines(chunk_bytes):
                yield _Chunk(s, paths[s], offset, line, lines)
                offset += sum(map(len, lines))
                line += len(lines)
        yield _SourceEnd(s)


# --------------------------------------------------------------------------------------------------
# Encoding (in the workers)
# --------------------------------------------------------------------------------------------------


@dataclasses.dataclass
class _Encoded:
    """A chunk's lines encoded: ``tokens`` (T,) int32 all lines' ids in order; ``counts`` (n,) the ids
    of each line; ``blank`` (n,) bool; ``keys``: each ``.jsonl`` line's document key (None if blank)."""

    tokens: np.ndarray
    counts: np.ndarray
    blank: list[bool]
    keys: list | None


def encode_chunk(tokenizer: Tokenizer, chunk: _Chunk) -> _Encoded:
    """Decode, parse and encode each line of ``chunk`` as ``corpus.iter_documents`` reads it
    (``tokenizers.encode_line``); a bad line raises ``UsageError`` naming the file and line."""
    ids: list[int] = []
    counts: list[int] = []
    blank: list[bool] = []
    keys: list | None = [] if chunk.jsonl else None
    for i, raw in enumerate(chunk.lines):
        lineno = chunk.line + i + 1
        line = decode_line(chunk.path, lineno, raw)
        is_blank = not line.strip()
        blank.append(is_blank)
        key = None
        if is_blank:
            text = ""
        elif keys is not None:
            text, key = jsonl_record(chunk.path, lineno, line)
        else:
            text = line.strip()
        if keys is not None:
            keys.append(key)
        line_ids = [] if is_blank else encode_line(tokenizer, text)
        ids.extend(line_ids)
        counts.append(len(line_ids))
    return _Encoded(np.array(ids, dtype=np.int32), np.array(counts, dtype=np.int64), blank, keys)


_worker_tokenizer: Tokenizer | None = None


def _init_worker(spec: tuple) -> None:
    global _worker_tokenizer
    _worker_tokenizer = from_worker_spec(spec)


def _encode_in_worker(chunk: _Chunk) -> _Encoded:
    return encode_chunk(_worker_tokenizer, chunk)


def _pool_context() -> multiprocessing.context.BaseContext:
    """``fork`` (the workers start at once) from a process with no other Python thread, no CUDA and
    no process group; else ``forkserver``, safe for a threaded parent (the server imports this module
    once; a script calling ``prepare_corpus`` then needs the ``if __name__ == "__main__"`` guard)."""
    torch = sys.modules.get("torch")
    threaded = threading.active_count() > 1 or (torch is not None and (
        torch.cuda.is_initialized() or (torch.distributed.is_available() and torch.distributed.is_initialized())))
    if not threaded and "fork" in multiprocessing.get_all_start_methods():
        return multiprocessing.get_context("fork")
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload([__name__])
    return context


@contextlib.contextmanager
def _encoder(tokenizer: Tokenizer, workers: int) -> Iterator[Callable[[_Chunk], Future]]:
    """``submit(chunk) -> Future[_Encoded]``: in this process for one worker, else in a pool of
    ``workers`` processes."""
    if workers == 1:
        def submit(chunk: _Chunk) -> Future:
            done: Future = Future()
            done.set_result(encode_chunk(tokenizer, chunk))
            return done

        yield submit
        return
    pool = ProcessPoolExecutor(workers, mp_context=_pool_context(), initializer=_init_worker,
                               initargs=(worker_spec(tokenizer),))
    try:
        yield lambda chunk: pool.submit(_encode_in_worker, chunk)
    finally:
        pool.shutdown(wait=True, cancel_futures=True)


# --------------------------------------------------------------------------------------------------
# Sequencing: documents and <eod> across chunks (in this process, in source order)
# --------------------------------------------------------------------------------------------------


@dataclasses.dataclass
class _Piece:
    """Part of the token stream: ``stream`` (T,) ids; ``unit_ends`` (U,) where each source line's
    tokens end in it (the places a shard may end); ``doc_ends`` the end (exclusive) of each document
    closed in it; ``positions[u]`` the source position after unit u; ``nbytes`` source bytes read."""

    stream: np.ndarray
    unit_ends: np.ndarray
    doc_ends: np.ndarray
    positions: Callable[[int], Position]
    nbytes: int
    end: Position


def _document_marks(enc: _Encoded, jsonl: bool, state: Position) -> tuple[list[bool], list[bool], list]:
    """Per line: whether an ``<eod>`` comes before its tokens, and whether a document is open and
    which key it has after the line."""
    eod, open_after, key_after = [], [], []
    in_doc, key = state.in_document, state.key
    for i, blank in enumerate(enc.blank):
        ends = False
        if blank:
            ends, in_doc = (False, in_doc) if jsonl else (in_doc, False)
        else:
            if jsonl:
                ends = in_doc and enc.keys[i] != key
                key = enc.keys[i]
            in_doc = True
        eod.append(ends)
        open_after.append(in_doc)
        key_after.append(key)
    return eod, open_after, key_after


def _sequence_chunk(chunk: _Chunk, enc: _Encoded, state: Position, eod_id: int) -> _Piece:
    eod, open_after, key_after = _document_marks(enc, chunk.jsonl, state)
    eod_lines = np.flatnonzero(np.array(eod, dtype=bool))
    line_starts = np.cumsum(enc.counts) - enc.counts
    stream = np.insert(enc.tokens, line_starts[eod_lines], eod_id)
    byte_ends = np.cumsum(np.fromiter(map(len, chunk.lines), dtype=np.int64, count=len(chunk.lines)))

    def position(u: int) -> Position:
        return Position(chunk.source, chunk.offset + int(byte_ends[u]), chunk.line + u + 1, open_after[u],
                        key_after[u])

    return _Piece(stream=stream, unit_ends=np.cumsum(enc.counts + np.array(eod, dtype=np.int64)),
                  doc_ends=line_starts[eod_lines] + np.arange(1, len(eod_lines) + 1), positions=position,
                  nbytes=int(byte_ends[-1]), end=position(len(chunk.lines) - 1))


def _sequence_source_end(end: _SourceEnd, state: Position, eod_id: int) -> _Piece:
    stream = np.array([eod_id] if state.in_document else [], dtype=np.int32)
    after = Position(end.source + 1)
    return _Piece(stream=stream, unit_ends=np.array([len(stream)]), doc_ends=np.arange(1, len(stream) + 1),
                  positions=lambda u: after, nbytes=0, end=after)


# --------------------------------------------------------------------------------------------------
# Writing shards and the index
# --------------------------------------------------------------------------------------------------


def _write_json_atomic(path: str, obj: dict) -> None:
    tmp = f"{path}.tmp{os.getpid()}"
    try:
        with naming_path(path), open(tmp, "w", encoding="utf-8") as f:
            json.dump(obj, f, indent=1)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.remove(tmp)


@dataclasses.dataclass
class _OpenShard:
    """The shard being written: its two temporary files, the tokens' sha256, documents ended in it."""

    tokens: io.BufferedWriter
    docs: io.BufferedWriter
    digest: object
    docs_digest: object
    documents: int = 0

    def files(self) -> tuple[io.BufferedWriter, io.BufferedWriter]:
        return self.docs, self.tokens


class _ShardWriter:
    """Cuts the stream into shards of at least ``shard_tokens`` tokens, each ending after a whole
    unit (source line); each shard is written to temporary files, renamed into place, then recorded
    in the index."""

    def __init__(self, out_dir: str, index: dict, stats: dict) -> None:
        self.out_dir, self.index, self.stats = out_dir, index, stats
        self.dtype = np.dtype(index["dtype"]).newbyteorder("<")
        self.shard_tokens = int(index["shard_tokens"])
        self.closed_tokens = sum(s["tokens"] for s in index["shards"])
        self.filled = 0
        self._open: _OpenShard | None = None

    def add(self, piece: _Piece) -> None:
        done = 0
        while True:
            target = done + self.shard_tokens - self.filled
            u = int(np.searchsorted(piece.unit_ends, target, side="left"))
            if u == len(piece.unit_ends):
                self._write(piece, done, len(piece.stream))
                return
            end = int(piece.unit_ends[u])
            self._write(piece, done, end)
            self._close(piece.positions(u))
            done = end

    def stream_tokens(self) -> int:
        """Tokens written so far (closed shards and the open one)."""
        return self.closed_tokens + self.filled

    def _paths(self) -> tuple[str, str]:
        i = len(self.index["shards"])
        return os.path.join(self.out_dir, shard_name(i)), os.path.join(self.out_dir, docs_name(i))

    def _write(self, piece: _Piece, lo: int, hi: int) -> None:
        if hi <= lo:
            return
        if self._open is None:
            suffix = f".tmp{os.getpid()}"
            tokens_path, docs_path = self._paths()
            self._open = _OpenShard(open(tokens_path + suffix, "wb"), open(docs_path + suffix, "wb"), hashlib.sha256(),
                                    hashlib.sha256())
        shard = self._open
        data = piece.stream[lo:hi].astype(self.dtype).tobytes()
        with naming_path(shard.tokens.name):
            shard.tokens.write(data)
        shard.digest.update(data)
        ends = piece.doc_ends[(piece.doc_ends > lo) & (piece.doc_ends <= hi)]
        docs = (ends - lo + self.filled).astype("<i8").tobytes()
        with naming_path(shard.docs.name):
            shard.docs.write(docs)
        shard.docs_digest.update(docs)
        shard.documents += len(ends)
        self.filled += hi - lo

    def _close(self, end: Position) -> None:
        shard = self._open
        for f in shard.files():
            with naming_path(f.name):
                f.flush()
                os.fsync(f.fileno())
            f.close()
            final = f.name.rsplit(".tmp", 1)[0]
            os.replace(f.name, final)
            self.stats[os.path.basename(final)] = _file_stat(final)
        _write_json_atomic(os.path.join(self.out_dir, STAT_NAME), self.stats)
        tokens_path, _ = self._paths()
        self.index["shards"].append({"file": os.path.basename(tokens_path), "tokens": self.filled,
                                     "documents": shard.documents, "sha256": shard.digest.hexdigest(),
                                     "docs_sha256": shard.docs_digest.hexdigest(), "end": end.to_json()})
        self.closed_tokens += self.filled
        self.filled, self._open = 0, None
        _write_json_atomic(os.path.join(self.out_dir, INDEX_NAME), self.index)

    def finish(self, end: Position) -> None:
        """Close the last shard and mark the index complete."""
        if self.filled:
            self._close(end)
        shards = self.index["shards"]
        ends = self.index["source_end_tokens"]
        for i, source in enumerate(self.index["sources"]):
            source["tokens"] = ends[i] - (ends[i - 1] if i else 0)
        self.index.update(complete=True, num_tokens=self.closed_tokens,
                          num_documents=sum(s["documents"] for s in shards))
        _write_json_atomic(os.path.join(self.out_dir, INDEX_NAME), self.index)

    def discard(self) -> None:
        """Remove the open shard's temporary files (after an error)."""
        if self._open is not None:
            for f in self._open.files():
                f.close()
                with contextlib.suppress(FileNotFoundError):
                    os.remove(f.name)
            self._open = None


# --------------------------------------------------------------------------------------------------
# Which work is left: the index against the sources and the tokenizer
# --------------------------------------------------------------------------------------------------


def _fresh_index(paths: list[str], digests: list[str], tokenizer: Tokenizer, tok_digest: str,
                 shard_tokens: int) -> dict:
    return {
        "format": FORMAT,
        "dtype": token_dtype(tokenizer.vocab_size).name,
        "vocab_size": tokenizer.vocab_size,
        "eod_id": document_end_id(tokenizer),
        "tokenizer_sha256": tok_digest,
        "corpus_sha256": combine_digests(digests),
        "sources": [{"path": p, "sha256": d, "bytes": os.path.getsize(p)} for p, d in zip(paths, digests)],
        "shard_tokens": shard_tokens,
        "shards": [],
        "source_end_tokens": [],
        "complete": False,
    }


def read_index(directory: str) -> dict | None:
    """The directory's index, or None when it has none or an unreadable one."""
    try:
        with open(os.path.join(directory, INDEX_NAME), encoding="utf-8") as f:
            index = json.load(f)
    except (OSError, ValueError):
        return None
    return index if isinstance(index, dict) and index.get("format") == FORMAT else None


_INDEX_FIELDS = {"dtype": str, "vocab_size": int, "tokenizer_sha256": str, "corpus_sha256": str, "sources": list,
                 "shard_tokens": int, "shards": list, "source_end_tokens": list, "complete": bool}
_COMPLETE_FIELDS = {"num_tokens": int, "num_documents": int}
_SHARD_FIELDS = {"tokens": int, "documents": int, "sha256": str, "end": dict}


def index_problem(index: dict) -> str | None:
    """What is missing or wrong in an index (``read_index``'s), None when nothing is."""
    def wrong(record: dict, fields: dict, where: str) -> str | None:
        for key, kind in fields.items():
            value = record.get(key) if isinstance(record, dict) else None
            if not isinstance(value, kind) or (kind is int and (isinstance(value, bool) or value < 0)):
                return f"{where}'{key}' is missing or not a{'n' if kind in (int, list) else ''} {kind.__name__}"
        return None

    problem = wrong(index, _INDEX_FIELDS, "")
    if problem is None and index["complete"]:
        problem = wrong(index, _COMPLETE_FIELDS, "")
    if problem is None and index["dtype"] not in ("uint16", "int32"):
        problem = f"'dtype' {index['dtype']!r} is neither uint16 nor int32"
    for i, shard in enumerate(index.get("shards") or []):
        problem = problem or wrong(shard, _SHARD_FIELDS, f"shard {i}: ")
    return problem


def _why_not_reusable(old: dict, new: dict) -> str | None:
    """Why an existing index cannot be continued for ``new``'s sources and settings (None: it can)."""
    old_sources, new_sources = old.get("sources", []), new["sources"]
    if len(old_sources) != len(new_sources):
        return f"it was prepared from {len(old_sources)} source file(s), now {len(new_sources)} are given"
    for was, now in zip(old_sources, new_sources):
        if was.get("sha256") != now["sha256"]:
            return (f"{now['path']} differs from the prepared source {was.get('path')} (content sha256 "
                    f"{str(was.get('sha256'))[:12]} -> {now['sha256'][:12]})")
    if old.get("tokenizer_sha256") != new["tokenizer_sha256"]:
        return "it was encoded with another tokenizer"
    for name in ("dtype", "shard_tokens", "eod_id"):
        if old.get(name) != new[name]:
            return f"its {name} {old.get(name)} differs from {new[name]}"
    return None


def _file_stat(path: str) -> list[int]:
    st = os.stat(path)
    return [st.st_size, st.st_mtime_ns]


def read_stats(directory: str) -> dict:
    """``stat.json``: shard file name -> ``[size, mtime_ns]`` when it was written or last verified."""
    try:
        with open(os.path.join(directory, STAT_NAME), encoding="utf-8") as f:
            stats = json.load(f)
    except (OSError, ValueError):
        return {}
    return stats if isinstance(stats, dict) else {}


_hashed: set[tuple] = set()  # (path, size, mtime_ns, sha256) of the shard files this process hashed and found right


def _file_sha256(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 22), b""):
            h.update(chunk)
    return h.hexdigest()


def _shard_problem(directory: str, i: int, shard: dict, itemsize: int, stats: dict, hash_all: bool) -> str | None:
    """Why shard ``i`` cannot be used (``None``: it can): a file missing or of the wrong size; with
    ``hash_all``, or when a file's size or time differs from ``stats``, a sha256 that is not the index's."""
    files = ((shard_name(i), shard["tokens"] * itemsize, shard.get("sha256")),
             (docs_name(i), shard["documents"] * 8, shard.get("docs_sha256")))
    for name, size, _ in files:
        path = os.path.join(directory, name)
        if not os.path.isfile(path) or os.path.getsize(path) != size:
            return f"{name} is missing or truncated"
    for name, _, expected in files:
        path = os.path.join(directory, name)
        stat = _file_stat(path)
        key = (os.path.realpath(path), *stat, expected)
        if expected is None or key in _hashed or (not hash_all and stats.get(name) == stat):
            continue
        if _file_sha256(path) != expected:
            return f"{name} does not match its sha256 in {INDEX_NAME} (changed since it was prepared)"
        _hashed.add(key)
    return None


def _hash_note(directory: str, shards: list, stats: dict, hash_all: bool) -> None:
    """Say (once per open) that shards are hashed, and why."""
    if hash_all:
        logger.info("%s: verifying the sha256 of its %d shard(s)", directory, len(shards))
        return
    changed = [shard_name(i) for i in range(len(shards))
               if os.path.isfile(os.path.join(directory, shard_name(i)))
               and stats.get(shard_name(i)) != _file_stat(os.path.join(directory, shard_name(i)))]
    if changed:
        logger.info("%s: verifying the sha256 of %d shard(s) whose size or modification time is not the one "
                    "recorded in %s (%s%s; copied, or prepared by an earlier version?)", directory, len(changed),
                    STAT_NAME, ", ".join(changed[:3]), ", ..." if len(changed) > 3 else "")


def _continue_index(directory: str, old: dict, new: dict, verify: bool) -> dict:
    """``old``'s shards up to the first one missing, of the wrong size or (hashed when its time
    changed, or all with ``verify``) of the wrong sha256; the rest is prepared again."""
    itemsize = np.dtype(new["dtype"]).itemsize
    shards = old["shards"]
    stats = read_stats(directory)
    _hash_note(directory, shards, stats, hash_all=verify)
    good, problem = len(shards), None
    for i, shard in enumerate(shards):
        problem = _shard_problem(directory, i, shard, itemsize, stats, hash_all=verify)
        if problem is not None:
            good = i
            break
    if problem is not None:
        logger.warning("%s: %s: preparing again from there", directory, problem)
    index = dict(new, shards=shards[:good])
    end = Position.from_json(shards[good - 1]["end"]) if good else Position()
    index["source_end_tokens"] = old.get("source_end_tokens", [])[:end.source]
    index["complete"] = bool(old.get("complete")) and good == len(shards)
    if index["complete"]:
        index.update({k: old[k] for k in ("num_tokens", "num_documents")})
        index["sources"] = [dict(s, tokens=o.get("tokens")) for s, o in zip(new["sources"], old["sources"])]
    return index


def _start_index(directory: str, new: dict, verify: bool = False) -> dict:
    """The index to continue: the existing one if it matches ``new``'s sources and settings, else
    ``new`` (saying why the existing one is discarded)."""
    old = read_index(directory)
    problem = index_problem(old) if old is not None else "unreadable"
    if problem is not None:
        if os.path.exists(os.path.join(directory, INDEX_NAME)):
            logger.warning("%s: %s %s: preparing from the start", directory, INDEX_NAME, problem)
        return new
    reason = _why_not_reusable(old, new)
    if reason is not None:
        logger.warning("%s holds prepared data that is out of date (%s): preparing it again", directory, reason)
        return new
    return _continue_index(directory, old, new, verify)


def _remove_stale_files(directory: str, keep_shards: int) -> None:
    """Delete shard files (and temporary files) not among the first ``keep_shards`` shards."""
    for name in os.listdir(directory):
        m = _SHARD_FILE.fullmatch(name)
        if m and (int(m.group(1)) >= keep_shards or ".tmp" in name):
            os.remove(os.path.join(directory, name))
        elif name.startswith(INDEX_NAME + ".tmp") or name.startswith(STAT_NAME + ".tmp"):
            os.remove(os.path.join(directory, name))


def _save_tokenizer(directory: str, tokenizer: Tokenizer, digest: str) -> None:
    """``directory/tokenizer``, unless it already holds this tokenizer."""
    final = os.path.join(directory, TOKENIZER_DIR)
    with contextlib.suppress(OSError, ValueError):
        if tokenizer_digest(load_tokenizer_dir(final)) == digest:
            return
    tmp = f"{final}.tmp{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        with naming_path(tmp):
            tokenizer.save_pretrained(tmp)
        shutil.rmtree(final, ignore_errors=True)  # only prepare's own files (outputs.check_output_dir)
        os.replace(tmp, final)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


@contextlib.contextmanager
def _directory_lock(directory: str) -> Iterator[None]:
    """One prepare at a time in ``directory``: a second one waits for the first."""
    if fcntl is None:
        yield
        return
    fd = os.open(os.path.join(directory, LOCK_NAME), os.O_RDWR | os.O_CREAT, 0o644)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            logger.warning("%s: another process is preparing it: waiting", directory)
            fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


# --------------------------------------------------------------------------------------------------
# Prepare
# --------------------------------------------------------------------------------------------------


def owned_by_prepare(name: str, is_dir: bool) -> bool:
    """Whether ``prepare_corpus`` writes the entry ``name`` (a path relative to its output directory)."""
    parts = name.split(os.sep)
    if parts[0] == TOKENIZER_DIR or re.fullmatch(rf"{TOKENIZER_DIR}\.tmp\d+", parts[0]):
        return is_dir if len(parts) == 1 else (len(parts) == 2 and not is_dir and parts[1] in ALL_TOKENIZER_FILES)
    if is_dir or len(parts) > 1:
        return False
    return bool(_SHARD_FILE.fullmatch(name)) or name in (INDEX_NAME, STAT_NAME, LOCK_NAME) or bool(
        re.fullmatch(rf"({re.escape(INDEX_NAME)}|{re.escape(STAT_NAME)})\.tmp\d+", name))


def _check_arguments(paths: list[str], tokenizer: Tokenizer, out_dir: str, workers: int, shard_tokens: int,
                     chunk_bytes: int) -> None:
    for name, value in (("workers", workers), ("shard_tokens", shard_tokens), ("chunk_bytes", chunk_bytes)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise UsageError(f"{name} must be a positive integer, got {value!r}")
    if not paths:
        raise UsageError("no source files given")
    check_readable(paths)
    check_output_dir(out_dir, command="data prepare", inputs=[*paths, tokenizer_source(tokenizer)], kind=PREPARED_DIR,
                     owned=owned_by_prepare)


class _Progress:
    """A tqdm bar on stderr in source MB, with tokens/s."""

    def __init__(self, total: int, done: int, enabled: bool) -> None:
        from tqdm import tqdm

        class Bar(tqdm):
            monitor_interval = 0  # no monitor thread: a later prepare may still fork its workers

        self.bar = Bar(total=total, initial=done, unit="B", unit_scale=True, desc="prepare", file=sys.stderr,
                       disable=not enabled, dynamic_ncols=True, smoothing=0.1)
        self.start, self.tokens = time.perf_counter(), 0

    def update(self, nbytes: int, ntokens: int) -> None:
        self.tokens += ntokens
        self.bar.update(nbytes)
        elapsed = time.perf_counter() - self.start
        if elapsed > 0:
            self.bar.set_postfix_str(f"{self.tokens / elapsed:,.0f} tokens/s", refresh=False)

    def close(self) -> None:
        self.bar.close()


def _run(paths: list[str], tokenizer: Tokenizer, writer: _ShardWriter, start: Position, workers: int,
         chunk_bytes: int, show_progress: bool) -> Position:
    """Encode the sources from ``start`` and hand the pieces to ``writer`` in order; at most
    2 x ``workers`` chunks are in flight. Returns the position after the last source."""
    state = start
    pending: collections.deque = collections.deque()
    sources = writer.index["sources"]
    done = sum(s["bytes"] for s in sources[:start.source]) + start.offset
    eod_id = document_end_id(tokenizer)

    def consume() -> None:
        nonlocal state
        item, future = pending.popleft()
        if isinstance(item, _Chunk):
            piece = _sequence_chunk(item, future.result(), state, eod_id)
        else:
            piece = _sequence_source_end(item, state, eod_id)
        if isinstance(item, _SourceEnd):  # recorded first: a shard may end with this piece
            writer.index["source_end_tokens"].append(writer.stream_tokens() + len(piece.stream))
        writer.add(piece)
        progress.update(piece.nbytes, len(piece.stream))
        state = piece.end

    with _encoder(tokenizer, workers) as submit, contextlib.closing(
            _Progress(sum(s["bytes"] for s in sources), done, show_progress)) as progress:  # after the fork
        for item in _read_chunks(paths, start, chunk_bytes):
            pending.append((item, submit(item) if isinstance(item, _Chunk) else None))
            while len(pending) > 2 * workers:
                consume()
        while pending:
            consume()
    return state


def prepare_corpus(paths: Iterable[str | os.PathLike], tokenizer: Tokenizer, out_dir: str | os.PathLike, *,
                   workers: int | None = None, shard_tokens: int = DEFAULT_SHARD_TOKENS, progress: bool = False,
                   chunk_bytes: int = CHUNK_BYTES, verify: bool = False, overwrite: bool = False) -> "TokenShards":
    """Encode ``paths`` with ``tokenizer`` into ``out_dir`` (see the module docstring) using ``workers``
    processes (default: the usable cores); continues an interrupted prepare and returns at once when
    ``out_dir`` is already prepared from these contents. Data prepared from other contents or settings
    is prepared again only with ``overwrite``, else a ``UsageError`` (``outputs.refuse_earlier_output``).
    The shards kept from an earlier prepare are checked as ``TokenShards`` checks them (``verify``: every
    one hashed); a bad one is prepared again, with what follows it."""
    paths = [os.path.abspath(os.fspath(p)) for p in paths]
    out_dir = os.fspath(out_dir)
    workers = default_workers() if workers is None else workers
    _check_arguments(paths, tokenizer, out_dir, workers, shard_tokens, chunk_bytes)
    new = _fresh_index(paths, [file_digest(p) for p in paths], tokenizer, tokenizer_digest(tokenizer), shard_tokens)
    _refuse_other_data(out_dir, new, overwrite)  # before anything is written
    os.makedirs(out_dir, exist_ok=True)
    with naming_path(out_dir), _directory_lock(out_dir):
        try:
            _prepare_locked(paths, tokenizer, out_dir, new, workers, chunk_bytes, progress, verify)
        except UsageError:  # bad input: what was prepared is of no use, remove it (the lock file stays:
            _remove_own_files(out_dir)  # another prepare may be waiting on it)
            raise
    return TokenShards(out_dir)


def _refuse_other_data(out_dir: str, new: dict, overwrite: bool) -> None:
    """An ``out_dir`` holding data prepared from other contents or settings than ``new``'s is replaced
    only with ``overwrite`` (one with an unreadable index is prepared from the start, said then)."""
    old = read_index(out_dir)
    if old is None or index_problem(old) is not None:
        return
    reason = _why_not_reusable(old, new)
    refuse_earlier_output(out_dir, command="data prepare", overwrite=overwrite,
                          found=None if reason is None else f"prepared data that is out of date ({reason})")


def _prepare_locked(paths: list[str], tokenizer: Tokenizer, out_dir: str, new: dict, workers: int,
                    chunk_bytes: int, progress: bool, verify: bool) -> None:
    """``prepare_corpus``'s work for the index ``new`` (``_fresh_index``), holding the directory's lock."""
    tok_digest = new["tokenizer_sha256"]
    index = _start_index(out_dir, new, verify)
    _save_tokenizer(out_dir, tokenizer, tok_digest)
    stats = _kept_stats(out_dir, index)
    if stats != read_stats(out_dir):  # the times of the shards verified now (e.g. of a copied directory)
        _write_json_atomic(os.path.join(out_dir, STAT_NAME), stats)
    if index["complete"]:
        return
    _remove_stale_files(out_dir, len(index["shards"]))
    _write_json_atomic(os.path.join(out_dir, INDEX_NAME), index)
    start = Position.from_json(index["shards"][-1]["end"]) if index["shards"] else Position()
    if index["shards"]:
        logger.info("%s: resuming after %d complete shard(s)", out_dir, len(index["shards"]))
    writer = _ShardWriter(out_dir, index, stats)
    try:
        end = _run(paths, tokenizer, writer, start, workers, chunk_bytes, progress)
        if writer.stream_tokens() == 0:
            raise UsageError(f"no text found in {paths}")
        writer.finish(end)
    except BaseException:  # interrupted or a full disk: the complete shards stay for a resume, and the
        writer.discard()   # index says the preparation did not finish (nothing takes it as data)
        raise


def _kept_stats(directory: str, index: dict) -> dict:
    """``stat.json``'s entries for the shards the index keeps, as the files are now (``_start_index``
    verified them)."""
    names = [n for i in range(len(index["shards"])) for n in (shard_name(i), docs_name(i))]
    return {n: _file_stat(os.path.join(directory, n)) for n in names}


def _remove_own_files(directory: str) -> None:
    """Delete everything ``prepare_corpus`` wrote in ``directory`` but its lock (held until the end)."""
    for entry in os.scandir(directory):
        if entry.name != LOCK_NAME and owned_by_prepare(entry.name, entry.is_dir(follow_symlinks=False)):
            if entry.is_dir(follow_symlinks=False):
                shutil.rmtree(entry.path)
            else:
                os.remove(entry.path)


# --------------------------------------------------------------------------------------------------
# Reading prepared data
# --------------------------------------------------------------------------------------------------


def is_prepared_dir(path: str | os.PathLike) -> bool:
    """Whether ``path`` is a directory with a prepared-data index (complete or not)."""
    return os.path.isdir(path) and os.path.isfile(os.path.join(path, INDEX_NAME))


def prepared_directory(paths: Iterable[str | os.PathLike], flag: str = "--data") -> str | None:
    """The directory when ``paths`` is one prepared directory, None when it names no directory;
    ``UsageError`` (naming ``flag``) for a directory that is not prepared data or one mixed with other
    paths."""
    paths = [os.fspath(p) for p in paths]
    dirs = [p for p in paths if os.path.isdir(p)]
    if not dirs:
        return None
    if not is_prepared_dir(dirs[0]):
        raise UsageError(f"{flag} {dirs[0]} is a directory without {INDEX_NAME}, not prepared data: prepare it "
                         "with `xlnet-fast data prepare FILE... --out DIR` or pass the text files")
    if len(paths) > 1:
        raise UsageError(f"{flag} takes text files or one prepared directory, got {len(dirs)} "
                         f"director{'y' if len(dirs) == 1 else 'ies'} among {len(paths)} paths")
    return dirs[0]


def data_digest(paths: list[str], flag: str = "--data") -> str:
    """The content digest of text files (``corpus_digest``) or of a prepared directory (the digest of
    the files it was prepared from, from its index)."""
    directory = prepared_directory(paths, flag)
    return TokenShards(directory).corpus_sha256 if directory is not None else corpus_digest(paths)


MIN_BYTES_PER_WORKER = 8 * CHUNK_BYTES  # a smaller corpus is not worth another process


def workers_for(paths: Iterable[str | os.PathLike]) -> int:
    """Worker processes worth starting for these files: the usable cores, but at most one per
    ``MIN_BYTES_PER_WORKER`` bytes (a small corpus is encoded in this process)."""
    total = sum(os.path.getsize(p) for p in paths)
    return max(1, min(default_workers(), total // MIN_BYTES_PER_WORKER))


def prepared_tokens(paths: list[str], tokenizer: Tokenizer, cache_dir: str, rank: int = 0, world: int = 1,
                    progress: bool = False, digest: str | None = None, verify: bool = False) -> "TokenShards":
    """The tokens of ``paths``: a prepared directory as it is, or text files prepared (by rank 0; the
    others wait, and rank 0's error reaches them) into ``cache_dir/prepared``, keyed by the text's
    content (``digest``: its ``corpus_digest`` when the caller has it) and the tokenizer's.
    ``verify``: hash every shard on opening."""
    from .distributed import from_rank0

    directory = prepared_directory(paths)
    if directory is None:
        digest = digest or corpus_digest(paths)
        key = hashlib.sha256(f"{digest}:{tokenizer_digest(tokenizer)}".encode()).hexdigest()
        directory = os.path.join(cache_dir, "prepared", key[:16])

        def prepare() -> None:
            if not is_prepared_dir(directory):
                logger.info("preparing %s into %s (for a large corpus, run `xlnet-fast data prepare` first and "
                            "pass its directory)", " ".join(map(os.fspath, paths)), directory)
            prepare_corpus(paths, tokenizer, directory, workers=workers_for(paths), progress=progress,
                           overwrite=True)  # the cache's own, keyed by content

        from_rank0(prepare, rank, world)
    return TokenShards(directory, verify=verify)


class TokenShards:
    """A prepared directory's token stream as one read-only sequence over memory-mapped shards.

    ``len()`` is the number of tokens; indexing takes an int, a slice or an integer array and returns
    ids in the shards' dtype (uint16 or int32), like indexing one ``np.memmap`` of the whole stream.
    """

    def __init__(self, directory: str | os.PathLike, verify: bool = False) -> None:
        """Open and check a prepared directory (the module's docstring says what is checked; ``verify``:
        hash every shard). A problem is a ``UsageError`` naming the file."""
        self.directory = os.fspath(directory)
        index = read_index(self.directory)
        again = "prepare it again (`xlnet-fast data prepare` with the same files)"
        if index is None:
            raise UsageError(f"{self.directory} is not prepared data (no readable {INDEX_NAME}): prepare it "
                             "with `xlnet-fast data prepare`")
        if not index.get("complete"):
            raise UsageError(f"{self.directory}: its preparation did not finish: run `xlnet-fast data prepare` "
                             "again with the same files to resume it")
        problem = index_problem(index)
        if problem is not None:
            raise UsageError(f"{os.path.join(self.directory, INDEX_NAME)}: {problem}: {again}")
        if not holds_tokenizer(os.path.join(self.directory, TOKENIZER_DIR)):
            raise UsageError(f"{os.path.join(self.directory, TOKENIZER_DIR, SPIECE_NAME)} is missing (the tokenizer "
                             f"that encoded the data; a word-level one is {VOCAB_TXT}): {again}")
        self.index = index
        self.dtype = np.dtype(index["dtype"]).newbyteorder("<")
        stats = read_stats(self.directory)
        _hash_note(self.directory, index["shards"], stats, hash_all=verify)
        self._maps = []
        for i, shard in enumerate(index["shards"]):
            problem = _shard_problem(self.directory, i, shard, self.dtype.itemsize, stats, hash_all=verify)
            if problem is not None:
                raise UsageError(f"{self.directory}: {problem}: {again}")
            self._maps.append(np.memmap(os.path.join(self.directory, shard_name(i)), dtype=self.dtype, mode="r",
                                        shape=(shard["tokens"],)))
        self._starts = np.cumsum([0] + [s["tokens"] for s in index["shards"]])
        self._len = int(self._starts[-1])
        # ids are checked against the vocabulary as they are read (a uint16 id is always below 65536)
        self._id_limit = None if self.dtype.itemsize == 2 and self.vocab_size >= UINT16_VOCAB_LIMIT else self.vocab_size

    @property
    def vocab_size(self) -> int:
        return int(self.index["vocab_size"])

    @property
    def tokenizer_sha256(self) -> str:
        return self.index["tokenizer_sha256"]

    @property
    def corpus_sha256(self) -> str:
        """``corpus_digest`` of the sources it was prepared from."""
        return self.index["corpus_sha256"]

    @property
    def num_documents(self) -> int:
        return int(self.index["num_documents"])

    def tokenizer(self) -> Tokenizer:
        """The tokenizer that encoded the data."""
        return load_tokenizer_dir(os.path.join(self.directory, TOKENIZER_DIR))

    def tokenizer_dir(self) -> str:
        return os.path.join(self.directory, TOKENIZER_DIR)

    def head(self, n: int) -> "TokenShards":
        """The first ``n`` tokens as a ``TokenShards`` over the same memory maps (no copy)."""
        view = copy.copy(self)
        view._len = max(0, min(int(n), self._len))
        return view

    def __len__(self) -> int:
        return self._len

    def __repr__(self) -> str:
        return f"TokenShards({self.directory!r}: {self._len} tokens in {len(self._maps)} shard(s), {self.dtype.name})"

    def __getitem__(self, key):
        if isinstance(key, slice):
            start, stop, step = key.indices(self._len)
            if step == 1:
                stop = max(start, stop)
                return self._checked(self._range(start, stop), lambda k: start + k)
            key = np.arange(start, stop, step)
        idx = np.asarray(key)
        if idx.ndim == 0:
            return self._gather(idx.reshape(1))[0]
        return self._gather(idx)

    def _checked(self, ids: np.ndarray, position) -> np.ndarray:
        """``ids`` as read, or a ``UsageError`` naming the shard holding one past the vocabulary
        (``position(k)``: the stream position of ``ids.flat[k]``)."""
        if self._id_limit is None or ids.size == 0 or int(ids.max()) < self._id_limit:
            return ids
        k = int(np.argmax(ids.reshape(-1) >= self._id_limit))
        where = int(position(k))
        shard = int(np.searchsorted(self._starts, where, side="right")) - 1
        raise UsageError(f"{os.path.join(self.directory, shard_name(shard))}: token id {int(ids.reshape(-1)[k])} at "
                         f"position {where - int(self._starts[shard])} is outside the vocabulary of "
                         f"{self.vocab_size} (the shard is damaged): prepare it again (`xlnet-fast data prepare` "
                         "with the same files)")

    def _range(self, start: int, stop: int) -> np.ndarray:
        first = int(np.searchsorted(self._starts, start, side="right")) - 1
        parts = []
        s = first
        while start < stop:
            lo = start - int(self._starts[s])
            hi = min(stop, int(self._starts[s + 1])) - int(self._starts[s])
            parts.append(self._maps[s][lo:hi])
            start = int(self._starts[s + 1])
            s += 1
        return np.concatenate(parts) if len(parts) > 1 else (parts[0] if parts else np.zeros(0, self.dtype))

    def _gather(self, idx: np.ndarray) -> np.ndarray:
        if idx.dtype.kind not in "iu":
            raise TypeError(f"TokenShards indices must be integers, got {idx.dtype}")
        idx = np.where(idx < 0, idx + self._len, idx)
        if idx.size and (idx.min() < 0 or idx.max() >= self._len):
            raise IndexError(f"index out of range for {self._len} tokens")
        if len(self._maps) == 1:
            return self._checked(self._maps[0][idx], lambda k: idx.reshape(-1)[k])
        shard = np.searchsorted(self._starts, idx, side="right") - 1
        out = np.empty(idx.shape, dtype=self.dtype)
        for s in np.unique(shard):
            sel = shard == s
            out[sel] = self._maps[s][idx[sel] - self._starts[s]]
        return self._checked(out, lambda k: idx.reshape(-1)[k])
