"""Units, users, directories and the installer, checked as installed (in a sandbox)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests import sandbox
from tests.conftest import TINY

ROOT = Path(__file__).resolve().parents[1]
needs_sandbox = pytest.mark.skipif(not sandbox.available(), reason="needs root and unshare")

INSTALLED = ["/usr/lib/systemd/system/qvld.service", "/usr/lib/systemd/system/qvld.socket",
             "/usr/lib/systemd/system/qvld-http.socket",
             "/usr/lib/systemd/system/qvld@.service", "/usr/lib/systemd/system/qvld@.socket",
             "/usr/lib/sysusers.d/qvld.conf", "/usr/lib/tmpfiles.d/qvld.conf",
             "/usr/bin/qvld", "/usr/bin/qvlctl",
             "/usr/share/doc/qvld/README.md", "/opt/venvs/qvld/bin/qvld",
             "/usr/share/qvld/prometheus/qvld-alerts.yml",
             "/usr/share/qvld/prometheus/qvld-alerts.test.yml",
             "/usr/share/qvld/grafana/qvld-dashboard.json",
             "/usr/share/qvld/systemd/remote-metrics.conf",
             "/usr/share/man/man8/qvld.8", "/usr/share/man/man1/qvlctl.1",
             "/usr/share/man/man5/qvld.yaml.5",
             "/usr/share/bash-completion/completions/qvlctl",
             "/usr/share/zsh/vendor-completions/_qvlctl"]
# A listing of everything the installer owns, with contents, to compare two runs.
SNAPSHOT = (
    "find /opt/venvs/qvld/bin /usr/lib/systemd/system/qvld.* /usr/lib/sysusers.d/qvld.conf "
    "/usr/lib/tmpfiles.d/qvld.conf /usr/bin/qvld /usr/bin/qvlctl /etc/qvld "
    "/var/lib/qvld /var/cache/qvld /run/qvld -printf '%p %m %u %g %l\\n' | sort; "
    "md5sum /usr/lib/systemd/system/qvld.* /etc/qvld/qvld.yaml; "
    "getent passwd qvld | cut -d: -f1,6,7; getent group qvl qvl-admin | cut -d: -f1,4"
)


@needs_sandbox
@pytest.mark.slow
def test_install_verify_idempotent_uninstall() -> None:
    script = f"""
set -e
cd {ROOT}
packaging/install.sh >/dev/null
echo "== first"; {SNAPSHOT}
echo "== verify"; systemd-analyze verify /usr/lib/systemd/system/qvld.service \
    /usr/lib/systemd/system/qvld.socket /usr/lib/systemd/system/qvld-http.socket \
    qvld@0.service qvld@0.socket 2>&1
echo "verify-rc $?"
echo "== shipped"; for f in {" ".join(INSTALLED)}; do test -e $f || echo "missing $f"; done
mkdir -p /etc/systemd/system/qvld.service.d
cp /usr/share/qvld/systemd/remote-metrics.conf /etc/systemd/system/qvld.service.d/
systemd-analyze verify /usr/lib/systemd/system/qvld.service 2>&1; echo "drop-in-rc $?"
rm -r /etc/systemd/system/qvld.service.d
echo "== security"; systemd-analyze security --offline=yes qvld.service 2>&1 | tail -1
echo "== preflight"; /usr/bin/qvld preflight --set model.path={TINY} >/dev/null && echo ran
echo "== mdwe"; /opt/venvs/qvld/bin/python -c 'import qvld' && echo importable
packaging/install.sh >/dev/null
echo "== second"; {SNAPSHOT}
echo "== edit"
echo "edited: true" >> /etc/qvld/qvld.yaml
packaging/install.sh 2>&1 >/dev/null | tail -1
test -e /etc/qvld/qvld.yaml.dist && grep -q "edited: true" /etc/qvld/qvld.yaml && echo kept-edit
mkdir -p /var/lib/qvld/models/mine && touch /var/lib/qvld/models/mine/weights.bin
packaging/install.sh --uninstall
echo "== after uninstall"
for f in {" ".join(INSTALLED)}; do test -e $f && echo "left $f"; done
test -d /etc/qvld && test -e /var/lib/qvld/models/mine/weights.bin && echo kept-data
packaging/install.sh --uninstall --purge
test -e /etc/qvld || test -e /var/lib/qvld || echo purged
echo "== destdir"
packaging/install.sh --destdir /tmp/stage >/dev/null 2>&1; echo "destdir-rc $?"
for f in {" ".join(INSTALLED)}; do  # (links into the venv name where it will be)
  test -e /tmp/stage$f || test -L /tmp/stage$f || echo "missing $f"; done
