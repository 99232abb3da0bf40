"""API keys: the keys file, key lookup, HTTP user ids and the Authorization header."""

from __future__ import annotations

import hashlib
import logging
import os
from pathlib import Path

import pytest

from qvld.http.keys import (
    HTTP_USER_ID_BASE,
    ApiKeys,
    KeyFileError,
    UserIds,
    hash_key,
    new_key,
    parse_bearer,
)

ABC_HASH = "sha256:ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad"


def write(tmp_path: Path, text: str, mode: int = 0o640) -> Path:
    path = tmp_path / "api_keys"
    path.write_text(text)
    path.chmod(mode)
    return path


def test_hash_key_known_vector() -> None:
    assert hash_key("abc") == ABC_HASH
    assert hash_key("é") == "sha256:" + hashlib.sha256("é".encode()).hexdigest()


def test_new_keys_are_fresh_and_fit_a_bearer_header() -> None:
    first, second = new_key(), new_key()
    assert first != second
    assert first.startswith("qvld-") and len(first) >= 40
    assert parse_bearer(f"Bearer {first}") == first


def test_load_a_valid_file(tmp_path: Path) -> None:
    alice, bob = new_key(), new_key()
    path = write(tmp_path, "# the HTTP users\n\n"
                           f"alice:{hash_key(alice)}\n"
                           f"  bob.b@example-1_x:{hash_key(bob)}  \r\n"
                           "   # indented comment\n")
    keys = ApiKeys.load(path)
    assert keys.path == path
    assert len(keys) == 2
    assert keys.names == frozenset({"alice", "bob.b@example-1_x"})
    assert keys.user(alice) == "alice"
    assert keys.user(bob) == "bob.b@example-1_x"


def test_user_is_none_for_a_wrong_or_empty_key(tmp_path: Path) -> None:
    alice = new_key()
    keys = ApiKeys.load(write(tmp_path, f"alice:{hash_key(alice)}\n"))
    assert keys.user(alice + "x") is None
    assert keys.user(alice[:-1]) is None
    assert keys.user("") is None
    assert keys.user("\ud800") is None  # not encodable: no key, no exception
    assert keys.user(hash_key(alice)) is None  # the hash is not the key


def test_an_empty_file_has_no_keys(tmp_path: Path) -> None:
    keys = ApiKeys.load(write(tmp_path, "# nobody yet\n"))
    assert len(keys) == 0 and not keys
    assert keys.user("anything") is None


def test_every_error_is_reported_at_once_with_its_line(tmp_path: Path) -> None:
    good = hash_key("good")
    plaintext = new_key()
    path = write(tmp_path, "\n".join([
        f"alice:{good}",                                  # 1 fine
        f"bad name:{hash_key('a')}",                      # 2 bad name
        f"alice:{hash_key('b')}",                         # 3 duplicate name
        f"carol:{good}",                                  # 4 duplicate hash
        f"dave:{plaintext}",                              # 5 plaintext key
        f"erin:sha256:{'g' * 64}",                        # 6 bad hex
        f"frank:sha256:{'a' * 63}",                       # 7 wrong length
        f"gina:sha256:{'A' * 64}",                        # 8 uppercase is not lowercase hex
        f"{'x' * 65}:{hash_key('c')}",                    # 9 name too long
        f"hank:md5:{'a' * 32}",                           # 10 other hash
        plaintext,                                        # 11 a bare key
        "ivan:",                                          # 12 nothing after the name
    ]) + "\n")
    with pytest.raises(KeyFileError) as caught:
        ApiKeys.load(path)
    errors = caught.value.errors
    by_line: dict[int, list[str]] = {}
    for error in errors:
        prefix, line, why = error.split(":", 2)
        assert prefix == str(path), error
        by_line.setdefault(int(line), []).append(why)
    assert sorted(by_line) == list(range(2, 13)), errors
    assert all(len(whys) == 1 for whys in by_line.values()), errors
    assert "user name 'bad name'" in by_line[2][0]
    assert "'alice' already has a key on line 1" in by_line[3][0]
    assert "same key hash as line 1" in by_line[4][0]
    assert "plaintext key" in by_line[5][0] and "qvld api-key dave" in by_line[5][0]
    assert "lowercase hex" in by_line[6][0]
    assert "63 hex digits, not 64" in by_line[7][0]
    assert "lowercase hex" in by_line[8][0]
    assert "longer than 64" in by_line[9][0]
    assert "only sha256" in by_line[10][0]
    assert "plaintext key" in by_line[11][0] and "qvld api-key NAME" in by_line[11][0]
    assert "no sha256" in by_line[12][0]
    # The message names the file's problems, never a key that might be in it.
    assert plaintext not in str(caught.value)
    assert str(caught.value) == "\n".join(errors)


