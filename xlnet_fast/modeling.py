"""A complete PyTorch XLNet with HuggingFace ``transformers`` parameter names, forward arguments and
outputs. Activations are batch-first ``(B, L, d_model)`` inside; mems are seq-first
``(mlen, B, d_model)`` at the boundary, like HF, so they are interchangeable.

Every attention call goes through ``xlnet_fast.rel_attention``: the model builds compact rank masks
where the inputs allow it (padding, causal ``"uni"``, the model's own permutation ranks), a dense mask
only for a user's ``perm_mask`` (or ``same_length``), and runs the query stream on the target rows
only when ``target_mapping`` is one-hot (or ``target_pos`` is given).
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, fields
from typing import Any

import torch
from torch import Tensor, nn
from torch.nn import functional as F

from .config import XLNetConfig
from .masks import block_padding, with_memory
from .ops import attention_probabilities, rel_attention, rel_attention_two_stream

logger = logging.getLogger(__name__)

_ACTIVATIONS = {
    "gelu": F.gelu,
    "relu": F.relu,
    "silu": F.silu,
    "swish": F.silu,
    "gelu_new": lambda x: F.gelu(x, approximate="tanh"),
    "tanh": torch.tanh,
}


def _activation(name):
    if callable(name):
        return name
    if name not in _ACTIVATIONS:
        raise ValueError(f"unsupported activation {name!r}; choose from {sorted(_ACTIVATIONS)}")
    return _ACTIVATIONS[name]


# --------------------------------------------------------------------------------------------------
# Outputs
# --------------------------------------------------------------------------------------------------


class ModelOutput:
    """Dataclass output that also indexes like HF's: ``out[0]`` is the first field that is not None."""

    def to_tuple(self) -> tuple:
        return tuple(getattr(self, f.name) for f in fields(self) if getattr(self, f.name) is not None)

    def __getitem__(self, key):
        if isinstance(key, str):
            return getattr(self, key)
        return self.to_tuple()[key]

    def keys(self):
        return [f.name for f in fields(self) if getattr(self, f.name) is not None]


@dataclass
class XLNetModelOutput(ModelOutput):
    last_hidden_state: Tensor | None = None
    mems: tuple[Tensor, ...] | None = None
    hidden_states: tuple[Tensor, ...] | None = None
    attentions: tuple | None = None


@dataclass
class XLNetLMHeadModelOutput(ModelOutput):
    loss: Tensor | None = None
    logits: Tensor | None = None
    mems: tuple[Tensor, ...] | None = None
    hidden_states: tuple[Tensor, ...] | None = None
    attentions: tuple | None = None


XLNetForSequenceClassificationOutput = XLNetLMHeadModelOutput
XLNetForTokenClassificationOutput = XLNetLMHeadModelOutput
XLNetForMultipleChoiceOutput = XLNetLMHeadModelOutput


@dataclass
class XLNetForQuestionAnsweringSimpleOutput(ModelOutput):
    loss: Tensor | None = None
    start_logits: Tensor | None = None
    end_logits: Tensor | None = None
    mems: tuple[Tensor, ...] | None = None
    hidden_states: tuple[Tensor, ...] | None = None
    attentions: tuple | None = None


@dataclass
class XLNetForQuestionAnsweringOutput(ModelOutput):
    loss: Tensor | None = None
    start_top_log_probs: Tensor | None = None
    start_top_index: Tensor | None = None
    end_top_log_probs: Tensor | None = None
    end_top_index: Tensor | None = None
    cls_logits: Tensor | None = None
    mems: tuple[Tensor, ...] | None = None
    hidden_states: tuple[Tensor, ...] | None = None
    attentions: tuple | None = None


# --------------------------------------------------------------------------------------------------
# Attention inputs shared by every layer of one forward
# --------------------------------------------------------------------------------------------------


@dataclass
class StreamInputs:
    """What each layer passes to the attention op besides q/k/v/k_r and the biases.

    ``content``/``query`` hold ``rel_attention``'s keyword arguments for the two streams; ``joint``
    holds ``rel_attention_two_stream``'s when the query stream runs on target rows only (both streams
    in one launch). ``target_mapping`` is set only for the general query-stream path (queries mapped
    onto all L positions, as HF does). ``k_r_index`` expands the two bi_data position embeddings.
    ``blocked_g (B, M)`` marks query-stream rows that see no key, to be given transformers' uniform
    average over all keys (only with ``XLNetModel.average_blocked_rows``).
    """

    content: dict[str, Any]
    query: dict[str, Any] | None = None
    joint: dict[str, Any] | None = None
    target_mapping: Tensor | None = None
    k_r_index: Tensor | None = None
    blocked_g: Tensor | None = None


# --------------------------------------------------------------------------------------------------
# Layers
# --------------------------------------------------------------------------------------------------


def _average_blocked_rows(attn: Tensor, probs: Tensor | None, v: Tensor, blocked: Tensor | None):
    """Rows marked in ``blocked (B, M)`` attend uniformly to all K keys: transformers' result for a row
    that sees no key (its -1e30 mask swamps the scores); the op gives such rows zeros."""
    if blocked is None:
        return attn, probs
    attn = torch.where(blocked[:, :, None, None], v.mean(1, keepdim=True).to(attn.dtype), attn)
    if probs is not None:
        probs = torch.where(blocked[:, None, :, None], 1.0 / v.shape[1], probs)
    return attn, probs


class XLNetRelativeAttention(nn.Module):
    def __init__(self, config: XLNetConfig):
        super().__init__()
        self.config = config
        self.n_head, self.d_head, self.d_model = config.n_head, config.d_head, config.d_model
        shape = (config.d_model, config.n_head, config.d_head)
        self.q = nn.Parameter(torch.empty(shape))
        self.k = nn.Parameter(torch.empty(shape))
        self.v = nn.Parameter(torch.empty(shape))
        self.o = nn.Parameter(torch.empty(shape))
        self.r = nn.Parameter(torch.empty(shape))
        self.r_r_bias = nn.Parameter(torch.empty(config.n_head, config.d_head))
        self.r_s_bias = nn.Parameter(torch.empty(config.n_head, config.d_head))
        self.r_w_bias = nn.Parameter(torch.empty(config.n_head, config.d_head))
        self.seg_embed = nn.Parameter(torch.empty(2, config.n_head, config.d_head))
        self.layer_norm = nn.LayerNorm(config.d_model, eps=config.layer_norm_eps)
        self.dropout = nn.Dropout(config.dropout)

    def _project(self, x: Tensor, weight: Tensor) -> Tensor:
        """(..., d_model) @ (d_model, H, D) -> (..., H, D)."""
        return torch.matmul(x, weight.flatten(1)).unflatten(-1, (self.n_head, self.d_head))

    def post_attention(self, h: Tensor, attn_vec: Tensor) -> Tensor:
        out = torch.matmul(attn_vec.flatten(-2), self.o.flatten(1).t())
        return self.layer_norm(self.dropout(out) + h)

    def _op_kwargs(self, kwargs: dict) -> dict:
        extra = dict(dropout_p=self.dropout.p if self.dropout.training else 0.0,
                     backend=self.config.attn_backend)
        if "q_seg" in kwargs:
            extra.update(r_s_bias=self.r_s_bias, seg_embed=self.seg_embed)
        return {**kwargs, **extra}

    def _attend(self, q, k, v, k_r, kwargs: dict, output_attentions: bool):
        out = rel_attention(q, k, v, k_r, self.r_w_bias, self.r_r_bias, **self._op_kwargs(kwargs))
        probs = None
        if output_attentions:
            probs = attention_probabilities(q, k, v, k_r, self.r_w_bias, self.r_r_bias,
                                            **self._op_kwargs(kwargs))
        return out, probs

    def forward(self, h: Tensor, g: Tensor | None, pos_emb: Tensor, mems: Tensor | None,
                streams: StreamInputs, output_attentions: bool = False):
        """h (B, L, d), g (B, P, d) or None, pos_emb (Br, R, d), mems (B, mlen, d) or None."""
        cat = h if mems is None else torch.cat([mems.to(h.dtype), h], dim=1)
        k = self._project(cat, self.k)
        v = self._project(cat, self.v)
        k_r = self._project(pos_emb.to(self.r.dtype), self.r)
        if streams.k_r_index is not None:
            k_r = k_r[streams.k_r_index]
        if streams.joint is not None:  # both streams, target rows only, one launch
            attn_h, attn_g = rel_attention_two_stream(
                self._project(h, self.q), self._project(g, self.q), k, v, k_r, self.r_w_bias,
                self.r_r_bias, **self._op_kwargs(streams.joint))
            attn_g, _ = _average_blocked_rows(attn_g, None, v, streams.blocked_g)
            return self.post_attention(h, attn_h), self.post_attention(g, attn_g), None

        attn_h, prob_h = self._attend(self._project(h, self.q), k, v, k_r, streams.content,
                                      output_attentions)
        out_h = self.post_attention(h, attn_h)
        if g is None:
            return out_h, None, prob_h

        q_g = self._project(g, self.q)
        tm = streams.target_mapping
        if tm is not None:  # general path: queries placed on all L positions, as HF does
            q_g = torch.einsum("bpl,bphd->blhd", tm.to(q_g.dtype), q_g)
        attn_g, prob_g = self._attend(q_g, k, v, k_r, streams.query, output_attentions)
        attn_g, prob_g = _average_blocked_rows(attn_g, prob_g, v, streams.blocked_g)
        if tm is not None:
            attn_g = torch.einsum("bpl,blhd->bphd", tm.to(attn_g.dtype), attn_g)
        out_g = self.post_attention(g, attn_g)
        return out_h, out_g, (prob_h, prob_g) if output_attentions else None


