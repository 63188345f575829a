"""Training checkpoints: ``out/checkpoints/step_XXXXXXX``, written atomically and sealed, read back with checks.

A checkpoint holds the model in transformers' format, the tokenizer, the optimizer, scheduler, RNG
states, data position and mems of every rank, and the run's settings (``run.json``). It is written to
``step_XXXXXXX.tmp``, fsynced, sealed with a checksum manifest (``COMPLETE``) and renamed; the last
``keep`` are kept. Reading checks every file against the manifest before a checkpoint is used.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import shutil

import torch

from ..config import XLNetConfig
from .distributed import barrier
from .errors import CheckpointError
from .settings import CHANGEABLE_SETTINGS, FIXED_SETTINGS, TrainConfig
from .tokenizer import SPIECE_NAME, XLNetTokenizer

logger = logging.getLogger(__name__)

_STEP_DIR = re.compile(r"step_(\d+)")


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


def _save_synced(obj, path: str) -> None:
    with open(path, "wb") as f:
        torch.save(obj, f)
        f.flush()
        os.fsync(f.fileno())


def _seal(directory: str, step: int) -> None:
    """fsync every file, then write ``COMPLETE``: the step and each file's size and sha256."""
    files = {name: hash_file(os.path.join(directory, name), sync=True) for name in sorted(os.listdir(directory))}
    manifest = json.dumps({"step": step, "files": files}, indent=1).encode()
    write_synced(os.path.join(directory, "COMPLETE"), manifest)
    fsync_dir(directory)


def rng_state() -> dict:
    state = {"torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict) -> None:
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
    root = checkpoint_root(c)
    final = os.path.join(root, f"step_{step:07d}")
    tmp = final + ".tmp"
    if rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        os.makedirs(tmp)
    barrier(world)
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
    _save_synced({"rng": rng_state(), "data": batches.state_dict(),
                  "mems": [m.cpu() for m in mems] if mems is not None else None},
                 os.path.join(tmp, f"rank{rank}.pt"))
    barrier(world)
    if rank == 0:
        _seal(tmp, step)
        shutil.rmtree(final, ignore_errors=True)
        os.replace(tmp, final)
        fsync_dir(root)
        for old in list_checkpoints(c)[: -c.keep] if c.keep > 0 else []:
            shutil.rmtree(old, ignore_errors=True)
    barrier(world)
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
    actual = hash_file(path)
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


def newest_readable(paths: list[str]) -> tuple[str | None, list[str]]:
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
    return newest_readable(list_checkpoints(c))[0]


def read_run_record(path: str) -> dict:
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



def read_model_state(path: str) -> dict[str, torch.Tensor]:
    """A checkpoint's full model state on the CPU, under transformers' parameter names."""
    from safetensors.torch import load_file

    return load_file(os.path.join(path, "model.safetensors"))


def load_model_weights(model: torch.nn.Module, path: str) -> None:
    """A checkpoint's model weights into ``model`` (an ``XLNetPreTrainedModel``)."""
    model.load_hf_state_dict(read_model_state(path), source=path)


def restore_training_state(path: str, optimizer, scheduler, batches, rank: int, fsdp: bool,
                           device: torch.device | None) -> list[torch.Tensor] | None:
    """Load this rank's optimizer, scheduler, data position and RNG states from a checkpoint; return
    its mems on ``device`` (None when the checkpoint has none or ``device`` is None: no memory)."""
    def load(name):
        return torch.load(os.path.join(path, name), map_location="cpu", weights_only=False)

    trainer_state = load("trainer.pt")
    optimizer.load_state_dict(load(f"optimizer_rank{rank}.pt") if fsdp else trainer_state["optimizer"])
    scheduler.load_state_dict(trainer_state["scheduler"])
    rank_state = load(f"rank{rank}.pt")
    batches.load_state_dict(rank_state["data"])
    set_rng_state(rank_state["rng"])
    if rank == 0:
        logger.info("resumed from %s at step %d", path, trainer_state["step"])
    if rank_state["mems"] is None or device is None:
        return None
    return [m.to(device) for m in rank_state["mems"]]
