"""Autoregressive generation carried by memory, for Transformer-XL and XLNet.

Each step runs the model on the new tokens only, attending to the previous ones through ``mems``, so a
token costs O(context) instead of a forward over the whole context (``use_cache=False`` recomputes
it, for comparison).

- Transformer-XL (``generate_transfo_xl``): the prompt in one forward from the memory the model's
  forward starts from (``init_mems``: ``config.mem_start``, by default transformers 4.x's
  ``mem_len`` zero rows; ``mem_start="empty"`` the original code's empty memory), then one token
  per forward; the memory keeps the last ``mem_len`` rows of each layer, as the paper samples —
  held as their keys and values, projected once when the rows were new (``TransfoXLCache``; the
  same numbers as projecting ``mems`` again each step), and the relative positions projected once
  per key count. So the tokens are greedy decoding over the model's own forward with ``mems``
  carried (and transformers 4.x's ``generate`` from its start). From the empty start with
  ``mem_len`` at least the final length they equal recomputing the whole context each step.
- XLNet (``generate_xlnet``): transformers' scheme, so greedy tokens equal transformers'
  ``XLNetLMHeadModel.generate`` on the same weights: a dummy token appended, that no position sees
  (rank masks here, transformers' ``perm_mask``), predicted by the query stream; after the first
  step the input is the last two tokens and the dummy, the memory the cached rows without the
  last two (``offset = 2``).

Token choice, as transformers: greedy, or sampling after ``temperature``, ``top_k`` and ``top_p``
(in that order); a row that produced ``eos_token_id`` continues with ``pad_token_id``, and
generation stops when every row has. ``eos_token_id``/``pad_token_id`` default to the config's;
``eos_token_id=None`` never stops early.

transformers' keywords: ``num_beams=1`` (beam search is refused), ``output_scores`` and
``return_dict_in_generate`` (a ``GenerateOutput`` with ``sequences`` and, with ``output_scores``,
``scores``: per new token the ``(B, V)`` scores the token was chosen from, as transformers' —
the model's logits (XLNet) or log-probabilities (Transformer-XL) in float32, after the sampling
warpers when sampling). Any other keyword is a ``ValueError`` naming it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable, Iterator

import torch
from torch import Tensor

from .masks import INT32_MAX
from .model.inputs import _check_mems, _layer_mems
from .model.outputs import ModelOutput


class _FromConfig:
    def __repr__(self) -> str:
        return "<the model config's>"


FROM_CONFIG: Any = _FromConfig()
XLNET_OFFSET = 2  # transformers' XLNet recomputes the last two tokens each step


# --------------------------------------------------------------------------------------------------
# Checks and token choice
# --------------------------------------------------------------------------------------------------


def _int_arg(name: str, value, low: int) -> int:
    if not isinstance(value, int) or isinstance(value, bool):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    if value < low:
        raise ValueError(f"{name} must be >= {low}, got {value}")
    return value


def _token_id(name: str, value, vocab_size: int) -> int | None:
    if value is None:
        return None
    _int_arg(name, value, 0)
    if value >= vocab_size:
        raise ValueError(f"{name} must be in [0, vocab_size={vocab_size}), got {value}")
    return value


def _check_prompt(input_ids, vocab_size: int, device) -> None:
    if not isinstance(input_ids, Tensor) or input_ids.dtype not in (torch.long, torch.int):
        got = getattr(input_ids, "dtype", type(input_ids).__name__)
        raise TypeError(f"input_ids must be an integer tensor, got {got}")
    if input_ids.dim() != 2 or input_ids.shape[0] < 1 or input_ids.shape[1] < 1:
        raise ValueError(f"input_ids must be (batch, prompt_len) with both >= 1, got shape {tuple(input_ids.shape)}")
    if input_ids.device != device:
        raise ValueError(f"input_ids is on {input_ids.device} but the model is on {device}")
    lo, hi = int(input_ids.min()), int(input_ids.max())
    if lo < 0 or hi >= vocab_size:
        raise ValueError(f"input_ids must be in [0, vocab_size={vocab_size}), got values in [{lo}, {hi}]")


class TokenChooser:
    """Picks the next token from scores ``(B, V)`` (logits or log-probabilities) as transformers'
    greedy search or sampling, and keeps track of finished rows."""

    def __init__(self, config, batch: int, device, do_sample: bool = False, temperature: float = 1.0,
                 top_k: int = 0, top_p: float = 1.0, eos_token_id=FROM_CONFIG, pad_token_id=FROM_CONFIG,
                 generator: torch.Generator | None = None):
        V = config.vocab_size
        if not isinstance(do_sample, bool):
            raise TypeError(f"do_sample must be a bool, got {type(do_sample).__name__}")
        if not isinstance(temperature, (int, float)) or isinstance(temperature, bool) or not (
                math.isfinite(temperature) and temperature > 0):
            raise ValueError(f"temperature must be a finite number > 0, got {temperature!r}")
        self.top_k = _int_arg("top_k", top_k, 0)
        if not isinstance(top_p, (int, float)) or isinstance(top_p, bool) or not 0 < top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {top_p!r}")
        if eos_token_id is FROM_CONFIG:
            eos_token_id = getattr(config, "eos_token_id", None)
        if pad_token_id is FROM_CONFIG:
            pad_token_id = getattr(config, "pad_token_id", None)
        self.eos = _token_id("eos_token_id", eos_token_id, V)
        self.pad = _token_id("pad_token_id", pad_token_id, V)
        if self.pad is None:
            self.pad = self.eos  # as transformers: finished rows repeat eos
        self.do_sample, self.temperature, self.top_p, self.generator = do_sample, float(temperature), top_p, generator
        self.unfinished = torch.ones(batch, dtype=torch.bool, device=device)

    def _warp(self, scores: Tensor) -> Tensor:
        scores = scores.float() / self.temperature
        if self.top_k:
            kth = torch.topk(scores, min(self.top_k, scores.shape[-1]), dim=-1).values[:, -1:]
            scores = scores.masked_fill(scores < kth, float("-inf"))
        if self.top_p < 1.0:
            # drop the tokens outside the smallest set whose probability reaches top_p (keep >= 1)
            sorted_scores, order = torch.sort(scores, descending=False, dim=-1)
            cum = sorted_scores.softmax(-1).cumsum(-1)
            drop_sorted = cum <= 1 - self.top_p
            drop_sorted[:, -1] = False
            scores = scores.masked_fill(drop_sorted.scatter(1, order, drop_sorted), float("-inf"))
        return scores

    def __call__(self, scores: Tensor) -> Tensor:
        """The next token ``(B,)`` of each row (``pad_token_id`` for finished rows). ``last_scores``:
        the scores it was chosen from, as transformers' ``output_scores`` gives them."""
        if self.do_sample:
            self.last_scores = self._warp(scores)
            probs = self.last_scores.softmax(-1)
            token = torch.multinomial(probs, 1, generator=self.generator).squeeze(1)
        else:
            self.last_scores = scores.float()
            token = scores.argmax(-1)
        if self.eos is not None:
            token = torch.where(self.unfinished, token, torch.full_like(token, self.pad))
            self.unfinished &= token != self.eos
        return token

    @property
    def done(self) -> bool:
        return self.eos is not None and not bool(self.unfinished.any())