class XLNetFeedForward(nn.Module):
    def __init__(self, config: XLNetConfig):
        super().__init__()
        self.layer_norm = nn.LayerNorm(config.d_model, eps=config.layer_norm_eps)
        self.layer_1 = nn.Linear(config.d_model, config.d_inner)
        self.layer_2 = nn.Linear(config.d_inner, config.d_model)
        self.dropout = nn.Dropout(config.dropout)
        self.activation_function = _activation(config.ff_activation)

    def forward(self, x: Tensor) -> Tensor:
        y = self.dropout(self.activation_function(self.layer_1(x)))
        y = self.dropout(self.layer_2(y))
        return self.layer_norm(y + x)


class XLNetLayer(nn.Module):
    def __init__(self, config: XLNetConfig):
        super().__init__()
        self.rel_attn = XLNetRelativeAttention(config)
        self.ff = XLNetFeedForward(config)
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, h, g, pos_emb, mems, streams: StreamInputs, output_attentions=False):
        h, g, probs = self.rel_attn(h, g, pos_emb, mems, streams, output_attentions)
        return self.ff(h), (self.ff(g) if g is not None else None), probs


# --------------------------------------------------------------------------------------------------
# Base class: init, loading and saving in HF's format
# --------------------------------------------------------------------------------------------------


def _load_state_file(path: str) -> dict[str, Tensor]:
    try:
        if path.endswith(".safetensors"):
            from safetensors.torch import load_file

            return load_file(path)
        return torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:
        raise ValueError(f"could not read checkpoint file {path}: it is truncated or corrupted ({exc})") from exc


class XLNetPreTrainedModel(nn.Module):
    """Shared init, ``from_pretrained`` and ``save_pretrained`` (HF directory format)."""

    base_model_prefix = "transformer"
    _tied_weights_keys: dict[str, str] = {}

    def __init__(self, config: XLNetConfig):
        super().__init__()
        if not isinstance(config, XLNetConfig):
            raise TypeError(f"config must be an XLNetConfig, got {type(config).__name__}")
        self.config = config

    def post_init(self) -> None:
        self.apply(self._init_weights)
        self.tie_weights()

    def tie_weights(self) -> None:
        pass

    def _init_weights(self, module: nn.Module) -> None:
        std = self.config.initializer_range
        if isinstance(module, nn.Linear):
            nn.init.normal_(module.weight, mean=0.0, std=std)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, mean=0.0, std=std)
        elif isinstance(module, nn.LayerNorm):
            nn.init.ones_(module.weight)
            nn.init.zeros_(module.bias)
        elif isinstance(module, XLNetRelativeAttention):
            for p in (module.q, module.k, module.v, module.o, module.r, module.r_r_bias,
                      module.r_s_bias, module.r_w_bias, module.seg_embed):
                nn.init.normal_(p, mean=0.0, std=std)
        elif isinstance(module, XLNetModel):
            nn.init.normal_(module.mask_emb, mean=0.0, std=std)

    @property
    def device(self) -> torch.device:
        return next(self.parameters()).device

    @property
    def dtype(self) -> torch.dtype:
        return next(self.parameters()).dtype

    def num_parameters(self) -> int:
        return sum(p.numel() for p in self.parameters())

    def save_pretrained(self, directory: str | os.PathLike,
                        state_dict: dict[str, Tensor] | None = None) -> None:
        """Write ``config.json`` and ``model.safetensors`` that ``transformers`` loads.

        ``state_dict`` replaces the model's own (e.g. a gathered FSDP state)."""
        from safetensors.torch import save_file

        os.makedirs(directory, exist_ok=True)
        self.config.architectures = [type(self).__name__]
        self.config.save_pretrained(directory)
        state = self.state_dict() if state_dict is None else state_dict
        state = {k: v.detach().contiguous() for k, v in state.items() if k not in self._tied_weights_keys}
        save_file(state, os.path.join(directory, "model.safetensors"), metadata={"format": "pt"})

    @classmethod
    def from_pretrained(cls, directory: str | os.PathLike, config: XLNetConfig | None = None,
                        ignore_mismatched_sizes: bool = False, **config_overrides: Any):
        """Load a directory written by ``transformers`` or by ``save_pretrained``, in eval mode (as
        transformers does).

        Keyword arguments override config fields as in transformers (``num_labels=3`` relabels the
        head ``LABEL_0..2``, ``id2label=...``, ``attn_backend="eager"``); a name that is no config
        field is a TypeError. A weight whose shape differs from the model's (a head resized by
        ``num_labels``) is an error unless ``ignore_mismatched_sizes``, which leaves it initialised.
        """
        directory = os.fspath(directory)
        if not os.path.isdir(directory):
            raise FileNotFoundError(f"{directory} is not a directory")
        if config is None:
            saved = XLNetConfig.from_pretrained(directory)
            unknown = sorted(k for k in config_overrides if not saved.is_field(k))
            if unknown:
                raise TypeError(f"{cls.__name__}.from_pretrained() got keyword arguments that are no "
                                f"XLNetConfig field: {unknown}")
            config = XLNetConfig.from_pretrained(directory, **config_overrides)
        elif config_overrides:
            raise TypeError(f"{cls.__name__}.from_pretrained() got config= and config fields "
                            f"{sorted(config_overrides)}: set them on the config instead")
        model = cls(config)
        for name in ("model.safetensors", "pytorch_model.bin"):
            path = os.path.join(directory, name)
            if os.path.exists(path):
                break
        else:
            raise FileNotFoundError(f"no model.safetensors or pytorch_model.bin in {directory}")
        state = _load_state_file(path)
        model.load_hf_state_dict(state, source=path, ignore_mismatched_sizes=ignore_mismatched_sizes)
        return model.eval()

    def _own_key_names(self, state: dict[str, Tensor], own: dict[str, Tensor]) -> dict[str, Tensor]:
        """``state`` with the ``transformer.`` prefix added or removed to match this model's keys."""
        prefix = self.base_model_prefix + "."
        has_prefix = any(k.startswith(prefix) for k in own)
        fixed = {}
        for key, value in state.items():
            if has_prefix and not key.startswith(prefix) and prefix + key in own:
                key = prefix + key
            elif not has_prefix and key.startswith(prefix):
                key = key[len(prefix):]
            fixed[key] = value
        return fixed

    def load_hf_state_dict(self, state: dict[str, Tensor], source: str = "state dict",
                           ignore_mismatched_sizes: bool = False) -> None:
        """Load HF-named weights, adding or removing the ``transformer.`` prefix as needed.

        Missing and unexpected keys are reported by name (tied weights are not missing). A weight of
        another shape than the model's raises, or with ``ignore_mismatched_sizes`` is left as it is.
        """
        own = self.state_dict()
        fixed = self._own_key_names(state, own)
        mismatched = [k for k, v in fixed.items() if k in own and own[k].shape != v.shape]
        if mismatched and not ignore_mismatched_sizes:
            shapes = ", ".join(f"{k} has shape {tuple(fixed[k].shape)}, the model expects {tuple(own[k].shape)}"
                               for k in mismatched)
            raise ValueError(f"{source}: {shapes} (pass ignore_mismatched_sizes=True to leave such "
                             "weights newly initialised)")
        if mismatched:
            logger.warning("%s: weights of another shape left newly initialised: %s", source, mismatched)
            fixed = {k: v for k, v in fixed.items() if k not in mismatched}
        result = self.load_state_dict(fixed, strict=False)
        missing = [k for k in result.missing_keys if k not in self._tied_weights_keys and k not in mismatched]
        if missing:
            logger.warning("%s: weights not found, left at their initial values: %s", source, missing)
        if result.unexpected_keys:
            logger.warning("%s: unexpected weights ignored: %s", source, result.unexpected_keys)
        self.tie_weights()


