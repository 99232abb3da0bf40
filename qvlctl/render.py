"""Human-readable output for qvlctl (JSON output is produced by cli.py directly)."""

from __future__ import annotations

from typing import Any


def timings_line(result: dict[str, Any]) -> str:
    usage = result.get("usage", {})
    t = result.get("timings", {})
    generated = usage.get("completion_tokens", 0)
    decode = t.get("decode_s", 0.0)
    rate = (generated - 1) / decode if generated > 1 and decode > 0 else 0.0
    parts = [
        f"prompt {usage.get('prompt_tokens', 0)} tokens"
        + (f" ({usage['image_tokens']} image)" if usage.get("image_tokens") else ""),
        f"{generated} generated",
        f"TTFT {t.get('ttft_s', 0.0):.2f} s",
        f"{rate:.1f} tokens/s",
        f"total {t.get('total_s', 0.0):.2f} s",
        f"finish {result.get('finish_reason', '?')}",
    ]
    if usage.get("cached_tokens"):
        parts.insert(1, f"{usage['cached_tokens']} cached")
    return "[" + ", ".join(parts) + "]"


def key_values(data: dict[str, Any], indent: int = 0) -> str:
    """Nested maps as aligned `key: value` lines."""
    width = max((len(str(k)) for k in data), default=0)
    lines = []
    for key, value in data.items():
        pad = " " * indent
        if isinstance(value, dict) and value:
            lines.append(f"{pad}{key}:")
            lines.append(key_values(value, indent + 2))
        else:
            shown = "-" if value is None else (", ".join(map(str, value))
                                               if isinstance(value, list) else value)
            lines.append(f"{pad}{str(key) + ':':<{width + 1}} {shown}")
    return "\n".join(lines)


def table(rows: list[dict[str, Any]], columns: list[str]) -> str:
    """Rows as an aligned text table (a header, then one line per row)."""
    if not rows:
        return "(none)"
    cells = [[str(row.get(c, "")) for c in columns] for row in rows]
    widths = [max(len(c), *(len(r[i]) for r in cells)) for i, c in enumerate(columns)]
    lines = ["  ".join(c.upper().ljust(w) for c, w in zip(columns, widths, strict=True))]
    lines += ["  ".join(v.ljust(w) for v, w in zip(r, widths, strict=True)) for r in cells]
    return "\n".join(line.rstrip() for line in lines)
