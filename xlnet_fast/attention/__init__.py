"""The attention op: argument record and validation (``args``), ``torch.library`` registration and
entry points (``op``), masks prepared once for many calls (``prepared``), the eager backend (``eager``) and backend resolution (``backends``). The Triton
backend is ``xlnet_fast.kernels``."""

from .args import AttnArgs
from .backends import BACKENDS, explain_auto_backend, resolve_backend, triton_status
from .op import attention_probabilities, rel_attention, rel_attention_two_stream
from .prepared import PreparedMasks, prepare_masks, prepare_two_stream_masks

__all__ = ["rel_attention", "rel_attention_two_stream", "attention_probabilities", "prepare_masks",
           "prepare_two_stream_masks", "PreparedMasks", "AttnArgs", "BACKENDS", "resolve_backend",
           "explain_auto_backend", "triton_status"]