# --------------------------------------------------------------------------------------------------
# The backbone
# --------------------------------------------------------------------------------------------------

# transformers' XLNetModel.forward takes these and ignores them (it ignores every extra keyword)
_IGNORED_KWARGS = ("head_mask", "position_ids", "logits_to_keep", "num_items_in_batch", "use_cache")
_warned: set[str] = set()


def _warn_once(message: str) -> None:
    if message not in _warned:
        _warned.add(message)
        logger.warning(message)


def _check_extra_kwargs(kwargs: dict[str, Any]) -> None:
    """Accept the keywords transformers' XLNet accepts and ignores; any other is a TypeError."""
    if kwargs.get("use_cache") is not None:
        _warn_once("use_cache is deprecated in XLNet and ignored; use use_mems")
    if kwargs.get("head_mask") is not None:
        _warn_once("XLNet has no head masking: head_mask is ignored (as in transformers)")
    unknown = sorted(k for k in kwargs if k not in _IGNORED_KWARGS)
    if unknown:
        raise TypeError(f"XLNetModel.forward() got unexpected keyword arguments: {unknown}")


def _layer_mems(mems: Any) -> tuple[Tensor, ...] | None:
    """``mems`` as one tensor per layer. Takes a list or tuple, or one stacked
    ``(n_layer, mlen, B, d_model)`` tensor (transformers indexes it the same way); all None means no
    memory, a mix of None and tensors is an error."""
    if mems is None:
        return None
    if isinstance(mems, Tensor):
        if mems.dim() != 4:
            raise ValueError("mems given as one tensor must be (n_layer, mlen, batch, d_model), got shape "
                             f"{tuple(mems.shape)}")
        return tuple(mems.unbind(0))
    if not isinstance(mems, (list, tuple)):
        raise TypeError(f"mems must be a list or tuple with one tensor per layer, got {type(mems).__name__}")
    missing = [i for i, m in enumerate(mems) if m is None]
    if len(missing) == len(mems):
        return None
    if missing:
        raise ValueError(f"mems[{missing[0]}] is None but other layers have memory: pass a tensor for "
                         "every layer, or mems=None")
    return tuple(mems)


def _as_bool_padding(attention_mask: Tensor | None, input_mask: Tensor | None) -> Tensor | None:
    """(B, L) True where a token is padding, from HF's ``attention_mask`` (0 = pad) or ``input_mask``
    (1 = pad); at most one is given (checked by ``_validate_inputs``)."""
    if input_mask is not None:
        return input_mask > 0
    if attention_mask is not None:
        return (1.0 - attention_mask.float()) > 0
    return None


def _one_hot_targets(target_mapping: Tensor) -> Tensor | None:
    """(B, P) target positions if ``target_mapping`` is one-hot rows (or empty rows, -1) with no
    position targeted twice; else None."""
    tm = target_mapping
    binary = bool(((tm == 0) | (tm == 1)).all())
    if not binary:
        return None
    rows, cols = tm.sum(-1), tm.sum(-2)
    if bool((rows > 1).any()) or bool((cols > 1).any()):
        return None
    pos = tm.argmax(-1)
    return torch.where(rows > 0, pos, torch.full_like(pos, -1))


def _rows_without_keys(dense_g: Tensor | None, rank_q: Tensor | None, rank_k: Tensor | None) -> Tensor | None:
    """(B, M) True for the query-stream rows that see no key at all (dense ``(B, M, K)`` blocked mask,
    or ranks without the own-key exception); None when every row sees some key."""
    if dense_g is not None:
        return dense_g.all(-1)
    if rank_q is not None:
        return rank_k.min(-1).values[:, None] >= rank_q
    return None


def _check_target_pos_range(target_pos: Tensor | None, L: int) -> None:
    if target_pos is None or not target_pos.numel() or torch.compiler.is_compiling():
        return
    top = int(target_pos.max())
    if top >= L:
        raise ValueError(f"target_pos values must be < seq_len = {L} (negative marks a padding row), got {top}")


