"""Command line: ``xlnet-fast`` (also ``python -m xlnet_fast``)."""

from __future__ import annotations

import argparse
import os
import platform
import sys



def _info(args: argparse.Namespace) -> int:
    import torch

    from . import __version__
    from .attention import explain_auto_backend, triton_status

    try:
        import triton

        triton_version = triton.__version__
    except Exception:
        triton_version = "not installed"
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    lines = [
        f"xlnet_fast  {__version__}",
        f"python      {platform.python_version()}",
        f"torch       {torch.__version__}",
        f"triton      {triton_version}",
        f"device      {torch.cuda.get_device_name(0) if device.type == 'cuda' else 'cpu'}",
        f"triton backend usable: {_triton_usable(device, *triton_status())}",
        f"backend='auto' on {device.type}: {explain_auto_backend(device)}",
    ]
    print("\n".join(lines))
    return 0


def _triton_usable(device, ok: bool, reason: str) -> str:
    """``info``'s answer: whether the fused kernels can run here, and on a machine without a GPU that they
    run only in Triton's CPU interpreter, which is for tests."""
    from .kernel_contract import contract

    if not ok:
        return f"no ({reason})"
    if device.type == "cuda":
        return f"yes ({reason})"
    if contract.interpreting():
        return (f"only in Triton's CPU interpreter (TRITON_INTERPRET=1 is set; {reason}): for tests, far slower "
                "than eager")
    return (f"no, no CUDA GPU here ({reason} is installed; on a CPU the kernels run only in Triton's interpreter, "
            "TRITON_INTERPRET=1, for tests)")


LOG_FORMAT = "%(levelname)s %(name)s: %(message)s"


def setup_logging() -> None:
    """Every command's logging, set once by ``main``: ``LEVEL logger: message`` on stderr (INFO and
    above), ``warnings.warn`` through it too (and so around a progress bar)."""
    import logging

    logging.basicConfig(level=logging.INFO, format=LOG_FORMAT)
    logging.captureWarnings(True)


def _pretrain(args: argparse.Namespace) -> int:
    from .pretrain import NonFiniteLossError, TrainConfig, pretrain
    from .pretrain.summary import format_summary

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
    print(format_summary(result), flush=True)
    return 0


def _eval(args: argparse.Namespace) -> int:
    import json

    from .cli_generate import check_xlnet_eval_flags, eval_transfo_xl, eval_transfo_xl_checkpoint
    from .pretrain.evaluate import evaluate_model_dir
    from .transfo_xl import is_transfo_xl_dir

    if _transfo_xl_checkpoint(args.model):
        return eval_transfo_xl_checkpoint(args)
    if is_transfo_xl_dir(args.model):
        return eval_transfo_xl(args)
    check_xlnet_eval_flags(args)
    layout = {name: getattr(args, name) for name in ("seq_len", "reuse_len", "mem_len", "num_predict", "perm_size",
                                                     "batch_size")}
    result = evaluate_model_dir(args.model, data=args.data, batches=args.batches, tokenizer=args.tokenizer,
                                cache_dir=args.cache_dir, backend=args.backend, verify=not args.no_verify,
                                verify_data=args.verify_data, progress=not args.no_progress, **layout)
    print(json.dumps(result), flush=True)
    return 0


def _transfo_xl_checkpoint(path: str) -> bool:
    """Whether ``path`` is a Transformer-XL training checkpoint, or a run directory whose newest one is."""
    from .pretrain.checkpoint import list_checkpoints
    from .pretrain.models import TRANSFO_XL, model_of_dir
    from .pretrain.outputs import CHECKPOINT_DIR, directory_kind
    from .pretrain.settings import TrainConfig

    if os.path.isdir(os.path.join(path, "checkpoints")):
        found = list_checkpoints(TrainConfig(out=path))
        return bool(found) and model_of_dir(found[-1]) == TRANSFO_XL
    return directory_kind(path) == CHECKPOINT_DIR and model_of_dir(path) == TRANSFO_XL


def _plot(args: argparse.Namespace) -> int:
    from .pretrain.plot import write_loss_plot

    if not os.path.isdir(args.run_dir):
        from .pretrain.errors import UsageError

        raise UsageError(f"{args.run_dir} is not a directory")  # a file, or missing
    print(f"wrote {write_loss_plot(args.run_dir, args.out)}")
    return 0


def _export(args: argparse.Namespace) -> int:
    from .pretrain.export import DTYPE_NAMES, export_model

    r = export_model(args.source, args.out, dtype=args.dtype, overwrite=args.overwrite, verify=not args.no_verify)
    if r["model_class"] != "XLNetLMHeadModel":
        print(f"wrote {r['out']} ({r['parameters']:,} parameters, {r['dtype']}) from {r['source']}: load with "
              f"xlnet_fast.{r['model_class']}.from_pretrained({r['out']!r}) or transformers 4.x's")
        return 0
    print(f"wrote {r['out']} ({r['parameters']:,} parameters, {r['dtype']}) from {r['source']}: load with "
          f"transformers.XLNetLMHeadModel.from_pretrained({r['out']!r}) or xlnet_fast's")
    if r["dtype"] != "fp32":  # transformers' XLNet creates its attention weights as float32 tensors
        print(f"with transformers, add .to(torch.{DTYPE_NAMES[r['dtype']]}) after from_pretrained: its XLNet keeps "
              "the attention weights in float32 otherwise")
    return 0