def test_a_64_character_name_is_fine(tmp_path: Path) -> None:
    keys = ApiKeys.load(write(tmp_path, f"{'n' * 64}:{ABC_HASH}\n"))
    assert keys.user("abc") == "n" * 64


def test_unreadable_or_missing_file_is_a_key_file_error(tmp_path: Path) -> None:
    with pytest.raises(KeyFileError) as caught:
        ApiKeys.load(tmp_path / "missing")
    assert caught.value.errors == [f"{tmp_path / 'missing'}: No such file or directory"]
    latin1 = tmp_path / "latin1"
    latin1.write_bytes(b"\xe9:x\n")
    with pytest.raises(KeyFileError, match="not UTF-8"):
        ApiKeys.load(latin1)
    with pytest.raises(KeyFileError):
        ApiKeys.load(tmp_path)  # a directory


@pytest.fixture
def http_log(caplog: pytest.LogCaptureFixture,
             monkeypatch: pytest.MonkeyPatch) -> pytest.LogCaptureFixture:
    # setup_logging() in another test of this process may have stopped "qvld" propagating
    # to the root logger, where caplog listens.
    monkeypatch.setattr(logging.getLogger("qvld"), "propagate", True)
    caplog.set_level(logging.WARNING, logger="qvld.http")
    return caplog


def test_a_world_readable_file_warns_but_loads(tmp_path: Path,
                                               http_log: pytest.LogCaptureFixture) -> None:
    path = write(tmp_path, f"alice:{ABC_HASH}\n", mode=0o644)
    assert ApiKeys.load(path).user("abc") == "alice"
    warnings = [r for r in http_log.records
                if r.name == "qvld.http" and r.levelno == logging.WARNING]
    assert len(warnings) == 1
    assert str(path) in warnings[0].getMessage() and "0644" in warnings[0].getMessage()


def test_a_private_file_does_not_warn(tmp_path: Path,
                                      http_log: pytest.LogCaptureFixture) -> None:
    ApiKeys.load(write(tmp_path, f"alice:{ABC_HASH}\n", mode=0o640))
    assert not [r for r in http_log.records if r.name == "qvld.http"]


def test_user_ids_are_stable_distinct_and_above_every_uid() -> None:
    ids = UserIds()
    alice = ids.id("alice")
    bob = ids.id("bob")
    assert alice == HTTP_USER_ID_BASE == 2**32
    assert alice > 2**32 - 1 and bob > 2**32 - 1
    assert alice != bob
    assert ids.id("alice") == alice  # again, and after others
    assert ids.name(alice) == "alice" and ids.name(bob) == "bob"
    assert ids.name(0) is None and ids.name(bob + 1) is None
    assert ids.name(HTTP_USER_ID_BASE - 1) is None


def test_is_http() -> None:
    ids = UserIds()
    assert UserIds.is_http(ids.id("alice"))
    assert not UserIds.is_http(0)  # root
    assert not UserIds.is_http(1000)
    assert not UserIds.is_http(2**32 - 1)  # the largest uid_t