test -e /tmp/stage/etc/passwd && echo "users made in the staged tree"
test -e /tmp/stage/run/qvld && echo "state directories made in the staged tree"
true  # (the script's status is the checks' above, not this last test's)
"""
    out = sandbox.run_in_sandbox(script)
    assert out.returncode == 0, out.stdout + out.stderr
    text = out.stdout
    sections = dict(re.findall(r"== (\w[\w ]*)\n(.*?)(?=\n== |\Z)", text, re.S))
    assert sections["first"] == sections["second"]  # idempotent
    assert "qvld:/var/lib/qvld:/usr/sbin/nologin" in sections["first"]
    assert "/run/qvld 750 qvld qvl" in sections["first"]
    # systemd-analyze verify prints nothing at all for the installed units.
    assert sections["verify"].strip() == "verify-rc 0", sections["verify"]
    # Everything is in place, and the remote-metrics drop-in verifies as shipped.
    # (verify prints nothing for it: no unknown or misplaced directive)
    assert sections["shipped"].strip() == "drop-in-rc 0", sections["shipped"]
    exposure = float(re.search(r"exposure level for qvld.service: ([\d.]+)",
                               sections["security"]).group(1))  # type: ignore[union-attr]
    assert exposure <= 2.0
    print(f"systemd-analyze security: exposure {exposure}")
    assert "ran" in sections["preflight"]
    assert "kept-edit" in text
    uninstall = sections["after uninstall"]
    assert "left " not in uninstall and "kept-data" in uninstall and "purged" in uninstall
    # A staged tree for a package (it failed at systemd-sysusers on Debian 12: #46): all
    # the files, no users or state directories made in it or on this machine.
    staged = sections["destdir"]  # (the script's stderr, pip's notes, may follow it)
    assert "destdir-rc 0" in staged and "missing " not in staged \
        and "made in the staged tree" not in staged, staged


def test_units_name_what_the_installer_installs() -> None:
    service = (ROOT / "packaging/systemd/qvld.service").read_text()
    socket_unit = (ROOT / "packaging/systemd/qvld.socket").read_text()
    assert "ExecStart=/usr/bin/qvld " in service
    assert "RestartPreventExitStatus=78" in service and "Type=notify" in service
    assert "RuntimeDirectory=" not in service.replace("no RuntimeDirectory=", "")
    assert not re.search(r"^MemoryDenyWriteExecute", service, re.M)
    assert "ListenStream=/run/qvld/qvld.sock" in socket_unit
    assert "SocketMode=0660" in socket_unit and "SocketGroup=qvl" in socket_unit
    config = (ROOT / "etc/qvld/qvld.yaml").read_text()
    assert "socket: /run/qvld/qvld.sock" in config
    # The HTTP socket reaches the same service under the name the daemon looks for, on
    # loopback (the service allows only localhost traffic), ordered before the service.
    http_unit = (ROOT / "packaging/systemd/qvld-http.socket").read_text()
    assert "FileDescriptorName=http" in http_unit and "Service=qvld.service" in http_unit
    assert re.search(r"^ListenStream=127\.0\.0\.1:\d+$", http_unit, re.M)
    assert re.search(r"^After=.*\bqvld-http\.socket\b", service, re.M)


PR_SET_MDWE, PR_MDWE_REFUSE_EXEC_GAIN = 65, 1


def mdwe_supported() -> bool:
    code = "import ctypes,sys; sys.exit(ctypes.CDLL(None).prctl(65, 1, 0, 0, 0) != 0)"
    return subprocess.run([sys.executable, "-c", code], check=False).returncode == 0


@pytest.mark.skipif(not mdwe_supported(), reason="kernel without PR_SET_MDWE (Linux < 6.3)")
def test_openvino_cannot_run_under_memory_deny_write_execute() -> None:
    # MemoryDenyWriteExecute= forbids memory that becomes executable after being
    # writable; the kernel's per-process MDWE enforces the same rule.
    code = f"""
