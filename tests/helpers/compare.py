"""The relative error every comparison in the tests uses."""

import torch


def rel_err(actual: torch.Tensor, expected: torch.Tensor, floor: float = 1e-30) -> float:
    """``||actual - expected|| / max(||expected||, floor)`` in float64 on the CPU (any shapes that
    broadcast); ``floor`` keeps an all-zero ``expected`` from dividing by zero."""
    a, b = actual.detach().double().cpu(), expected.detach().double().cpu()
    return float((a - b).norm() / b.norm().clamp_min(floor))
