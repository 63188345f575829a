"""Fused Triton kernels for XLNet relative attention (installed as ``xlnet_fast.kernels``)."""

from __future__ import annotations


def available() -> tuple[bool, str]:
    """(usable, reason) for the Triton backend."""
    return False, "the fused Triton kernels are not part of this build yet (eager backend only)"