def _tokenizer_train(args: argparse.Namespace) -> int:
    from .pretrain.corpus import check_corpus, iter_lines
    from .pretrain.errors import UsageError
    from .pretrain.outputs import check_output_dir
    from .pretrain.tokenizer import SPECIAL_TOKENS, TOKENIZER_FILES, train_tokenizer
    from .pretrain.tokenizers import ALL_TOKENIZER_FILES, WORD, WORD_TOKENIZER_FILES
    from .transfo_xl.tokenizer import TransfoXLTokenizer

    word = args.kind == WORD
    specials = 2 if word else len(SPECIAL_TOKENS)  # <eos> <unk>, or XLNet's
    if args.vocab_size <= specials:
        raise UsageError(f"--vocab-size must exceed the {specials} special tokens, got {args.vocab_size}")
    files = WORD_TOKENIZER_FILES if word else TOKENIZER_FILES
    check_output_dir(args.out, command="tokenizer train", inputs=args.files, overwrite=args.overwrite,
                     owned=lambda name, is_dir: name in ALL_TOKENIZER_FILES)  # either kind's: one replaces the other
    check_corpus(args.files)
    if word:
        tok = TransfoXLTokenizer.from_corpus(iter_lines(args.files), args.vocab_size)
        tok.save_pretrained(args.out)
        written = f"{os.path.join(args.out, files[0])} ({tok.vocab_size} symbols)"
    else:
        tok = train_tokenizer(iter_lines(args.files), args.vocab_size, args.out)
        written = f"{tok.model_file} ({tok.vocab_size} pieces)"
    for name in set(ALL_TOKENIZER_FILES) - set(files):  # the other kind's, replaced (--overwrite)
        if os.path.lexists(os.path.join(args.out, name)):
            os.remove(os.path.join(args.out, name))
    print(f"wrote {written}")
    return 0


def _data_prepare(args: argparse.Namespace) -> int:
    from .pretrain.corpus import check_readable
    from .pretrain.errors import UsageError
    from .pretrain.prepare import default_workers, prepare_corpus
    from .pretrain.tokenizers import load_tokenizer_dir

    for flag, value in (("--workers", args.workers), ("--shard-tokens", args.shard_tokens)):
        if value is not None and value < 1:
            raise UsageError(f"{flag} must be a positive integer, got {value}")
    cores = default_workers()
    if args.workers is not None and args.workers > 4 * cores:
        raise UsageError(f"--workers {args.workers}: at most 4 x the {cores} usable cores ({4 * cores}); each worker "
                         "is a process holding the tokenizer and its chunks")
    check_readable(args.files)
    try:
        tokenizer = load_tokenizer_dir(args.tokenizer)
    except (OSError, ValueError) as exc:
        raise UsageError(f"--tokenizer {args.tokenizer}: {exc}") from None
    data = prepare_corpus(args.files, tokenizer, args.out, workers=args.workers, shard_tokens=args.shard_tokens,
                          progress=not args.no_progress, verify=True,  # an existing directory: every shard hashed
                          overwrite=args.overwrite)
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
    from . import __version__
    from .cli_generate import add_generate_parser, generate_command
    from .cli_help import (add_data_parser, add_eval_parser, add_export_parser, add_plot_parser,
                           add_pretrain_parser, add_tokenizer_parser)

    parser = _Parser(prog="xlnet-fast", description="Fast XLNet: fused relative attention, "
                     "HF-compatible model, permutation-LM pretraining.")
    parser.add_argument("--version", action="version", version=f"xlnet-fast {__version__}",
                        help="print the version and exit")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    p = sub.add_parser("info", help="versions, device, and which attention backend 'auto' picks and why")
    p.set_defaults(func=_info)
    add_pretrain_parser(sub).set_defaults(func=_pretrain)
    add_eval_parser(sub).set_defaults(func=_eval)
    add_plot_parser(sub).set_defaults(func=_plot)
    add_export_parser(sub).set_defaults(func=_export)
    add_generate_parser(sub).set_defaults(func=generate_command)

    add_tokenizer_parser(sub).set_defaults(func=_tokenizer_train)
    add_data_parser(sub).set_defaults(func=_data_prepare)
    return parser


EXIT_USAGE, EXIT_FAILURE, EXIT_INTERRUPTED = 2, 1, 130


def _check_forced_backend(backend: str | None) -> None:
    """``--backend triton`` where it cannot run (no CUDA and no interpreter, triton missing): one line,
    before any set-up, instead of a ``RuntimeError`` from the first forward."""
    if backend != "triton":
        return
    import torch

    from .attention.backends import resolve_backend
    from .pretrain.errors import UsageError

    try:
        resolve_backend("triton", torch.device("cuda" if torch.cuda.is_available() else "cpu"))
    except RuntimeError as exc:
        raise UsageError(f"--backend triton: {exc}") from None


def main(argv: list[str] | None = None) -> int:
    """Run a command. Each error is one line on stderr, never a traceback: a user's mistake (a bad
    flag, an unusable input file or checkpoint) exits 2, an environment failure (disk full, permission,
    a path under a file; the line names the path) exits 1, a Ctrl-C that stops at once exits 130."""
    args = build_parser().parse_args(argv)
    from .pretrain.errors import CheckpointError, UsageError, os_error_line, underlying_os_error

    setup_logging()
    try:
        _check_forced_backend(getattr(args, "backend", None))
        return args.func(args)
    except (UsageError, CheckpointError) as exc:
        _error(str(exc))
        return EXIT_USAGE
    except KeyboardInterrupt:
        _error("interrupted")
        return EXIT_INTERRUPTED
    except OSError as exc:
        _error(os_error_line(exc))
        return EXIT_FAILURE
    except BaseException as exc:  # e.g. torch.distributed.checkpoint's CheckpointException around a full disk
        cause = underlying_os_error(exc)
        if cause is None or isinstance(exc, (SystemExit, GeneratorExit)):
            raise
        _error(os_error_line(cause))
        return EXIT_FAILURE


if __name__ == "__main__":
    sys.exit(main())
