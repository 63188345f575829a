"""Permutation-LM pretraining: tokenizer -> data -> the training loop, with its run directory and checkpoints.

``tokenizer`` (SentencePiece XLNet tokenizer), ``corpus`` (reading text files: documents, checks,
content digests), ``data`` (a token stream -> two-stream batches with compact masks), ``settings`` (presets, ``TrainConfig``), ``run_dir`` (lock, planning, metrics),
``checkpoint`` (the layout of atomic, sealed, verified checkpoints and their readers), ``sharded``
(the training state through ``torch.distributed.checkpoint``: sharded, optionally asynchronous
saves, resumed on any number of ranks), ``distributed`` (process-group helpers), ``loop``
(``pretrain``), ``prepare`` (parallel tokenization into sharded token files), ``evaluate`` (held-out
evaluation, ``xlnet-fast eval``), ``flops`` (FLOPs of a step, device peaks, tokens/s and MFU),
``summary`` and ``plot`` (the end-of-run summary, ``loss.png``), ``artifacts`` (run, checkpoint and
transformers directories), ``export`` and ``outputs`` (where a command may write; the cache directory).
"""

from .checkpoint import check_checkpoint, list_checkpoints, load_latest_checkpoint
from .errors import CheckpointError, NonFiniteLossError, UsageError
from .loop import pretrain
from .settings import PRESETS, TrainConfig, default_corpus
from .tokenizer import XLNetTokenizer, train_tokenizer

__all__ = ["pretrain", "TrainConfig", "PRESETS", "default_corpus", "UsageError", "NonFiniteLossError",
           "CheckpointError", "check_checkpoint", "list_checkpoints", "load_latest_checkpoint", "XLNetTokenizer",
           "train_tokenizer"]
