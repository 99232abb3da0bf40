"""One user's answer beside another user's stream of long prompts (#46 item 8).

Starts the real daemon on MODEL (the bundled tiny model by default), times root's
answer of ``--tokens`` tokens alone, then beside ``--clients`` connections of uid 65534
sending prompts of about 2 000 tokens with ``max_tokens: 1`` back to back, and prints
the medians and their ratio. ``--tree PATH`` runs the daemon from another checkout
(say, the code before a change) with the same clients, for a before/after in one run.

    python bench/prompt_flood.py [--model DIR] [--clients 4] [--rounds 4] [--tree PATH]

Runs as root (the flood is another uid, as the issue measured it).
"""

from __future__ import annotations

import argparse
import os
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from qvlctl.client import Client
from qvld import protocol

ROOT = Path(__file__).resolve().parent.parent
TINY = ROOT / "tests" / "fixtures" / "models" / "tiny"
NOBODY = 65534
# A socket client for uid 65534 (the system python: nothing of the project's is
# readable to it): sends prepared frames one connection at a time, waits for the reply.
FLOOD = r"""
import socket, sys
frames = [bytes.fromhex(line) for line in open(sys.argv[2])]
k = int(sys.argv[3])
while True:
    k = (k + 7) % len(frames)
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(120)
    s.connect(sys.argv[1])
    s.sendall(frames[k])
    buf = b""
    while len(buf) < 4 or len(buf) < 4 + int.from_bytes(buf[:4], "big"):
        chunk = s.recv(65536)
        if not chunk:
            break
        buf += chunk
    s.close()
"""
WORDS = ["alpha", "beta", "gamma", "delta", "epsilon", "zeta", "eta", "theta",
         "iota", "kappa", "lambda", "mu"]


def flood_frames(path: Path, count: int = 300, words: int = 480) -> None:
    rnd = random.Random(0)
    with path.open("w") as f:
        for _ in range(count):
            text = " ".join(rnd.choice(WORDS) for _ in range(words))
            f.write(protocol.pack({"id": 1, "op": "generate", "params": {
                "messages": [{"role": "user", "content": text}], "max_tokens": 1}}).hex())
            f.write("\n")
    path.chmod(0o644)


def start_daemon(work: Path, model: Path, tree: Path) -> tuple[subprocess.Popen[bytes], Path]:
    sock = work / "qvld.sock"
    config = work / "qvld.yaml"
    config.write_text(f"server:\n  allow_uids: [{NOBODY}]\n")
    env = {**os.environ, "PYTHONPATH": str(tree)}
    log = (work / "qvld.log").open("wb")
    proc = subprocess.Popen([sys.executable, "-m", "qvld.cli", "--config", str(config),
                             "--model", str(model), "--socket", str(sock),
                             "--set", "metrics.listen="], stdout=log,
                            stderr=subprocess.STDOUT, env=env, cwd=tree)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"qvld exited:\n{(work / 'qvld.log').read_text()}")
        try:
            with Client(sock, timeout=5) as client:
                if client.health()["ready"]:
                    sock.chmod(0o777)
                    return proc, sock
        except OSError:
            pass
        time.sleep(0.1)
    raise SystemExit("qvld did not get ready")


def answer_s(sock: Path, tokens: int) -> float:
    with Client(sock, timeout=300) as client:
        t0 = time.perf_counter()
        client.generate({"messages": [{"role": "user", "content": "Tell me a story."}],
                         "max_tokens": tokens, "ignore_eos": True, "temperature": 0})
        return time.perf_counter() - t0


def measure(model: Path, tree: Path, clients: int, rounds: int, tokens: int
            ) -> tuple[list[float], list[float]]:
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        work.chmod(0o755)
        frames = work / "frames.txt"
        flood_frames(frames)
        proc, sock = start_daemon(work, model, tree)
        floods: list[subprocess.Popen[bytes]] = []
        try:
            for _ in range(2):
                answer_s(sock, tokens)  # warm
            alone = [answer_s(sock, tokens) for _ in range(rounds)]
            floods = [subprocess.Popen(["/usr/bin/python3", "-c", FLOOD, str(sock),
                                        str(frames), str(k)], user=NOBODY, group=NOBODY,
                                       cwd="/", stderr=subprocess.DEVNULL)
                      for k in range(clients)]
            time.sleep(3)  # the flood under way
            beside = [answer_s(sock, tokens) for _ in range(rounds)]
        finally:
            for flood in floods:
                flood.kill()
                flood.wait()
            proc.send_signal(signal.SIGTERM)
            proc.wait(60)
    return alone, beside


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, default=TINY)
    parser.add_argument("--clients", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--tokens", type=int, default=200)
    parser.add_argument("--tree", type=Path, action="append", default=[],
                        help="another checkout to run the daemon from (repeatable)")
    args = parser.parse_args(argv)
    for tree in [ROOT, *args.tree]:
        alone, beside = measure(args.model, tree.resolve(), args.clients, args.rounds,
                                args.tokens)
        a, b = statistics.median(alone), statistics.median(beside)
        print(f"{tree}: {args.tokens} tokens alone {a:.2f} s, beside {args.clients} "
              f"flooding clients {b:.2f} s: {b / a:.1f}x "
              f"(alone {[round(x, 2) for x in alone]}, beside {[round(x, 2) for x in beside]})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
