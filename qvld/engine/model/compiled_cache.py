"""The compiled-model cache (``model.cache_dir``), not trusted blindly.

A runtime imports a cached blob without checking its bytes (an overwritten blob made
every answer token 0). So blobs live in a subdirectory keyed by what they were compiled
from (runtime and version, qvld, device, the model files, the compile properties) and are
checked against a manifest of their sha256 before the runtime sees them; a damaged or
unknown blob discards the subdirectory's blobs, and a directory others can write is not
used at all. Knows nothing of the runtime itself: the backend passes its name and version.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import logging
import os
import shutil
import stat
import tempfile
from collections.abc import Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from qvld import __version__
from qvld.engine.model.model_dir import SUBMODELS, ModelSpec

log = logging.getLogger("qvld.engine")


def usable_cache_dir(path: Path) -> bool:
    """Whether the compiled-model cache can be written; if not, serve without it."""
    try:
        path.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=path):
            pass
    except OSError as exc:
        log.warning("model.cache_dir %s is not usable (%s); compiling without a cache",
                    path, exc.strerror or exc)
        return False
    if shutil.disk_usage(path).free < 256 << 20:
        log.warning("model.cache_dir %s has less than 256 MiB free; compiling without a "
                    "cache", path)
        return False
    return True


# -- the compiled-model cache ------------------------------------------------------------

MANIFEST = "manifest.json"
_CHUNK = 8 << 20  # hashlib releases the GIL on large updates: files hash in parallel
# A .bin is keyed by size, mtime and these sampled bytes (~1 ms), not by a full sha256:
# measured here (SHA-NI) 1.55 GB/s in memory, 0.6-0.9 GB/s from the page cache on this
# shared 2-core box, i.e. 1.3-3 s a start for a 2 GB .bin, on top of verifying the blobs
# (which must be read in full). OpenVINO already hashes every weight into a blob's own
# name (a changed .bin compiled into a new blob, tested), so a stale blob is never used.
_SAMPLES, _SAMPLE_BYTES = 16, 64 << 10


def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb", buffering=0) as f:
        buffer = bytearray(_CHUNK)
        view = memoryview(buffer)
        while n := f.readinto(buffer):
            digest.update(view[:n])
    return digest.hexdigest()


def sampled_digest(path: Path) -> str:
    """size, mtime and evenly spaced blocks (the first and last included) of ``path``."""
    info = path.stat()
    digest = hashlib.sha256(f"{info.st_size}:{info.st_mtime_ns}".encode())
    last = max(0, info.st_size - _SAMPLE_BYTES)
    with open(path, "rb") as f:
        for i in range(_SAMPLES):
            f.seek(last * i // (_SAMPLES - 1))
            digest.update(f.read(_SAMPLE_BYTES))
    return digest.hexdigest()


def cache_key(spec: ModelSpec, runtime: str, device: str,
              properties: dict[str, dict[str, Any]]) -> str:
    """The name of the cache subdirectory: the runtime (name and version), qvld (its
    graph rewrites), the device, every submodel's files and the properties each is
    compiled with."""
    files = {sub: [sha256_file(spec.ir(sub)), sampled_digest(spec.ir(sub).with_suffix(".bin"))]
             for sub in SUBMODELS}
    identity = {"runtime": runtime, "qvld": __version__, "device": device,
                "files": files, "properties": properties}
    text = json.dumps(identity, sort_keys=True, default=str)
    return "ov-" + hashlib.sha256(text.encode()).hexdigest()[:32]


def unsafe_dir(path: Path) -> tuple[str, str] | None:
    """Why ``path`` must not hold compiled models (someone else could replace them),
    and the remedy."""
    info = path.stat()
    uid = os.geteuid()
    if info.st_mode & (stat.S_IWGRP | stat.S_IWOTH) and not info.st_mode & stat.S_ISVTX:
        return (f"{path} is writable by others (mode {stat.S_IMODE(info.st_mode):04o})",
                f"chmod go-w {path}")
    if info.st_uid not in (0, uid):
        return (f"{path} is owned by uid {info.st_uid}, not by this daemon (uid {uid}) or "
                "root", f"chown {uid} {path}")
    return None


@dataclass(frozen=True)
class BlobRecord:
    sha256: str
    size: int
    mtime_ns: int = 0  # when it was hashed here: an unchanged file need not be hashed again


def _record(path: Path) -> BlobRecord:
    info = path.stat()  # before hashing: a later write shows as a newer mtime
    return BlobRecord(sha256_file(path), info.st_size, info.st_mtime_ns)


def _hash_all(paths: Iterable[Path]) -> dict[str, BlobRecord]:
    paths = list(paths)
    with ThreadPoolExecutor(max_workers=max(1, min(4, len(paths), os.cpu_count() or 1)),
                            thread_name_prefix="qvld-hash") as pool:
        return dict(zip([p.name for p in paths], pool.map(_record, paths), strict=True))


def _read_manifest(directory: Path) -> dict[str, BlobRecord] | None:
    try:
        blobs = json.loads((directory / MANIFEST).read_text(encoding="utf-8"))["blobs"]
        return {str(name): BlobRecord(str(entry["sha256"]), int(entry["size"]))
                for name, entry in blobs.items()}
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None  # missing or damaged: nothing in the directory can be trusted


def _check(directory: Path, manifest: dict[str, BlobRecord]
           ) -> tuple[list[str], dict[str, BlobRecord]]:
    """What differs from the manifest (by file), and the records of the blobs hashed."""
    present = {p.name: p for p in directory.glob("*.blob")}
    problems = [f"{n} is not in the manifest" for n in sorted(present.keys() - manifest.keys())]
    problems += [f"{n} is missing" for n in sorted(manifest.keys() - present.keys())]
    both = sorted(manifest.keys() & present.keys())
    resized = [n for n in both if present[n].stat().st_size != manifest[n].size]
    problems += [f"{n} has a different size" for n in resized]
    actual = _hash_all(present[n] for n in both if n not in resized)
    problems += [f"{n} does not match its sha256" for n, record in actual.items()
                 if record.sha256 != manifest[n].sha256]
    return problems, actual


def _verified_blobs(directory: Path) -> dict[str, BlobRecord]:
    """The blobs, if all match the manifest; else none: all are deleted."""
    blobs = sorted(directory.glob("*.blob"))
    manifest = _read_manifest(directory)
    if manifest is None:
        if not blobs:
            return {}  # a new subdirectory
        problems = [f"{MANIFEST} is missing or unreadable"]
    else:
        problems, records = _check(directory, manifest)
        if not problems:
            return records
    log.warning("model.cache_dir %s: %s; deleting its %d compiled blob(s) and compiling "
                "afresh", directory, "; ".join(problems), len(blobs))
    for blob in blobs:
        blob.unlink(missing_ok=True)
    (directory / MANIFEST).unlink(missing_ok=True)
    return {}


def _write_atomically(path: Path, text: str) -> None:
    """A crash leaves the old manifest or the new one, never half of one."""
    with tempfile.NamedTemporaryFile("w", dir=path.parent, prefix=f".{path.name}.",
                                     delete=False, encoding="utf-8") as tmp:
        tmp.write(text)
        tmp.flush()
        os.fsync(tmp.fileno())
    os.replace(tmp.name, path)
    directory = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(directory)
    finally:
        os.close(directory)


class ModelCache:
    """One verified subdirectory of model.cache_dir, locked while compiling into it."""

    def __init__(self, path: Path, verified: dict[str, BlobRecord], runtime: str) -> None:
        self.path = path
        self.verified = verified
        self.runtime = runtime

    def blobs(self) -> list[Path]:
        return sorted(self.path.glob("*.blob"))

    def seal(self) -> None:
        """Record what the compile wrote (only blobs new or changed since verified)."""
        current = {p.name: p.stat() for p in self.blobs()}
        records = {name: r for name, r in self.verified.items() if name in current
                   and (current[name].st_size, current[name].st_mtime_ns) == (r.size, r.mtime_ns)}
        fresh = _hash_all(self.path / name for name in current if name not in records)
        if not fresh and records.keys() == self.verified.keys():
            return
        records.update(fresh)
        blobs = {name: {"sha256": r.sha256, "size": r.size} for name, r in sorted(records.items())}
        _write_atomically(self.path / MANIFEST, json.dumps(
            {"format": 1, "runtime": self.runtime, "blobs": blobs}, indent=1) + "\n")
        self.verified = records


@contextlib.contextmanager
def open_model_cache(root: Path | None, key: str, runtime: str
                     ) -> Iterator[ModelCache | None]:
    """The verified cache subdirectory for ``key``, or None: compile without a cache."""
    if root is None or not usable_cache_dir(root):
        yield None
        return
    directory = root / key
    problem = unsafe_dir(root)
    if problem is None and directory.is_symlink():
        # Ours to create: a link could point the cache (and its deletions) elsewhere.
        problem = (f"{directory} is a symbolic link", f"rm {directory}")
    if problem is None:
        with contextlib.suppress(OSError):  # usable_cache_dir says what is wrong
            directory.mkdir(mode=0o700)
        if not usable_cache_dir(directory):
            yield None
            return
        problem = unsafe_dir(directory)
    if problem is not None:
        log.warning("model.cache_dir: %s: compiling without the cache (remedy: %s)", *problem)
        yield None
        return
    # Another qvld (or a reload) compiling the same model must not see half-written blobs.
    with open(directory / ".lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield ModelCache(directory, _verified_blobs(directory), runtime)
