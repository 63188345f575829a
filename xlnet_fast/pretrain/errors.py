"""The pretraining errors: a user's mistake, a checkpoint that cannot be used, a diverged run; and the
one way an environment failure (disk full, permission, a path under a file) is reported.

The command line maps them to exit statuses: ``UsageError`` and ``CheckpointError`` (the input is
wrong) exit 2, ``OSError`` and ``NonFiniteLossError`` (the machine or the run failed) exit 1, each as one
line. Writers raise ``OSError`` with the path they were writing (``naming_path``), so that line names it.
"""

from __future__ import annotations

import contextlib
import errno
import os
from collections.abc import Iterator


class UsageError(ValueError):
    """A user's mistake: a bad setting or an unusable input file. The CLI reports it in one line (exit 2)."""


class NonFiniteLossError(RuntimeError):
    """Training diverged: a non-finite loss, gradient norm or weight. Nothing non-finite was saved."""


class CheckpointError(ValueError):
    """A training checkpoint that cannot be used; the message names the file."""


_HINTS = {errno.ENOSPC: "the disk is full", errno.EDQUOT: "the disk quota is exceeded",
          errno.EFBIG: "the file size limit is reached or the disk is full",
          errno.ENOTDIR: "a part of the path is a file, not a directory",
          errno.EEXIST: "a file is in the way", errno.EROFS: "the file system is read-only"}


def os_error_line(exc: OSError) -> str:
    """One line for an environment failure, naming the path: ``cannot write PATH: No space left on
    device (the disk is full)``."""
    what = exc.strerror or str(exc)
    hint = _HINTS.get(exc.errno)
    where = exc.filename if exc.filename is not None else None
    if exc.filename2 is not None:
        where = f"{exc.filename} -> {exc.filename2}"
    text = f"{where}: {what}" if where is not None else what
    return text + (f" ({hint})" if hint and hint not in what.lower() else "")


@contextlib.contextmanager
def naming_path(path: str | os.PathLike) -> Iterator[None]:
    """An ``OSError`` raised inside (e.g. by ``write``, which names no file) names ``path``."""
    try:
        yield
    except OSError as exc:
        if exc.filename is not None or exc.errno is None:
            raise
        raise OSError(exc.errno, exc.strerror or str(exc), os.fspath(path)) from None


def underlying_os_error(exc: BaseException) -> OSError | None:
    """The ``OSError`` behind ``exc``: itself, its cause or context, or one of the failures that
    ``torch.distributed.checkpoint``'s ``CheckpointException`` (a ``BaseException``) carries."""
    seen: set[int] = set()
    todo = [exc]
    while todo:
        e = todo.pop(0)
        if e is None or id(e) in seen:
            continue
        seen.add(id(e))
        if isinstance(e, OSError) and e.errno is not None:
            return e
        failures = getattr(e, "failures", None)
        if isinstance(failures, dict):
            todo.extend(f[0] if isinstance(f, tuple) else f for f in failures.values())
        todo.extend([e.__cause__, e.__context__])
    return None