def _stream(first: Callable[[], Tensor], step: Callable[[Tensor, Tensor], Tensor], input_ids: Tensor,
            max_new_tokens: int, chooser: TokenChooser, scores_out: list | None = None) -> Iterator[Tensor]:
    """The new tokens ``(B,)`` one at a time: ``first()`` gives the scores ``(B, V)`` after the prompt,
    ``step(new_token (B,), sequence (B, n))`` those after each new token; ``scores_out`` receives the
    scores each token was chosen from."""

    @torch.no_grad()
    def tokens() -> Iterator[Tensor]:
        if max_new_tokens == 0:
            return
        seq, scores = input_ids, first()
        for n in range(max_new_tokens):
            token = chooser(scores)
            if scores_out is not None:
                scores_out.append(chooser.last_scores)
            yield token
            if n == max_new_tokens - 1 or chooser.done:
                return
            seq = torch.cat([seq, token[:, None].to(seq.dtype)], dim=1)
            scores = step(token, seq)

    return tokens()


def _collect(input_ids: Tensor, tokens: Iterator[Tensor]) -> Tensor:
    new = list(tokens)
    return torch.cat([input_ids, torch.stack(new, 1).to(input_ids.dtype)], dim=1) if new else input_ids


@dataclass
class GenerateOutput(ModelOutput):
    """``generate(..., return_dict_in_generate=True)``: transformers' ``GenerateDecoderOnlyOutput``
    fields that are given here: ``sequences (B, P + n)`` and, with ``output_scores=True``,
    ``scores``, one ``(B, V)`` float32 tensor per new token."""

    sequences: Tensor | None = None
    scores: tuple[Tensor, ...] | None = None


# generate's keywords besides max_new_tokens, and transformers' that it takes with one value only
_CHOICE_KEYWORDS = ("do_sample", "temperature", "top_k", "top_p", "eos_token_id", "pad_token_id", "generator")
_OUTPUT_KEYWORDS = ("output_scores", "return_dict_in_generate", "num_beams")