import ctypes, sys
assert ctypes.CDLL(None).prctl({PR_SET_MDWE}, {PR_MDWE_REFUSE_EXEC_GAIN}, 0, 0, 0) == 0
from qvld.config import Config, ModelConfig
from qvld.engine import Engine, GenerateRequest
engine = Engine(Config(model=ModelConfig(path=sys.argv[1])))
engine.generate(GenerateRequest(messages=[{{"role": "user", "content": "Hi"}}], max_tokens=2))
print("ran")
"""
    blocked = subprocess.run([sys.executable, "-c", code, str(TINY)], capture_output=True,
                             text=True, timeout=120, check=False)
    assert blocked.returncode != 0 and "ran" not in blocked.stdout
    free = subprocess.run([sys.executable, "-c", code.replace("assert ctypes", "# ctypes"),
                           str(TINY)], capture_output=True, text=True, timeout=120,
                          check=False)
    assert free.returncode == 0 and "ran" in free.stdout, free.stderr


def test_the_lock_pins_every_runtime_dependency_within_its_range() -> None:
    """requirements.lock (what the installer and the package install, hash-checked)
    cannot drift from pyproject.toml: each dependency is pinned there, with a hash, at a
    version its specifier allows (after a change: make lock)."""
    import tomllib
    from packaging.requirements import Requirement
    from packaging.utils import canonicalize_name

    lock = (ROOT / "requirements.lock").read_text()
    pinned = {canonicalize_name(name): version for name, version in
              re.findall(r"^([A-Za-z0-9_.-]+)==([^ \\\n]+)", lock, re.M)}
    assert len(pinned) == len(re.findall(r"^[A-Za-z0-9_.-]+==", lock, re.M))
    entries = re.split(r"\n(?=[A-Za-z0-9_.-]+==)", lock)
    assert all("--hash=sha256:" in e for e in entries if re.match(r"[A-Za-z0-9_.-]+==", e))
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    for line in project["dependencies"]:
        requirement = Requirement(line)
        name = canonicalize_name(requirement.name)
        assert name in pinned, f"{name} is not in requirements.lock (make lock)"
        assert requirement.specifier.contains(pinned[name], prereleases=True), (
            f"{name}=={pinned[name]} is outside {requirement.specifier} (make lock)")


def service_lines(unit: str) -> list[str]:
    text = (ROOT / "packaging/systemd" / unit).read_text()
    body = text.split("[Service]\n", 1)[1].split("\n[Install]", 1)[0]
    return [line for line in body.splitlines() if line and not line.startswith("#")]


def test_the_template_unit_is_the_plain_one_but_for_its_instance() -> None:
    """qvld@.service cannot include qvld.service: the two [Service] sections are held
    equal here, but for the instance's own command line and cache directory."""
    plain, template = service_lines("qvld.service"), service_lines("qvld@.service")
    assert [line.replace(" --instance %i", "").replace("CacheDirectory=qvld/%i",
                                                         "CacheDirectory=qvld")
            for line in template] == plain
    assert "ExecStart=/usr/bin/qvld --config /etc/qvld/qvld.yaml --instance %i" in template
    unit = (ROOT / "packaging/systemd/qvld@.service").read_text()
    assert "Requires=qvld@%i.socket" in unit and "Also=qvld@%i.socket" in unit
    assert "ListenStream=/run/qvld/qvld-%i.sock" in \
        (ROOT / "packaging/systemd/qvld@.socket").read_text()


def test_the_proxies_never_send_a_generation_that_reached_an_instance_again() -> None:
    """nginx: no non_idempotent in proxy_next_upstream (a POST is passed on only when it
    never reached an instance). HAProxy: retry-on only conn-failure, empty-response and
    503 (qvld answers 503 before any work starts)."""
    nginx = (ROOT / "packaging/nginx/qvld.conf").read_text()
    directives = re.findall(r"^\s*proxy_next_upstream\s+([^;]*);", nginx, re.M)
    assert directives and all("non_idempotent" not in d for d in directives)
    haproxy = (ROOT / "packaging/haproxy/haproxy.cfg").read_text()
    retries = re.findall(r"^\s*retry-on\s+(.*)$", haproxy, re.M)
    assert retries and all(set(r.split()) <= {"conn-failure", "empty-response", "503"}
                           for r in retries)


def test_the_units_let_qvld_ask_the_kernel_who_is_calling() -> None:
    for unit in ("qvld.service", "qvld@.service"):
        text = (ROOT / "packaging/systemd" / unit).read_text()
        families = re.search(r"^RestrictAddressFamilies=(.*)$", text, re.M)
        assert families is not None and "AF_NETLINK" in families.group(1).split(), unit