def _check_tensor_args(args: dict[str, tuple[Tensor | None, tuple | None]], device: torch.device) -> None:
    """Each ``name: (tensor, expected shape or None)``: a tensor of that shape on ``device``."""
    for name, (t, shape) in args.items():
        if t is None:
            continue
        if not isinstance(t, Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if shape is not None and tuple(t.shape) != shape:
            raise ValueError(f"{name} must have shape {shape}, got {tuple(t.shape)}")
        if t.device != device:
            raise ValueError(f"{name} is on {t.device} but the model is on {device}")


def _record(outputs: list | None, *items) -> None:
    """Append the items that are not None to ``outputs``, unless it is None (output not asked for)."""
    if outputs is not None:
        outputs.extend(item for item in items if item is not None)


@dataclass
class BackboneInputs:
    """``XLNetModel.forward``'s arguments after the config's defaults, normalisation and validation
    (``XLNetModel.prepare_inputs``); ``XLNetModel.forward_prepared`` runs them."""

    batch: int
    seq_len: int
    input_ids: Tensor | None
    inputs_embeds: Tensor | None
    padding: Tensor | None  # (B, L) bool, True = padding
    mems: tuple[Tensor, ...] | None
    perm_mask: Tensor | None
    target_mapping: Tensor | None
    token_type_ids: Tensor | None
    q_rank: Tensor | None
    k_rank: Tensor | None
    target_pos: Tensor | None
    use_mems: bool
    output_attentions: bool
    output_hidden_states: bool
    return_dict: bool

    @property
    def mlen(self) -> int:
        return self.mems[0].shape[0] if self.mems is not None else 0


@dataclass
class _Masks:
    """Masks of one forward: dense ``(B, L, K)`` blocked-key masks (``dense_h`` for the content stream,
    which always sees its own key; ``dense_g`` for the query stream), or compact ranks ``rank_q (B, L)``
    / ``rank_k (B, K)``; all None when every key is visible."""

    dense_h: Tensor | None = None
    dense_g: Tensor | None = None
    rank_q: Tensor | None = None
    rank_k: Tensor | None = None


class XLNetModel(XLNetPreTrainedModel):
    base_model_prefix = "transformer"
    #: A query-stream row that sees no key outputs zeros (DESIGN.md §2) unless this is True: then it
    #: averages every key uniformly, as transformers' XLNet does (``patch_transformers`` sets it).
    average_blocked_rows = False

    def __init__(self, config: XLNetConfig):
        super().__init__(config)
        self.word_embedding = nn.Embedding(config.vocab_size, config.d_model)
        self.mask_emb = nn.Parameter(torch.empty(1, 1, config.d_model))
        self.layer = nn.ModuleList([XLNetLayer(config) for _ in range(config.n_layer)])
        self.dropout = nn.Dropout(config.dropout)
        self.post_init()

    def get_input_embeddings(self) -> nn.Embedding:
        return self.word_embedding

    def set_input_embeddings(self, emb: nn.Embedding) -> None:
        self.word_embedding = emb

    def relative_positional_encoding(self, qlen: int, klen: int, device) -> Tensor:
        """Sinusoids ``(Br0, R, d_model)``; ``Br0 = 2`` with bi_data (forward, then negated positions)."""
        c = self.config
        freq_seq = torch.arange(0, c.d_model, 2, device=device).float()
        inv_freq = 1 / torch.pow(10000, freq_seq / c.d_model)
        end = -qlen if c.attn_type == "bi" else -1
        fwd = torch.arange(klen, end, -1, device=device).float()
        seqs = torch.stack([fwd, -fwd]) if c.bi_data else fwd[None]
        if c.clamp_len > 0:
            seqs = seqs.clamp(-c.clamp_len, c.clamp_len)
        sinusoid = seqs[..., None] * inv_freq
        return torch.cat([torch.sin(sinusoid), torch.cos(sinusoid)], dim=-1)

    def _cache_mem(self, h: Tensor, prev: Tensor | None) -> Tensor:
        """New seq-first mem ``(mlen', B, d)`` from this layer's input ``h (B, L, d)``."""
        c = self.config
        cur = h.transpose(0, 1)
        if c.reuse_len is not None and c.reuse_len > 0:
            cur = cur[: c.reuse_len]
        new = cur if prev is None else torch.cat([prev, cur], dim=0)
        if c.mem_len is not None and c.mem_len > 0:
            new = new[-c.mem_len:]
        return new.detach().contiguous()

    # ---- masks and the op's arguments ------------------------------------------------------------

    def _dense_blocked(self, a: BackboneInputs, device) -> Tensor:
        """(B, L, K) True where the query stream may not look (transformers' ``attn_mask``)."""
        c = self.config
        L, mlen = a.seq_len, a.mlen
        i = torch.arange(L, device=device)[:, None]
        j = torch.arange(mlen + L, device=device)[None, :]
        blocked = torch.zeros(a.batch, L, mlen + L, dtype=torch.bool, device=device)
        if c.attn_type == "uni":
            blocked |= j > mlen + i
            if c.same_length:
                blocked |= (j < i) & (j < L)
        if a.padding is not None:
            blocked[:, :, mlen:] |= a.padding[:, None, :]
        if a.perm_mask is not None:
            blocked[:, :, mlen:] |= a.perm_mask > 0
        return blocked

    def _masks(self, a: BackboneInputs, device) -> _Masks:
        """Compact ranks where the inputs allow it (padding, causal "uni", the caller's ranks), a dense
        mask for a ``perm_mask`` (or ``same_length``)."""
        c = self.config
        B, L = a.batch, a.seq_len
        uni = c.attn_type == "uni"
        if a.perm_mask is not None or (uni and c.same_length):
            blocked = self._dense_blocked(a, device)
            j = torch.arange(a.mlen + L, device=device)[None, :]
            own = j == a.mlen + torch.arange(L, device=device)[:, None]
            return _Masks(dense_h=blocked & ~own, dense_g=blocked)
        if a.q_rank is not None:
            rank_q, rank_k = a.q_rank.to(torch.int32), a.k_rank.to(torch.int32)
        elif uni:
            ar = torch.arange(L, dtype=torch.int32, device=device).expand(B, L)
            rank_q, rank_k = ar + 1, ar
        elif a.padding is not None:
            rank_q = torch.ones(B, L, dtype=torch.int32, device=device)
            rank_k = torch.zeros(B, L, dtype=torch.int32, device=device)
        else:
            return _Masks()
        return _Masks(rank_q=rank_q, rank_k=with_memory(block_padding(rank_k, a.padding), a.mlen))

    def _stream_inputs(self, a: BackboneInputs, device) -> StreamInputs:
        masks = self._masks(a, device)
        content: dict[str, Any] = {"qlen": a.seq_len}
        if a.token_type_ids is not None:
            content["q_seg"] = a.token_type_ids
            content["k_seg"] = F.pad(a.token_type_ids, (a.mlen, 0))  # memory keys: segment 0
        if masks.dense_h is not None:
            content["attn_mask"] = masks.dense_h
        elif masks.rank_q is not None:
            content.update(q_rank=masks.rank_q, k_rank=masks.rank_k, self_visible=True)
        streams = StreamInputs(content=content)
        if self.config.bi_data:
            streams.k_r_index = (torch.arange(a.batch, device=device) >= a.batch // 2).long()

        target_pos = a.target_pos
        if target_pos is None and a.target_mapping is not None and not a.output_attentions:
            target_pos = _one_hot_targets(a.target_mapping)
        if target_pos is not None:
            self._query_on_targets(streams, masks, target_pos, a.output_attentions)
        elif a.target_mapping is not None:
            self._query_on_all_rows(streams, masks, a.target_mapping)
        return streams

    def _query_on_targets(self, streams: StreamInputs, masks: _Masks, target_pos: Tensor,
                          separate: bool) -> None:
        """Query stream on the target rows only: in the content stream's launch, or (``separate``, to
        get its attention probabilities) in a launch of its own at ``q_pos = target_pos``."""
        content = streams.content
        rows = target_pos.long().clamp(min=0)
        dense_g = rank_q = None
        if masks.dense_g is not None:
            dense_g = masks.dense_g.gather(1, rows[..., None].expand(-1, -1, masks.dense_g.shape[-1]))
        elif masks.rank_q is not None:
            rank_q = masks.rank_q.gather(1, rows)
        if self.average_blocked_rows:
            blocked = _rows_without_keys(dense_g, rank_q, masks.rank_k)
            streams.blocked_g = None if blocked is None else blocked & (target_pos >= 0)
        if not separate:
            joint: dict[str, Any] = {"target_pos": target_pos}
            joint.update({key: content[key] for key in ("q_seg", "k_seg") if key in content})
            if dense_g is not None:
                joint.update(attn_mask=masks.dense_h, attn_mask_g=dense_g)
            elif rank_q is not None:
                joint.update(q_rank=masks.rank_q, k_rank=masks.rank_k)
            streams.joint = joint
            return
        query: dict[str, Any] = {"qlen": content["qlen"], "q_pos": target_pos}
        if "q_seg" in content:
            query.update(q_seg=content["q_seg"].gather(1, rows), k_seg=content["k_seg"])
        if dense_g is not None:
            query["attn_mask"] = dense_g
        elif rank_q is not None:
            query.update(q_rank=rank_q, k_rank=masks.rank_k, self_visible=False)
        streams.query = query

    def _query_on_all_rows(self, streams: StreamInputs, masks: _Masks, target_mapping: Tensor) -> None:
        """General ``target_mapping``: the query stream runs on all L positions, mapped in and out by
        the layer, as transformers does."""
        content = streams.content
        streams.target_mapping = target_mapping
        query: dict[str, Any] = {key: content[key] for key in ("qlen", "q_seg", "k_seg") if key in content}
        if masks.dense_g is not None:
            query["attn_mask"] = masks.dense_g
        elif masks.rank_q is not None:
            query.update(q_rank=masks.rank_q, k_rank=masks.rank_k, self_visible=False)
        streams.query = query
        if self.average_blocked_rows:
            streams.blocked_g = _rows_without_keys(masks.dense_g, masks.rank_q, masks.rank_k)

    # ---- validation --------------------------------------------------------------------------------

    def _check_tokens(self, input_ids, inputs_embeds) -> tuple[int, int]:
        """``input_ids`` or ``inputs_embeds``, exactly one, well formed; returns (B, L)."""
        if input_ids is not None and inputs_embeds is not None:
            raise ValueError("You cannot specify both input_ids and inputs_embeds at the same time")
        if input_ids is None and inputs_embeds is None:
            raise ValueError("You have to specify either input_ids or inputs_embeds")
        if input_ids is not None:
            self._check_input_ids(input_ids)
        else:
            self._check_inputs_embeds(inputs_embeds)
        B, L = (input_ids if input_ids is not None else inputs_embeds).shape[:2]
        if L == 0:
            raise ValueError("the sequence is empty (seq_len = 0)")
        return B, L

    def _check_input_ids(self, input_ids) -> None:
        vocab_size = self.config.vocab_size
        if not isinstance(input_ids, Tensor) or input_ids.dtype not in (torch.long, torch.int):
            raise TypeError(f"input_ids must be an integer tensor, got "
                            f"{getattr(input_ids, 'dtype', type(input_ids).__name__)}")
        if input_ids.dim() != 2:
            raise ValueError(f"input_ids must be (batch, seq_len), got shape {tuple(input_ids.shape)}")
        if input_ids.numel() and not torch.compiler.is_compiling():
            lo, hi = int(input_ids.min()), int(input_ids.max())
            if lo < 0 or hi >= vocab_size:
                raise ValueError(f"input_ids must be in [0, vocab_size={vocab_size}), got values in "
                                 f"[{lo}, {hi}]")

    def _check_inputs_embeds(self, inputs_embeds) -> None:
        d_model = self.config.d_model
        if not isinstance(inputs_embeds, Tensor):
            raise TypeError(f"inputs_embeds must be a torch.Tensor, got {type(inputs_embeds).__name__}")
        if inputs_embeds.dim() != 3 or inputs_embeds.shape[-1] != d_model:
            raise ValueError(f"inputs_embeds must be (batch, seq_len, d_model={d_model}), got "
                             f"{tuple(inputs_embeds.shape)}")
        if not inputs_embeds.is_floating_point():
            raise TypeError(f"inputs_embeds must be floating point, got {inputs_embeds.dtype}")
        weights = self.mask_emb.dtype
        if inputs_embeds.dtype != weights and not torch.is_autocast_enabled(inputs_embeds.device.type):
            raise TypeError(f"inputs_embeds has dtype {inputs_embeds.dtype} but the model's weights are "
                            f"{weights}: cast it (inputs_embeds.to(model.dtype)) or run under torch.autocast")

    def _check_mems(self, mems: tuple[Tensor, ...] | None, B: int) -> None:
        c = self.config
        if mems is None:
            return
        if len(mems) != c.n_layer:
            raise ValueError(f"mems must hold one tensor per layer ({c.n_layer}), got {len(mems)}")
        for i, m in enumerate(mems):
            if not isinstance(m, Tensor):
                raise TypeError(f"mems[{i}] must be a torch.Tensor, got {type(m).__name__}")
            if m.dim() != 3 or m.shape[1] != B or m.shape[2] != c.d_model:
                raise ValueError(f"mems[{i}] must be (mlen, batch={B}, d_model={c.d_model}), got "
                                 f"{tuple(m.shape)}")
            if m.shape[0] != mems[0].shape[0]:
                raise ValueError(f"mems[{i}] has mlen {m.shape[0]}, mems[0] has {mems[0].shape[0]}")

    def _check_combinations(self, B, L, attention_mask, input_mask, perm_mask, target_mapping, q_rank,
                            k_rank, target_pos) -> None:
        """Arguments that exclude or need each other, and values that depend on L."""
        c = self.config
        if attention_mask is not None and input_mask is not None:
            raise ValueError("pass only one of attention_mask (0 = padding) and input_mask (1 = padding)")
        if (q_rank is None) != (k_rank is None):
            raise ValueError("q_rank and k_rank must be given together")
        if q_rank is not None and perm_mask is not None:
            raise ValueError("pass either perm_mask or q_rank/k_rank, not both")
        if q_rank is not None and c.attn_type != "bi":
            raise ValueError("q_rank/k_rank (permutation ranks) need attn_type='bi'")
        if target_pos is not None and target_mapping is not None:
            raise ValueError("pass either target_mapping or target_pos, not both")
        if c.bi_data and B % 2:
            raise ValueError(f"bi_data needs an even batch size, got {B}")
        _check_target_pos_range(target_pos, L)

    def _validate_inputs(self, input_ids, inputs_embeds, attention_mask, input_mask, mems, perm_mask,
                         target_mapping, token_type_ids, q_rank, k_rank, target_pos) -> tuple[int, int]:
        """Check shapes, ranges, dtypes and devices before any compute; returns (B, L)."""
        B, L = self._check_tokens(input_ids, inputs_embeds)
        self._check_mems(mems, B)
        P = target_mapping.shape[1] if isinstance(target_mapping, Tensor) and target_mapping.dim() == 3 else -1
        tensors = {"input_ids": (input_ids, None), "inputs_embeds": (inputs_embeds, None),
                   "attention_mask": (attention_mask, (B, L)), "input_mask": (input_mask, (B, L)),
                   "token_type_ids": (token_type_ids, (B, L)), "perm_mask": (perm_mask, (B, L, L)),
                   "target_mapping": (target_mapping, (B, P, L)), "q_rank": (q_rank, (B, L)),
                   "k_rank": (k_rank, (B, L)),
                   "target_pos": (target_pos, (B, target_pos.shape[-1] if target_pos.dim() else -1)
                                  if isinstance(target_pos, Tensor) else None)}
        tensors.update({f"mems[{i}]": (m, None) for i, m in enumerate(mems or ())})
        _check_tensor_args(tensors, self.word_embedding.weight.device)
        for name, t in (("token_type_ids", token_type_ids), ("q_rank", q_rank), ("k_rank", k_rank),
                        ("target_pos", target_pos)):
            if t is not None and t.is_floating_point():
                raise TypeError(f"{name} must be an integer tensor, got {t.dtype}")
        self._check_combinations(B, L, attention_mask, input_mask, perm_mask, target_mapping, q_rank,
                                 k_rank, target_pos)
        return B, L

    # ---- forward -----------------------------------------------------------------------------------

    def prepare_inputs(
        self,
        input_ids: Tensor | None = None,
        attention_mask: Tensor | None = None,
        mems: list[Tensor] | tuple[Tensor, ...] | Tensor | None = None,
        perm_mask: Tensor | None = None,
        target_mapping: Tensor | None = None,
        token_type_ids: Tensor | None = None,
        input_mask: Tensor | None = None,
        inputs_embeds: Tensor | None = None,
        use_mems: bool | None = None,
        output_attentions: bool | None = None,
        output_hidden_states: bool | None = None,
        return_dict: bool | None = None,
        q_rank: Tensor | None = None,
        k_rank: Tensor | None = None,
        target_pos: Tensor | None = None,
        **kwargs: Any,
    ) -> BackboneInputs:
        """``forward``'s arguments with the config's defaults applied, normalised and validated before
        any compute; bad input raises ValueError or TypeError naming the argument."""
        c = self.config
        _check_extra_kwargs(kwargs)
        mems = _layer_mems(mems)
        B, L = self._validate_inputs(input_ids, inputs_embeds, attention_mask, input_mask, mems,
                                     perm_mask, target_mapping, token_type_ids, q_rank, k_rank,
                                     target_pos)
        if target_mapping is not None and not target_mapping.is_floating_point():
            target_mapping = target_mapping.to(self.mask_emb.dtype)  # e.g. a bool one-hot mapping
        if use_mems is None:
            use_mems = c.use_mems_train if self.training else c.use_mems_eval
        return BackboneInputs(
            batch=B, seq_len=L, input_ids=input_ids, inputs_embeds=inputs_embeds,
            padding=_as_bool_padding(attention_mask, input_mask), mems=mems, perm_mask=perm_mask,
            target_mapping=target_mapping, token_type_ids=token_type_ids, q_rank=q_rank, k_rank=k_rank,
            target_pos=target_pos, use_mems=bool(use_mems),
            output_attentions=c.output_attentions if output_attentions is None else output_attentions,
            output_hidden_states=c.output_hidden_states if output_hidden_states is None else output_hidden_states,
            return_dict=c.return_dict if return_dict is None else return_dict,
        )

    def forward(
        self,
        input_ids: Tensor | None = None,
        attention_mask: Tensor | None = None,
        mems: list[Tensor] | tuple[Tensor, ...] | Tensor | None = None,
        perm_mask: Tensor | None = None,
        target_mapping: Tensor | None = None,
        token_type_ids: Tensor | None = None,
        input_mask: Tensor | None = None,
        inputs_embeds: Tensor | None = None,
        use_mems: bool | None = None,
        output_attentions: bool | None = None,
        output_hidden_states: bool | None = None,
        return_dict: bool | None = None,
        q_rank: Tensor | None = None,
        k_rank: Tensor | None = None,
        target_pos: Tensor | None = None,
        **kwargs: Any,
    ) -> XLNetModelOutput | tuple:
        """HF's ``XLNetModel.forward`` plus compact masks: ``q_rank``/``k_rank`` ``(B, L)`` int
        permutation ranks (see ``xlnet_fast.masks.local_perm``) and ``target_pos (B, P)`` int positions
        of the query-stream rows (negative = padding row), used instead of ``perm_mask`` /
        ``target_mapping``. ``mems`` may also be one stacked tensor; ``head_mask``, ``position_ids``,
        ``logits_to_keep``, ``use_cache`` and ``num_items_in_batch`` are accepted and ignored, as
        transformers' XLNetModel does."""
        return self.forward_prepared(self.prepare_inputs(
            input_ids, attention_mask, mems, perm_mask, target_mapping, token_type_ids, input_mask,
            inputs_embeds, use_mems, output_attentions, output_hidden_states, return_dict, q_rank,
            k_rank, target_pos, **kwargs))

    def forward_prepared(self, a: BackboneInputs) -> XLNetModelOutput | tuple:
        """The forward pass over the inputs ``prepare_inputs`` returned."""
        h = self.word_embedding(a.input_ids) if a.input_ids is not None else a.inputs_embeds
        device = h.device
        streams = self._stream_inputs(a, device)
        h = self.dropout(h)
        g = None
        if streams.query is not None or streams.joint is not None:
            P = a.target_mapping.shape[1] if a.target_mapping is not None else a.target_pos.shape[1]
            g = self.dropout(self.mask_emb.expand(a.batch, P, -1))
        pos_emb = self.dropout(self.relative_positional_encoding(a.seq_len, a.mlen + a.seq_len, device))
        out = self._run_layers(h, g, pos_emb, streams, a)
        return out if a.return_dict else out.to_tuple()

    def _run_layers(self, h: Tensor, g: Tensor | None, pos_emb: Tensor, streams: StreamInputs,
                    a: BackboneInputs) -> XLNetModelOutput:
        new_mems: tuple = ()
        hidden_states: list | None = [] if a.output_hidden_states else None
        attentions: list | None = [] if a.output_attentions else None
        for i, layer in enumerate(self.layer):
            layer_mems = a.mems[i] if a.mems is not None else None
            if a.use_mems:
                new_mems += (self._cache_mem(h, layer_mems),)
            _record(hidden_states, h, g)
            h, g, probs = layer(h, g, pos_emb,
                                layer_mems.transpose(0, 1) if layer_mems is not None else None,
                                streams, a.output_attentions)
            _record(attentions, probs)
        _record(hidden_states, h, g)
        return XLNetModelOutput(
            last_hidden_state=self.dropout(g if g is not None else h),
            mems=new_mems if a.use_mems else None,
            hidden_states=tuple(hidden_states) if hidden_states is not None else None,
            attentions=tuple(attentions) if attentions is not None else None,
        )


# --------------------------------------------------------------------------------------------------
# Heads
# --------------------------------------------------------------------------------------------------

def _wrap(output_cls, return_dict: bool, backbone_out: XLNetModelOutput, **head):
    out = output_cls(**head, mems=backbone_out.mems, hidden_states=backbone_out.hidden_states,
                     attentions=backbone_out.attentions)
    return out if return_dict else out.to_tuple()


def _keep_positions(hidden: Tensor, logits_to_keep: int | Tensor) -> Tensor:
    """The rows of ``hidden (B, L, d)`` that ``logits_to_keep`` selects (see ``XLNetLMHeadModel``)."""
    if isinstance(logits_to_keep, bool) or not isinstance(logits_to_keep, (int, Tensor)):
        raise TypeError(f"logits_to_keep must be an int or a tensor, got {type(logits_to_keep).__name__}")
    if isinstance(logits_to_keep, int):
        if logits_to_keep < 0:
            raise ValueError(f"logits_to_keep must be >= 0, got {logits_to_keep}")
        return hidden[:, -logits_to_keep:] if logits_to_keep else hidden
    return _keep_tensor_positions(hidden, logits_to_keep.to(hidden.device))


def _keep_tensor_positions(hidden: Tensor, keep: Tensor) -> Tensor:
    integer = not keep.is_floating_point() and not keep.is_complex() and keep.dtype != torch.bool
    if keep.dim() == 1 and integer:
        return hidden[:, keep]
    if keep.dim() == 2 and keep.dtype == torch.bool and keep.shape == hidden.shape[:2]:
        return hidden[keep]
    if keep.dim() == 2 and integer and keep.shape[0] == hidden.shape[0]:
        return torch.take_along_dim(hidden, keep[..., None].long(), dim=1)
    raise ValueError(f"logits_to_keep must be an int, a 1-D integer tensor, a (batch, n) integer tensor or a "
                     f"(batch, seq_len) bool tensor; got {keep.dtype} of shape {tuple(keep.shape)}")


class XLNetLMHeadModel(XLNetPreTrainedModel):
    _tied_weights_keys = {"lm_loss.weight": "transformer.word_embedding.weight"}

    def __init__(self, config: XLNetConfig):
        super().__init__(config)
        self.transformer = XLNetModel(config)
        self.lm_loss = nn.Linear(config.d_model, config.vocab_size, bias=True)
        self.post_init()

    def tie_weights(self) -> None:
        if self.config.tie_word_embeddings:
            self.lm_loss.weight = self.transformer.word_embedding.weight

    def get_output_embeddings(self) -> nn.Linear:
        return self.lm_loss

    def forward(self, input_ids: Tensor | None = None, labels: Tensor | None = None,
                return_dict: bool | None = None, logits_to_keep: int | Tensor = 0, **kwargs: Any):
        """HF's forward; ``logits`` are ``(B, P, vocab)`` over the query stream when it runs.
        ``logits_to_keep`` projects only some positions, as in transformers: an int keeps the last
        that many (0: all), a 1-D tensor these positions, a ``(B, n)`` int tensor per-row positions, a
        ``(B, L)`` bool tensor the True positions (flattened)."""
        return_dict = self.config.return_dict if return_dict is None else return_dict
        out = self.transformer(input_ids, return_dict=True, **kwargs)
        logits = self.lm_loss(_keep_positions(out.last_hidden_state, logits_to_keep))
        loss = None
        if labels is not None:
            loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), labels.reshape(-1))
        return _wrap(XLNetLMHeadModelOutput, return_dict, out, loss=loss, logits=logits)


