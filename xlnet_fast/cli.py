"""Command line: ``xlnet-fast`` (also ``python -m xlnet_fast``)."""

from __future__ import annotations

import argparse
import platform
import sys


def _info(args: argparse.Namespace) -> int:
    import torch

    from . import __version__
    from .ops import explain_auto_backend, triton_status

    try:
        import triton

        triton_version = triton.__version__
    except Exception:
        triton_version = "not installed"
    ok, reason = triton_status()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    lines = [
        f"xlnet_fast  {__version__}",
        f"python      {platform.python_version()}",
        f"torch       {torch.__version__}",
        f"triton      {triton_version}",
        f"device      {torch.cuda.get_device_name(0) if device.type == 'cuda' else 'cpu'}",
        f"triton backend usable: {'yes' if ok else 'no'} ({reason})",
        f"backend='auto' on {device.type}: {explain_auto_backend(device)}",
    ]
    print("\n".join(lines))
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="xlnet-fast", description="Fast XLNet: fused relative attention, "
                                     "HF-compatible model, permutation-LM pretraining.")
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("info", help="versions, device, and which attention backend 'auto' picks and why")
    p.set_defaults(func=_info)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
