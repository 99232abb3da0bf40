"""Bearer API keys for the HTTP listener.

The keys live in one file (``http.api_keys_file``), stored hashed, one key per user
name; the daemon re-reads it on SIGHUP. The format::

    # comments and blank lines are ignored
    alice:sha256:ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad
    bob:sha256:<64 lowercase hex digits>

- NAME: 1-64 characters of ``[A-Za-z0-9._@-]``; each name appears once.
- ``sha256:`` and the SHA-256 of the UTF-8 key, 64 lowercase hex digits; each hash
  appears once (two users with one key could not be told apart).

``qvld api-key NAME --keys-file FILE`` prints a new key and appends its line. A line
holding a plaintext key is refused: the file is read by the daemon and copied into
backups, so it holds only hashes.
"""

from __future__ import annotations

import contextlib
import grp
import hashlib
import logging
import os
import pwd
import re
import secrets
import stat
import tempfile
import threading
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType

log = logging.getLogger("qvld.http")

# HTTP users get ids above every uid (uid_t is 32 bits), so no key ever maps to root or
# to a user of the socket.
HTTP_USER_ID_BASE = 1 << 32

SCHEME = "sha256:"
MAX_TOKEN = 512
_NAME = re.compile(r"[A-Za-z0-9._@-]{1,64}")
_HEX = re.compile(r"[0-9a-f]+")
# RFC 9110 credentials: scheme, then SP/HTAB, then the token; nothing else splits them
# (str.split() would also split on \x1c-\x1f, \x85 and friends).
_BEARER = re.compile(rf"[ \t]*([A-Za-z]+)[ \t]+([\x21-\x7e]{{1,{MAX_TOKEN}}})[ \t]*")


class KeyFileError(Exception):
    """The keys file cannot be used; ``errors`` holds every problem, "path:line: why"."""

    def __init__(self, errors: list[str]) -> None:
        super().__init__("\n".join(errors))
        self.errors = errors


def hash_key(key: str) -> str:
    """``"sha256:<hex>"`` of the UTF-8 key.

    Keys are long random tokens (see new_key), not passwords: nobody can guess one from
    its hash, so a fast hash is right and a slow KDF would only cost every request.
    """
    return SCHEME + hashlib.sha256(key.encode("utf-8")).hexdigest()


def new_key() -> str:
    """A fresh key: 256 random bits; the prefix makes a leaked key easy to recognise."""
    return "qvld-" + secrets.token_urlsafe(32)


def valid_name(name: str) -> bool:
    return _NAME.fullmatch(name) is not None


def parse_bearer(header: str | None) -> str | None:
    """The token of an ``Authorization: Bearer <token>`` header, else None."""
    if header is None:
        return None
    match = _BEARER.fullmatch(header)
    if match is None or match.group(1).lower() != "bearer":
        return None
    return match.group(2)


def _parse_line(line: str, where: str) -> tuple[str | None, str | None, list[str]]:
    """(name, hash, errors) of one non-comment line; name or hash None where invalid.

    Messages never quote what may be a key: they end up in logs.
    """
    name, sep, rest = line.partition(":")
    if sep and not rest:
        return None, None, [f"{where}: no sha256:<hex> after the name"]
    if not sep or ":" not in rest:
        who = name if sep and valid_name(name) else "NAME"
        return None, None, [
            f"{where}: looks like a plaintext key; the file holds only hashes: issue a new "
            f"key with `qvld api-key {who} --keys-file FILE`, or write "
            f"{who}:sha256:<sha256 hex of the key>"]
    errors = []
    if not valid_name(name):
        shown = repr(name) if len(name) <= 64 else "longer than 64 characters"
        errors.append(f"{where}: user name {shown} is not 1-64 characters of "
                      "[A-Za-z0-9._@-]")
    key_hash: str | None = None
    scheme, _, digest = rest.partition(":")
    if scheme != SCHEME[:-1]:
        errors.append(f"{where}: unknown hash {scheme[:16]!r} (only sha256)")
    elif _HEX.fullmatch(digest) is None:
        errors.append(f"{where}: the sha256 hash is not lowercase hex digits")
    elif len(digest) != 64:
        errors.append(f"{where}: the sha256 hash has {len(digest)} hex digits, not 64")
    else:
        key_hash = SCHEME + digest
    return (name if valid_name(name) else None), key_hash, errors


# The service's own user (packaging/sysusers.d): `qvld check-config` run by root trusts
# a file the daemon's user owns, as the daemon itself does.
SERVICE_USER = "qvld"


