"""The Debian package: install, upgrade and purge inside a real systemd guest."""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import os
import shutil
import subprocess
import tarfile
import tempfile
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests import guest as guest_module
from tests.conftest import free_port, wait_for
from tests.guest import Guest

ROOT = Path(__file__).resolve().parents[1]
ARCH = subprocess.run(["dpkg", "--print-architecture"], capture_output=True, text=True,
                      check=False).stdout.strip()


def os_target() -> str:
    """What build.sh appends to the version: +deb12 on Debian 12."""
    fields = dict(line.split("=", 1) for line in Path("/etc/os-release").read_text()
                  .splitlines() if "=" in line)
    ident, version = fields["ID"].strip('"'), fields["VERSION_ID"].strip('"')
    return f"deb{version.split('.')[0]}" if ident == "debian" else f"{ident}{version}"


TARGET = os_target()
pytestmark = [pytest.mark.slow, pytest.mark.skipif(
    not guest_module.available(), reason="needs root, unshare, nsenter and cgroup2")]


@pytest.fixture(scope="module")
def debs() -> Iterator[tuple[Path, Path]]:
    # Outside /tmp: the guest has a /tmp of its own.
    out = Path(tempfile.mkdtemp(prefix="qvld-debs-", dir="/var/tmp"))
    built = []
    for version in ("0.1.0-1", "0.1.0-2"):  # the target (+deb12 ...) is appended
        result = subprocess.run([str(ROOT / "packaging/deb/build.sh"), str(out)],
                                capture_output=True, text=True, check=False, timeout=600,
                                env={**os.environ, "VERSION": version})
        assert result.returncode == 0, result.stderr
        built.append(Path(result.stdout.strip().splitlines()[-1]))
    installed = subprocess.run(["dpkg-deb", "-f", str(built[0]), "Installed-Size"],
                               capture_output=True, text=True, check=True).stdout.strip()
    print(f"package: {built[0].stat().st_size / 1e6:.1f} MB, installed "
          f"{int(installed) / 1024:.0f} MiB")  # the figures docs/operations.md quotes
    yield built[0], built[1]
    shutil.rmtree(out, ignore_errors=True)