class XLNetSequenceSummary(nn.Module):
    """HF's sequence summary: pick a token (last/first/mean/cls_index), project, activate."""

    def __init__(self, config: XLNetConfig):
        super().__init__()
        self.summary_type = config.summary_type
        if self.summary_type == "attn":
            raise NotImplementedError("summary_type='attn' is not implemented (nor in transformers)")
        self.summary = nn.Identity()
        if config.summary_use_proj:
            proj_to_labels = getattr(config, "summary_proj_to_labels", False)
            n = config.num_labels if proj_to_labels and config.num_labels > 0 else config.d_model
            self.summary = nn.Linear(config.d_model, n)
        act = config.summary_activation
        self.activation = _activation(act) if act else nn.Identity()
        first = getattr(config, "summary_first_dropout", 0.0) or 0.0
        self.first_dropout = nn.Dropout(first) if first > 0 else nn.Identity()
        last = config.summary_last_dropout or 0.0
        self.last_dropout = nn.Dropout(last) if last > 0 else nn.Identity()

    def forward(self, hidden: Tensor, cls_index: Tensor | None = None) -> Tensor:
        if self.summary_type == "last":
            out = hidden[:, -1]
        elif self.summary_type == "first":
            out = hidden[:, 0]
        elif self.summary_type == "mean":
            out = hidden.mean(dim=1)
        elif self.summary_type == "cls_index":
            if cls_index is None:
                idx = torch.full((hidden.shape[0],), hidden.shape[1] - 1, device=hidden.device)
            else:
                idx = cls_index
            out = hidden[torch.arange(hidden.shape[0], device=hidden.device), idx.long()]
        else:
            raise ValueError(f"unknown summary_type {self.summary_type!r}")
        return self.last_dropout(self.activation(self.summary(self.first_dropout(out))))