@pytest.mark.parametrize(("header", "token"), [
    ("Bearer abc", "abc"),
    ("bearer abc", "abc"),
    ("BEARER abc", "abc"),
    ("  Bearer    abc  ", "abc"),
    ("Bearer\tabc", "abc"),
    ("Bearer a.b-c_d~e+f/g=", "a.b-c_d~e+f/g="),
    ("Bearer " + "k" * 512, "k" * 512),
    (None, None),
    ("", None),
    ("Bearer", None),
    ("Bearer ", None),
    ("Bearer abc def", None),
    ("Bearer abc\x00", None),
    ("Bearer ab\x1fc", None),
    ("Bearer\x1fabc", None),
    ("Bearer abc\n", None),
    ("Bearer ab\x7fc", None),
    ("Bearer abcé", None),
    ("Bearer " + "k" * 513, None),
    ("Basic YWxpY2U6c2VjcmV0", None),
    ("Bearerabc", None),
    ("Token abc", None),
])
def test_parse_bearer(header: str | None, token: str | None) -> None:
    assert parse_bearer(header) == token


def test_a_new_key_under_a_name_is_a_new_user() -> None:
    ids = UserIds()
    old = ids.id("alice", hash_key("old"))
    new = ids.id("alice", hash_key("new"))
    assert old != new and ids.name(old) == ids.name(new) == "alice"
    assert ids.known("alice", hash_key("old")) == old
    assert ids.known("alice", hash_key("never asked")) is None


@pytest.mark.parametrize(("mode", "why"), [
    (0o666, "mode 0666"), (0o620, "mode 0620"), (0o602, "mode 0602")])
def test_a_file_others_can_write_is_refused(tmp_path: Path, mode: int, why: str) -> None:
    path = write(tmp_path, f"alice:{ABC_HASH}\n", mode=mode)
    with pytest.raises(KeyFileError, match=f"writable by other users \\({why}\\)"):
        ApiKeys.load(path)


def test_a_file_owned_by_another_user_is_refused(tmp_path: Path) -> None:
    path = write(tmp_path, f"alice:{ABC_HASH}\n", mode=0o600)
    os.chown(path, 65534, 65534)
    with pytest.raises(KeyFileError, match="owned by uid 65534"):
        ApiKeys.load(path)


def test_a_directory_others_can_write_is_refused_unless_sticky(tmp_path: Path) -> None:
    directory = tmp_path / "conf"
    directory.mkdir()
    path = write(directory, f"alice:{ABC_HASH}\n", mode=0o600)
    directory.chmod(0o777)
    with pytest.raises(KeyFileError, match=f"its directory {directory} \\(mode 0777\\)"):
        ApiKeys.load(path)
    directory.chmod(0o1777)  # sticky, like /tmp: others cannot replace the file
    assert ApiKeys.load(path).user("abc") == "alice"
    directory.chmod(0o755)
    os.chown(directory, 65534, 65534)
    with pytest.raises(KeyFileError, match=f"its directory {directory} is owned by uid 65534"):
        ApiKeys.load(path)
    # A link from a safe place to a file in an unsafe one is judged where it points.
    os.chown(directory, 0, 0)
    directory.chmod(0o777)
    link = tmp_path / "keys-link"
    link.symlink_to(path)
    with pytest.raises(KeyFileError, match="lets others replace it"):
        ApiKeys.load(link)


def test_a_file_on_a_read_only_mount_is_trusted(tmp_path: Path) -> None:
    """A Kubernetes Secret or a container's :ro bind: nobody here can change it, whoever
    owns it (in a mount namespace of its own, so nothing else sees the mount)."""
    import subprocess
    import sys
    import textwrap

    mount = tmp_path / "ro"
    mount.mkdir()
    script = textwrap.dedent(f"""
        set -e
        mount -t tmpfs tmpfs {mount}
        printf 'alice:{ABC_HASH}\\n' > {mount}/keys
        chmod 0666 {mount}/keys
        chown 65534 {mount}/keys
        {sys.executable} -c 'from qvld.http.keys import ApiKeys; from pathlib import Path
        ApiKeys.load(Path("{mount}/keys"))' 2>/dev/null && echo writable-accepted
        mount -o remount,ro {mount}
        {sys.executable} -c 'from qvld.http.keys import ApiKeys; from pathlib import Path
        print(ApiKeys.load(Path("{mount}/keys")).user("abc"))'
        """)
    out = subprocess.run(["unshare", "--mount", "--propagation", "private", "sh", "-c",
                          script], capture_output=True, text=True, timeout=60, check=False)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["alice"], out.stdout
