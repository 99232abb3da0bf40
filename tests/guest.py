"""A real systemd (PID 1 of fresh PID, mount and cgroup namespaces) booted on a
throw-away overlay of this machine, for driving qvld the way an operator does.

Isolation: the overlay's writes go to a tmpfs that lives only in the guest's private
mount namespace; the guest has its own /tmp and /run; its cgroups live in one cgroup2
subtree made for it and removed afterwards. Everything is torn down when the test ends,
and also when it is interrupted (the guest is killed with its PID namespace).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import tempfile
import time
import uuid
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
BOOT = r"""
set -e
R="$SANDBOX/root"
mount -t tmpfs -o size=8g tmpfs "$SANDBOX"
mkdir -p "$SANDBOX/upper" "$SANDBOX/work" "$R"
mount -t overlay overlay -o lowerdir=/,upperdir="$SANDBOX/upper",workdir="$SANDBOX/work" "$R"
mount -t proc proc "$R/proc"
mount --rbind /dev "$R/dev"
mount -t sysfs sysfs "$R/sys"
mount -t cgroup2 cgroup2 "$R/sys/fs/cgroup"
mount -t tmpfs tmpfs "$R/tmp"
mount -t tmpfs tmpfs "$R/run"
# The checkout stays reachable at its own path, even when it lives under /tmp.
# (an overlay of it: the sandbox's writes, such as pip's in-tree build, stay inside)
mkdir -p "$SANDBOX/repo-upper" "$SANDBOX/repo-work" "$R$REPO"
mount -t overlay overlay \
    -o lowerdir="$REPO",upperdir="$SANDBOX/repo-upper",workdir="$SANDBOX/repo-work" \
    "$R$REPO"
for unit in console-getty.service getty@tty1.service prometheus.service haproxy.service \
            nginx.service postgresql.service postgresql@15-main.service; do
  ln -sf /dev/null "$R/etc/systemd/system/$unit"
done
exec chroot "$R" /lib/systemd/systemd --system --show-status=no
"""


def cgroup2_root() -> Path | None:
    for line in Path("/proc/mounts").read_text().splitlines():
        fields = line.split()
        if fields[2] == "cgroup2":
            return Path(fields[1])
    return None


def available() -> bool:
    return (os.geteuid() == 0 and shutil.which("unshare") is not None
            and shutil.which("nsenter") is not None and Path("/lib/systemd/systemd").exists()
            and cgroup2_root() is not None)


class Guest:
    def __init__(self) -> None:
        root = cgroup2_root()
        assert root is not None
        self.cgroup = root / f"qvld-test-{uuid.uuid4().hex[:8]}"
        self.mountpoint = Path(tempfile.mkdtemp(prefix="qvld-guest-", dir="/var/tmp"))
        self.proc: subprocess.Popen[bytes] | None = None
        self.pid = 0

    def boot(self, timeout: float = 60) -> Guest:
        self.cgroup.mkdir()
        # Enter the fresh cgroup first, so the guest's cgroup namespace is rooted there.
        wrapper = ('echo $$ > "$CGROUP/cgroup.procs" && exec unshare --mount --pid --fork '
                   '--propagation private --cgroup -- /bin/bash -c "$BOOT"')
        env = {"SANDBOX": str(self.mountpoint), "CGROUP": str(self.cgroup), "BOOT": BOOT,
               "REPO": str(REPO),
               "PATH": "/usr/sbin:/usr/bin:/sbin:/bin"}
        self.proc = subprocess.Popen(["/bin/bash", "-c", wrapper], env=env,
                                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            children = Path(f"/proc/{self.proc.pid}/task/{self.proc.pid}/children")
            with contextlib.suppress(OSError):
                pids = children.read_text().split()
                if pids and Path(f"/proc/{pids[0]}/exe").resolve().name == "systemd":
                    self.pid = int(pids[0])
                    state = self.run("systemctl is-system-running", check=False).stdout
                    if state.strip() in ("running", "degraded"):
                        return self
            if self.proc.poll() is not None:
                raise RuntimeError("the guest systemd exited while booting")
            time.sleep(0.1)  # the polling interval (this loop also watches for an exit)
        raise TimeoutError("the guest systemd did not finish booting")

    def run(self, script: str, check: bool = True, timeout: float = 300,
            user: str | None = None) -> subprocess.CompletedProcess[str]:
        """Run a bash script inside the guest (as root, or as ``user`` via setpriv)."""
        command = ["nsenter", "-t", str(self.pid), "-m", "-p", "-C", "-r", "-w", "--",
                   "/bin/bash", "-c", script]
        if user is not None:
            command[-1] = f"exec setpriv --reuid={user} --regid={user} --init-groups -- " \
                          f"/bin/bash -c {shlex_quote(script)}"
        out = subprocess.run(command, capture_output=True, text=True, timeout=timeout,
                             check=False, env={"PATH": "/usr/sbin:/usr/bin:/sbin:/bin",
                                               "HOME": "/root", "LANG": "C.UTF-8"})
        if check and out.returncode != 0:
            raise AssertionError(f"guest command failed ({out.returncode}): {script}\n"
                                 f"{out.stdout}\n{out.stderr}")
        return out

    def shutdown(self) -> None:
        if self.pid:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, 9)  # PID 1 of the namespace: everything in it dies
        if self.proc is not None:
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(30)
        for _ in range(50):  # the guest's cgroups empty out, then they can go
            with contextlib.suppress(FileNotFoundError):
                for path in sorted(self.cgroup.rglob("*"), key=lambda p: -len(p.parts)):
                    if path.is_dir():
                        with contextlib.suppress(OSError):
                            path.rmdir()
                with contextlib.suppress(OSError):
                    self.cgroup.rmdir()
            if not self.cgroup.exists():
                break
            time.sleep(0.1)  # the polling interval: retried until the cgroups empty out
        with contextlib.suppress(OSError):
            self.mountpoint.rmdir()


def shlex_quote(text: str) -> str:
    import shlex

    return shlex.quote(text)