def _classification_loss(config: XLNetConfig, logits: Tensor, labels: Tensor) -> Tensor:
    n = config.num_labels
    if config.problem_type is None:
        if n == 1:
            config.problem_type = "regression"
        elif labels.dtype in (torch.long, torch.int):
            config.problem_type = "single_label_classification"
        else:
            config.problem_type = "multi_label_classification"
    if config.problem_type == "regression":
        return F.mse_loss(logits.squeeze(), labels.squeeze()) if n == 1 else F.mse_loss(logits, labels)
    if config.problem_type == "single_label_classification":
        return F.cross_entropy(logits.view(-1, n), labels.view(-1))
    return F.binary_cross_entropy_with_logits(logits, labels)


class XLNetForSequenceClassification(XLNetPreTrainedModel):
    def __init__(self, config: XLNetConfig):
        super().__init__(config)
        self.num_labels = config.num_labels
        self.transformer = XLNetModel(config)
        self.sequence_summary = XLNetSequenceSummary(config)
        self.logits_proj = nn.Linear(config.d_model, config.num_labels)
        self.post_init()

    def forward(self, input_ids=None, labels=None, return_dict=None, **kwargs):
        return_dict = self.config.return_dict if return_dict is None else return_dict
        out = self.transformer(input_ids, return_dict=True, **kwargs)
        logits = self.logits_proj(self.sequence_summary(out.last_hidden_state))
        loss = _classification_loss(self.config, logits, labels) if labels is not None else None
        return _wrap(XLNetForSequenceClassificationOutput, return_dict, out, loss=loss, logits=logits)


