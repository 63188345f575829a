"""The training state as a ``torch.distributed.checkpoint`` (DCP): saved by every rank (optionally in
the background), restored on the same or on another number of ranks.

The state (nested, flattened by DCP into ``model.<name>``, ``optim.<...>``, ``rows.G.*``, ``ranks.R.*``):

- ``model``, ``optim``: ``get_state_dict`` of the model and AdamW — under FSDP2 each rank's shards
  (DTensors), no gather; DCP reshards them on load for any number of ranks, FSDP2, DDP or one process.
- ``rows.G``: global batch row G's data position and random generator (``data``, JSON: the batches'
  ``row_state``) and its mems
  (``mems``, ``(n_layer, mlen, d_model)``): saved by the rank that owns row G, loaded by whichever
  rank owns it now (rank r owns rows ``[r * batch_size, (r + 1) * batch_size)``).
- ``ranks.R``: rank R's torch (and CUDA) RNG — the dropout's. Restored on the same number of ranks;
  on another number each rank seeds it with ``resharded_seed(seed, step, rank)`` (dropout draws
  then differ from a run that kept its number of ranks; everything else continues as it would have,
  up to the float rounding of another reduction order).

The LR scheduler's state, the same on every rank, is in ``run.json``.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import shutil
import warnings
from concurrent.futures import Future, ThreadPoolExecutor

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException  # a BaseException, around each rank's error

from .checkpoint import (MODEL_KEY, RUN_RECORD_NAME, dcp_load, dcp_metadata, empty_entries,
                         hash_file, publish, read_run_record, run_record, seal, step_dir)
from .distributed import barrier
from .errors import CheckpointError, underlying_os_error
from .settings import TrainConfig

logger = logging.getLogger(__name__)

OPTIM_KEY, ROWS_KEY, RANKS_KEY = "optim", "rows", "ranks"

# DCP says so on every single-process save and load, also when asked to (``no_dist=True``), and from
# the background thread of an asynchronous save, where no ``catch_warnings`` reaches: one process
# is what a single-rank run means.
warnings.filterwarnings("ignore", category=UserWarning, message=r"torch\.distributed is disabled, unavailable or "
                        r"uninitialized, assuming the intent is to (save|load) in a single process")


def _rank_files(rank: int) -> re.Pattern:
    """The shard files DCP's ``FileSystemWriter`` names for one rank: ``__<rank>_<n>.distcp``."""
    return re.compile(rf"__{rank}_\d+\.distcp")


def resharded_seed(seed: int, step: int, rank: int) -> int:
    """The torch RNG seed of ``rank`` after a resume at ``step`` on another number of ranks."""
    digest = hashlib.sha256(f"xlnet_fast-reshard:{seed}:{step}:{rank}".encode()).digest()
    return int.from_bytes(digest[:8], "little") >> 1


def _tied_names(raw_model) -> dict[str, str]:
    return dict(getattr(raw_model, "_tied_weights_keys", {}) or {})


# --------------------------------------------------------------------------------------------------
# What is saved
# --------------------------------------------------------------------------------------------------


