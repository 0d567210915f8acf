"""Where a benchmark writes its figures: ``bench/results/<name>.json`` and ``.md``, with commit, date, machine."""

from __future__ import annotations

import datetime
import json
import os
import platform
import subprocess
import sys
from pathlib import Path

import torch

RESULTS = Path(__file__).resolve().parent / "results"


def machine(device: str | None = None) -> str:
    if device != "cpu" and torch.cuda.is_available():
        return f"{torch.cuda.get_device_name()} ({torch.cuda.device_count()} visible)"
    cpu = platform.processor() or platform.machine()
    return f"CPU: {cpu}, {os.cpu_count()} cores, torch threads {torch.get_num_threads()}"


def commit() -> str:
    """``git rev-parse --short HEAD`` (+dirty), or ``$BENCH_COMMIT`` where the tree has no git (a copied checkout)."""
    if os.environ.get("BENCH_COMMIT"):
        return os.environ["BENCH_COMMIT"]
    try:
        out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, timeout=10)
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], capture_output=True, text=True)
        return out.stdout.strip() + ("+dirty" if dirty.stdout.strip() else "") if out.returncode == 0 else "unknown"
    except OSError:
        return "unknown"


def record(
    name: str, module: str, rows: list[dict], columns: list[str], notes: str = "", device: str | None = None
) -> Path:
    """Write the rows as JSON and as a markdown table; returns the markdown path. ``device``: what the figures were
    measured on (``cpu`` for a CPU-only benchmark on a machine with a GPU); default: cuda when one is visible."""
    tag = device or ("cuda" if torch.cuda.is_available() else "cpu")
    meta = {
        "command": " ".join(["python", "-m", module, *sys.argv[1:]]),
        "date": datetime.date.today().isoformat(),
        "commit": commit(),
        "machine": machine(tag),
        "torch": torch.__version__,
    }
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / f"{name}-{tag}.json").write_text(json.dumps({**meta, "rows": rows}, indent=2) + "\n")
    lines = [f"# {name}", "", *(f"- {k}: `{v}`" for k, v in meta.items()), ""]
    if notes:
        lines += [notes, ""]
    lines += ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(_fmt(row.get(c, "")) for c in columns) + " |" for row in rows]
    path = RESULTS / f"{name}-{tag}.md"
    path.write_text("\n".join(lines) + "\n")
    return path


def _fmt(value) -> str:
    if isinstance(value, float):
        return f"{value:,.3g}" if abs(value) < 100 else f"{value:,.0f}"
    return str(value)
