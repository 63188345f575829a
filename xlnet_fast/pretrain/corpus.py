"""Reading the corpus: text files as documents and lines, their checks and content digests.

A ``.jsonl``/``.ndjson`` file (any case) holds one JSON record per line with a string ``text`` field;
a new ``book`` (or ``doc``) value starts a new document. Any other file is plain text, where a blank
line ends a document. Files must be UTF-8; a problem is a ``UsageError`` naming the file (and line).
The digests are of the files' bytes and of how they are parsed, never of their names, sizes or times.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Iterable, Iterator

from .errors import UsageError

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
    """The lines of ``iter_documents``, one document after the other (blank lines are not lines of a
    document)."""
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
