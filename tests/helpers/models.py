"""Small models: a transformers XLNet, its xlnet_fast twin with the same weights, token ids."""

import torch
import transformers

import xlnet_fast
from xlnet_fast.config import XLNetConfig

SMALL = dict(vocab_size=50, d_model=32, n_layer=2, n_head=4, d_inner=48, dropout=0.0,
             summary_last_dropout=0.0, mem_len=6)
FIRST_REGULAR_ID = 9  # ids below are XLNet's special tokens


def hf_model(class_name: str, seed: int = 0, **overrides):
    """A transformers model of ``class_name`` on SMALL (with ``overrides``), seeded, in eval mode."""
    torch.manual_seed(seed)
    return getattr(transformers, class_name)(transformers.XLNetConfig(**{**SMALL, **overrides})).eval()


def twins(class_name: str, seed: int = 0, **overrides):
    """(hf_model, our_model) in eval mode with identical weights, eager attention backend."""
    hf = hf_model(class_name, seed, **overrides)
    ours = getattr(xlnet_fast, class_name)(XLNetConfig(**{**SMALL, **overrides}, attn_backend="eager")).eval()
    ours.load_hf_state_dict(hf.state_dict())
    return hf, ours


def token_ids(batch: int, length: int, seed: int = 0) -> torch.Tensor:
    """Random regular (non-special) token ids ``(batch, length)`` below SMALL's vocab_size."""
    return torch.randint(FIRST_REGULAR_ID, SMALL["vocab_size"], (batch, length),
                         generator=torch.Generator().manual_seed(seed))
