"""Result records in product.md's schema, and where they are written.

A record is one number: {suite, case, impl, metric, value, floor, commit,
date, device, ...}. `floor` is the best a case can do where one applies
(for 'ms': the bytes over the measured bandwidth); extra keys (spread, bytes,
ceiling, error) help a reader but are never required by a consumer.
"""
from __future__ import annotations

import datetime as _dt
import json
import os
import re
import subprocess
from dataclasses import dataclass
from pathlib import Path

import torch

METRICS = ("GB/s", "TFLOP/s", "ms")
REQUIRED_KEYS = ("suite", "case", "impl", "metric", "value", "floor", "commit", "date", "device")


@dataclass(frozen=True)
class RunInfo:
    """What every record of one run shares."""

    commit: str
    date: str
    device: str          # human name: 'cpu' or torch.cuda.get_device_name()
    device_folder: str   # 'cpu', 'h200', ...
    threads: int = 0     # torch.get_num_threads() when the run started
    loadavg: float = 0.0  # 1-minute load average at the start: >0.5 means the numbers
                          # shared the cores with something else and are suspect

    def stamp(self) -> str:
        """Filesystem-safe form of the date, for file names."""
        return re.sub(r"[^0-9T]", "", self.date.split("+")[0])


def repo_root() -> Path | None:
    """The git checkout this package lives in (editable install), else the cwd's."""
    for start in (Path(__file__).resolve().parent, Path.cwd()):
        try:
            top = subprocess.run(["git", "-C", str(start), "rev-parse", "--show-toplevel"],
                                 capture_output=True, text=True, timeout=10)
        except (OSError, subprocess.SubprocessError):
            return None
        if top.returncode == 0:
            return Path(top.stdout.strip())
    return None


def git_commit(root: Path | None = None) -> str:
    """HEAD's hash, with '-dirty' when tracked files differ from it; the
    environment's OPFUSE_COMMIT where the tree has no git (the GPU machine)."""
    import os
    if os.environ.get("OPFUSE_COMMIT"):
        return os.environ["OPFUSE_COMMIT"]
    root = root or repo_root()
    if root is None:
        return "unknown"
    head = subprocess.run(["git", "-C", str(root), "rev-parse", "HEAD"],
                          capture_output=True, text=True)
    if head.returncode != 0:
        return "unknown"
    dirty = subprocess.run(["git", "-C", str(root), "status", "--porcelain",
                            "--untracked-files=no"], capture_output=True, text=True)
    return head.stdout.strip() + ("-dirty" if dirty.stdout.strip() else "")


def device_names(device: torch.device) -> tuple[str, str]:
    """('NVIDIA H200', 'h200') on the GPU, ('cpu', 'cpu') otherwise."""
    if device.type != "cuda":
        return "cpu", "cpu"
    name = torch.cuda.get_device_name(device)
    if "H200" in name.upper():
        return name, "h200"
    return name, re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-")


def run_info(device: torch.device) -> RunInfo:
    name, folder = device_names(device)
    now = _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")
    return RunInfo(commit=git_commit(), date=now, device=name, device_folder=folder,
                   threads=torch.get_num_threads(), loadavg=round(os.getloadavg()[0], 2))


def make_record(info: RunInfo, *, suite: str, case: str, impl: str, metric: str,
                value: float | None, floor: float | None = None, **extra) -> dict:
    if metric not in METRICS:
        raise ValueError(f"metric {metric!r} not in {METRICS}")
    record = {"suite": suite, "case": case, "impl": impl, "metric": metric,
              "value": value, "floor": floor, "commit": info.commit,
              "date": info.date, "device": info.device, "threads": info.threads,
              "loadavg": info.loadavg}
    record.update(extra)
    return record


def validate_record(record: dict) -> None:
    """Raise ValueError if a record breaks the schema (used by tests and before writing)."""
    missing = [k for k in REQUIRED_KEYS if k not in record]
    if missing:
        raise ValueError(f"record lacks {missing}: {record}")
    if record["metric"] not in METRICS:
        raise ValueError(f"bad metric {record['metric']!r}")
    if record["value"] is None and not record.get("error"):
        raise ValueError(f"a record without a value must say why (error): {record}")
    for key in ("value", "floor"):
        if record[key] is not None and not isinstance(record[key], (int, float)):
            raise ValueError(f"{key} must be a number or null: {record}")


def default_results_dir(info: RunInfo) -> Path:
    root = repo_root() or Path.cwd()
    return root / "bench" / "results" / info.device_folder


def write_records(records: list[dict], info: RunInfo, suite: str, out_dir: Path) -> Path:
    for r in records:
        validate_record(r)
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / f"{suite}-{info.stamp()}.json"
    path.write_text(json.dumps(records, indent=1) + "\n")
    return path
