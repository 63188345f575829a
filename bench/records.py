"""Shared by the benchmark scripts: the environment fields of a record, and appending records."""

from __future__ import annotations

import datetime
import json
from pathlib import Path

import torch


def environment() -> dict:
    """``device``, ``torch``, ``triton``, ``date`` for a result record."""
    try:
        import triton

        triton_version = triton.__version__
    except ImportError:
        triton_version = None
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    return {"device": device, "torch": torch.__version__, "triton": triton_version,
            "date": datetime.date.today().isoformat()}


def append_records(path: Path, records: list[dict]) -> None:
    """Append ``records`` to the JSON list in ``path`` (created if missing)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    old = json.loads(path.read_text()) if path.exists() else []
    path.write_text(json.dumps(old + records, indent=1) + "\n")
    print(f"appended {len(records)} records to {path}")
