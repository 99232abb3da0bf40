"""Reload as a contract: what it applies, and every key it cannot apply without a
restart, named in the reply and left as it was in the effective configuration."""

from __future__ import annotations

from pathlib import Path

from qvld.app import RESTART_KEYS
from tests.conftest import Daemon


def test_reload_names_every_key_it_did_not_apply(tmp_path: Path) -> None:
    daemon = Daemon(tmp_path).start()
    changed = {
        "server.socket_mode": '"0600"',
        "tuning.apply": "false",
        "engine.infer_requests": "3",  # applied: the engine is loaded again
        "tuning.nofile": "4096",
        "server.queue_max": "5",  # applied
        "logging.level": "debug",  # applied
    }
    sections: dict[str, list[str]] = {}
    for key, value in changed.items():
        section, name = key.split(".")
        sections.setdefault(section, []).append(f"  {name}: {value}")
    try:
        with daemon.client() as client:
            before = client.config()
            (tmp_path / "qvld.yaml").write_text("".join(
                f"{section}:\n" + "\n".join(lines) + "\n" for section, lines in sections.items()))
            result = client.reload()
            after = client.config()
    finally:
        assert daemon.stop() == 0
    # (metrics.listen is given on the command line here: --set wins over the file.)
    not_applied = ["server.socket_mode", "tuning.apply", "tuning.nofile"]
    assert result["reloaded"] and sorted(result["restart_required"]) == sorted(not_applied)
    for key in not_applied:
        section, name = key.split(".")
        assert after[section][name] == before[section][name], key  # what is in effect
        assert f"{key} changed: it takes effect only after a restart" in daemon.log()
    assert after["server"]["queue_max"] == 5 and after["logging"]["level"] == "debug"
    assert after["engine"]["infer_requests"] == 3 and result["model_reloaded"]


def test_the_restart_keys_are_keys_of_the_schema() -> None:
    from qvld.config import iter_keys

    assert set(RESTART_KEYS) <= set(iter_keys())
    assert {"server.socket", "metrics.listen"} <= set(RESTART_KEYS)
