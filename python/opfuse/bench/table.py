"""Plain-text tables (no dependency beyond the standard library)."""
from __future__ import annotations

from typing import Sequence


def fmt(value, digits: int = 3) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        if value == 0 or abs(value) >= 100:
            return f"{value:.1f}"
        return f"{value:.{digits}g}"
    return str(value)


def format_table(headers: Sequence[str], rows: Sequence[Sequence]) -> str:
    cells = [[fmt(c) for c in row] for row in rows]
    widths = [max(len(h), *(len(r[i]) for r in cells)) if cells else len(h)
              for i, h in enumerate(headers)]
    line = lambda items: "  ".join(s.ljust(w) for s, w in zip(items, widths)).rstrip()
    out = [line(headers), line(["-" * w for w in widths])]
    out += [line(r) for r in cells]
    return "\n".join(out)
