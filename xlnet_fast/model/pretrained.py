"""The base classes of the models: loading and saving transformers' directory format
(``PreTrainedModel``, shared by XLNet and Transformer-XL) and XLNet's weight init."""

from __future__ import annotations

import logging
import os
from typing import Any

import torch
from torch import Tensor, nn

from ..config import XLNetConfig
from .layers import XLNetRelativeAttention

logger = logging.getLogger(__name__)


def _load_state_file(path: str) -> dict[str, Tensor]:
    try:
        if path.endswith(".safetensors"):
            from safetensors.torch import load_file

            return load_file(path)
        return torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:
        raise ValueError(f"could not read checkpoint file {path}: it is truncated or corrupted ({exc})") from exc


def _unshared(state: dict[str, Tensor]) -> dict[str, Tensor]:
    """``state`` detached and contiguous, a tensor that shares memory with an earlier one copied
    (safetensors refuses shared tensors; e.g. Transformer-XL's shared ``r_w_bias`` under every layer)."""
    seen: set[tuple[int, int]] = set()
    out = {}
    for key, value in state.items():
        value = value.detach().contiguous()
        where = (value.untyped_storage().data_ptr(), value.storage_offset())
        out[key] = value.clone() if where in seen and value.numel() else value
        seen.add(where)
    return out


class PreTrainedModel(nn.Module):
    """``from_pretrained`` and ``save_pretrained`` in transformers' directory format for a model
    whose configuration is a ``config_class``; ``_tied_weights_keys`` maps a weight that is another's
    (not saved, never missing) to it."""

    config_class: type = XLNetConfig
    base_model_prefix = "transformer"
    _tied_weights_keys: dict[str, str] = {}

    def __init__(self, config):
        super().__init__()
        if not isinstance(config, self.config_class):
            raise TypeError(f"config must be a {self.config_class.__name__}, got {type(config).__name__}")
        self.config = config

    def post_init(self) -> None:
        self.apply(self._init_weights)
        self.tie_weights()

    def tie_weights(self) -> None:
        pass

    def _init_weights(self, module: nn.Module) -> None:
        raise NotImplementedError

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
        state = _unshared({k: v for k, v in state.items() if k not in self._tied_weights_keys})
        save_file(state, os.path.join(directory, "model.safetensors"), metadata={"format": "pt"})

    @classmethod
    def from_pretrained(cls, directory: str | os.PathLike, config=None,
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
            saved = cls.config_class.from_pretrained(directory)
            unknown = sorted(k for k in config_overrides if not saved.is_field(k))
            if unknown:
                raise TypeError(f"{cls.__name__}.from_pretrained() got keyword arguments that are no "
                                f"{cls.config_class.__name__} field: {unknown}")
            config = cls.config_class.from_pretrained(directory, **config_overrides)
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


class XLNetPreTrainedModel(PreTrainedModel):
    """The base of every XLNet model: XLNet's weight init."""

    config_class = XLNetConfig

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
        elif isinstance(getattr(module, "mask_emb", None), nn.Parameter):  # the backbone
            nn.init.normal_(module.mask_emb, mean=0.0, std=std)
