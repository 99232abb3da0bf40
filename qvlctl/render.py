"""Human-readable output for qvlctl, and what reaches a terminal.

Model output and every string the daemon sends are untrusted: an ESC or OSC sequence in
generated text could retitle the terminal, rewrite what is on screen, or (OSC 52) set
the clipboard. So when the stream is a terminal (``is_terminal``), control characters
are shown instead of obeyed: every C0 control except newline and tab, DEL, and every C1
control becomes the Python-style escape ``\\xNN`` (ESC shows as ``\\x1b``, CSI U+009B
as ``\\x9b``); carriage return is escaped too, since it lets text overwrite what
precedes it. ``\\xNN`` was chosen over control pictures (␛) or caret notation (^[)
because it is plain ASCII, names the exact code point and reads the same in every font
(it is for display only: backslashes in the text itself are left alone). Everything
else, including all non-ASCII text, passes unchanged.

When the stream is not a terminal (a pipe or a file), text is written exactly as the
daemon sent it, so scripts get the real answer. JSON output is exact JSON either way
(``json_text``).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import IO, Any

# C0 without \t and \n, DEL, C1: the code points a terminal may act on.
CONTROLS = [*(c for c in range(0x20) if c not in (0x09, 0x0A)), 0x7F, *range(0x80, 0xA0)]
_VISIBLE = {c: f"\\x{c:02x}" for c in CONTROLS}
# JSON's own escaping (json.dumps with ensure_ascii=False) leaves DEL and C1 raw.
_JSON_UNSAFE = {c: f"\\u{c:04x}" for c in range(0x7F, 0xA0)}


def escape_controls(text: str) -> str:
    """``text`` with control characters shown as ``\\xNN`` (newline and tab kept)."""
    return text.translate(_VISIBLE)


def is_terminal(stream: IO[str]) -> bool:
    """Whether ``stream`` is a terminal (False when it cannot say, e.g. once closed)."""
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError, OSError):  # closed, detached or not a real file
        return False


def _same(text: str) -> str:
    return text


def cleaner(stream: IO[str]) -> Callable[[str], str]:
    """What to pass text through before writing it to ``stream`` (decided once)."""
    return escape_controls if is_terminal(stream) else _same


def json_text(document: Any, indent: int | None = None) -> str:
    """``document`` as exact JSON that is still safe on a terminal.

    Non-ASCII text stays readable (ensure_ascii=False); DEL and C1, which JSON allows
    raw inside strings, are written as \\u escapes, which decode to the same string.
    """
    return json.dumps(document, ensure_ascii=False, indent=indent).translate(_JSON_UNSAFE)


CUT_SHORT = ("the answer was cut short: the daemon stopped or cancelled it "
             "(it may be restarting); try again later")


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


def _samples(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Exposition text -> {(sample name, labels): value} (no dependencies needed)."""
    samples = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        name_labels, _, value = line.rpartition(" ")
        name, _, labels = name_labels.partition("{")
        pairs = tuple(sorted(
            (k, v.strip('"')) for k, _, v in (p.partition("=") for p in
                                               labels.rstrip("}").split('",') if p)))
        try:
            samples[(name, pairs)] = float(value)
        except ValueError:
            continue
    return samples


def metrics_summary(text: str) -> str:
    s = _samples(text)

    def total(name: str, **match: str) -> float:
        return sum(v for (n, labels), v in s.items() if n == name
                   and all(dict(labels).get(k, "").strip('"') == m for k, m in match.items()))

    def mean(name: str) -> str:
        count = total(f"{name}_count")
        return f"{total(f'{name}_sum') / count:.3f} s" if count else "-"

    generated = total("qvld_requests_total", op="generate")
    ok = total("qvld_requests_total", op="generate", outcome="ok")
    return "\n".join([
        f"ready:             {'yes' if total('qvld_ready') == 1 else 'no'}",
        f"generations:       {generated:.0f} ({ok:.0f} ok)",
        f"in flight / queue: {total('qvld_requests_in_flight'):.0f} / "
        f"{total('qvld_queue_depth'):.0f}",
        f"tokens:            {total('qvld_prompt_tokens_total'):.0f} prompt, "
        f"{total('qvld_generated_tokens_total'):.0f} generated",
        f"mean TTFT:         {mean('qvld_time_to_first_token_seconds')}",
        f"mean token gap:    {mean('qvld_inter_token_latency_seconds')}",
        f"image cache:       {total('qvld_image_cache_hits_total'):.0f} hits, "
        f"{total('qvld_image_cache_misses_total'):.0f} misses",
        f"sessions:          {total('qvld_sessions_active'):.0f}",
        f"resident memory:   {total('process_resident_memory_bytes') / 2**20:.0f} MiB",
    ])
