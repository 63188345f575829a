"""Where a command may write: one rule for every output path (``--out``), checked before anything is
written.

- An output never is, contains or sits inside one of the command's inputs.
- It never is or sits inside a directory that another command owns — a pretraining run, a training
  checkpoint, prepared data — except the command's own kind at the output itself (``data prepare``
  continuing its prepared directory, ``pretrain`` its run).
- Every command that writes a directory (``tokenizer train``, ``data prepare``, ``export``,
  ``pretrain``) writes into a new or empty one. One that holds an earlier output of the same command
  is replaced only with ``--overwrite``, and continued only where the command continues its own
  work on the same inputs (``pretrain --resume``; ``data prepare`` of the same files, tokenizer and
  shard size, which resumes or repairs it): ``refuse_earlier_output``, the one check and message.
- A command replaces only its own files (``owned``): ``export``, ``data prepare`` and ``tokenizer
  train`` refuse a directory holding any other file, with or without ``--overwrite``; ``pretrain``
  never replaces its run directory and deletes only its own entries (``checkpoints/step_N``,
  ``metrics.jsonl``).

A refusal is a ``UsageError`` naming the flag, the path and the reason.

The cache directory (tokenizers trained on the data, prepared token shards) is ``--cache-dir``, else
``$XLNET_FAST_CACHE``, else ``~/.cache/xlnet_fast`` (``default_cache_dir``).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable

from .errors import UsageError

CACHE_ENV = "XLNET_FAST_CACHE"  # the cache directory when --cache-dir is not given
RUN_DIR = "a pretraining run directory"
CHECKPOINT_DIR = "a training checkpoint"
PREPARED_DIR = "prepared data"

# owned(relative path inside the output, is_dir) -> whether the command writes that entry
Owned = Callable[[str, bool], bool]


def default_cache_dir(given: str | None = None) -> str:
    """The cache directory: ``given`` (``--cache-dir``), else ``$XLNET_FAST_CACHE``, else
    ``~/.cache/xlnet_fast``."""
    return given or os.environ.get(CACHE_ENV) or os.path.join(os.path.expanduser("~"), ".cache", "xlnet_fast")


def _real(path: str | os.PathLike) -> str:
    return os.path.realpath(os.path.abspath(os.fspath(path)))


def _within(path: str, parent: str) -> bool:
    return path == parent or path.startswith(parent.rstrip(os.sep) + os.sep)


def directory_kind(path: str) -> str | None:
    """Which xlnet-fast output the directory ``path`` is (``RUN_DIR``, ``CHECKPOINT_DIR``,
    ``PREPARED_DIR``), by the files only that kind writes; None for any other directory."""
    if not os.path.isdir(path):
        return None
    has = lambda name: os.path.lexists(os.path.join(path, name))  # noqa: E731
    if has("COMPLETE") or has("run.json") or has(".metadata"):
        return CHECKPOINT_DIR
    if os.path.isdir(os.path.join(path, "checkpoints")) or has("run.lock") or has("metrics.jsonl"):
        return RUN_DIR
    if has("prepare.lock") or _is_prepared_index(os.path.join(path, "index.json")):
        return PREPARED_DIR
    return None


def _is_prepared_index(path: str) -> bool:
    try:
        with open(path, "rb") as f:
            return b'"xlnet_fast.prepared/' in f.read(256)  # the format, the index's first field
    except OSError:
        return False


def _ancestors(real: str) -> Iterable[str]:
    """``real`` and every directory above it, nearest first."""
    while True:
        yield real
        parent = os.path.dirname(real)
        if parent == real:
            return
        real = parent


def _foreign_entry(out: str, owned: Owned) -> str | None:
    """The first entry of ``out`` (recursively inside owned directories) that ``owned`` disowns."""
    todo = [""]
    while todo:
        rel = todo.pop()
        for entry in sorted(os.scandir(os.path.join(out, rel)), key=lambda e: e.name):
            name = os.path.join(rel, entry.name)
            is_dir = entry.is_dir(follow_symlinks=False)
            if not owned(name, is_dir):
                return name + (os.sep if is_dir else "")
            if is_dir:
                todo.append(name)
    return None


def check_output_dir(out: str | os.PathLike, *, command: str, flag: str = "--out", inputs: Iterable = (),
                     kind: str | None = None, owned: Owned | None = None, overwrite: bool | None = None) -> None:
    """Apply the module's rule to the output directory ``out`` of ``command`` (``xlnet-fast export``
    ...): ``inputs`` are the paths it reads, ``kind`` the owned kind it may continue at ``out``
    itself, ``owned`` what it writes there (None: it never replaces ``out``). ``overwrite`` (not None):
    whether an earlier output of the command in ``out`` may be replaced (``refuse_earlier_output``);
    None leaves that to the caller (a command that continues its own output)."""
    out = os.fspath(out)
    if not out:
        raise UsageError(f"{flag} is empty: give a directory")
    if os.path.lexists(out) and not os.path.isdir(out):
        raise UsageError(f"{flag} {out} is a file, not a directory")
    _check_against_inputs(out, flag, inputs)
    real = _real(out)
    for directory in _ancestors(real):
        found = directory_kind(directory)
        if found is None or (directory == real and found == kind):
            continue
        where = "is" if directory == real else f"is inside {directory}, which is"
        raise UsageError(f"{flag} {out} {where} {found}, which {command} does not own: choose another {flag}")
    if owned is not None and os.path.isdir(out):
        foreign = _foreign_entry(out, owned)
        if foreign is not None:
            raise UsageError(f"{flag} {out} holds {os.path.join(out, foreign)}, which {command} did not write: "
                             f"{command} replaces only its own files; choose a new or empty {flag}")
    if overwrite is not None and os.path.isdir(out):
        earlier = sorted(os.listdir(out))  # only the command's own files (checked above)
        found = ", ".join(earlier[:3]) + (", ..." if len(earlier) > 3 else "") if earlier else None
        refuse_earlier_output(out, command=command, found=found, overwrite=overwrite, flag=flag)


def refuse_earlier_output(out: str | os.PathLike, *, command: str, found: str | None, overwrite: bool,
                          flag: str = "--out", resume: str | None = None) -> None:
    """The one rule for an output directory holding an earlier output of the same command (``found``
    says what, None: it holds none): a ``UsageError`` unless ``overwrite``; ``resume``: the flag that
    continues that output instead, when the command has one."""
    if found is None or overwrite:
        return
    hint = f"pass {resume} to continue it or --overwrite to replace it" if resume else "pass --overwrite to replace it"
    raise UsageError(f"{flag} {os.fspath(out)} already holds {found} from an earlier {command}: {hint} (or choose "
                     f"another {flag})")


def check_output_file(out: str | os.PathLike, *, command: str, flag: str = "--out", inputs: Iterable = (),
                      replaceable: Callable[[str], bool] = lambda path: True) -> None:
    """The rule for an output file: not a directory, not an input, not inside a checkpoint or prepared
    data, and an existing file only if ``replaceable`` says the command wrote it."""
    out = os.fspath(out)
    if not out:
        raise UsageError(f"{flag} is empty: give a file name")
    if os.path.isdir(out):
        raise UsageError(f"{flag} {out} is a directory, not a file")
    _check_against_inputs(out, flag, inputs)
    for directory in _ancestors(os.path.dirname(_real(out))):
        found = directory_kind(directory)
        if found in (CHECKPOINT_DIR, PREPARED_DIR):
            raise UsageError(f"{flag} {out} is inside {directory}, which is {found}, which {command} does not "
                             f"own: choose another {flag}")
    if os.path.lexists(out) and not replaceable(out):
        raise UsageError(f"{flag} {out} exists and was not written by {command}: choose another {flag}")


def _check_against_inputs(out: str, flag: str, inputs: Iterable) -> None:
    real = _real(out)
    for given in inputs:
        if given is None:
            continue
        path = _real(given)
        if path == real:
            raise UsageError(f"{flag} {out} is the input {os.fspath(given)}: choose another {flag}")
        if _within(path, real):
            raise UsageError(f"{flag} {out} contains the input {os.fspath(given)}: choose another {flag}")
        if _within(real, path):
            raise UsageError(f"{flag} {out} is inside the input {os.fspath(given)}: choose another {flag}")


def ensure_parent(path: str | os.PathLike) -> None:
    """Create the directories above an output file (an ``OSError`` naming the path when one is a file)."""
    parent = os.path.dirname(os.path.abspath(os.fspath(path)))
    os.makedirs(parent, exist_ok=True)