def _check_keywords(kwargs: dict, own: tuple[str, ...]) -> tuple[dict, bool, bool]:
    """``(the keywords for the stream, output_scores, return_dict_in_generate)``; ``num_beams`` other
    than 1 and any keyword generate does not take are a ``ValueError`` naming them (transformers
    accepts many more: each one silently dropped would change what the caller asked for)."""
    known = _CHOICE_KEYWORDS + _OUTPUT_KEYWORDS + own
    unknown = sorted(k for k in kwargs if k not in known)
    if unknown:
        hint = " (pass max_new_tokens: the number of new tokens)" if "max_length" in unknown else ""
        raise ValueError(f"generate() does not support the keyword argument(s) {', '.join(map(repr, unknown))}"
                         f"{hint}; it takes max_new_tokens, {', '.join(known)}")
    kwargs = dict(kwargs)
    num_beams = kwargs.pop("num_beams", 1)
    if num_beams != 1 or isinstance(num_beams, bool):
        raise ValueError(f"num_beams={num_beams!r}: beam search is not supported (greedy decoding or sampling "
                         "only): pass num_beams=1 or leave it out")
    flags = []
    for name in ("output_scores", "return_dict_in_generate"):
        value = kwargs.pop(name, False)
        if not isinstance(value, bool):
            raise TypeError(f"{name} must be a bool, got {type(value).__name__}")
        flags.append(value)
    return kwargs, flags[0], flags[1]


def _generate(stream, model, input_ids: Tensor, max_new_tokens: int, kwargs: dict, own: tuple[str, ...]):
    """The sequences, or a ``GenerateOutput`` with ``return_dict_in_generate``."""
    kwargs, output_scores, return_dict = _check_keywords(kwargs, own)
    scores: list[Tensor] | None = [] if output_scores else None
    sequences = _collect(input_ids, stream(model, input_ids, max_new_tokens, scores_out=scores, **kwargs))
    if not return_dict:
        return sequences
    return GenerateOutput(sequences=sequences, scores=tuple(scores) if scores is not None else None)


# --------------------------------------------------------------------------------------------------
# Transformer-XL
# --------------------------------------------------------------------------------------------------


@dataclass
class TransfoXLCache:
    """What generation carries between steps: each layer's keys and values of the memory rows
    ``(B, mlen, H, D)`` (the last ``mem_len``), and each layer's projected relative positions
    ``(1, R, H, D)`` for the longest key count so far. Starts from ``mems`` (hidden states, per
    layer ``(mlen, B, d)``) or empty."""

    mems: list[Tensor] | None = None
    kv: list[tuple[Tensor, Tensor]] | None = None
    k_r: list[Tensor] | None = None

    @property
    def mlen(self) -> int:
        if self.kv is not None:
            return self.kv[0][0].shape[1]
        return self.mems[0].shape[0] if self.mems is not None else 0


def stream_transfo_xl(model, input_ids: Tensor, max_new_tokens: int = 20, do_sample: bool = False,
                      temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0, eos_token_id=FROM_CONFIG,
                      pad_token_id=FROM_CONFIG, mems: list[Tensor] | None = None, mem_start: str | None = None,
                      generator: torch.Generator | None = None, use_cache: bool = True,
                      scores_out: list | None = None) -> Iterator[Tensor]:
    """``generate_transfo_xl``'s new tokens ``(B,)`` one at a time, as they are chosen (arguments
    checked at the call); ``scores_out``: a list that receives each token's scores."""
    c = model.config
    _check_prompt(input_ids, c.vocab_size, model.device)
    _int_arg("max_new_tokens", max_new_tokens, 0)
    B = input_ids.shape[0]
    chooser = TokenChooser(c, B, input_ids.device, do_sample, temperature, top_k, top_p, eos_token_id, pad_token_id,
                           generator)
    mems = _layer_mems(mems)
    _check_mems(c, mems, B)
    if mems is not None and mem_start is not None:
        raise ValueError("generate takes mems= (a memory to start from) or mem_start= (which start), not both")
    if mems is None:
        mems = model.init_mems(B, start=mem_start)
    if not use_cache:
        def recompute(token: Tensor | None, seq: Tensor) -> Tensor:
            return model(seq, mems=mems, logits_to_keep=1).prediction_scores[:, -1]

        return _stream(lambda: recompute(None, input_ids), recompute, input_ids, max_new_tokens, chooser, scores_out)
    cache = TransfoXLCache(mems=mems)

    def forward(ids: Tensor) -> Tensor:
        return model.crit.log_probs(model.transformer.generation_step(ids, cache)[:, -1])

    return _stream(lambda: forward(input_ids), lambda token, seq: forward(token[:, None]), input_ids,
                   max_new_tokens, chooser, scores_out)


