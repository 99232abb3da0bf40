#!/usr/bin/env bash
# Build the container image and check that it serves: /health, and one chat completion
# about examples/receipt.png on the bundled tiny model with an API key.
#   tools/container-check.sh [--ca FILE]      (--ca: a TLS-intercepting proxy's CA for pip)
# Needs podman (Debian's) and the base image docker.io/library/debian:12-slim in local
# storage (pulled, or where no registry is reachable: debootstrap --variant=minbase
# bookworm DIR && tar -C DIR -c . | podman import - docker.io/library/debian:12-slim).
# Where podman's OCI runtime cannot start containers (a container without cgroup or
# rlimit rights), the image's own file system, user, config and entrypoint are run in
# fresh mount and PID namespaces instead (chroot), and the script says so.
set -euo pipefail
cd "$(dirname "$0")/.."
ca=""
[ "${1:-}" = --ca ] && ca=$2
podman=(podman --storage-driver vfs --cgroup-manager cgroupfs)
build=("${podman[@]}" build --format docker --isolation chroot --network host
       -f packaging/container/Containerfile -t localhost/qvld:check)
[ -n "$ca" ] && build+=(--build-arg PIP_CERT=/run/host-ca.crt -v "$ca:/run/host-ca.crt:ro")
"${build[@]}" . >/dev/null
echo "built localhost/qvld:check ($("${podman[@]}" image inspect -f '{{.Size}}' \
  localhost/qvld:check) bytes)"
work=$(mktemp -d /var/tmp/qvld-check-XXXX)
.venv/bin/qvld api-key check --keys-file "$work/api-keys" 2>/dev/null > "$work/key"
chmod 0644 "$work/api-keys"
model=$PWD/tests/fixtures/models/tiny
pid=""
cleanup() {
  "${podman[@]}" rm -f qvld-check >/dev/null 2>&1 || true
  [ -n "$pid" ] && kill "$pid" 2>/dev/null || true
  "${podman[@]}" image unmount localhost/qvld:check >/dev/null 2>&1 || true
  rm -rf "$work"
}
trap cleanup EXIT
if "${podman[@]}" run -d --name qvld-check --network host \
     -v "$model:/models/qwen3-vl-2b:ro" -v "$work/api-keys:/etc/qvld/keys/api-keys:ro" \
     localhost/qvld:check >/dev/null 2>"$work/run.err"; then
  echo "running with podman run"
else
  echo "podman run cannot start containers here ($(tail -1 "$work/run.err")); running" \
       "the image's root file system under chroot as uid 10001 instead"
  rootfs=$("${podman[@]}" image mount localhost/qvld:check)
  unshare --mount --pid --fork --propagation private bash -c '
    set -e
    R=$1/root
    mkdir -p $1/upper $1/work $R
    mount -t overlay overlay -o lowerdir=$2,upperdir=$1/upper,workdir=$1/work $R
    mount -t proc proc $R/proc
    mount --rbind /dev $R/dev
    for d in run/qvld var/cache/qvld; do
      mount -t tmpfs -o uid=10001,gid=10001,mode=0750 tmpfs $R/$d
    done
    mount -t tmpfs tmpfs $R/tmp
    mkdir -p $R/models/qwen3-vl-2b $R/etc/qvld/keys
    touch $R/etc/qvld/keys/api-keys
    mount --bind -o ro $3 $R/models/qwen3-vl-2b
    mount --bind -o ro $1/api-keys $R/etc/qvld/keys/api-keys
    exec chroot --userspec=10001:10001 $R /usr/bin/env -i PATH=/usr/bin:/bin \
      /opt/venvs/qvld/bin/qvld --config /etc/qvld/qvld.yaml' _ "$work" "$rootfs" "$model" \
      >"$work/qvld.log" 2>&1 &
  pid=$!
fi
for _ in $(seq 120); do
  curl -fsS http://127.0.0.1:8090/health >/dev/null 2>&1 && break
  sleep 1
done
echo "/health: $(curl -sS http://127.0.0.1:8090/health)"
image=$(base64 -w0 examples/receipt.png)
printf '{"model": "qwen3-vl-2b", "max_tokens": 8, "messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "data:image/png;base64,%s"}}, {"type": "text", "text": "What is the total?"}]}]}' \
  "$image" > "$work/request.json"
code=$(curl -sS -o "$work/answer.json" -w '%{http_code}' -H "Authorization: Bearer $(cat "$work/key")" \
  -H 'Content-Type: application/json' --data @"$work/request.json" \
  http://127.0.0.1:8090/v1/chat/completions)
echo "chat completion: HTTP $code, $(python3 -c 'import json,sys; d=json.load(open(sys.argv[1])); print(d["usage"]["completion_tokens"], "tokens,", d["choices"][0]["finish_reason"])' "$work/answer.json")"
[ "$code" = 200 ]