def test_install_upgrade_purge(debs: tuple[Path, Path]) -> None:
    first, second = debs
    machine = Guest().boot()
    try:
        machine.run(f"""
set -e
# This machine is a Docker image, whose policy-rc.d forbids maintainer scripts to start
# services (deb-systemd-invoke honours it, as it must); a real host has none.
rm -f /usr/sbin/policy-rc.d
apt-get install -y -q {first} >/tmp/apt.out 2>&1
""")
        # No model yet: the socket is enabled but not started (a client would start a
        # daemon that exits at once), and the admin is told what to do.
        assert machine.run("systemctl is-active qvld.socket", check=False
                           ).stdout.strip() == "inactive"
        assert machine.run("systemctl is-enabled qvld.socket").stdout.strip() == "enabled"
        assert "then: systemctl start qvld.socket" in machine.run("cat /tmp/apt.out").stdout
        machine.run(f"""
set -e
cp -r {ROOT}/tests/fixtures/models/tiny /var/lib/qvld/models/qwen3-vl-2b
chown -R qvld:qvld /var/lib/qvld/models
sed -i 's|^  listen: .*|  listen: ""  # edited by the admin|' /etc/qvld/qvld.yaml
systemctl start qvld.socket
""")
        assert machine.run("systemctl is-active qvld.socket").stdout.strip() == "active"
        # The generated manual pages render from where the package put them; completion
        # loads.
        assert "qvlctl ask" in machine.run("MANWIDTH=100 man -P cat qvlctl").stdout
        for page in ("man1/qvlctl.1.gz", "man5/qvld.yaml.5.gz", "man8/qvld.8.gz"):
            # (man -l: the file as installed; groff's complaints would go to stderr)
            rendered = machine.run(f"MANWIDTH=100 man -P cat -l /usr/share/man/{page}")
            assert rendered.stderr == "" and len(rendered.stdout) > 500, rendered.stderr
        assert "engine.grammar_compile_timeout_s" in machine.run(
            "MANWIDTH=100 man -P cat 5 qvld.yaml").stdout
        assert "check-config" in machine.run("MANWIDTH=100 man -P cat 8 qvld").stdout
        assert "_shtab_qvlctl" in machine.run(
            "bash -c 'source /usr/share/bash-completion/completions/qvlctl; "
            "complete -p qvlctl'").stdout
        assert machine.run("stat -c '%a %G' /run/qvld/qvld.sock").stdout.strip() == "660 qvl"
        machine.run(f"qvlctl ask {ROOT}/examples/receipt.png 'Total?' --max-tokens 4")
        assert machine.run("systemctl is-active qvld.service").stdout.strip() == "active"
        # The stripped extension modules work (llguidance's here); postinst compiled the
        # bytecode the package does not ship.
        answer = machine.run(f"qvlctl ask {ROOT}/examples/receipt.png 'Total?' --json-object "
                             "--max-tokens 40 2>/dev/null").stdout
        assert answer.startswith("{"), answer
        compiled = machine.run("find /opt/venvs/qvld/lib -path '*/qvld/__pycache__/*.pyc' | "
                               "wc -l").stdout
        assert int(compiled) > 10, compiled
        # An instance of the template units beside the plain service, from a file of its
        # own, enabled by the admin: upgrades restart it, purge stops it and its links go.
        port = free_port()
        machine.run(f"""
set -e
printf 'model:\\n  path: /var/lib/qvld/models/qwen3-vl-2b\\n  cache_dir: /var/cache/qvld/edge\\n'\\
'http:\\n  listen: 127.0.0.1:{port}\\nmetrics:\\n  listen: ""\\n' > /etc/qvld/edge.yaml
systemctl enable --now qvld@edge.service
""")
        machine.run("qvlctl --instance edge health")
        instance_pid = machine.run("systemctl show -p MainPID --value qvld@edge.service").stdout
        socket_since = machine.run(
            "systemctl show -p ActiveEnterTimestampMonotonic --value qvld.socket").stdout
        upgrade = machine.run(f"dpkg -i {second} 2>&1")
        assert "conffile" not in upgrade.stdout.lower() or "keep" in upgrade.stdout.lower()
        assert machine.run("dpkg-query -W -f '${Version}' qvld").stdout == f"0.1.0-2+{TARGET}"
        assert second.name == f"qvld_0.1.0-2+{TARGET}_{ARCH}.deb"
        depends = subprocess.run(["dpkg-deb", "-f", str(second), "Depends"], text=True,
                                 capture_output=True, check=True).stdout
        # The venv's python3 (the system's, which build.sh uses) and nothing newer.
        minor = int(subprocess.run(["/usr/bin/python3", "-c", "import sys; print("
                                    "sys.version_info[1])"], capture_output=True, text=True,
                                   check=True).stdout)
        assert f"python3 (>= 3.{minor}), python3 (<< 3.{minor + 1})" in depends, depends
        assert "edited by the admin" in machine.run("cat /etc/qvld/qvld.yaml").stdout
        # The socket stayed up through the upgrade; the daemon came back on the new code.
        assert machine.run("systemctl show -p ActiveEnterTimestampMonotonic --value "
                           "qvld.socket").stdout == socket_since
        machine.run(f"qvlctl ask {ROOT}/examples/receipt.png 'Total?' --max-tokens 4")
        # the running instance restarted on the new code, and serves
        wait_for(lambda: machine.run("qvlctl --instance edge health", check=False
                                     ).returncode == 0, timeout=120, what="qvld@edge ready")
        assert machine.run("systemctl show -p MainPID --value qvld@edge.service"
                           ).stdout not in (instance_pid, "0\n")
        machine.run("apt-get purge -y qvld >/dev/null 2>&1")
        assert machine.run("systemctl is-active qvld@edge.service", check=False
                           ).stdout.strip() in ("inactive", "failed")
        assert machine.run("find /etc/systemd/system -name 'qvld@*' | wc -l").stdout.strip() \
            == "0"
        left = machine.run("ls -d /opt/venvs/qvld /etc/qvld /var/cache/qvld "
                           "/lib/systemd/system/qvld.service /usr/bin/qvld 2>/dev/null; "
                           "dpkg-query -W -f '${Status}' qvld 2>&1", check=False).stdout
        assert "/" not in left.split("dpkg-query")[0].replace("no packages found", ""), left
        assert "installed" not in left.replace("not-installed", "")
        # The models the admin copied in survive a purge unless asked for.
        assert machine.run("ls /var/lib/qvld").stdout.split() == ["models"]
        assert machine.run("test -f /var/lib/qvld/models/qwen3-vl-2b/config.json && echo kept"
                           ).stdout.strip() == "kept"
        machine.run(f"dpkg -i {second} >/dev/null && QVLD_PURGE_MODELS=1 apt-get purge -y "
                    "qvld >/dev/null 2>&1")
        assert machine.run("test -e /var/lib/qvld || echo gone").stdout.strip() == "gone"
    finally:
        machine.shutdown()


