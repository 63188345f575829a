"""The model directories ``xlnet-fast eval`` and ``xlnet-fast export`` read: a run directory (its
newest readable checkpoint), one training checkpoint (``out/checkpoints/step_N``), or a transformers
directory (``config.json`` and weights, e.g. written by ``XLNetLMHeadModel.save_pretrained``).

A training checkpoint's weights are read only through ``checkpoint.read_model_state`` /
``checkpoint.load_model_weights`` and its model configuration from its ``config.json``.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from ..config import XLNetConfig
from ..model import XLNetLMHeadModel
from .checkpoint import list_checkpoints, load_model_weights, newest_readable, read_model_state, read_run_record
from .errors import UsageError
from .settings import TrainConfig
from .tokenizer import SPIECE_NAME, XLNetTokenizer

RUN_RECORD_NAME = "run.json"


@dataclass
class ModelDir:
    path: str  # the directory holding config.json and the weights
    record: dict | None  # a training checkpoint's run record (settings, data, world size); None otherwise

    @property
    def step(self) -> int | None:
        return None if self.record is None else self.record["step"]

    @property
    def is_checkpoint(self) -> bool:
        return self.record is not None


def resolve_model_dir(path: str, flag: str) -> ModelDir:
    """``path`` as a run directory, a training checkpoint or a transformers directory; anything else
    is a ``UsageError`` naming ``flag``."""
    path = os.fspath(path)
    if not os.path.isdir(path):
        raise UsageError(f"{flag} {path}: not a directory")
    if os.path.isdir(os.path.join(path, "checkpoints")):  # a run directory
        found = list_checkpoints(TrainConfig(out=path))
        newest, _ = newest_readable(found)
        if newest is None:
            raise UsageError(f"{flag} {path}: no readable checkpoint in {os.path.join(path, 'checkpoints')}"
                             + (f" ({len(found)} unreadable)" if found else ""))
        path = newest
    if os.path.exists(os.path.join(path, RUN_RECORD_NAME)) or os.path.exists(os.path.join(path, "trainer.pt")):
        return ModelDir(path, read_run_record(path))
    if os.path.exists(os.path.join(path, "config.json")):
        return ModelDir(path, None)
    raise UsageError(f"{flag} {path}: neither a run directory, a training checkpoint nor a transformers "
                     "directory (no config.json)")


def read_config(src: ModelDir, **overrides) -> XLNetConfig:
    try:
        return XLNetConfig.from_pretrained(src.path, **overrides)
    except (OSError, ValueError) as exc:
        raise UsageError(f"{src.path}: {exc}") from None


def load_lm(src: ModelDir, **config_overrides) -> XLNetLMHeadModel:
    """The directory's ``XLNetLMHeadModel`` on the CPU, in eval mode; ``config_overrides`` replace
    fields of its ``config.json``."""
    config = read_config(src, **config_overrides)
    try:
        if src.is_checkpoint:
            model = XLNetLMHeadModel(config)
            load_model_weights(model, src.path)
            return model.eval()
        return XLNetLMHeadModel.from_pretrained(src.path, config=config)
    except (OSError, ValueError) as exc:
        raise UsageError(f"{src.path}: cannot load the weights ({exc})") from None


def model_state(src: ModelDir) -> dict:
    """The full model state (transformers' names, CPU tensors) of a checkpoint or of a transformers
    directory."""
    if src.is_checkpoint:
        return read_model_state(src.path)
    return load_lm(src).state_dict()


def load_tokenizer(src: ModelDir, given: str | None = None, flag: str | None = "--tokenizer") -> XLNetTokenizer:
    """``given`` (a directory or a spiece.model), else the directory's own tokenizer; ``flag``: the
    option that gives one (None: there is none)."""
    where = given or src.path
    if given is None and not os.path.exists(os.path.join(src.path, SPIECE_NAME)):
        hint = f": pass {flag} DIR" if flag else ""
        raise UsageError(f"{src.path} holds no tokenizer ({SPIECE_NAME}){hint}")
    try:
        return XLNetTokenizer.from_pretrained(where)
    except (OSError, ValueError) as exc:
        raise UsageError(f"{flag + ' ' if given else ''}{where}: {exc}") from None
