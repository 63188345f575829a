"""``xlnet-fast generate`` and the Transformer-XL side of ``xlnet-fast eval``.

``generate --model DIR --prompt TEXT`` continues a prompt with a Transformer-XL directory (its
word-level vocabulary) or an XLNet one (a transformers directory, a training checkpoint or a run
directory, with its sentencepiece tokenizer), carrying memory so each new token costs one forward
over itself. It prints the prompt and its continuation on stdout and the speed on stderr.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

from .transfo_xl.config import MEM_STARTS

XLNET_ONLY_EVAL_FLAGS = ("seq_len", "reuse_len", "num_predict", "perm_size", "no_verify", "verify_data", "cache_dir")
TRANSFO_XL_EVAL_FLAGS = ("tgt_len", "clamp_len", "same_length", "mem_start")
MEM_START_HELP = ("the memory the text starts from: zeros (transformers 4.x's mem_len zero rows) or empty (the "
                  "original code's) (default: the model's config.mem_start, zeros unless set)")
DEFAULT_TGT_LEN, DEFAULT_EVAL_ROWS = 128, 10


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def add_transfo_xl_eval_flags(p: argparse.ArgumentParser) -> None:
    """``xlnet-fast eval``'s flags for a Transformer-XL directory (--mem-len and --batch-size are shared)."""
    g = p.add_argument_group("Transformer-XL (a directory with model_type 'transfo-xl'): perplexity of --data "
                             "as the original eval.py, with the memory carried across segments")
    g.add_argument("--tgt-len", type=int, dest="tgt_len", metavar="N",
                   help=f"tokens per segment (default: {DEFAULT_TGT_LEN}); --mem-len: memory rows (default: the "
                   f"model's); --batch-size: rows the stream is cut into (default: {DEFAULT_EVAL_ROWS}); "
                   "--batches: at most N segments (default: all)")
    g.add_argument("--clamp-len", type=int, dest="clamp_len", metavar="N",
                   help="clamp relative distances at N, <= 0: no clamp (default: the model's)")
    g.add_argument("--same-length", action="store_true", dest="same_length", default=None,
                   help="every token attends to the same number of keys, mem_len (default: the model's)")
    g.add_argument("--mem-start", choices=MEM_STARTS, dest="mem_start", help=MEM_START_HELP)


def eval_transfo_xl(args: argparse.Namespace) -> int:
    """``xlnet-fast eval`` on a Transformer-XL directory: one JSON line."""
    from .pretrain.errors import UsageError
    from .transfo_xl.evaluate import evaluate_transfo_xl_dir

    given = [_flag(n) for n in XLNET_ONLY_EVAL_FLAGS if getattr(args, n, None) is not None]
    if given:
        raise UsageError(f"{', '.join(given)}: XLNet's record layout, checkpoint and prepared-data checks and data "
                         "cache; a Transformer-XL directory is evaluated with --tgt-len, --mem-len, --clamp-len, "
                         "--same-length")
    result = evaluate_transfo_xl_dir(
        args.model, args.data, tgt_len=DEFAULT_TGT_LEN if args.tgt_len is None else args.tgt_len, mem_len=args.mem_len,
        clamp_len=args.clamp_len, same_length=args.same_length, mem_start=args.mem_start,
        batch_size=DEFAULT_EVAL_ROWS if args.batch_size is None else args.batch_size,
        batches=args.batches, tokenizer=args.tokenizer, backend=args.backend, progress=not args.no_progress)
    print(json.dumps(result), flush=True)
    return 0