def _rng_entries() -> dict[str, torch.Tensor]:
    state = {"torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def _row_entries(batches, mems: list[torch.Tensor] | None) -> dict[str, dict]:
    """``{str(global row): {"data": JSON position (and generator), "mems": (n_layer, mlen, d)}}`` of
    this rank's rows (``batches.row_state``); ``mems`` are per layer ``(mlen, rows, d)``."""
    rows = {}
    for i, g in enumerate(batches.row_ids):
        row = {"data": json.dumps(batches.row_state(g))}
        if mems is not None:
            row["mems"] = torch.stack([m[:, i] for m in mems])
        rows[str(g)] = row
    return rows


def training_state(raw_model, optimizer, batches, mems, rank: int) -> dict:
    """This rank's part of the DCP state (see the module's docstring)."""
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model_state, optim_state = get_state_dict(raw_model, optimizer)
    for name in _tied_names(raw_model):
        model_state.pop(name, None)
    return {MODEL_KEY: model_state, OPTIM_KEY: optim_state, ROWS_KEY: _row_entries(batches, mems),
            RANKS_KEY: {str(rank): _rng_entries()}}


# --------------------------------------------------------------------------------------------------
# Saving
# --------------------------------------------------------------------------------------------------


class CheckpointWriter:
    """Writes checkpoints (``checkpoint.py`` describes the layout): every rank its DCP shards, rank 0
    ``config.json``, the tokenizer and ``run.json``; then each rank hashes its own shards, rank 0 seals
    the directory with the manifest, renames it and rotates old ones.

    With ``c.async_save`` the shards are copied to host memory during ``save`` and written, hashed
    and sealed by a background thread; the next ``save`` and ``wait`` wait for it first and raise its
    error. Collectives of the save use their own gloo process group (``group``), so that a background
    save never interleaves with the training's collectives."""

    def __init__(self, c: TrainConfig, rank: int, world: int) -> None:
        self.c, self.rank, self.world = c, rank, world
        self.group = dist.new_group(backend="gloo") if world > 1 else None
        self._executor = ThreadPoolExecutor(1, thread_name_prefix="xlnet-checkpoint") if c.async_save else None
        self._stager = _host_stager() if c.async_save else None
        self._pending: tuple[Future, str] | None = None

    def save(self, step: int, raw_model, optimizer, scheduler, batches, mems, tokenizer, run_info: dict) -> str:
        """Write ``step_N`` (``run_info``: data paths and digest); returns its final path (with
        ``async_save`` it is there once the background write finished)."""
        self.wait()
        final = step_dir(self.c, step)
        tmp = final + ".tmp"
        try:
            if self.rank == 0:
                shutil.rmtree(tmp, ignore_errors=True)
                os.makedirs(tmp)
                raw_model.config.architectures = [type(raw_model).__name__]
                raw_model.config.save_pretrained(tmp)
                tokenizer.save_pretrained(tmp)
                record = run_record(self.c, step, self.world, run_info, scheduler.state_dict())
                path = os.path.join(tmp, RUN_RECORD_NAME)
                with open(path, "w") as f:
                    try:
                        json.dump(record, f, indent=1)
                    except OSError as exc:  # write() names no file
                        raise OSError(exc.errno, exc.strerror, path) from None
            barrier(self.world)
            state = training_state(raw_model, optimizer, batches, mems, self.rank)
            writer = _filesystem_writer(tmp)
            if self._executor is None:
                dcp.save(state, storage_writer=writer, process_group=self.group, no_dist=self.group is None)
                self._finish(None, step, tmp, final)
            else:
                upload = dcp.async_save(state, storage_writer=writer, process_group=self.group,
                                        async_stager=self._stager, no_dist=self.group is None)
                self._pending = (self._executor.submit(self._finish, upload, step, tmp, final), final)
        except (Exception, CheckpointException) as exc:
            self._discard(tmp)
            raise _save_failure(exc, tmp) from None
        return final

    def _discard(self, tmp: str) -> None:
        """After a failed save: rank 0 removes the unfinished ``step_N.tmp`` (the previous checkpoint
        stays the newest)."""
        if self.rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)

    def wait(self) -> None:
        """Wait for the background save, if any; its failure is raised here."""
        if self._pending is None:
            return
        future, final = self._pending
        self._pending = None
        try:
            future.result()
        except (Exception, CheckpointException) as exc:  # the command line reports the OSError behind it
            raise RuntimeError(f"the asynchronous save of {final} failed: {type(exc).__name__}: "
                               f"{_save_failure(exc, final + '.tmp')}") from exc

    def close(self) -> None:
        """On the way out after an error: wait for the background save, logging (not raising) its
        failure, and stop the thread. (A normal end calls ``wait`` first.)"""
        try:
            self.wait()
        except RuntimeError as exc:
            logger.error("%s", exc)
        finally:
            if self._executor is not None:
                self._executor.shutdown(wait=True)
                self._stager.close()
            if self.group is not None:
                dist.destroy_process_group(self.group)
                self.group = None

    def _finish(self, upload: Future | None, step: int, tmp: str, final: str) -> None:
        """After the shards are written: every rank hashes (and fsyncs) its own files, rank 0 seals
        and publishes; an error on any rank is raised on every rank."""
        own = _rank_files(self.rank)

        def hash_own_shards() -> dict:
            if upload is not None:
                upload.result()  # the background DCP write
            return {n: hash_file(os.path.join(tmp, n), sync=True) for n in os.listdir(tmp) if own.fullmatch(n)}

        try:
            files = self._exchange(hash_own_shards)
            error = None
            if self.rank == 0:
                try:
                    self._seal_and_publish(step, tmp, final, files)
                except Exception as exc:
                    error = exc
            outcome = self._broadcast(None if error is None else f"{type(error).__name__}: {error}")
            if error is not None:
                raise error
            if outcome is not None:
                raise RuntimeError(f"rank 0 could not seal {tmp}: {outcome}")
        except (Exception, CheckpointException):
            if upload is not None:  # the synchronous save discards it in save()
                self._discard(tmp)
            raise

    def _seal_and_publish(self, step: int, tmp: str, final: str, shard_hashes: dict) -> None:
        others = re.compile(r"__\d+_\d+\.distcp")
        files = dict(shard_hashes)
        for name in os.listdir(tmp):  # rank 0's own files: config, tokenizer, run.json, .metadata
            if name not in files and not others.fullmatch(name):
                files[name] = hash_file(os.path.join(tmp, name), sync=True)
        seal(tmp, step, files)
        publish(self.c, tmp, final)

    def _exchange(self, fn) -> dict:
        """``fn()`` on every rank, merged (dicts) on every rank; any rank's error raised on all (this
        rank's own as it is)."""
        own_error = None
        try:
            mine = (True, fn())
        except (Exception, CheckpointException) as exc:
            own_error, mine = exc, (False, f"{type(exc).__name__}: {exc}")
        if self.group is None:
            results = [mine]
        else:
            results = [None] * self.world
            dist.all_gather_object(results, mine, group=self.group)
        if own_error is not None:
            raise own_error
        errors = [f"rank {r}: {err}" for r, (ok, err) in enumerate(results) if not ok]
        if errors:
            raise RuntimeError("; ".join(errors))
        merged = {}
        for _, value in results:
            merged.update(value)
        return merged

    def _broadcast(self, value):
        if self.group is None:
            return value
        box = [value]
        dist.broadcast_object_list(box, src=0, group=self.group)
        return box[0]


