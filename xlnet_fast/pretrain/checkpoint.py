"""Training checkpoints: ``out/checkpoints/step_XXXXXXX``, their layout, manifest, checks and readers.

A checkpoint directory holds

- ``.metadata`` and ``__R_N.distcp``: a ``torch.distributed.checkpoint`` (DCP) of the training state,
  each rank R writing its own shards (``sharded.py``): the model (``model.*``, transformers' parameter
  names, tied weights once), the optimizer (``optim.*``), each global batch row's data position, RNG
  and mems (``rows.G.*``) and each rank's torch RNG (``ranks.R.*``);
- ``config.json`` and the tokenizer (``spiece.model`` ...), written by rank 0;
- ``run.json``: the step, the run's settings, data, number of ranks and the LR scheduler's state;
- ``COMPLETE``: the manifest, the step and each file's size and sha256, written last.

It is written to ``step_XXXXXXX.tmp``, every file fsynced, sealed by ``COMPLETE`` and renamed; the
last ``keep`` are kept. Reading checks every file against the manifest before a checkpoint is used.
A checkpoint written before 0.1's sharded checkpoints (``trainer.pt``, ``model.safetensors``, no
``.metadata``) is refused with a ``UsageError`` saying so.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import shutil

import torch

from .errors import CheckpointError, UsageError
from .models import read_model_config
from .settings import STORED_SETTINGS, TrainConfig
from .tokenizer import SPIECE_NAME, XLNetTokenizer

logger = logging.getLogger(__name__)

_STEP_DIR = re.compile(r"step_(\d+)")
MANIFEST_NAME = "COMPLETE"
RUN_RECORD_NAME = "run.json"
DCP_METADATA_NAME = ".metadata"  # torch.distributed.checkpoint's index of the shards
MODEL_KEY = "model"  # the model's entries in the DCP state (``model.<parameter name>``)


def checkpoint_root(c: TrainConfig) -> str:
    return os.path.join(c.out, "checkpoints")


def _dir_step(path: str) -> int:
    return int(_STEP_DIR.fullmatch(os.path.basename(path)).group(1))


def list_checkpoints(c: TrainConfig) -> list[str]:
    """``out/checkpoints/step_N`` directories, oldest first (temporary and set-aside ones excluded)."""
    root = checkpoint_root(c)
    if not os.path.isdir(root):
        return []
    names = [n for n in os.listdir(root) if _STEP_DIR.fullmatch(n)]
    return [os.path.join(root, n) for n in sorted(names, key=lambda n: int(n[5:]))]


def hash_file(path: str, sync: bool = False) -> dict:
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


def fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_synced(path: str, data: bytes) -> None:
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def step_dir(c: TrainConfig, step: int) -> str:
    return os.path.join(checkpoint_root(c), f"step_{step:07d}")


def seal(directory: str, step: int, files: dict[str, dict]) -> None:
    """Write ``COMPLETE``: the step and ``files`` (name -> ``hash_file(..., sync=True)`` of every
    file, taken after all of them were written), then fsync the directory."""
    missing = sorted(set(os.listdir(directory)) - set(files))
    if missing:
        raise CheckpointError(f"{directory}: no checksum for {missing}")
    manifest = json.dumps({"step": step, "files": dict(sorted(files.items()))}, indent=1).encode()
    write_synced(os.path.join(directory, MANIFEST_NAME), manifest)
    fsync_dir(directory)


def publish(c: TrainConfig, tmp: str, final: str) -> None:
    """Rename a sealed ``step_N.tmp`` into place, then keep the last ``c.keep`` checkpoints."""
    root = os.path.dirname(final)
    shutil.rmtree(final, ignore_errors=True)
    os.replace(tmp, final)
    fsync_dir(root)
    for old in list_checkpoints(c)[: -c.keep] if c.keep > 0 else []:
        shutil.rmtree(old, ignore_errors=True)


def run_record(c: TrainConfig, step: int, world: int, run_info: dict, scheduler_state: dict) -> dict:
    """``run.json``: what a resume restores and checks. ``run_info``: data paths and digest."""
    return {"step": step, "settings": {n: getattr(c, n) for n in STORED_SETTINGS}, "world_size": world,
            **run_info, "scheduler": scheduler_state}


_EARLIER_FORMAT_FILE = "trainer.pt"  # in every checkpoint written before 0.1's sharded ones, in none since


def _refuse_earlier_format(path: str) -> None:
    """``UsageError`` for a checkpoint directory written before 0.1's sharded checkpoints."""
    if os.path.exists(os.path.join(path, _EARLIER_FORMAT_FILE)) and \
            not os.path.exists(os.path.join(path, DCP_METADATA_NAME)):
        raise UsageError(f"{path} was written by xlnet_fast before 0.1's sharded checkpoints ({_EARLIER_FORMAT_FILE}, "
                         "model.safetensors), which this version does not read: re-run pretraining")


