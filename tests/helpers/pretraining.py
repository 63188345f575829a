"""A small corpus and a tiny pretraining run, as a TrainConfig and as the command line that gives it."""

import random
import socket
import sys

from xlnet_fast.pretrain import TrainConfig

WORDS = ("in the beginning god created heaven and earth light was good darkness upon face of deep "
         "spirit moved waters said let there be day night evening morning first second firmament").split()
# the tiny run's sizes; pretrain_command passes the same values as flags (--vocab-size 120 ...)
TINY_RUN = dict(vocab_size=120, seq_len=32, reuse_len=16, mem_len=16, num_predict=6, perm_size=8, batch_size=4)


def write_corpus(path, seed: int = 0, docs: int = 40) -> str:
    """``docs`` documents of 30 random lines over WORDS, separated by blank lines; returns the path."""
    rng = random.Random(seed)
    with open(path, "w") as f:
        for _ in range(docs):
            for _ in range(30):
                f.write(" ".join(rng.choice(WORDS) for _ in range(rng.randint(5, 15))) + ".\n")
            f.write("\n")
    return str(path)


def train_config(out, corpus: str, cache_dir, **overrides) -> TrainConfig:
    """The tiny run on ``corpus`` into ``out``: eager backend, no progress bar, 2 steps unless overridden."""
    settings = dict(preset="tiny", data=[corpus], out=str(out), cache_dir=str(cache_dir), **TINY_RUN, steps=2,
                    progress=False, backend="eager")
    settings.update(overrides)
    return TrainConfig(**settings)


def pretrain_command(out, corpus: str, cache_dir, *extra: str) -> list[str]:
    """``python -m xlnet_fast pretrain`` for the tiny run (TINY_RUN as flags, eager, no progress), then ``extra``."""
    sizes = [arg for name, value in TINY_RUN.items() for arg in (f"--{name.replace('_', '-')}", str(value))]
    return [sys.executable, "-m", "xlnet_fast", "pretrain", "--data", corpus, "--out", str(out),
            "--cache-dir", str(cache_dir), *sizes, "--backend", "eager", "--no-progress", *extra]


def free_port() -> int:
    """A TCP port free right now on this host, for a torchrun rendezvous (fixed ports collide when two
    test runs share a machine)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
