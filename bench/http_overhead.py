"""What the HTTP front costs against the Unix socket: the same request, the same daemon.

    python bench/http_overhead.py MODEL [--repeats 5] [--tokens 64] [--size 448] [--json OUT]

One qvld serves both front doors (``http.listen`` on loopback). Every repeat asks the
same question both ways, streamed, greedy, eos ignored, in alternating order (so a noisy
machine hits both alike), in two scenes:

- fresh: a new image each request (image encode + full prefill: the TTFT users see);
- warm: the same image and question again (image and prefix caches: the small TTFT,
  where a fixed overhead shows most).

The HTTP client is a plain ``http.client`` reading Server-Sent Event lines (the daemon's
cost, not a client library's); the socket client is qvlctl's. Per request it records the
client-side TTFT (send to first token), the daemon's own ``timings.ttft_s`` (the same
code on both paths), and the gaps between streamed tokens. Reported:

- TTFT medians per path and scene, and the front-door overhead: median over repeats of
  (client TTFT - daemon TTFT) for HTTP minus the same for the socket;
- what HTTP adds per token: median of (client ms/token - daemon ms/token) for HTTP minus
  the same for the socket, also as a share of decode time; and the decode ms/token
  medians per path with their ratio (moved by the machine's noise more than by either
  front door).
"""

from __future__ import annotations

import argparse
import http.client
import json
import shutil
import socket
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from scenes import scene_image  # noqa: E402
from systems import _start_daemon, png, user  # noqa: E402

QUESTION = "Describe this image."


def data_url(image: bytes) -> str:
    import base64

    return "data:image/png;base64," + base64.b64encode(image).decode()


def ask_socket(sock: Path, image: bytes, tokens: int) -> dict[str, Any]:
    from qvlctl.client import Client

    stamps: list[float] = []
    with Client(sock, timeout=600) as client:
        client.health()  # the line is open before the clock starts, as on HTTP below
        t0 = time.perf_counter()
        reply = client.generate(
            {"messages": user(image, QUESTION), "max_tokens": tokens, "temperature": 0,
             "ignore_eos": True, "stream": True},
            on_token=lambda text, ids: stamps.append(time.perf_counter()))
    return {"start": t0, "stamps": stamps, "server": reply["timings"],
            "tokens": reply["usage"]["completion_tokens"]}


def ask_http(port: int, image: bytes, tokens: int) -> dict[str, Any]:
    body = json.dumps({"model": "qvld", "max_tokens": tokens, "temperature": 0,
                       "ignore_eos": True, "stream": True,
                       "stream_options": {"include_usage": True},
                       "messages": [{"role": "user", "content": [
                           {"type": "image_url", "image_url": {"url": data_url(image)}},
                           {"type": "text", "text": QUESTION}]}]}).encode()
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=600)
    conn.connect()
    stamps: list[float] = []
    timings: dict[str, Any] = {}
    tokens = 0
    try:
        t0 = time.perf_counter()
        conn.request("POST", "/v1/chat/completions", body,
                     {"Content-Type": "application/json"})
        response = conn.getresponse()
        assert response.status == 200, response.read()
        # The raw lines of the chunked body: event lines and chunk sizes (skipped).
        while line := response.fp.readline():
            if line.startswith(b"data: [DONE]"):
                break
            if not line.startswith(b"data: "):
                continue
            now = time.perf_counter()
            event = json.loads(line[6:])
            if event["choices"] and "content" in event["choices"][0]["delta"] and (
                    "role" not in event["choices"][0]["delta"]):
                stamps.append(now)
            if "timings" in event:
                timings = event["timings"]
                tokens = event["usage"]["completion_tokens"]
    finally:
        conn.close()
    return {"start": t0, "stamps": stamps, "server": timings, "tokens": tokens}


