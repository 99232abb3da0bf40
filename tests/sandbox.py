"""A throw-away copy of this machine to install into: an overlay of / in a private mount
namespace, chrooted. Writes land in a tmpfs that vanishes with the namespace; the host's
files, /tmp, units and cgroups are never touched."""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SETUP = """
set -e
mount -t tmpfs -o size=6g tmpfs "$SANDBOX"
mkdir -p "$SANDBOX/upper" "$SANDBOX/work" "$SANDBOX/root"
mount -t overlay overlay -o lowerdir=/,upperdir="$SANDBOX/upper",workdir="$SANDBOX/work" \
    "$SANDBOX/root"
mount -t proc proc "$SANDBOX/root/proc"
mount --rbind /dev "$SANDBOX/root/dev"
mount -t sysfs sysfs "$SANDBOX/root/sys"
mount -t tmpfs tmpfs "$SANDBOX/root/tmp"
mount -t tmpfs tmpfs "$SANDBOX/root/run"
# The checkout stays reachable at its own path, even when it lives under /tmp.
# (an overlay of it: the sandbox's writes, such as pip's in-tree build, stay inside)
mkdir -p "$SANDBOX/repo-upper" "$SANDBOX/repo-work" "$SANDBOX/root$REPO"
mount -t overlay overlay \
    -o lowerdir="$REPO",upperdir="$SANDBOX/repo-upper",workdir="$SANDBOX/repo-work" \
    "$SANDBOX/root$REPO"
exec chroot "$SANDBOX/root" /bin/bash -c "$SCRIPT"
"""


def available() -> bool:
    return os.geteuid() == 0 and shutil.which("unshare") is not None


def run_in_sandbox(script: str, timeout: float = 900) -> subprocess.CompletedProcess[str]:
    """Run ``script`` (bash) as root inside a fresh overlay of /; returns its output."""
    mountpoint = tempfile.mkdtemp(prefix="qvld-sandbox-")
    try:
        env = {"SANDBOX": mountpoint, "SCRIPT": script, "REPO": str(REPO),
               "PATH": os.environ.get("PATH", ""),
               "HOME": "/root", "LANG": "C.UTF-8"}
        return subprocess.run(["unshare", "--mount", "--propagation", "private", "--",
                               "/bin/bash", "-c", SETUP], env=env, capture_output=True,
                              text=True, timeout=timeout, check=False)
    finally:
        Path(mountpoint).rmdir()
