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
import time
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
        f"{generated} generated"
        + (f" ({usage['forced_tokens']} forced)" if usage.get("forced_tokens") else ""),
        f"TTFT {t.get('ttft_s', 0.0):.2f} s",
        f"{rate:.1f} tokens/s",
        f"total {t.get('total_s', 0.0):.2f} s",
        f"finish {result.get('finish_reason', '?')}",
    ]
    if usage.get("cached_tokens"):
        parts.insert(1, f"{usage['cached_tokens']} cached")
    return "[" + ", ".join(parts) + "]"


def human_duration(seconds: float | None) -> str:
    """0.25 -> "0.25 s", 75 -> "1 min 15 s", 9000 -> "2 h 30 min", 200000 -> "2 d 7 h"."""
    if seconds is None:
        return "-"
    if seconds < 10:
        return f"{seconds:.2f} s" if seconds < 1 else f"{seconds:.1f} s"
    whole = int(seconds)
    days, rest = divmod(whole, 86400)
    hours, rest = divmod(rest, 3600)
    minutes, secs = divmod(rest, 60)
    if days:
        return f"{days} d {hours} h"
    if hours:
        return f"{hours} h {minutes} min"
    return f"{minutes} min {secs} s" if minutes else f"{secs} s"


def human_bytes(count: float | None) -> str:
    """253440 -> "248 KiB" (binary units, as memory and caches are sized)."""
    if count is None:
        return "-"
    value = float(count)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(value) < 1024 or unit == "GiB":
            return f"{value:.0f} {unit}" if unit == "B" or value >= 10 else f"{value:.1f} {unit}"
        value /= 1024
    raise AssertionError("unreachable")


def clock_time(epoch_s: float, now: float | None = None) -> str:
    """An event's wall time: the time of day if it was today, else the date too."""
    at = time.localtime(epoch_s)
    today = time.localtime(now if now is not None else time.time())
    if at[:3] == today[:3]:
        return time.strftime("%H:%M:%S", at)
    return time.strftime("%Y-%m-%d %H:%M:%S", at)


def _yes_no(value: Any) -> str:
    return "yes" if value else "no"


def _count(value: Any, noun: str, plural: str | None = None) -> str:
    return f"{value} {noun if value == 1 else plural or noun + 's'}"


def table(rows: list[dict[str, Any]], columns: list[str],
          formats: dict[str, Callable[[Any], str]] | None = None,
          headers: dict[str, str] | None = None) -> str:
    """Rows as an aligned text table: a header, then one line per row; ``formats`` turns
    a column's values into text (default ``str``), ``headers`` renames columns."""
    if not rows:
        return "(none)"
    formats = formats or {}
    headers = headers or {}
    cells = [[formats.get(c, str)(row.get(c)) if c in row else "-" for c in columns]
             for row in rows]
    titles = [headers.get(c, c).upper() for c in columns]
    widths = [max(len(t), *(len(r[i]) for r in cells)) for i, t in enumerate(titles)]
    lines = ["  ".join(t.ljust(w) for t, w in zip(titles, widths, strict=True))]
    lines += ["  ".join(v.ljust(w) for v, w in zip(r, widths, strict=True)) for r in cells]
    return "\n".join(line.rstrip() for line in lines)


def _who(rows: list[dict[str, Any]], columns: list[str]) -> list[str]:
    """``columns`` with the user's name for the uid where the daemon sends one (an HTTP
    user's key name, ``uid:N`` for others; daemons before it send the uid only)."""
    if any("user" in row for row in rows):
        return ["user" if c == "uid" else c for c in columns]
    return columns


SESSION_COLUMNS = ["id", "uid", "turns", "tokens", "images", "bytes", "age_s", "idle_s", "busy"]


def sessions_table(sessions: list[dict[str, Any]]) -> str:
    return table(sessions, _who(sessions, SESSION_COLUMNS),
                 formats={"bytes": human_bytes, "age_s": human_duration,
                          "idle_s": human_duration, "busy": _yes_no},
                 headers={"bytes": "size", "age_s": "age", "idle_s": "idle"})


def _fields(pairs: list[tuple[str, str]]) -> list[str]:
    width = max(len(label) for label, _ in pairs)
    return [f"{label:<{width}}  {value}" for label, value in pairs]


def _model_line(model: dict[str, Any]) -> list[tuple[str, str]]:
    runtime = model.get("runtime") or {}
    parts = [runtime.get("name", "?") + (f" {runtime['version']}" if "version" in runtime
                                         else "")]
    if "INFERENCE_PRECISION_HINT" in runtime:
        parts.append(f"{runtime['INFERENCE_PRECISION_HINT']} compute")
    if "WEIGHTS" in runtime:
        parts.append(f"{runtime['WEIGHTS']} weights")
    lines = [("model", f"{model.get('name', '?')} ({', '.join(parts)})")]
    details = []
    if model.get("load_s") is not None:
        details.append(f"loaded in {human_duration(model['load_s'])}")
    if "max_context_tokens" in model:
        details.append(f"{model['max_context_tokens']}-token context")
    if "infer_requests" in model:
        details.append(_count(model["infer_requests"], "infer request"))
    if details:
        lines.append(("", ", ".join(details)))
    if model.get("path"):
        lines.append(("", f"path {model['path']}"))
    return lines