def _read_manifest(path: str) -> tuple[int, dict]:
    """``(step, files)`` from ``COMPLETE``."""
    marker = os.path.join(path, MANIFEST_NAME)
    try:
        with open(marker) as f:
            content = json.load(f)
    except FileNotFoundError:
        raise CheckpointError(f"{marker} is missing (the checkpoint was never finished)") from None
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"{marker} is unreadable ({exc})") from None
    if not (isinstance(content, dict) and isinstance(content.get("step"), int)
            and isinstance(content.get("files"), dict)):
        raise CheckpointError(f"{marker} is not a checkpoint manifest")
    return content["step"], content["files"]


def _verify_file(path: str, expected: dict, checksums: bool = True) -> None:
    """The file's size against the manifest's, and its sha256 too with ``checksums``."""
    if not os.path.isfile(path):
        raise CheckpointError(f"{path} is missing")
    size = os.path.getsize(path)
    if size != expected.get("size"):
        raise CheckpointError(f"{path} has {size} bytes, the manifest says {expected.get('size')} (truncated?)")
    if checksums and hash_file(path)["sha256"] != expected.get("sha256"):
        raise CheckpointError(f"{path} does not match its checksum in COMPLETE (corrupted; --no-verify, or "
                              "verify=False in Python, reads it without comparing checksums)")


def dcp_metadata(directory: str):
    """The DCP index (``torch.distributed.checkpoint.Metadata``) of a checkpoint directory."""
    from torch.distributed.checkpoint import FileSystemReader

    return FileSystemReader(directory).read_metadata()


def _load_checkpoint_file(directory: str, name: str):
    """Parse one checkpoint file by its kind (None for a kind not parsed: the DCP shards are checked
    by their checksums and against the index)."""
    path = os.path.join(directory, name)
    try:
        if name == "config.json":
            return read_model_config(directory)
        if name == DCP_METADATA_NAME:
            return dcp_metadata(directory)
        if name == SPIECE_NAME:
            return XLNetTokenizer(path)
        if name.endswith(".json"):
            with open(path) as f:
                return json.load(f)
    except Exception as exc:
        raise CheckpointError(f"{path} is unreadable ({type(exc).__name__}: {exc})") from None
    return None


def _check_shard_index(path: str, metadata, files: dict) -> None:
    """Every byte range the DCP index points at lies in a shard listed in the manifest."""
    for info in (metadata.storage_data or {}).values():
        name = info.relative_path
        if name not in files:
            raise CheckpointError(f"{os.path.join(path, name)} is missing (named by {DCP_METADATA_NAME}, "
                                  f"not in {MANIFEST_NAME})")
        if info.offset + info.length > files[name]["size"]:
            raise CheckpointError(f"{os.path.join(path, name)} is shorter than {DCP_METADATA_NAME} says")


# checkpoints whose checksums were verified in this process, by the files' (name, size, mtime):
# reading one again (a run directory resolved, then its weights read) does not hash it again
_verified: dict[tuple, int] = {}


def _stat_key(path: str) -> tuple:
    entries = sorted(os.scandir(path), key=lambda e: e.name)
    return (os.path.realpath(path), *((e.name, e.stat().st_size, e.stat().st_mtime_ns) for e in entries))


def check_checkpoint(path: str, checksums: bool = True) -> int:
    """Read every file of a training checkpoint and return its step.

    Files listed in the ``COMPLETE`` manifest must exist with their size and (``checksums``) sha256;
    every file of a known kind must parse; ``run.json`` must be the record of the manifest's step and
    the DCP index must point only into listed shards. Raises ``CheckpointError`` naming the first bad
    file (a directory without ``COMPLETE``, e.g. an unfinished ``step_N.tmp``, is one), and a
    ``UsageError`` for a checkpoint written before 0.1's sharded checkpoints."""
    path = os.fspath(path)
    if not os.path.isdir(path):
        raise CheckpointError(f"{path} is not a checkpoint directory")
    _refuse_earlier_format(path)
    key = _stat_key(path)
    if key in _verified:
        return _verified[key]
    step = _check_checkpoint(path, checksums)
    if checksums:
        _verified[key] = step
    return step