def data_members(deb: Path) -> dict[str, tuple[Any, ...]]:
    """Every file of the package's data archive: its metadata and content hash."""
    tar_bytes = subprocess.run(["dpkg-deb", "--fsys-tarfile", str(deb)], capture_output=True,
                               check=True).stdout
    members = {}
    with tarfile.open(fileobj=io.BytesIO(tar_bytes)) as archive:
        for info in archive:
            data = archive.extractfile(info).read() if info.isfile() else b""  # type: ignore[union-attr]
            members[info.name] = (info.type, info.mode, info.uname, info.gname, info.mtime,
                                  info.linkname, hashlib.sha256(data).hexdigest())
    return members


def test_a_rebuild_gives_the_same_package_contents(debs: tuple[Path, Path]) -> None:
    """The fixture built the same commit twice (versions -1 and -2): apart from what
    names the version, the archives are identical, timestamps and modes included."""
    first, second = (data_members(deb) for deb in debs)
    changelog = "./usr/share/doc/qvld/changelog.Debian.gz"
    assert first.keys() == second.keys()
    differing = sorted(name for name in first if first[name] != second[name])
    assert differing == [changelog], differing
    fields = [subprocess.run(["dpkg-deb", "-f", str(deb)], capture_output=True, text=True,
                             check=True).stdout.replace("0.1.0-2", "0.1.0-1") for deb in debs]
    assert fields[0] == fields[1]
    # no bytecode shipped (postinst compiles it), nothing names the build's staging tree
    assert not [name for name in first if name.endswith(".pyc")]
    assert {entry[4] for entry in first.values()} == {int(subprocess.run(
        ["git", "-C", str(ROOT), "log", "-1", "--format=%ct"], capture_output=True, text=True,
        check=True).stdout)}
    assert "Maintainer: qvld maintainers <" in fields[0]


def test_lintian_finds_nothing_beyond_the_overrides(debs: tuple[Path, Path]) -> None:
    """Every tag a vendored venv necessarily carries is overridden with its reason
    (packaging/deb/lintian-overrides); nothing else, and no override goes unused."""
    out = subprocess.run(["lintian", "-I", "--tag-display-limit", "0", str(debs[0])],
                         capture_output=True, text=True, timeout=600, check=False)
    tags = [line.split()[:3] for line in out.stdout.splitlines()
            if line[:2] in ("E:", "W:", "I:")]
    problems = {tag for level, _, tag in tags if level in ("E:", "W:")}
    assert problems == set(), out.stdout
    assert "unused-override" not in {tag for _, _, tag in tags}, out.stdout


