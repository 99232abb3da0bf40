"""qvld installed into a real systemd (252) and driven as an operator would.

The guest is a throw-away overlay of this machine with systemd as PID 1 of fresh
namespaces (tests/guest.py); nothing of the host changes."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests import guest as guest_module
from tests.conftest import wait_for
from tests.guest import Guest

ROOT = Path(__file__).resolve().parents[1]
pytestmark = [pytest.mark.slow, pytest.mark.skipif(
    not guest_module.available(), reason="needs root, unshare, nsenter and cgroup2")]

SOCKET = "/run/qvld/qvld.sock"
QUESTION = f"{ROOT}/examples/receipt.png 'What is the total?'"


@pytest.fixture(scope="module")
def guest() -> Iterator[Guest]:
    machine = Guest().boot()
    try:
        machine.run(f"""
set -e
cd {ROOT}
packaging/install.sh >/dev/null
cp -r {ROOT}/tests/fixtures/models/tiny /var/lib/qvld/models/qwen3-vl-2b
chown -R qvld:qvld /var/lib/qvld/models
# Keep the guest off the host's TCP ports (the network namespace is shared).
sed -i 's|^  listen: .*|  listen: ""|' /etc/qvld/qvld.yaml
systemctl enable --now qvld.socket
""", timeout=600)
        yield machine
    finally:
        machine.shutdown()


def qvlctl(machine: Guest, args: str, user: str | None = None, check: bool = True
           ) -> tuple[int, str, str]:
    out = machine.run(f"/usr/bin/qvlctl {args}", check=False, user=user)
    if check:
        assert out.returncode == 0, out.stdout + out.stderr
    return out.returncode, out.stdout, out.stderr


def show(machine: Guest, prop: str, unit: str = "qvld.service") -> str:
    return machine.run(f"systemctl show -p {prop} --value {unit}").stdout.strip()


def test_socket_listens_0660_group_qvl_before_the_service(guest: Guest) -> None:
    assert guest.run(f"stat -c '%a %U %G' {SOCKET}").stdout.strip() == "660 qvld qvl"
    assert show(guest, "ActiveState", "qvld.socket") == "active"
    assert show(guest, "ActiveState") == "inactive"


def test_first_ask_activates_the_service(guest: Guest) -> None:
    _, out, err = qvlctl(guest, f"ask {QUESTION} --max-tokens 8")
    assert "TTFT" in err and out.strip()
    assert show(guest, "ActiveState") == "active"
    status = guest.run("systemctl status qvld.service --no-pager", check=False).stdout
    assert "Active: active (running)" in status
    assert re.search(r"Status: \"ready: ", status), status
    assert show(guest, "User") == "qvld"


def test_journal_holds_the_request_log(guest: Guest) -> None:
    journal = guest.run("journalctl -u qvld --no-pager -o cat").stdout
    assert "op=generate outcome=ok" in journal
    assert "tuning pin_cpus:" in journal
    # Each request's fields are structured fields of its entry (the native protocol).
    entries = [json.loads(line) for line in guest.run(
        "journalctl -u qvld --no-pager -o json QVLD_OP=generate").stdout.splitlines()]
    served = [e for e in entries if e.get("QVLD_OUTCOME") == "ok"]
    assert served, entries
    assert served[0]["PRIORITY"] == "6" and served[0]["SYSLOG_IDENTIFIER"] == "qvld"
    assert float(served[0]["QVLD_TTFT_S"]) > 0 and int(served[0]["QVLD_GENERATED_TOKENS"]) > 0
    assert served[0]["QVLD_API"] == "socket" and "op=generate" in served[0]["MESSAGE"]


def test_reload_keeps_serving(guest: Guest) -> None:
    pid = show(guest, "MainPID")
    guest.run("systemctl reload qvld.service")
    wait_for(lambda: "reload done" in guest.run("journalctl -u qvld --no-pager -o cat").stdout,
             60, "'reload done' in the journal", interval=0.2)
    assert show(guest, "MainPID") == pid
    qvlctl(guest, f"ask {QUESTION} --max-tokens 4")


def test_outsider_is_refused_and_a_qvl_member_is_served(guest: Guest) -> None:
    guest.run("useradd --no-create-home outsider && useradd --no-create-home -G qvl alice")
    code, _, err = qvlctl(guest, "health", user="outsider", check=False)
    # The socket's permissions refuse it: forbidden, with the group to join.
    assert code == 7 and "permission denied" in err and "usermod -aG qvl" in err, err
    code, out, _ = qvlctl(guest, "health", user="alice", check=False)
    assert code == 0 and out.strip() == "ready"
    code, _, err = qvlctl(guest, "reload", user="alice", check=False)
    assert code == 7 and "forbidden" in err  # qvl is not qvl-admin


def test_stop_drains_and_the_socket_reactivates(guest: Guest) -> None:
    guest.run("(/usr/bin/qvlctl ask --json --max-tokens 400 'Tell me everything' "
              "> /root/long.json 2>&1; echo done >> /root/long.json) &")

    def generating_or_done() -> bool:
        out = guest.run("/usr/bin/qvlctl status --json", check=False).stdout
        if out and json.loads(out)["queue"]["running"] == 1:
            return True
        return "done" in guest.run("cat /root/long.json", check=False).stdout

    wait_for(generating_or_done, 60, "the long answer to be generating", interval=0.1)
    guest.run("systemctl stop qvld.service")
    assert show(guest, "ActiveState") == "inactive"
    result = guest.run("cat /root/long.json").stdout
    answer = json.loads(result.splitlines()[0])
    assert answer["finish_reason"] in ("length", "stop", "cancelled")
    journal = guest.run("journalctl -u qvld --no-pager -o cat").stdout
    assert "draining" in journal
    # The socket outlived the service and starts it again.
    assert show(guest, "ActiveState", "qvld.socket") == "active"
    assert guest.run(f"test -S {SOCKET} && echo yes").stdout.strip() == "yes"
    qvlctl(guest, f"ask {QUESTION} --max-tokens 4")
    assert show(guest, "ActiveState") == "active"


def test_a_hung_daemon_is_restarted_by_the_watchdog(guest: Guest) -> None:
    guest.run("""
