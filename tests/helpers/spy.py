"""Which forward ran: the calls of xlnet_fast's attention op, each with the backend it ran on, and
the calls of transformers' XLNet attention core.

``torch.ops.xlnet_fast.rel_attention`` (and its backward) is what every attention of xlnet_fast goes
through, whatever the model, the patch or the launch path: a ``TorchDispatchMode`` sees each call
and its ``backend`` argument, the backend the call resolved to (``"eager"`` or ``"triton"``; never
``"auto"``). Nothing here depends on how the model reaches the op.
"""

from __future__ import annotations

import collections
import contextlib

from torch.utils._python_dispatch import TorchDispatchMode


class OpCalls(TorchDispatchMode):
    """Counts ``xlnet_fast::`` op calls as ``{(op name, backend): n}`` in ``calls``."""

    def __init__(self):
        super().__init__()
        self.calls: collections.Counter = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        namespace, _, name = func.name().partition("::")
        if namespace == "xlnet_fast":
            backend = next((a for a in args if isinstance(a, str)), None)  # the op's one string argument
            self.calls[name, backend] += 1
        return func(*args, **(kwargs or {}))

    def count(self, op: str = "rel_attention", backend: str | None = None) -> int:
        """Calls of ``op`` (``"rel_attention"`` or ``"rel_attention_backward"``), on ``backend`` or any."""
        return sum(n for (name, b), n in self.calls.items() if name == op and backend in (None, b))

    def backends(self) -> set:
        """The backends the attention ops ran on (``mask_tables``, the Triton backend's tables, has none)."""
        return {b for name, b in self.calls if name.startswith("rel_attention")}


@contextlib.contextmanager
def hf_core_calls(monkeypatch):
    """Counts calls of transformers' ``XLNetRelativeAttention.rel_attn_core`` (its attention: what
    transformers' own forward, i.e. the patch's fallback, runs); yields a one-item list."""
    from transformers.models.xlnet import modeling_xlnet

    original = modeling_xlnet.XLNetRelativeAttention.rel_attn_core
    count = [0]

    def counted(*args, **kwargs):
        count[0] += 1
        return original(*args, **kwargs)

    monkeypatch.setattr(modeling_xlnet.XLNetRelativeAttention, "rel_attn_core", counted)
    try:
        yield count
    finally:
        monkeypatch.setattr(modeling_xlnet.XLNetRelativeAttention, "rel_attn_core", original)