def eval_transfo_xl_checkpoint(args: argparse.Namespace) -> int:
    """``xlnet-fast eval`` on a Transformer-XL training checkpoint or run directory: the run's evaluation
    (its eval_loss at that step) or the same on ``--data``; one JSON line."""
    from .pretrain.artifacts import resolve_model_dir
    from .pretrain.causal import evaluate_checkpoint
    from .pretrain.errors import UsageError

    given = [_flag(n) for n in ("seq_len", "reuse_len", "num_predict", "perm_size") if getattr(args, n) is not None]
    if given:
        raise UsageError(f"{', '.join(given)}: XLNet's record layout; a Transformer-XL is evaluated with --tgt-len, "
                         "--mem-len, --clamp-len, --same-length, --mem-start")
    if args.mem_len is not None and args.mem_len < 0:
        raise UsageError(f"--mem-len must be 0 or a positive integer, got {args.mem_len}")
    src = resolve_model_dir(args.model, "--model", verify=not args.no_verify)
    result = evaluate_checkpoint(src, data=args.data, batches=args.batches, tokenizer=args.tokenizer,
                                 cache_dir=args.cache_dir, verify_data=bool(args.verify_data), rows=args.batch_size,
                                 tgt_len=args.tgt_len, mem_len=args.mem_len, clamp_len=args.clamp_len,
                                 same_length=args.same_length, mem_start=args.mem_start, attn_backend=args.backend,
                                 progress=not args.no_progress)
    print(json.dumps(result), flush=True)
    return 0


def check_xlnet_eval_flags(args: argparse.Namespace) -> None:
    from .pretrain.errors import UsageError

    given = [_flag(n) for n in TRANSFO_XL_EVAL_FLAGS if getattr(args, n, None) is not None]
    if given:
        raise UsageError(f"{', '.join(given)}: Transformer-XL flags; --model {args.model} is an XLNet")


# --------------------------------------------------------------------------------------------------
# xlnet-fast generate
# --------------------------------------------------------------------------------------------------

GENERATE_DESCRIPTION = ("Continue --prompt with a Transformer-XL or an XLNet, one forward over the new token per "
                        "step (the memory holds the rest). Greedy unless --sample. Prints the text on stdout and "
                        "the speed on stderr.")


def add_generate_parser(sub) -> argparse.ArgumentParser:
    from .attention.backends import BACKENDS

    p = sub.add_parser("generate", help="continue a prompt (Transformer-XL or XLNet), memory carried between tokens",
                       description=GENERATE_DESCRIPTION)
    p.add_argument("--model", required=True, metavar="DIR", help="a Transformer-XL or XLNet transformers directory, "
                   "an XLNet training checkpoint or run directory (required)")
    p.add_argument("--prompt", required=True, metavar="TEXT", help="the text to continue (required)")
    p.add_argument("--max-new-tokens", type=int, default=50, dest="max_new_tokens", metavar="N",
                   help="tokens to generate at most (default: %(default)s)")
    p.add_argument("--sample", action="store_true", help="sample instead of greedy decoding (default: off)")
    p.add_argument("--temperature", type=float, default=1.0, metavar="T", help="with --sample (default: %(default)s)")
    p.add_argument("--top-k", type=int, default=0, dest="top_k", metavar="K", help="with --sample: the K most likely "
                   "tokens only, 0: all (default: %(default)s)")
    p.add_argument("--top-p", type=float, default=1.0, dest="top_p", metavar="P", help="with --sample: nucleus "
                   "sampling (default: %(default)s)")
    p.add_argument("--seed", type=int, default=0, metavar="N", help="sampling seed (default: %(default)s)")
    p.add_argument("--mem-len", type=int, dest="mem_len", metavar="N", help="memory rows per layer (default: the "
                   "model's)")
    p.add_argument("--mem-start", choices=MEM_STARTS, dest="mem_start", help="Transformer-XL: " + MEM_START_HELP)
    p.add_argument("--no-cache", action="store_true", dest="no_cache", help="recompute the whole context for every "
                   "token, without memory (for comparison; default: off)")
    p.add_argument("--tokenizer", metavar="DIR", help="the tokenizer's directory (default: the model's)")
    p.add_argument("--backend", choices=BACKENDS, help="attention backend (default: the model's config, else auto)")
    return p


