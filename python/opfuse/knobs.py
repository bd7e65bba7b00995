"""Integer knobs read from the environment (OPFUSE_*), with a clear error
naming the variable when its value is not a number."""
from __future__ import annotations

import os


def count_from_env(name: str, default: int, what: str = "a count") -> int:
    """os.environ[name] as a non-negative int (negatives read as 0);
    `default` when unset or empty."""
    raw = os.environ.get(name, "")
    if not raw:
        return default
    try:
        value = int(raw)
    except ValueError:
        raise ValueError(f"{name}={raw!r}: want {what}") from None
    return max(value, 0)
