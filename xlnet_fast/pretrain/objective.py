"""What pretraining does differently for each model, behind one small seam: the loop (``loop.py``), its
run directory, checkpoints, resume, metrics, plot, throughput and export are shared.

An objective gives the model's config from the run's settings and tokenizer, names its layers (activation
checkpointing, FSDP2), gives the module DDP/FSDP2 wrap, the batches, the loss of one micro-batch
(a sum over its targets, their number and the memory for the next step), the held-out evaluator,
the FLOPs of a step, and the tokenizer a run builds from its data when given none:

- ``PermutationLM`` (``--model xlnet``): XLNet's two-stream permutation LM (``data.py``).
- ``CausalLM`` (``--model transfo-xl``): Transformer-XL's causal LM over parallel streams with the
  memory carried (``causal.py``).
"""

from __future__ import annotations

import torch

from ..config import XLNetConfig
from ..transfo_xl import TransfoXLConfig
from .causal import CausalLMLoss, StreamBatches, StreamEvaluator, forward_flops_per_batch
from .data import PretrainBatches, model_on_batch
from .evaluate import training_evaluator
from .flops import Throughput, device_peak_tflops, run_throughput
from .models import TRANSFO_XL, XLNET
from .settings import PRESETS, TRANSFO_XL_PRESETS, data_config
from .tokenizer import train_tokenizer
from .tokenizers import document_end_id

_warned_cutoffs: set = set()


class PermutationLM:
    model = XLNET
    tokenizer_recipe = ""  # sentencepiece (train_tokenizer); part of the cached tokenizer's key

    def segment_len(self, c) -> int:
        return c.seq_len

    def model_config(self, c, tokenizer) -> XLNetConfig:
        return XLNetConfig(vocab_size=tokenizer.vocab_size, **PRESETS[c.preset]["model"], dropout=c.dropout,
                           mem_len=c.mem_len, reuse_len=c.reuse_len, bi_data=c.bi_data,
                           attn_backend=c.backend, use_mems_train=c.mem_len > 0)

    def layers(self, model) -> list:
        return list(model.transformer.layer)

    def trainable(self, model):
        return model

    def batches(self, tokens, tokenizer, c, rank: int, world: int) -> PretrainBatches:
        return PretrainBatches(tokens, tokenizer, data_config(c), rows=c.batch_size, rank=rank, world_size=world)

    def loss(self, model, batch: dict, mems, c, device) -> tuple:
        """``(sum of the targets' cross-entropies, number of targets, the next step's mems)``."""
        batch = {k: v.to(device) for k, v in batch.items()}
        out = model_on_batch(model, batch, mems, use_mems=c.mem_len > 0)
        logits = out.logits.float()
        ce = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), batch["labels"].reshape(-1),
                                               reduction="sum")
        mems = [m.detach() for m in out.mems] if out.mems is not None else None
        return ce, (batch["labels"] != -100).sum(), mems

    def evaluator(self, c, tokenizer, heldout, cache_dir: str, rank: int, world: int):
        return training_evaluator(c, tokenizer, heldout, cache_dir, rank, world)

    def throughput(self, c, model_config, world: int, device) -> tuple[Throughput, str]:
        return run_throughput(c, model_config, world, device)

    def train_tokenizer(self, lines, vocab_size: int, out: str) -> None:
        train_tokenizer(lines, vocab_size, out)


class CausalLM:
    model = TRANSFO_XL
    tokenizer_recipe = "word-split-punctuation"  # TransfoXLTokenizer.from_corpus

    def segment_len(self, c) -> int:
        return c.tgt_len + 1

    def model_config(self, c, tokenizer) -> TransfoXLConfig:
        import logging

        fields = dict(TRANSFO_XL_PRESETS[c.preset]["model"])
        V = tokenizer.vocab_size
        kept = [x for x in fields["cutoffs"] if x < V]
        if kept != fields["cutoffs"] and (c.preset, V) not in _warned_cutoffs:
            _warned_cutoffs.add((c.preset, V))
            logging.getLogger(__name__).info(
                "adaptive softmax cutoffs %s for the %d-symbol vocabulary (the preset's %s, without those past it)",
                kept, V, fields["cutoffs"])
        fields["cutoffs"] = kept
        return TransfoXLConfig(vocab_size=V, **fields, mem_len=c.mem_len, clamp_len=c.clamp_len,
                               same_length=c.same_length, dropout=c.dropout, attn_backend=c.backend,
                               eos_token_id=document_end_id(tokenizer))

    def layers(self, model) -> list:
        return list(model.transformer.layers)

    def trainable(self, model) -> CausalLMLoss:
        return CausalLMLoss(model)

    def batches(self, tokens, tokenizer, c, rank: int, world: int) -> StreamBatches:
        return StreamBatches(tokens, c.tgt_len, c.batch_size, rank, world)

    def loss(self, model, batch: dict, mems, c, device) -> tuple:
        """``(sum of the targets' negative log-likelihoods, number of targets, the next step's mems)``:
        the memory starts afresh (the model's start memory) where the rows start their parts over."""
        mems = None if batch["restart"] else mems
        return model(batch["input_ids"].to(device), batch["labels"].to(device), mems)

    def evaluator(self, c, tokenizer, heldout, cache_dir: str, rank: int, world: int):
        def build(tokens, source):
            return StreamEvaluator(tokens, c.tgt_len, c.batch_size, c.eval_batches, rank, world, source)

        return training_evaluator(c, tokenizer, heldout, cache_dir, rank, world, build=build)

    def throughput(self, c, mc, world: int, device) -> tuple[Throughput, str]:
        head = (mc.cutoffs[0] if mc.cutoffs else mc.vocab_size) + len(mc.cutoffs)
        forward = forward_flops_per_batch(mc.d_model, mc.n_layer, mc.n_head, mc.d_head, mc.d_inner, c.tgt_len,
                                          c.mem_len, head, mc.d_embed, rows=c.batch_size)
        flops = 3 * forward * c.grad_accum * world  # the backward pass costs twice the forward
        peak, note = device_peak_tflops(device, c.peak_tflops)
        tokens = c.batch_size * world * c.tgt_len * c.grad_accum
        return Throughput(tokens, flops, world, peak), note

    def train_tokenizer(self, lines, vocab_size: int, out: str) -> None:
        from ..transfo_xl.tokenizer import TransfoXLTokenizer

        TransfoXLTokenizer.from_corpus(lines, vocab_size).save_pretrained(out)


OBJECTIVES = {XLNET: PermutationLM(), TRANSFO_XL: CausalLM()}


def objective_for(c):
    return OBJECTIVES[c.model]
