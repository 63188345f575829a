"""Checkpoint stall: how long the training loop waits for a checkpoint, synchronous against
asynchronous (``--async-save``) saving, at the base preset on CPU ranks.

    python -m bench.checkpoint_stall [--ranks 2] [--saves 2] [--steps-between 3] [--out FILE | --record]

Spawns ``--ranks`` gloo processes on the CPU, each holding its FSDP2 shard of the base model (vocab
32000), AdamW state and the mems of 16 rows per rank (``mem_len`` 384, as the preset trains; random
values, the content does not matter to the write), and saves through the trainer's own
``CheckpointWriter`` (DCP shards, per-rank hashing, manifest, rename, rotation). Per mode it trains
``--steps-between`` small steps (B=1, ``--seq`` tokens) before each of ``--saves`` saves, timing each
``save`` call and the wait for the last save before exit; a rank's stall is what its loop waits, the
table shows the slowest rank. Appends a record to ``--out`` (default: the cache directory, see
``bench.runner``), or with ``--record`` to ``bench/results/checkpoint_stall.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import sys
import tempfile
import time

import numpy as np
import torch
import torch.distributed as dist

from bench import cases, runner

RECORDS = "checkpoint_stall.json"
ROWS_PER_RANK = 16  # the base preset's --batch-size
MODES = ("sync", "async")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _dir_bytes(path: str) -> int:
    return sum(os.path.getsize(os.path.join(path, n)) for n in os.listdir(path))


def _train_config(out: str, mode: str):
    from xlnet_fast.pretrain import TrainConfig

    return TrainConfig(preset="base", out=out, keep=1, fsdp=True, batch_size=ROWS_PER_RANK,
                       async_save=mode == "async").resolved()


def _build(rank: int, world: int, tokenizer_dir: str):
    """This rank's FSDP2 base model, AdamW (state initialised), scheduler, rows and mems."""
    from torch.distributed.fsdp import fully_shard

    from xlnet_fast import XLNetConfig, XLNetLMHeadModel
    from xlnet_fast.pretrain import PRESETS, XLNetTokenizer
    from xlnet_fast.pretrain.data import DataConfig, PretrainBatches

    preset = PRESETS["base"]
    torch.manual_seed(0)
    model = XLNetLMHeadModel(XLNetConfig(vocab_size=preset["vocab_size"], **preset["model"], dropout=0.1,
                                         mem_len=preset["mem_len"], reuse_len=preset["reuse_len"],
                                         attn_backend="eager", use_mems_train=True))
    for layer in model.transformer.layer:
        fully_shard(layer)
    fully_shard(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
    tokenizer = XLNetTokenizer.from_pretrained(tokenizer_dir)
    tokens = np.random.default_rng(0).integers(9, tokenizer.vocab_size, 40 * world * ROWS_PER_RANK * preset["seq_len"],
                                               dtype=np.int32)
    data = DataConfig(seq_len=preset["seq_len"], reuse_len=preset["reuse_len"], num_predict=preset["num_predict"],
                      perm_size=preset["perm_size"])
    batches = PretrainBatches(tokens, tokenizer, data, rows=ROWS_PER_RANK, rank=rank, world_size=world)
    d_model, n_layer = preset["model"]["d_model"], preset["model"]["n_layer"]
    mems = [torch.randn(preset["mem_len"], ROWS_PER_RANK, d_model) for _ in range(n_layer)]
    return model, optimizer, scheduler, batches, mems, tokenizer


def _train_step(model, optimizer, seq: int) -> float:
    t0 = time.perf_counter()
    b = cases.pretraining_batch(cases.ModelCase("base", B=1, seq=seq, predict=max(1, seq // 6),
                                                vocab=model.config.vocab_size))
    out = model(b["ids"], q_rank=b["q_rank"], k_rank=b["k_rank"], target_pos=b["target_pos"], labels=b["labels"],
                use_mems=False)
    out.loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return time.perf_counter() - t0


def _measure_mode(mode: str, parts, rank: int, world: int, work: str, args) -> dict:
    from xlnet_fast.pretrain.sharded import CheckpointWriter

    model, optimizer, scheduler, batches, mems, tokenizer = parts
    writer = CheckpointWriter(_train_config(os.path.join(work, mode), mode), rank, world)
    stalls, step_times, step, final = [], [], 0, None
    for _ in range(args.saves):
        for _ in range(args.steps_between):
            step_times.append(_train_step(model, optimizer, args.seq))
            step += 1
        t0 = time.perf_counter()
        final = writer.save(step, model, optimizer, scheduler, batches, mems, tokenizer,
                            {"data": [], "data_digest": None})
        stalls.append(time.perf_counter() - t0)
    t0 = time.perf_counter()
    writer.wait()
    exit_wait = time.perf_counter() - t0
    writer.close()
    return {"stall_s": stalls, "exit_wait_s": exit_wait, "step_s": float(np.median(step_times)),
            "checkpoint_bytes": _dir_bytes(final) if rank == 0 else None}


def _rank_main(rank: int, world: int, port: int, tokenizer_dir: str, work: str, result_path: str, args) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(args.threads)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        parts = _build(rank, world, tokenizer_dir)
        _train_step(parts[0], parts[1], args.seq)  # AdamW state exists from here on, as in training
        mine = {mode: _measure_mode(mode, parts, rank, world, work, args) for mode in MODES}
        gathered = [None] * world
        dist.all_gather_object(gathered, mine)
        if rank == 0:
            n_params = sum(p.numel() for p in parts[0].parameters())
            with open(result_path, "w") as f:
                json.dump({"per_rank": gathered, "params": n_params}, f)
    finally:
        dist.destroy_process_group()


def _summary(per_rank: list[dict], mode: str) -> dict:
    """The slowest rank's stall per save and exit wait."""
    stalls = [max(r[mode]["stall_s"][i] for r in per_rank) for i in range(len(per_rank[0][mode]["stall_s"]))]
    exit_wait = max(r[mode]["exit_wait_s"] for r in per_rank)
    return {"stall_per_save_s": stalls, "exit_wait_s": exit_wait, "total_stall_s": sum(stalls) + exit_wait,
            "train_step_s": max(r[mode]["step_s"] for r in per_rank),
            "checkpoint_bytes": per_rank[0][mode]["checkpoint_bytes"]}


def _print_table(record: dict) -> None:
    print(f"\n{'mode':6} {'stall per save (s)':>22} {'exit wait (s)':>14} {'total stall (s)':>16} "
          f"{'train step (s)':>15} {'checkpoint':>11}")
    for mode in MODES:
        m = record["modes"][mode]
        per_save = " ".join(f"{s:.2f}" for s in m["stall_per_save_s"])
        print(f"{mode:6} {per_save:>22} {m['exit_wait_s']:14.2f} {m['total_stall_s']:16.2f} "
              f"{m['train_step_s']:15.2f} {m['checkpoint_bytes'] / 1e9:9.2f} GB")
    print(f"load average before/after: {record['loadavg_before']} / {record['loadavg_after']}")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--saves", type=int, default=2, help="checkpoints per mode")
    p.add_argument("--steps-between", type=int, default=3, help="training steps before each save")
    p.add_argument("--seq", type=int, default=128, help="tokens of a training step's single row")
    p.add_argument("--threads", type=int, default=max(1, (os.cpu_count() or 1) // 2), help="torch threads per rank")
    p.add_argument("--work-dir", default=None, help="where the checkpoints are written (default: a temp directory)")
    runner.add_output_args(p, RECORDS)
    args = p.parse_args(argv)
    print(f"checkpoint stall, sync vs async save: base preset (vocab 32000), FSDP2 on {args.ranks} gloo CPU ranks, "
          f"AdamW, mems of {ROWS_PER_RANK} rows per rank; per mode {args.saves} saves, each after "
          f"{args.steps_between} training steps (B=1, seq {args.seq}). Takes about 2 minutes on 2 idle cores "
          "(model set-up, training steps, 4 checkpoints of ~1.9 GB written and hashed).", flush=True)
    from xlnet_fast.pretrain import train_tokenizer

    work = tempfile.mkdtemp(prefix="checkpoint_stall_", dir=args.work_dir)
    try:
        words = "in the beginning god created heaven and earth light was good darkness upon face deep".split()
        lines = [" ".join(words[(i * 7 + j) % len(words)] for j in range(8)) for i in range(300)]
        tokenizer_dir = os.path.join(work, "tokenizer")
        train_tokenizer(lines, 40, tokenizer_dir)
        result_path = os.path.join(work, "result.json")
        loadavg_before = [round(x, 2) for x in os.getloadavg()]
        torch.multiprocessing.spawn(_rank_main, nprocs=args.ranks, join=True,
                                    args=(args.ranks, _free_port(), tokenizer_dir, work, result_path, args))
        with open(result_path) as f:
            result = json.load(f)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    record = {**runner.environment(), "op": "checkpoint_stall", "preset": "base", "ranks": args.ranks,
              "backend": "gloo",
              "fsdp": True, "params": result["params"], "rows_per_rank": ROWS_PER_RANK, "saves": args.saves,
              "steps_between": args.steps_between, "seq": args.seq, "threads_per_rank": args.threads,
              "cpu_count": os.cpu_count(), "loadavg_before": loadavg_before,
              "loadavg_after": [round(x, 2) for x in os.getloadavg()],
              "modes": {mode: _summary(result["per_rank"], mode) for mode in MODES}}
    _print_table(record)
    runner.write_records(args, RECORDS, [record])
    return 0


if __name__ == "__main__":
    sys.exit(main())