def _check_checkpoint(path: str, checksums: bool) -> int:
    step, files = _read_manifest(path)
    for name in (DCP_METADATA_NAME, RUN_RECORD_NAME):
        if name not in files:
            raise CheckpointError(f"{os.path.join(path, MANIFEST_NAME)} does not list {name} (not a sealed checkpoint)")
    for name, expected in sorted(files.items()):
        _verify_file(os.path.join(path, name), expected, checksums)
    parsed = {name: _load_checkpoint_file(path, name) for name in sorted(files)}
    record = parsed[RUN_RECORD_NAME]
    if not isinstance(record, dict) or record.get("step") != step:
        raise CheckpointError(f"{os.path.join(path, RUN_RECORD_NAME)} is not the record of step {step}")
    _check_shard_index(path, parsed[DCP_METADATA_NAME], files)
    if _STEP_DIR.fullmatch(os.path.basename(path)) and _dir_step(path) != step:
        raise CheckpointError(f"{os.path.join(path, MANIFEST_NAME)} says step {step}, not the directory's step")
    return step


def newest_readable(paths: list[str], checksums: bool = True) -> tuple[str | None, list[str]]:
    """The newest checkpoint of ``paths`` whose files all read, and the newer ones that do not."""
    rejected = []
    for older, path in reversed(list(enumerate(paths))):  # ``older``: how many checkpoints precede it
        try:
            check_checkpoint(path, checksums)
            return path, rejected
        except CheckpointError as exc:
            then = (f"falling back to the previous one, {os.path.basename(paths[older - 1])}" if older else
                    "no older checkpoint to fall back to")
            logger.warning("checkpoint %s is unreadable: %s; %s", path, exc, then)
            rejected.append(path)
    return None, rejected


def load_latest_checkpoint(c: TrainConfig) -> str | None:
    """The newest checkpoint in ``c.out`` whose files all read (see ``check_checkpoint``); each newer
    unreadable one is skipped with a warning naming the file."""
    return newest_readable(list_checkpoints(c))[0]


def read_run_record(path: str) -> dict:
    """A checkpoint's ``run.json`` (step, settings, data, world size, scheduler state)."""
    with open(os.path.join(path, RUN_RECORD_NAME)) as f:
        return json.load(f)


def dcp_load(state: dict, path: str, process_group=None, no_dist: bool = False) -> None:
    """``torch.distributed.checkpoint.load`` of ``state`` (nested, filled in place) from ``path``;
    ``no_dist``: in this process alone, whatever the process group."""
    import torch.distributed.checkpoint as dcp

    dcp.load(state, storage_reader=dcp.FileSystemReader(path), process_group=process_group, no_dist=no_dist)


def empty_entries(metadata, prefix: tuple[str, ...]) -> dict:
    """Placeholders for the DCP entries under ``prefix`` (e.g. ``("rows", "3")``), nested as saved:
    an empty CPU tensor of the stored shape and dtype for a tensor, ``""`` for any other value."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    out: dict = {}
    for key, md in metadata.state_dict_metadata.items():
        path = tuple(metadata.planner_data[key])
        if path[:len(prefix)] != prefix or len(path) == len(prefix):
            continue
        node = out
        for part in path[len(prefix):-1]:
            node = node.setdefault(part, {})
        node[path[-1]] = (torch.empty(md.size, dtype=md.properties.dtype)
                          if isinstance(md, TensorStorageMetadata) else "")
    return out


def read_model_state(path: str, verify: bool = True) -> dict[str, torch.Tensor]:
    """A checkpoint's full model state on the CPU, under transformers' parameter names (tied weights
    once, as ``save_pretrained`` writes them), read in this process alone from the DCP shards of any
    number of ranks.

    The checkpoint is checked first (``check_checkpoint``: ``COMPLETE`` present, every file's size
    and, unless ``verify=False``, sha256); any problem is a ``CheckpointError`` naming the file."""
    from torch.distributed.checkpoint.api import CheckpointException  # a BaseException

    path = os.fspath(path)
    check_checkpoint(path, checksums=verify)
    try:
        state = {MODEL_KEY: empty_entries(dcp_metadata(path), (MODEL_KEY,))}
        dcp_load(state, path, no_dist=True)
    except (Exception, CheckpointException) as exc:  # checked, yet unreadable (damaged, not verified)
        raise CheckpointError(f"{path}: cannot read the model weights ({type(exc).__name__}: "
                              f"{' '.join(str(exc).split())[:300]})") from None
    return state[MODEL_KEY]


def load_model_weights(model: torch.nn.Module, path: str, verify: bool = True) -> None:
    """A checkpoint's model weights into ``model`` (an XLNet or a Transformer-XL), checked as
    ``read_model_state`` checks them (``verify=False``: sizes, not checksums)."""
    model.load_hf_state_dict(read_model_state(path, verify=verify), source=path)