def _load(args):
    """(model, encode, decode, kind) for ``--model`` (a transformers directory, a training checkpoint or
    a run directory, of either model); a user's mistake is a UsageError."""
    from .pretrain.artifacts import load_lm, load_tokenizer, resolve_model_dir
    from .pretrain.errors import UsageError
    from .pretrain.models import TRANSFO_XL
    from .pretrain.tokenizers import WORD, tokenizer_kind

    src = resolve_model_dir(args.model, "--model")
    overrides = {k: v for k, v in (("mem_len", args.mem_len), ("attn_backend", args.backend)) if v is not None}
    if src.model == TRANSFO_XL:
        if args.mem_start is not None:
            overrides["mem_start"] = args.mem_start
    elif args.mem_start is not None:
        raise UsageError(f"--mem-start: Transformer-XL's start memory; --model {args.model} is an XLNet")
    model = load_lm(src, **overrides)
    tok = load_tokenizer(src, args.tokenizer)
    kind = "Transformer-XL" if src.model == TRANSFO_XL else "XLNet"
    if tokenizer_kind(tok) == WORD:
        if src.model != TRANSFO_XL:
            raise UsageError(f"{args.tokenizer or src.path}: a word-level vocabulary, but XLNet needs its "
                             "sentencepiece tokenizer (spiece.model)")
        encode, decode = tok.encode, tok.decode
    else:
        encode, decode = (lambda text: tok.encode(text, add_special_tokens=False),
                          lambda ids: tok.decode(ids, skip_special_tokens=True))
    if tok.vocab_size != model.config.vocab_size:
        raise UsageError(f"the tokenizer has {tok.vocab_size} tokens but the model's vocabulary "
                         f"{model.config.vocab_size}: pass the model's own with --tokenizer DIR")
    return model, encode, decode, kind


def generate_command(args: argparse.Namespace) -> int:
    import torch

    from .pretrain.errors import UsageError
    from .pretrain.settings import MAX_SEED

    if args.max_new_tokens < 1:
        raise UsageError(f"--max-new-tokens must be a positive integer, got {args.max_new_tokens}")
    if args.mem_len is not None and args.mem_len < 0:
        raise UsageError(f"--mem-len must be 0 or a positive integer, got {args.mem_len}")
    if not (args.temperature > 0 and args.temperature < float("inf")):
        raise UsageError(f"--temperature must be a finite number > 0, got {args.temperature}")
    if args.top_k < 0:
        raise UsageError(f"--top-k must be 0 (all tokens) or a positive integer, got {args.top_k}")
    if not 0 < args.top_p <= 1:
        raise UsageError(f"--top-p must be in (0, 1], got {args.top_p}")
    if not 0 <= args.seed <= MAX_SEED:  # torch's generator took 10**23 with an error naming no flag, and -1
        raise UsageError(f"--seed must be an integer in [0, 2**63 - 1], got {args.seed}")
    if not args.sample:
        given = [flag for flag, value, default in (("--temperature", args.temperature, 1.0), ("--top-k", args.top_k, 0),
                                                   ("--top-p", args.top_p, 1.0), ("--seed", args.seed, 0))
                 if value != default]
        if given:
            raise UsageError(f"{', '.join(given)}: sampling settings, but decoding is greedy: add --sample")
    model, encode, decode, kind = _load(args)
    ids = encode(args.prompt)
    if not ids:
        raise UsageError("--prompt gives no tokens")
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    model.to(device)
    prompt = torch.tensor([ids], dtype=torch.long, device=device)
    t0 = time.perf_counter()
    try:
        out = model.generate(prompt, max_new_tokens=args.max_new_tokens, do_sample=args.sample,
                             temperature=args.temperature, top_k=args.top_k, top_p=args.top_p,
                             generator=torch.Generator(device=device).manual_seed(args.seed),
                             use_cache=not args.no_cache)
    except (TypeError, ValueError) as exc:
        raise UsageError(str(exc)) from None
    seconds = time.perf_counter() - t0
    new = out.shape[1] - prompt.shape[1]
    print(decode(out[0].tolist()), flush=True)
    how = ("no memory, the context recomputed per token" if args.no_cache
           else f"memory of {model.config.mem_len} rows per layer")
    print(f"{kind}: {new} new tokens after a {prompt.shape[1]}-token prompt in {seconds:.2f} s "
          f"({new / max(seconds, 1e-9):,.1f} tokens/s; {how})", file=sys.stderr, flush=True)
    return 0