def _cache_lines(caches: dict[str, Any]) -> list[tuple[str, str]]:
    lines = []
    image = caches.get("image")
    if image:
        ratio = image.get("hit_ratio")
        lines.append(("images", f"{_count(image['entries'], 'entry', 'entries')}, "
                      f"{human_bytes(image['bytes'])} of {human_bytes(image['capacity_bytes'])}; "
                      f"{_count(image['hits'], 'hit')}, {_count(image['misses'], 'miss', 'misses')}"
                      + (f" ({ratio:.0%})" if ratio is not None else "")))
    if "kv_cached_tokens" in caches:
        lines.append(("prefix KV", f"{caches['kv_cached_tokens']} tokens kept "
                      f"(budget {caches.get('kv_budget_tokens', '?')})"))
    if "sessions" in caches:
        lines.append(("sessions", f"{caches['sessions']}, "
                      f"{human_bytes(caches.get('sessions_bytes'))}; their images "
                      f"{human_bytes(caches.get('session_image_bytes'))} of "
                      f"{human_bytes(caches.get('session_image_budget_bytes'))}"))
    grammars = caches.get("grammars")
    if grammars:
        lines.append(("grammars", f"{grammars['cached']} cached of {grammars['cache_size']}, "
                      f"{grammars['compiling']} compiling, {grammars['compiles']} compiled"))
    return lines


def status_text(status: dict[str, Any], now: float | None = None) -> str:
    """The status op's document for people: a summary, aligned fields, then tables of
    what runs now and the last errors (``--json`` is the whole document, for scripts)."""
    head = [("qvld", f"{status.get('version', '?')}, pid {status.get('pid', '?')}, "
             f"{status.get('state', '?')}, up {human_duration(status.get('uptime_s'))}")]
    requests = f"{status.get('requests_total', 0)} served"
    if "requests_in_flight" in status:
        requests += f", {status['requests_in_flight']} in flight"
    head.append(("requests", requests))
    model = status.get("model")
    head += _model_line(model) if isinstance(model, dict) else [("model", "not loaded")]
    pinned = status.get("pinned_cpus")
    if "threads" in status:
        head.append(("threads", f"{status['threads']}, pinned to "
                     + (",".join(map(str, pinned)) if pinned else "no CPUs in particular")))
    queue = status.get("queue")
    if queue:
        head.append(("queue", f"{queue.get('running', 0)} running, "
                     f"{queue.get('waiting', 0)} waiting, "
                     f"{queue.get('preemptions', 0)} preempted so far"))
    batch = status.get("batch")
    if batch:
        blocks = batch.get("kv_blocks") or {}
        text = (f"{'continuous' if batch.get('continuous_batching') else 'one at a time'}, "
                f"{batch.get('decoding', 0)} decoding, {batch.get('prefilling', 0)} prefilling, "
                f"peak {batch.get('peak_sequences', 0)}, {batch.get('steps', 0)} steps"
                + (f", prompts on {batch['prompt_runtime']}" if batch.get("prompt_runtime")
                   else ""))
        head.append(("batch", text))
        if blocks:
            held = blocks.get("held", 0)
            head.append(("KV blocks", f"{held} of {blocks['blocks']} held by sequences "
                         f"({held / max(blocks['blocks'], 1):.0%}), "
                         f"{blocks.get('kept', 0)} kept for sessions, "
                         f"{blocks.get('cached', 0)} cached, {blocks.get('free', 0)} free; "
                         f"{blocks['block_size']} tokens each"))
    head += _cache_lines(status.get("caches") or {})
    preflight = status.get("preflight")
    if preflight:
        counts: dict[str, list[str]] = {}
        for check, result in preflight.items():
            counts.setdefault(result, []).append(check)
        head.append(("preflight", "; ".join(
            f"{len(names)} {result}" + ("" if result in ("ok", "n/a") else
                                        f" ({', '.join(names)})")
            for result, names in counts.items()) + " (qvlctl preflight says more)"))
    parts = ["\n".join(_fields(head))]
    if status.get("generations"):
        parts.append("generations:\n" + table(
            status["generations"], _who(status["generations"], ["uid", "stage", "age_s"]),
            formats={"age_s": human_duration}, headers={"age_s": "age"}))
    if batch and batch.get("sequences"):
        parts.append("sequences:\n" + table(
            batch["sequences"], _who(batch["sequences"], [
                "uid", "state", "runtime", "prompt_tokens", "cached_tokens", "fed_tokens",
                "generated_tokens"]),
            headers={"prompt_tokens": "prompt", "cached_tokens": "cached",
                     "fed_tokens": "fed", "generated_tokens": "generated"}))
    if status.get("last_errors"):
        parts.append("last errors:\n" + table(
            status["last_errors"], _who(status["last_errors"], ["at", "op", "code", "uid"]),
            formats={"at": lambda at: clock_time(at, now)}, headers={"at": "when"}))
    return "\n\n".join(parts)


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
