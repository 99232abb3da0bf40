"""A user's short question beside another user's long clips being prepared, over HTTP
with two API keys, on the tiny model: does the clip decoding make the other user wait?

    python bench/video_beside.py [--seconds 40] [--size 640x360] [--clips 3]

Alice sends ``--clips`` copies of a ``--seconds`` clip at once; right after, bob asks
"Hi" three times (the output says whether alice was still waiting when bob was done);
bob alone beforehand for comparison.
"""

from __future__ import annotations

import argparse
import base64
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from qvld.http.keys import hash_key  # noqa: E402
from tests.engine.test_video import make_clip  # noqa: E402
from tests.test_http import HttpDaemon  # noqa: E402

ALICE, BOB = "alice-key-0123456789", "bob-key-0123456789abc"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=40.0)
    parser.add_argument("--size", default="640x360")
    parser.add_argument("--clips", type=int, default=3)
    args = parser.parse_args(argv)
    width, height = (int(v) for v in args.size.split("x"))
    clip = make_clip(args.seconds, 30, width, height)
    url = "data:video/mp4;base64," + base64.b64encode(clip).decode()
    with tempfile.TemporaryDirectory() as work:
        keys = Path(work) / "keys"
        keys.write_text(f"alice:{hash_key(ALICE)}\nbob:{hash_key(BOB)}\n")
        keys.chmod(0o600)
        daemon = HttpDaemon(Path(work), args=["--set", f"http.api_keys_file={keys}"]).start()
        try:
            def bob() -> float:
                t0 = time.perf_counter()
                daemon.openai(BOB).chat.completions.create(  # type: ignore[call-overload]
                    model="tiny", max_tokens=4, messages=[{"role": "user", "content": "Hi"}])
                return time.perf_counter() - t0

            alone = [bob() for _ in range(3)]
            done: list[float] = []

            def alice(i: int) -> None:
                t0 = time.perf_counter()
                daemon.openai(ALICE).chat.completions.create(  # type: ignore[call-overload]
                    model="tiny", max_tokens=4, messages=[{"role": "user", "content": [
                        {"type": "video_url", "video_url": {"url": url}},
                        {"type": "text", "text": f"What happens? ({i})"}]}])
                done.append(time.perf_counter() - t0)

            threads = [threading.Thread(target=alice, args=(i,)) for i in range(args.clips)]
            for thread in threads:
                thread.start()
            beside = [bob() for _ in range(3)]
            busy = len(done) < args.clips  # alice still waiting when bob was answered
            for thread in threads:
                thread.join()
        finally:
            daemon.stop()
    print(f"{args.clips} clips of {args.seconds:g} s {width}x{height} ({len(clip)} bytes): "
          f"alice's answers in {', '.join(f'{t:.2f}' for t in sorted(done))} s")
    print(f"bob alone {', '.join(f'{t:.3f}' for t in alone)} s; beside alice's clips "
          f"{', '.join(f'{t:.3f}' for t in beside)} s (alice still waiting: {busy})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
