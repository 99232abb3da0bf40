#!/usr/bin/env bash
# The main job in one command: start qvld on a model, ask a question about an image,
# print the streamed answer and timings, stop the daemon.
#   QVLD_MODEL=DIR QVLD_IMAGE=FILE QVLD_QUESTION=TEXT tools/demo.sh
set -euo pipefail
cd "$(dirname "$0")/.."
model=${QVLD_MODEL:-tests/fixtures/models/tiny}
image=${QVLD_IMAGE:-examples/receipt.png}
question=${QVLD_QUESTION:-What is the total on this receipt?}
bin=.venv/bin
workdir=$(mktemp -d)
socket=$workdir/qvld.sock

if [ "$model" = tests/fixtures/models/tiny ]; then
  echo "note: the bundled model has random weights; its answers are noise." \
       "Set QVLD_MODEL to a converted Qwen3-VL-2B-Instruct for real answers." >&2
fi
"$bin/qvld" --config /dev/null --model "$model" --socket "$socket" \
  --set metrics.listen= --set tuning.apply=false 2> "$workdir/qvld.log" &
pid=$!
cleanup() {
  kill -TERM "$pid" 2>/dev/null || true
  wait "$pid" 2>/dev/null || true
  rm -rf "$workdir"
}
trap cleanup EXIT

for _ in $(seq 1 600); do
  if "$bin/qvlctl" --socket "$socket" health >/dev/null 2>&1; then break; fi
  if ! kill -0 "$pid" 2>/dev/null; then cat "$workdir/qvld.log" >&2; exit 1; fi
  sleep 0.2
done
"$bin/qvlctl" --socket "$socket" health >/dev/null || { cat "$workdir/qvld.log" >&2; exit 1; }
echo "qvlctl ask $image \"$question\"" >&2
"$bin/qvlctl" --socket "$socket" ask "$image" "$question" --max-tokens 48