class XLNetForTokenClassification(XLNetPreTrainedModel):
    def __init__(self, config: XLNetConfig):
        super().__init__(config)
        self.num_labels = config.num_labels
        self.transformer = XLNetModel(config)
        self.classifier = nn.Linear(config.d_model, config.num_labels)
        self.post_init()

    def forward(self, input_ids=None, labels=None, return_dict=None, **kwargs):
        return_dict = self.config.return_dict if return_dict is None else return_dict
        out = self.transformer(input_ids, return_dict=True, **kwargs)
        logits = self.classifier(out.last_hidden_state)
        loss = None
        if labels is not None:
            loss = F.cross_entropy(logits.view(-1, self.num_labels), labels.view(-1))
        return _wrap(XLNetForTokenClassificationOutput, return_dict, out, loss=loss, logits=logits)


class XLNetForMultipleChoice(XLNetPreTrainedModel):
    def __init__(self, config: XLNetConfig):
        super().__init__(config)
        self.transformer = XLNetModel(config)
        self.sequence_summary = XLNetSequenceSummary(config)
        self.logits_proj = nn.Linear(config.d_model, 1)
        self.post_init()

    def forward(self, input_ids=None, token_type_ids=None, input_mask=None, attention_mask=None,
                inputs_embeds=None, labels=None, return_dict=None, **kwargs):
        """Inputs are ``(B, num_choices, L)``; logits ``(B, num_choices)``."""
        return_dict = self.config.return_dict if return_dict is None else return_dict
        ref = input_ids if input_ids is not None else inputs_embeds
        num_choices = ref.shape[1]

        def flat(t, keep):
            return None if t is None else t.reshape((-1,) + tuple(t.shape[-keep:]))

        out = self.transformer(flat(input_ids, 1), token_type_ids=flat(token_type_ids, 1),
                               input_mask=flat(input_mask, 1), attention_mask=flat(attention_mask, 1),
                               inputs_embeds=flat(inputs_embeds, 2), return_dict=True, **kwargs)
        logits = self.logits_proj(self.sequence_summary(out.last_hidden_state)).view(-1, num_choices)
        loss = F.cross_entropy(logits, labels.view(-1)) if labels is not None else None
        return _wrap(XLNetForMultipleChoiceOutput, return_dict, out, loss=loss, logits=logits)