def _trusted_owner(uid: int) -> bool:
    if uid in (0, os.geteuid()):
        return True
    try:
        return pwd.getpwnam(SERVICE_USER).pw_uid == uid
    except KeyError:
        return False


def writable_by_others(path: Path, info: os.stat_result) -> str | None:
    """Why someone besides root and the daemon's own user could change the keys file
    (and so give themselves a key), or None. As sshd's StrictModes: the file is owned by
    one of them and writable by no group or other user, and so is every directory above
    it, unless the directory is sticky (/tmp: others cannot replace what is not theirs).
    Both the path as given and the file it resolves to are checked. A file on a
    read-only mount (a Kubernetes Secret, a container's ``:ro`` bind) cannot be changed
    from here by anyone."""
    try:
        if os.statvfs(path).f_flag & os.ST_RDONLY:
            return None
    except OSError:
        pass
    if not _trusted_owner(info.st_uid):
        return (f"{path} is writable by other users: it is owned by uid {info.st_uid} "
                f"(only root or the daemon's user may own it): chown root {path}")
    if info.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        return (f"{path} is writable by other users (mode "
                f"{stat.S_IMODE(info.st_mode):04o}); chmod go-w {path}")
    absolute = Path(os.path.abspath(path))
    directories = {*absolute.parents, *Path(os.path.realpath(path)).parents}
    for directory in sorted(directories, key=lambda d: len(d.parts)):
        try:
            dinfo = directory.stat()
        except OSError:
            continue  # the file was opened through it: nothing to say about it here
        if not _trusted_owner(dinfo.st_uid):
            return (f"{path} is writable by other users: its directory {directory} is "
                    f"owned by uid {dinfo.st_uid}, who can replace the file")
        if dinfo.st_mode & (stat.S_IWGRP | stat.S_IWOTH) \
                and not dinfo.st_mode & stat.S_ISVTX:
            return (f"{path} is writable by other users: its directory {directory} "
                    f"(mode {stat.S_IMODE(dinfo.st_mode):04o}) lets others replace it; "
                    f"chmod go-w {directory}")
    return None


@dataclass(frozen=True)
class ApiKeys:
    """The keys of one reading of the keys file."""

    users_by_hash: Mapping[str, str]  # "sha256:<hex>" -> user name
    path: Path | None = None

    @classmethod
    def load(cls, path: Path) -> ApiKeys:
        """Read and validate ``path``; KeyFileError lists every problem at once."""
        try:
            with open(path, "rb") as file:
                info = os.fstat(file.fileno())
                data = file.read()
        except OSError as exc:
            raise KeyFileError([f"{path}: {exc.strerror or exc}"]) from exc
        unsafe = writable_by_others(path, info)
        if unsafe is not None:
            raise KeyFileError([unsafe])
        if info.st_mode & stat.S_IROTH:
            # Hashes of random keys do not give keys away, but who has a key is still
            # nobody else's business; warn rather than refuse to start.
            log.warning("%s is readable by every user (mode %04o); chmod o-r it",
                        path, stat.S_IMODE(info.st_mode))
        try:
            text = data.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise KeyFileError([f"{path}: not UTF-8 text ({exc.reason})"]) from exc

        errors: list[str] = []
        users: dict[str, str] = {}
        name_lines: dict[str, int] = {}
        hash_lines: dict[str, int] = {}
        for number, raw in enumerate(text.splitlines(), start=1):
            line = raw.strip()
            if not line or line.startswith("#"):
                continue
            where = f"{path}:{number}"
            name, key_hash, line_errors = _parse_line(line, where)
            errors += line_errors
            if name is not None:
                if name in name_lines:
                    errors.append(f"{where}: user {name!r} already has a key on line "
                                  f"{name_lines[name]}")
                else:
                    name_lines[name] = number
            if key_hash is not None:
                if key_hash in hash_lines:
                    errors.append(f"{where}: the same key hash as line {hash_lines[key_hash]}")
                else:
                    hash_lines[key_hash] = number
            if not line_errors and name is not None and key_hash is not None:
                users.setdefault(key_hash, name)
        if errors:
            raise KeyFileError(errors)
        return cls(MappingProxyType(users), path)

    def user(self, key: str) -> str | None:
        """The user a presented key belongs to, or None."""
        found = self.identify(key)
        return found[0] if found is not None else None

    def identify(self, key: str) -> tuple[str, str] | None:
        """(user name, key hash) of a presented key, or None.

        A dict lookup of the key's hash, not hmac.compare_digest: what timing could leak
        is how much of a stored hash matches the hash of the attacker's guess, and that
        brings no closer a key hashing to it.
        """
        if not key:
            return None
        try:
            key_hash = hash_key(key)
        except UnicodeEncodeError:  # lone surrogates: no key in the file is one
            return None
        name = self.users_by_hash.get(key_hash)
        return (name, key_hash) if name is not None else None

    @property
    def names(self) -> frozenset[str]:
        return frozenset(self.users_by_hash.values())

    def __len__(self) -> int:
        return len(self.users_by_hash)