def _save_failure(exc: BaseException, tmp: str) -> BaseException:
    """What a failed save raises: the ``OSError`` behind it (a full disk: one line naming the file,
    ``step_N.tmp`` when the error names none), else the error itself."""
    cause = underlying_os_error(exc)
    if cause is None:
        return exc if isinstance(exc, Exception) else RuntimeError(f"saving {tmp} failed: {exc}")
    return OSError(cause.errno, cause.strerror or str(cause), cause.filename or tmp)


def _host_stager():
    """Copies the state to host memory, blocking (the save's only cost to the step), into buffers
    kept from one save to the next (pinned with CUDA): one host copy of the model and optimizer
    shards lives as long as the writer. (It is also ~3x faster than the FileSystemWriter's own
    staging, which deep-copies every CPU DTensor before copying it again.)"""
    from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

    return DefaultStager(StagingOptions(use_pinned_memory=torch.cuda.is_available(), use_shared_memory=False,
                                        use_async_staging=False, use_non_blocking_copy=False))


def _filesystem_writer(path: str) -> dcp.FileSystemWriter:
    return dcp.FileSystemWriter(path, single_file_per_rank=True, sync_files=True)


# --------------------------------------------------------------------------------------------------
# Restoring
# --------------------------------------------------------------------------------------------------


def _load_rows(rows: dict[str, dict], batches, device) -> list[torch.Tensor] | None:
    """Data positions and generators into ``batches``; the rows' mems as per-layer ``(mlen, rows, d)``
    on ``device`` (None without memory)."""
    batches.load_row_states({g: json.loads(rows[str(g)]["data"]) for g in batches.row_ids})
    per_row = [rows[str(g)].get("mems") for g in batches.row_ids]
    if device is None or any(m is None for m in per_row):
        return None
    stacked = torch.stack(per_row, dim=2)  # (n_layer, mlen, rows, d)
    return [layer.to(device) for layer in stacked.unbind(0)]


def _set_rng(entries: dict[str, torch.Tensor]) -> None:
    torch.set_rng_state(entries["torch"])
    if "cuda" in entries and torch.cuda.is_available():
        torch.cuda.set_rng_state(entries["cuda"])


def restore_training_state(path: str, raw_model, optimizer, scheduler, batches, rank: int, world: int,
                           seed: int, device: torch.device | None, group=None) -> list[torch.Tensor] | None:
    """Load a checkpoint into this rank's model and optimizer (after FSDP2 wrapping), scheduler, rows
    (``batches.row_ids``) and RNG; the checkpoint may come from another number of ranks (the global
    batch being the same). Returns this rank's mems on ``device`` (None without memory, or when
    ``device`` is None). Collective: every rank calls it."""
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    record = read_run_record(path)
    metadata = dcp_metadata(path)
    model_state, optim_state = get_state_dict(raw_model, optimizer)
    tied = _tied_names(raw_model)
    for name in tied:
        model_state.pop(name, None)
    rows = {str(g): empty_entries(metadata, (ROWS_KEY, str(g))) for g in batches.row_ids}
    absent = [g for g, entries in rows.items() if "data" not in entries]
    if absent:
        raise CheckpointError(f"{path} holds no state of batch row(s) {', '.join(absent)} (another global batch?)")
    state = {MODEL_KEY: model_state, OPTIM_KEY: optim_state, ROWS_KEY: rows}
    same_ranks = record.get("world_size") == world
    if same_ranks:
        state[RANKS_KEY] = {str(rank): empty_entries(metadata, (RANKS_KEY, str(rank)))}
    dcp_load(state, path, process_group=group, no_dist=group is None)
    for name, source in tied.items():
        if source in model_state:
            model_state[name] = model_state[source]
    set_state_dict(raw_model, optimizer, model_state_dict=model_state, optim_state_dict=optim_state)
    scheduler.load_state_dict(record["scheduler"])
    mems = _load_rows(rows, batches, device)
    if same_ranks:
        _set_rng(state[RANKS_KEY][str(rank)])
    else:
        torch.manual_seed(resharded_seed(seed, record["step"], rank))
    if rank == 0:
        logger.info("resumed from %s at step %d (%s)", path, record["step"],
                    "same ranks" if same_ranks else f"{record.get('world_size')} -> {world} ranks")
    return mems