class XLNetForQuestionAnsweringSimple(XLNetPreTrainedModel):
    def __init__(self, config: XLNetConfig):
        super().__init__(config)
        self.num_labels = config.num_labels
        self.transformer = XLNetModel(config)
        self.qa_outputs = nn.Linear(config.d_model, config.num_labels)
        self.post_init()

    def forward(self, input_ids=None, start_positions=None, end_positions=None, return_dict=None,
                **kwargs):
        return_dict = self.config.return_dict if return_dict is None else return_dict
        out = self.transformer(input_ids, return_dict=True, **kwargs)
        start_logits, end_logits = self.qa_outputs(out.last_hidden_state).split(1, dim=-1)
        start_logits = start_logits.squeeze(-1).contiguous()
        end_logits = end_logits.squeeze(-1).contiguous()
        loss = None
        if start_positions is not None and end_positions is not None:
            ignored = start_logits.shape[1]
            sp = start_positions.reshape(-1).clamp(0, ignored)
            ep = end_positions.reshape(-1).clamp(0, ignored)
            loss = (F.cross_entropy(start_logits, sp, ignore_index=ignored)
                    + F.cross_entropy(end_logits, ep, ignore_index=ignored)) / 2
        return _wrap(XLNetForQuestionAnsweringSimpleOutput, return_dict, out, loss=loss,
                     start_logits=start_logits, end_logits=end_logits)


def _mask_logits(x: Tensor, p_mask: Tensor | None) -> Tensor:
    if p_mask is None:
        return x
    big = 65500 if p_mask.dtype == torch.float16 else 1e30
    return x * (1 - p_mask) - big * p_mask


class XLNetPoolerStartLogits(nn.Module):
    def __init__(self, config: XLNetConfig):
        super().__init__()
        self.dense = nn.Linear(config.d_model, 1)

    def forward(self, hidden: Tensor, p_mask: Tensor | None = None) -> Tensor:
        return _mask_logits(self.dense(hidden).squeeze(-1), p_mask)


def _gather_start(hidden: Tensor, start_positions: Tensor) -> Tensor:
    """(B, L, d), (B,) -> (B, 1, d)."""
    idx = start_positions[:, None, None].expand(-1, -1, hidden.shape[-1])
    return hidden.gather(-2, idx)


class XLNetPoolerEndLogits(nn.Module):
    def __init__(self, config: XLNetConfig):
        super().__init__()
        self.dense_0 = nn.Linear(config.d_model * 2, config.d_model)
        self.activation = nn.Tanh()
        self.LayerNorm = nn.LayerNorm(config.d_model, eps=config.layer_norm_eps)
        self.dense_1 = nn.Linear(config.d_model, 1)

    def forward(self, hidden, start_states=None, start_positions=None, p_mask=None) -> Tensor:
        if start_positions is not None:
            start_states = _gather_start(hidden, start_positions).expand(-1, hidden.shape[-2], -1)
        elif start_states is None:
            raise ValueError("pass start_states or start_positions")
        x = self.dense_1(self.LayerNorm(self.activation(self.dense_0(torch.cat([hidden, start_states], -1)))))
        return _mask_logits(x.squeeze(-1), p_mask)


class XLNetPoolerAnswerClass(nn.Module):
    def __init__(self, config: XLNetConfig):
        super().__init__()
        self.dense_0 = nn.Linear(config.d_model * 2, config.d_model)
        self.activation = nn.Tanh()
        self.dense_1 = nn.Linear(config.d_model, 1, bias=False)

    def forward(self, hidden, start_states=None, start_positions=None, cls_index=None) -> Tensor:
        if start_positions is not None:
            start_states = _gather_start(hidden, start_positions).squeeze(-2)
        elif start_states is None:
            raise ValueError("pass start_states or start_positions")
        if cls_index is not None:
            cls_state = _gather_start(hidden, cls_index).squeeze(-2)
        else:
            cls_state = hidden[:, -1, :]
        x = self.activation(self.dense_0(torch.cat([start_states, cls_state], dim=-1)))
        return self.dense_1(x).squeeze(-1)


class XLNetForQuestionAnswering(XLNetPreTrainedModel):
    def __init__(self, config: XLNetConfig):
        super().__init__(config)
        self.start_n_top = config.start_n_top
        self.end_n_top = config.end_n_top
        self.transformer = XLNetModel(config)
        self.start_logits = XLNetPoolerStartLogits(config)
        self.end_logits = XLNetPoolerEndLogits(config)
        self.answer_class = XLNetPoolerAnswerClass(config)
        self.post_init()

    def forward(self, input_ids=None, start_positions=None, end_positions=None, is_impossible=None,
                cls_index=None, p_mask=None, return_dict=None, **kwargs):
        return_dict = self.config.return_dict if return_dict is None else return_dict
        out = self.transformer(input_ids, return_dict=True, **kwargs)
        hidden = out.last_hidden_state
        start_logits = self.start_logits(hidden, p_mask=p_mask)
        if start_positions is not None and end_positions is not None:
            squeeze = [None if x is None else (x.squeeze(-1) if x.dim() > 1 else x)
                       for x in (start_positions, end_positions, cls_index, is_impossible)]
            start_positions, end_positions, cls_index, is_impossible = squeeze
            end_logits = self.end_logits(hidden, start_positions=start_positions, p_mask=p_mask)
            loss = (F.cross_entropy(start_logits, start_positions)
                    + F.cross_entropy(end_logits, end_positions)) / 2
            if cls_index is not None and is_impossible is not None:
                cls_logits = self.answer_class(hidden, start_positions=start_positions, cls_index=cls_index)
                loss = loss + 0.5 * F.binary_cross_entropy_with_logits(cls_logits, is_impossible)
            return _wrap(XLNetForQuestionAnsweringOutput, return_dict, out, loss=loss)

        B, L, d = hidden.shape
        start_probs = F.softmax(start_logits, dim=-1)
        start_top_probs, start_top_index = torch.topk(start_probs, self.start_n_top, dim=-1)
        start_states = hidden.gather(-2, start_top_index[..., None].expand(-1, -1, d))
        start_states = start_states[:, None].expand(-1, L, -1, -1)
        hidden_exp = hidden[:, :, None].expand_as(start_states)
        pm = p_mask[..., None] if p_mask is not None else None
        end_logits = self.end_logits(hidden_exp, start_states=start_states, p_mask=pm)
        end_probs = F.softmax(end_logits, dim=1)
        end_top_probs, end_top_index = torch.topk(end_probs, self.end_n_top, dim=1)
        end_top_probs = end_top_probs.reshape(-1, self.start_n_top * self.end_n_top)
        end_top_index = end_top_index.reshape(-1, self.start_n_top * self.end_n_top)
        weighted_start = torch.einsum("blh,bl->bh", hidden, start_probs)
        cls_logits = self.answer_class(hidden, start_states=weighted_start, cls_index=cls_index)
        return _wrap(XLNetForQuestionAnsweringOutput, return_dict, out,
                     start_top_log_probs=start_top_probs, start_top_index=start_top_index,
                     end_top_log_probs=end_top_probs, end_top_index=end_top_index,
                     cls_logits=cls_logits)


MODEL_CLASSES = {
    "XLNetModel": XLNetModel,
    "XLNetLMHeadModel": XLNetLMHeadModel,
    "XLNetForSequenceClassification": XLNetForSequenceClassification,
    "XLNetForTokenClassification": XLNetForTokenClassification,
    "XLNetForMultipleChoice": XLNetForMultipleChoice,
    "XLNetForQuestionAnsweringSimple": XLNetForQuestionAnsweringSimple,
    "XLNetForQuestionAnswering": XLNetForQuestionAnswering,
}