class UserIds:
    """Stable numeric ids for HTTP users within one daemon process (the scheduler,
    sessions and caches key users by int). A user is a name with one key: a new key
    under a name (a revoked one issued again, a rotation) is a new user, with nothing of
    the old key's sessions or caches. Append-only, so a reload keeps every user's
    sessions; ids start at HTTP_USER_ID_BASE."""

    def __init__(self) -> None:
        self._ids: dict[tuple[str, str], int] = {}
        self._names: list[str] = []
        self._lock = threading.Lock()  # ids must stay distinct if threads ask at once

    def id(self, name: str, key_hash: str = "") -> int:
        with self._lock:
            user_id = self._ids.get((name, key_hash))
            if user_id is None:
                user_id = HTTP_USER_ID_BASE + len(self._names)
                self._ids[(name, key_hash)] = user_id
                self._names.append(name)
            return user_id

    def known(self, name: str, key_hash: str) -> int | None:
        """The id of that name and key if it has asked anything, else None."""
        with self._lock:
            return self._ids.get((name, key_hash))

    def name(self, user_id: int) -> str | None:
        index = user_id - HTTP_USER_ID_BASE
        with self._lock:
            return self._names[index] if 0 <= index < len(self._names) else None

    @staticmethod
    def is_http(user_id: int) -> bool:
        return user_id >= HTTP_USER_ID_BASE


REVOKED = "# revoked: "


def revoked_names(path: Path) -> dict[str, str]:
    """Names whose keys were revoked by ``qvld api-key --revoke/--replace``: name ->
    the rest of the record (when, and why)."""
    names = {}
    for line in path.read_text(encoding="utf-8").splitlines():
        if line.startswith(REVOKED):
            name, _, rest = line[len(REVOKED):].partition(" ")
            names[name] = rest
    return names


def revoke_line(path: Path, name: str, record: str) -> bool:
    """Turn ``name``'s key line into a ``# revoked: NAME RECORD`` comment (the name's
    history stays in the file: a later key for it is told it is a new user); False if
    the name has no key line."""
    lines = path.read_text(encoding="utf-8").splitlines()
    for number, line in enumerate(lines):
        if line.strip().partition(":")[0] == name and not line.lstrip().startswith("#"):
            lines[number] = f"{REVOKED}{name} {record}"
            _write(path, ("\n".join(lines) + "\n").encode(), exists=True)
            return True
    return False


def append_line(path: Path, line: str, exists: bool) -> None:
    """Append ``line`` (see _write)."""
    text = path.read_bytes() if exists else b""
    if text and not text.endswith(b"\n"):
        text += b"\n"
    _write(path, text + line.encode() + b"\n", exists)


def _write(path: Path, content: bytes, exists: bool) -> None:
    """Replace the file atomically: the daemon may re-read it at any moment, and a crash
    must leave either the old file or the new one, never a torn one."""
    if exists:
        info = path.stat()
        mode, owner = info.st_mode & 0o7777, (info.st_uid, info.st_gid)
    else:
        # The daemon's group may read it, others not: root's new file goes to the
        # service's group (the daemon runs as that user, not as root).
        mode, owner = 0o640, None
        if os.geteuid() == 0:
            with contextlib.suppress(KeyError):
                owner = (0, grp.getgrnam(SERVICE_USER).gr_gid)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as file:
            # Keep the owner and the group the daemon reads it through when root edits
            # the file (chown first: it may clear mode bits).
            made = os.fstat(file.fileno())
            if owner is not None and owner != (made.st_uid, made.st_gid):
                os.fchown(file.fileno(), *owner)
            os.fchmod(file.fileno(), mode)  # mkstemp makes 0600, and umask must not apply
            file.write(content)
            file.flush()
            os.fsync(file.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    dir_fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(dir_fd)  # make the rename itself durable
    finally:
        os.close(dir_fd)