def own_address() -> str | None:
    """This machine's first non-loopback IPv4 address: connections to it come from it,
    which the unit's IP filter treats like any remote peer (not localhost)."""
    out = subprocess.run(["hostname", "-I"], capture_output=True, text=True, check=False)
    return next((a for a in out.stdout.split() if "." in a and not a.startswith("127.")),
                None)


def scrape_health(prometheus: str, deadline_s: float = 60) -> dict[str, Any]:
    """The one target's state once Prometheus has tried it (after the first scrape)."""
    def tried() -> dict[str, Any] | None:
        with contextlib.suppress(OSError, ValueError):
            with urllib.request.urlopen(f"{prometheus}/api/v1/targets", timeout=5) as reply:
                targets = json.load(reply)["data"]["activeTargets"]
            if targets and targets[0]["lastScrape"] != "0001-01-01T00:00:00Z":
                return dict(targets[0])
        return None
    found = wait_for(tried, timeout=deadline_s, what="a scrape")
    assert found is not None
    return found


def test_a_remote_prometheus_scrapes_through_the_shipped_drop_in(
        debs: tuple[Path, Path], tmp_path: Path) -> None:
    address = own_address()
    assert address, "no non-loopback address on this machine"
    port = free_port()
    machine = Guest().boot()
    prometheus: subprocess.Popen[bytes] | None = None
    try:
        machine.run(f"""
set -e
rm -f /usr/sbin/policy-rc.d
dpkg -i {debs[1]} >/dev/null
cp -r {ROOT}/tests/fixtures/models/tiny /var/lib/qvld/models/qwen3-vl-2b
chown -R qvld:qvld /var/lib/qvld/models
sed -i 's|^  listen: "127.0.0.1:8479".*|  listen: "0.0.0.0:{port}"|' /etc/qvld/qvld.yaml
grep -q '0.0.0.0:{port}' /etc/qvld/qvld.yaml
systemctl start qvld.service
""")
        # Reachable on localhost, as shipped ...
        local = machine.run(f"curl -fsS http://127.0.0.1:{port}/metrics").stdout
        assert "qvld_ready 1.0" in local
        config = tmp_path / "prometheus.yml"
        config.write_text(f"global: {{scrape_interval: 1s, scrape_timeout: 900ms}}\n"
                          f"scrape_configs:\n  - job_name: qvld\n"
                          f"    static_configs: [{{targets: ['{address}:{port}']}}]\n")
        web = free_port()
        prometheus = subprocess.Popen(
            ["prometheus", f"--config.file={config}", f"--storage.tsdb.path={tmp_path}/tsdb",
             f"--web.listen-address=127.0.0.1:{web}"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        api = f"http://127.0.0.1:{web}"
        # ... but from another address the unit's IPAddressDeny= drops the packets.
        refused = scrape_health(api)
        assert refused["health"] == "down", refused
        # The shipped drop-in, with that address, lets the scrape through.
        machine.run(f"""
set -e
mkdir -p /etc/systemd/system/qvld.service.d
sed 's|^IPAddressAllow=.*|IPAddressAllow={address}|' \\
  /usr/share/qvld/systemd/remote-metrics.conf > /etc/systemd/system/qvld.service.d/remote.conf
systemctl daemon-reload
systemctl restart qvld.service
""")

        def scraped_up() -> bool:
            with contextlib.suppress(OSError, ValueError, KeyError, IndexError):
                with urllib.request.urlopen(f"{api}/api/v1/query?query=qvld_ready",
                                            timeout=5) as reply:
                    result = json.load(reply)["data"]["result"]
                return bool(result) and result[0]["value"][1] == "1"
            return False

        wait_for(scraped_up, timeout=60, what="qvld_ready through the remote scrape",
                 detail=lambda: json.dumps(scrape_health(api)))
        assert scrape_health(api)["health"] == "up"
    finally:
        if prometheus is not None:
            prometheus.terminate()
            prometheus.wait(30)
        machine.shutdown()