def generate_transfo_xl(model, input_ids: Tensor, max_new_tokens: int = 20, **kwargs) -> Tensor | GenerateOutput:
    """Continue ``input_ids (B, P)`` with a ``TransfoXLLMHeadModel``; returns ``(B, P + n)``, n <=
    max_new_tokens (a ``GenerateOutput`` with ``return_dict_in_generate=True``). Keywords:
    ``do_sample``, ``temperature``, ``top_k``, ``top_p``, ``eos_token_id``, ``pad_token_id``,
    ``generator``, ``num_beams=1``, ``output_scores``, ``return_dict_in_generate`` (module
    docstring); ``mems``: per layer ``(mlen, B, d_model)`` to start from, or ``mem_start`` which
    start (default: ``config.mem_start``, the memory ``forward`` starts from: 4.x's ``mem_len``
    zero rows unless set to ``"empty"``, the original code's); ``use_cache=False``: recompute the
    whole sequence each step from that start memory (the baseline; equal to the cached tokens from
    the empty start while ``mem_len`` covers the sequence)."""
    return _generate(stream_transfo_xl, model, input_ids, max_new_tokens, kwargs, ("mems", "mem_start", "use_cache"))


# --------------------------------------------------------------------------------------------------
# XLNet
# --------------------------------------------------------------------------------------------------


def _xlnet_step(model, ids: Tensor, mems, use_mems: bool = True) -> Any:
    """transformers' XLNet generation inputs with compact masks: ``ids`` and a dummy token (id 0) that
    no position sees (key rank INT32_MAX; the content rows see their own key), predicted by the query
    stream at the last position. Returns the model output (``logits (B, 1, V)``, ``mems``)."""
    B, L = ids.shape
    ids = torch.cat([ids, ids.new_zeros(B, 1)], dim=1)
    q_rank = torch.ones(B, L + 1, dtype=torch.int32, device=ids.device)
    k_rank = torch.zeros_like(q_rank)
    k_rank[:, -1] = INT32_MAX
    target_pos = torch.full((B, 1), L, dtype=torch.long, device=ids.device)
    return model(ids, q_rank=q_rank, k_rank=k_rank, target_pos=target_pos, mems=mems, use_mems=use_mems)


def stream_xlnet(model, input_ids: Tensor, max_new_tokens: int = 20, do_sample: bool = False,
                 temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0, eos_token_id=FROM_CONFIG,
                 pad_token_id=FROM_CONFIG, generator: torch.Generator | None = None,
                 use_cache: bool = True, scores_out: list | None = None) -> Iterator[Tensor]:
    """``generate_xlnet``'s new tokens ``(B,)`` one at a time (arguments checked at the call);
    ``scores_out``: a list that receives each token's scores."""
    c = model.config
    _check_prompt(input_ids, c.vocab_size, model.device)
    _int_arg("max_new_tokens", max_new_tokens, 0)
    if c.attn_type != "bi":
        raise ValueError(f"generate needs attn_type='bi' (transformers' scheme), got {c.attn_type!r}")
    chooser = TokenChooser(c, input_ids.shape[0], input_ids.device, do_sample, temperature, top_k, top_p,
                           eos_token_id, pad_token_id, generator)
    if not use_cache:
        def recompute(token: Tensor | None, seq: Tensor) -> Tensor:
            return _xlnet_step(model, seq, None, use_mems=False).logits[:, -1]

        return _stream(lambda: recompute(None, input_ids), recompute, input_ids, max_new_tokens, chooser, scores_out)
    state = {}

    def first() -> Tensor:
        out = _xlnet_step(model, input_ids, None)
        state["mems"] = out.mems
        return out.logits[:, -1]

    def step(token: Tensor, seq: Tensor) -> Tensor:
        mems = [m[:-XLNET_OFFSET] for m in state["mems"]]
        out = _xlnet_step(model, seq[:, -XLNET_OFFSET:], mems)
        state["mems"] = out.mems
        return out.logits[:, -1]

    return _stream(first, step, input_ids, max_new_tokens, chooser, scores_out)


def generate_xlnet(model, input_ids: Tensor, max_new_tokens: int = 20, **kwargs) -> Tensor | GenerateOutput:
    """Continue ``input_ids (B, P)`` with an ``XLNetLMHeadModel`` (transformers' scheme, see the module
    docstring); returns ``(B, P + n)``, n <= max_new_tokens (a ``GenerateOutput`` with
    ``return_dict_in_generate=True``). Keywords as ``generate_transfo_xl`` without ``mems`` and
    ``mem_start``; ``use_cache=False``: the whole sequence each step without memory (=
    transformers' ``generate(..., use_mems=False)``)."""
    return _generate(stream_xlnet, model, input_ids, max_new_tokens, kwargs, ("use_cache",))