mkdir -p /etc/systemd/system/qvld.service.d
printf '[Service]\\nWatchdogSec=3s\\nEnvironment=QVLD_DEBUG_FREEZE_ON_SIGUSR2=1\\n' \
  > /etc/systemd/system/qvld.service.d/watchdog-test.conf
systemctl daemon-reload
systemctl restart qvld.service
""")
    qvlctl(guest, "health")
    pid = show(guest, "MainPID")
    restarts = int(show(guest, "NRestarts"))
    guest.run("systemctl kill -s USR2 qvld.service")
    wait_for(lambda: show(guest, "MainPID") not in (pid, "0")
             and show(guest, "ActiveState") == "active", 60, "a restarted qvld",
             interval=0.5, detail=lambda: guest.run("journalctl -u qvld -n 30").stdout)
    assert int(show(guest, "NRestarts")) == restarts + 1
    journal = guest.run("journalctl -u qvld --no-pager").stdout
    assert "Watchdog timeout" in journal
    qvlctl(guest, "health")


def test_http_socket_activation_then_the_openai_client(guest: Guest) -> None:
    """qvld-http.socket starts the stopped service on the first HTTP request and hands
    it the listener; the real openai client is answered through it."""
    import base64

    import openai

    from tests.conftest import free_port

    port = free_port()  # the guest shares this machine's network namespace
    guest.run(f"""
mkdir -p /etc/systemd/system/qvld-http.socket.d
printf '[Socket]\\nListenStream=\\nListenStream=127.0.0.1:{port}\\n' \
  > /etc/systemd/system/qvld-http.socket.d/port.conf
systemctl daemon-reload
systemctl stop qvld.service
systemctl enable --now qvld-http.socket
""")
    assert show(guest, "ActiveState", "qvld-http.socket") == "active"
    assert show(guest, "ActiveState") == "inactive"
    image = base64.b64encode((ROOT / "examples/receipt.png").read_bytes()).decode()
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused",
                           max_retries=0, timeout=180)
    answer = client.chat.completions.create(model="qvld", max_tokens=8, messages=[{
        "role": "user", "content": [
            {"type": "image_url", "image_url": {"url": f"data:image/png;base64,{image}"}},
            {"type": "text", "text": "What is the total?"}]}])
    assert answer.choices[0].message.content
    assert answer.usage is not None and answer.usage.completion_tokens > 0
    assert answer.usage.prompt_tokens_details is not None
    assert show(guest, "ActiveState") == "active"
    journal = guest.run("journalctl -u qvld --no-pager -o cat").stdout
    assert f"HTTP API on http://127.0.0.1:{port}" in journal
    # Without keys the caller is who the kernel says: root, asked from sock_diag inside
    # the sandbox (RestrictAddressFamilies= includes AF_NETLINK).
    assert "uid=0 op=generate outcome=ok" in journal
    assert "reading /proc/net/tcp" not in journal
    # Both sockets reach the one process: the Unix socket still answers qvlctl.
    qvlctl(guest, "health")


def test_template_instances_each_with_their_socket_port_and_cache(guest: Guest) -> None:
    """qvld@0 and qvld@1 from the one shared file: each on its own socket, HTTP port
    (the shared one moved up by the instance number) and compiled-model cache."""
    import urllib.request

    from tests.conftest import free_port_pair

    base = free_port_pair()  # the guest shares this machine's network namespace
    guest.run(f"""
set -e
cp /etc/qvld/qvld.yaml /etc/qvld/qvld.yaml.before-instances
sed -i '/^http:/,/^[a-z]/ s|^  listen: .*|  listen: 127.0.0.1:{base}|' /etc/qvld/qvld.yaml
grep -q '^  listen: 127.0.0.1:{base}$' /etc/qvld/qvld.yaml
systemctl start qvld@0.service qvld@1.service
""")
    try:
        for node in (0, 1):
            unit = f"qvld@{node}.service"
            assert show(guest, "ActiveState", unit) == "active"
            assert guest.run(f"stat -c '%a %U %G' /run/qvld/qvld-{node}.sock"
                             ).stdout.strip() == "660 qvld qvl"
            err = qvlctl(guest, f"--instance {node} ask {QUESTION} --max-tokens 4")[2]
            assert "TTFT" in err
            config = json.loads(qvlctl(guest, f"--instance {node} config --json")[1])
            assert config["tuning"]["numa_node"] == node
            assert config["model"]["cache_dir"] == f"/var/cache/qvld/{node}"
            assert guest.run(f"ls /var/cache/qvld/{node} | wc -l").stdout.strip() != "0"
            with urllib.request.urlopen(f"http://127.0.0.1:{base + node}/health",
                                        timeout=30) as reply:
                assert json.load(reply)["ready"] is True
        # the plain service is not involved; each instance logs under its own unit
        assert "op=generate outcome=ok" in guest.run(
            "journalctl -u qvld@1.service --no-pager -o cat").stdout
    finally:
        guest.run("systemctl stop qvld@0.service qvld@1.service qvld@0.socket "
                  "qvld@1.socket; mv /etc/qvld/qvld.yaml.before-instances "
                  "/etc/qvld/qvld.yaml", check=False)

