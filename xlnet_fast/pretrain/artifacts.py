"""The model directories ``xlnet-fast eval`` and ``xlnet-fast export`` read: a run directory (its
newest readable checkpoint), one training checkpoint (``out/checkpoints/step_N``), or a transformers
directory (``config.json`` and weights, e.g. written by ``XLNetLMHeadModel.save_pretrained``).

A training checkpoint is checked when it is resolved (``checkpoint.check_checkpoint``: ``COMPLETE``
present, every file's size and, unless ``verify`` is off, sha256) and its weights are read only
through ``checkpoint.read_model_state`` / ``checkpoint.load_model_weights``, which check it too.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass

from .checkpoint import (check_checkpoint, list_checkpoints, load_model_weights, newest_readable, read_model_state,
                         read_run_record)
from .errors import UsageError
from .models import XLNET, lm_class, model_of_dir, read_model_config
from .outputs import CHECKPOINT_DIR, RUN_DIR, directory_kind
from .settings import TrainConfig
from .tokenizer import SPIECE_NAME
from .tokenizers import Tokenizer, holds_tokenizer, load_tokenizer_dir

logger = logging.getLogger(__name__)

NO_VERIFY_NOTE = ("not comparing the checkpoint's files with the sha256 checksums in its COMPLETE (--no-verify): "
                  "COMPLETE must still be there and every file's size match it")


@dataclass
class ModelDir:
    path: str  # the directory holding config.json and the weights
    record: dict | None  # a training checkpoint's run record (settings, data, world size); None otherwise
    verify: bool = True  # a training checkpoint's files are compared with the checksums in its COMPLETE

    @property
    def step(self) -> int | None:
        return None if self.record is None else self.record["step"]

    @property
    def is_checkpoint(self) -> bool:
        return self.record is not None

    @property
    def model(self) -> str:
        """``"xlnet"`` or ``"transfo-xl"``, by its config.json."""
        return model_of_dir(self.path)


def resolve_model_dir(path: str, flag: str, verify: bool = True) -> ModelDir:
    """``path`` as a run directory, a training checkpoint (checked: a damaged or unfinished one is a
    ``CheckpointError`` naming the file; ``verify=False`` skips the checksums) or a transformers
    directory; anything else is a ``UsageError`` naming ``flag``."""
    path = os.fspath(path)
    if not os.path.isdir(path):
        raise UsageError(f"{flag} {path}: not a directory")
    if not verify:
        logger.warning(NO_VERIFY_NOTE)
    if os.path.isdir(os.path.join(path, "checkpoints")) or directory_kind(path) == RUN_DIR:  # a run directory
        found = list_checkpoints(TrainConfig(out=path))
        root = os.path.join(path, "checkpoints")
        if not found:
            raise UsageError(f"{flag} {path}: no checkpoint yet in {root}: the run has not saved one (it saves "
                             "every --save-every steps, at its end and when stopped by SIGTERM or Ctrl-C)")
        newest, _ = newest_readable(found, checksums=verify)
        if newest is None:
            raise UsageError(f"{flag} {path}: no readable checkpoint in {root}: "
                             + (f"the only one, {os.path.basename(found[0])}, is unreadable" if len(found) == 1 else
                                f"all {len(found)} are unreadable") + " (see the warnings above)")
        path = newest
    if directory_kind(path) == CHECKPOINT_DIR:
        check_checkpoint(path, checksums=verify)  # before anything of it is used (a pre-0.1 one is refused)
        return ModelDir(path, read_run_record(path), verify)
    if os.path.exists(os.path.join(path, "config.json")):
        return ModelDir(path, None)
    raise UsageError(f"{flag} {path}: neither a run directory, a training checkpoint nor a transformers "
                     "directory (no config.json)")


def read_config(src: ModelDir, **overrides):
    """The directory's config: an ``XLNetConfig`` or a ``TransfoXLConfig`` (by its ``model_type``)."""
    try:
        return read_model_config(src.path, **overrides)
    except (OSError, ValueError, TypeError) as exc:
        raise UsageError(f"{src.path}: {exc}") from None


def load_lm(src: ModelDir, **config_overrides):
    """The directory's ``XLNetLMHeadModel`` or ``TransfoXLLMHeadModel`` on the CPU, in eval mode;
    ``config_overrides`` replace fields of its ``config.json``."""
    config = read_config(src, **config_overrides)
    cls = lm_class(src.model)
    try:
        if src.is_checkpoint:
            model = cls(config)
            load_model_weights(model, src.path, verify=src.verify)
            return model.eval()
        return cls.from_pretrained(src.path, config=config)
    except (OSError, ValueError) as exc:
        raise UsageError(f"{src.path}: cannot load the weights ({exc})") from None


def model_state(src: ModelDir) -> dict:
    """The full model state (transformers' names, CPU tensors) of a checkpoint or of a transformers
    directory."""
    if src.is_checkpoint:
        return read_model_state(src.path, verify=src.verify)
    return load_lm(src).state_dict()


def load_tokenizer(src: ModelDir, given: str | None = None, flag: str | None = "--tokenizer") -> Tokenizer:
    """``given`` (a directory, a spiece.model or a vocab.txt), else the directory's own tokenizer:
    sentencepiece (``XLNetTokenizer``) or word-level (``TransfoXLTokenizer``, a Transformer-XL's);
    ``flag``: the option that gives one (None: there is none)."""
    where = given or src.path
    if given is None and not holds_tokenizer(src.path):
        hint = f": pass {flag} DIR" if flag else ""
        what = SPIECE_NAME if src.model == XLNET else f"{SPIECE_NAME} or vocab.txt"
        raise UsageError(f"{src.path} holds no tokenizer ({what}){hint}")
    try:
        return load_tokenizer_dir(where)
    except (OSError, ValueError) as exc:
        raise UsageError(f"{flag + ' ' if given else ''}{where}: {exc}") from None
