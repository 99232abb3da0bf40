"""`qvld api-key NAME [--keys-file FILE]`: issue an HTTP API key without a config or model."""

from __future__ import annotations

import re
import stat
from pathlib import Path

import pytest

from qvld.cli import main
from qvld.http.keys import ApiKeys, hash_key


@pytest.fixture(autouse=True)
def no_config(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # Loading this config would fail (exit 78): api-key must not need one.
    monkeypatch.setenv("QVLD_CONFIG", str(tmp_path / "does-not-exist.yaml"))


def issue(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
    code = main(["api-key", *args])
    out, err = capsys.readouterr()
    return code, out, err


def test_the_config_really_would_fail() -> None:
    assert main(["check-config"]) == 78


def test_key_is_appended_to_a_new_file(tmp_path: Path,
                                       capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "api_keys"
    code, out, err = issue(capsys, "alice", "--keys-file", str(path))
    assert code == 0, err
    key = out.strip()
    assert out == key + "\n"  # only the key on stdout
    assert ApiKeys.load(path).user(key) == "alice"
    assert stat.S_IMODE(path.stat().st_mode) == 0o640
    assert "systemctl reload qvld" in err
    assert [p.name for p in tmp_path.iterdir()] == ["api_keys"]  # no temp file left


def test_second_user_keeps_the_first_and_the_mode(tmp_path: Path,
                                                  capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "api_keys"
    path.write_text(f"# users\nalice:{hash_key('abc')}")  # no final newline
    path.chmod(0o600)
    code, out, err = issue(capsys, "bob", "--keys-file", str(path))
    assert code == 0, err
    keys = ApiKeys.load(path)
    assert keys.user("abc") == "alice"
    assert keys.user(out.strip()) == "bob"
    assert path.read_text().startswith(f"# users\nalice:{hash_key('abc')}\nbob:sha256:")
    assert stat.S_IMODE(path.stat().st_mode) == 0o600


def test_a_name_with_a_key_is_refused(tmp_path: Path,
                                      capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "api_keys"
    assert issue(capsys, "alice", "--keys-file", str(path))[0] == 0
    before = path.read_bytes()
    code, out, err = issue(capsys, "alice", "--keys-file", str(path))
    assert code == 2
    assert out == ""  # no key that would not work
    assert "alice already has a key" in err and "--replace" in err
    assert path.read_bytes() == before


def test_replace_revokes_the_old_key_and_says_the_new_one_is_a_new_user(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "api_keys"
    code, old, _ = issue(capsys, "alice", "--keys-file", str(path))
    assert issue(capsys, "bob", "--keys-file", str(path))[0] == 0
    code, new, err = issue(capsys, "alice", "--replace", "--keys-file", str(path))
    assert code == 0, err
    keys = ApiKeys.load(path)
    assert keys.user(new.strip()) == "alice" and keys.user(old.strip()) is None
    assert len(keys) == 2
    assert "a new user" in err and "replaced now" in err
    assert re.search(r"^# revoked: alice \S+Z \(replaced\)$", path.read_text(), re.M)


def test_revoke_keeps_the_name_on_record(tmp_path: Path,
                                         capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "api_keys"
    _, old, _ = issue(capsys, "alice", "--keys-file", str(path))
    code, out, err = issue(capsys, "alice", "--revoke", "--keys-file", str(path))
    assert (code, out) == (0, "")  # no key printed
    assert "sessions end" in err
    assert ApiKeys.load(path).user(old.strip()) is None
    assert issue(capsys, "alice", "--revoke", "--keys-file", str(path))[0] == 2
    # Issued again later: allowed, and told that nothing of the old key comes along.
    code, new, err = issue(capsys, "alice", "--keys-file", str(path))
    assert code == 0 and ApiKeys.load(path).user(new.strip()) == "alice"
    assert "had a key before (revoked 2" in err and "a new user" in err


def test_an_invalid_name_is_refused(tmp_path: Path,
                                    capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "api_keys"
    for name in ("bad name", "a:b", "x" * 65, ""):
        code, out, err = issue(capsys, name, "--keys-file", str(path))
        assert (code, out) == (2, ""), name
        assert "user name" in err
    assert not path.exists()


def test_a_broken_keys_file_is_left_alone(tmp_path: Path,
                                          capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "api_keys"
    path.write_text("carol:plaintext-key\n")
    code, out, err = issue(capsys, "alice", "--keys-file", str(path))
    assert (code, out) == (78, "")
    assert f"{path}:1:" in err and "plaintext key" in err
    assert path.read_text() == "carol:plaintext-key\n"


def test_a_missing_directory_is_a_failure(tmp_path: Path,
                                          capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = issue(capsys, "alice", "--keys-file", str(tmp_path / "no" / "keys"))
    assert (code, out) == (1, "")
    assert "No such file or directory" in err


def test_without_a_file_the_line_to_add_is_printed(tmp_path: Path,
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = issue(capsys, "alice")
    assert code == 0
    key = out.strip()
    match = re.fullmatch(r"add to http\.api_keys_file: (alice:sha256:[0-9a-f]{64})\n", err)
    assert match is not None, err
    path = tmp_path / "api_keys"
    path.write_text(match.group(1) + "\n")
    assert ApiKeys.load(path).user(key) == "alice"


def test_a_missing_name_is_a_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as caught:
        main(["api-key"])
    assert caught.value.code == 2
    assert "NAME" in capsys.readouterr().err


def test_a_name_is_only_for_api_key(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as caught:
        main(["check-config", "alice"])
    assert caught.value.code == 2
    assert "unrecognized arguments: alice" in capsys.readouterr().err


def test_check_config_checks_the_keys_file_it_names(tmp_path: Path,
                                                    capsys: pytest.CaptureFixture[str],
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    from tests.conftest import TINY

    monkeypatch.delenv("QVLD_CONFIG")
    keys = tmp_path / "api_keys"
    code, _, _ = issue(capsys, "alice", "--keys-file", str(keys))
    assert code == 0
    args = ["check-config", "--model", str(TINY), "--set", f"http.api_keys_file={keys}"]
    assert main(args) == 0
    keys.write_text(keys.read_text() + "bob:plaintext-key\n")
    assert main(args) == 78
    assert f"{keys}:2: looks like a plaintext key" in capsys.readouterr().err
