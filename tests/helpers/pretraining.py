"""A small corpus and a tiny pretraining run, as a TrainConfig and as the command line that gives it;
the corpus's token stream read the simple way (the reference for prepared data); a checkpoint
rewritten in the format before 0.1's sharded checkpoints."""

import json
import os
import random
import socket
import sys

import numpy as np
import torch

from xlnet_fast.pretrain import TrainConfig
from xlnet_fast.pretrain.checkpoint import hash_file, read_model_state
from xlnet_fast.pretrain.corpus import iter_documents
from xlnet_fast.pretrain.tokenizer import EOD_ID

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


def reference_tokens(paths, tokenizer) -> np.ndarray:
    """The token stream of the files ``paths`` (n,) int32, in one pass in this process: each document
    of ``iter_documents`` as its lines encoded one by one (no special tokens), then ``<eod>`` — what
    ``prepare_corpus`` must write, whatever its workers, chunks and shards."""
    ids: list[int] = []
    for doc in iter_documents(paths):
        for line in doc:
            ids.extend(tokenizer.encode(line, add_special_tokens=False))
        ids.append(EOD_ID)
    return np.asarray(ids, dtype=np.int32)


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


def as_written_before_0_1(step_dir) -> None:
    """Rewrite the checkpoint ``step_dir`` as xlnet_fast wrote checkpoints before 0.1's sharded ones:
    the weights in ``model.safetensors``, ``trainer.pt`` (step, optimizer, scheduler), ``rank0.pt``
    (RNG, data position, mems), no DCP index or shards, and ``COMPLETE`` the manifest of those files."""
    from safetensors.torch import save_file

    state = read_model_state(str(step_dir))
    step = json.loads((step_dir / "COMPLETE").read_text())["step"]
    for name in os.listdir(step_dir):
        if name in (".metadata", "COMPLETE") or name.endswith(".distcp"):
            os.remove(step_dir / name)
    save_file(state, str(step_dir / "model.safetensors"), metadata={"format": "pt"})
    torch.save({"step": step, "optimizer": {}, "scheduler": {}}, step_dir / "trainer.pt")
    torch.save({"rng": {"torch": torch.get_rng_state()}, "data": {}, "mems": None}, step_dir / "rank0.pt")
    files = {name: hash_file(str(step_dir / name)) for name in sorted(os.listdir(step_dir))}
    (step_dir / "COMPLETE").write_text(json.dumps({"step": step, "files": files}, indent=1))


def stopped_after(run, step: int, into) -> None:
    """Make ``into`` the run directory that the run in ``run`` would have left had it stopped right
    after its step-``step`` checkpoint: that checkpoint, and the metrics rows (steps and evaluations)
    up to that step."""
    import shutil
    from pathlib import Path

    run, into = Path(run), Path(into)
    name = f"step_{step:07d}"
    shutil.copytree(run / "checkpoints" / name, into / "checkpoints" / name)
    rows = [json.loads(line) for line in open(run / "metrics.jsonl")]
    with open(into / "metrics.jsonl", "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in rows if r["step"] <= step)


def terminated_after_rows(cmd: list, metrics, rows: int, timeout_s: float = 120) -> tuple[int, str]:
    """Start ``cmd`` (a ``pretrain``), send it SIGTERM once its ``metrics`` file holds ``rows`` rows (or
    after ``timeout_s``), and return its exit status and output (stdout and stderr together)."""
    import signal
    import subprocess
    import time
    from pathlib import Path

    metrics = Path(metrics)
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    deadline = time.time() + timeout_s
    while time.time() < deadline and (not metrics.exists() or len(metrics.read_text().splitlines()) < rows):
        time.sleep(0.2)
    proc.send_signal(signal.SIGTERM)
    out, _ = proc.communicate(timeout=timeout_s)
    return proc.returncode, out