def measures(run: dict[str, Any]) -> dict[str, float]:
    """Client-side TTFT and decode ms/token, and what the front door adds to each: the
    client's figure minus the daemon's own for the same request (the engine's speed,
    which a noisy machine moves by several per cent between requests, cancels out)."""
    stamps, server = run["stamps"], run["server"]
    gaps = max(run["tokens"] - 1, 1)  # first token to last, as the daemon times decode
    ttft = stamps[0] - run["start"]
    span = stamps[-1] - stamps[0]
    return {"ttft_s": ttft, "front_s": ttft - server["ttft_s"],
            "ms_per_token": 1000 * span / gaps,
            "front_ms_per_token": 1000 * (span - server["decode_s"]) / gaps,
            "events": len(stamps)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("model", type=Path)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--size", type=int, default=448)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)

    workdir = Path(tempfile.mkdtemp(prefix="qvld-http-bench-"))
    with socket.socket() as probe:  # a port free on loopback now
        probe.bind(("127.0.0.1", 0))
        port = int(probe.getsockname()[1])
    cache = Path.home() / ".cache" / "qvld-bench" / "compiled"
    proc, ready_s = _start_daemon(args.model, workdir, cache,
                                  ("--set", f"http.listen=127.0.0.1:{port}"))
    sock = workdir / "qvld.sock"
    results: dict[str, dict[str, list[dict[str, float]]]] = {
        scene: {"socket": [], "http": []} for scene in ("fresh", "warm")}
    try:
        print(f"qvld ready in {ready_s:.1f} s; {args.repeats} repeats, {args.tokens} tokens, "
              f"{args.size}x{args.size}", flush=True)
        warm_image = png(scene_image(args.size, 999))
        for path in ("socket", "http"):  # warm-up, and each user's caches for `warm`
            for image in (png(scene_image(args.size, 998)), warm_image):
                (ask_socket(sock, image, 4) if path == "socket"
                 else ask_http(port, image, 4))
        for r in range(args.repeats):
            order = ("socket", "http") if r % 2 == 0 else ("http", "socket")
            for scene in ("fresh", "warm"):
                for n, path in enumerate(order):
                    image = png(scene_image(args.size, 10 * r + n)) if scene == "fresh" \
                        else warm_image
                    run = ask_socket(sock, image, args.tokens) if path == "socket" \
                        else ask_http(port, image, args.tokens)
                    m = measures(run)
                    results[scene][path].append(m)
                    print(f"repeat {r} {scene:5} {path:6} TTFT {m['ttft_s'] * 1000:8.1f} ms "
                          f"(front {m['front_s'] * 1000:6.2f} ms)  decode "
                          f"{m['ms_per_token']:6.1f} ms/token  {m['events']} events",
                          flush=True)
    finally:
        proc.terminate()
        proc.wait(60)
        shutil.rmtree(workdir, ignore_errors=True)

    summary: dict[str, Any] = {}
    print("\nscene  path    TTFT median  front median  decode ms/token")
    for scene, paths in results.items():
        for path, runs in paths.items():
            summary[f"{scene}_{path}"] = {
                key: statistics.median(m[key] for m in runs)
                for key in ("ttft_s", "front_s", "ms_per_token", "front_ms_per_token")}
            s = summary[f"{scene}_{path}"]
            print(f"{scene:5}  {path:6} {s['ttft_s'] * 1000:9.1f} ms {s['front_s'] * 1000:10.2f} ms"
                  f" {s['ms_per_token']:12.2f}")
        http_s, socket_s = summary[f"{scene}_http"], summary[f"{scene}_socket"]
        summary[f"{scene}_http_minus_socket_front_ms"] = 1000 * (
            http_s["front_s"] - socket_s["front_s"])
        summary[f"{scene}_decode_ratio"] = http_s["ms_per_token"] / socket_s["ms_per_token"]
        per_token = http_s["front_ms_per_token"] - socket_s["front_ms_per_token"]
        summary[f"{scene}_http_minus_socket_ms_per_token"] = per_token
        print(f"{scene:5}  HTTP adds {summary[f'{scene}_http_minus_socket_front_ms']:.2f} ms to "
              f"TTFT and {per_token:.3f} ms per token "
              f"({100 * per_token / socket_s['ms_per_token']:.2f} % of decode); decode "
              f"medians HTTP/socket = {summary[f'{scene}_decode_ratio']:.3f}")
    if args.json is not None:
        args.json.write_text(json.dumps({"summary": summary, "runs": results}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
