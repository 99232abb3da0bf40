"""`qvlctl model pull|list`: a model qvld serves, fetched from the Hugging Face hub.

``pull REPO [DIR]`` downloads an OpenVINO export of Qwen3-VL (the layout ``qvlctl model
convert`` writes: ``openvino_*_model.xml/.bin`` beside the tokenizer and configs) with
``huggingface_hub`` (it honours ``HF_ENDPOINT``, ``HF_TOKEN``, proxies, and resumes an
interrupted file with a range request), into ``DIR.partial`` beside the destination.
Every file is then checked against what the hub says of it (its size, and the sha256 of
a large file or the git blob id of a small one); only then is the directory renamed into
place, with ``qvld-pull.json`` recording where it came from, and loaded once to answer a
question, as ``convert`` does. A half-downloaded or mismatched model is never served. A
repository that holds a transformers checkpoint instead is downloaded the same way and
converted (``qvlctl model convert``'s defaults: int8 weights) where the ``convert``
extra is installed, and otherwise refused with the command that converts it.

``list`` shows the models pulled under the models directory (``DIR`` defaults to
``$QVLD_MODELS``, else ``/var/lib/qvld/models`` for root and
``$XDG_DATA_HOME/qvld/models`` for others), with their source and size.

Model names: ``qwen3-vl-2b`` (and ``-int8``, ``-int4``) stand for the repositories in
``KNOWN``: pre-converted OpenVINO exports of Qwen3-VL-2B-Instruct as their publishers
name them. No weights can be downloaded where this was written, so they were checked
against the hub's published layout, not pulled; ``pull`` checks what it gets either way.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

RECORD = "qvld-pull.json"

# name -> (repository, revision): the default model and its weight variants.
KNOWN: dict[str, tuple[str, str]] = {
    "qwen3-vl-2b": ("OpenVINO/Qwen3-VL-2B-Instruct-int8-ov", "main"),
    "qwen3-vl-2b-int8": ("OpenVINO/Qwen3-VL-2B-Instruct-int8-ov", "main"),
    "qwen3-vl-2b-int4": ("OpenVINO/Qwen3-VL-2B-Instruct-int4-ov", "main"),
}

# What makes a directory an OpenVINO export qvld serves (the rest is checked by
# ``model info`` once it is in place).
NEEDED = ("config.json", "tokenizer.json", "openvino_language_model.xml",
          "openvino_language_model.bin")


class PullError(Exception):
    """A pull refused or failed: the message says why and what to do."""


class CheckpointRepository(PullError):
    """The repository holds a transformers checkpoint, not an OpenVINO export."""


def can_convert() -> bool:
    """Whether the ``convert`` extra (torch, optimum-intel) is installed here."""
    from importlib.util import find_spec

    return all(find_spec(name) is not None for name in ("torch", "optimum"))


@dataclass
class HubFile:
    name: str
    size: int | None
    sha256: str | None  # large (LFS) files
    blob_id: str | None  # the git blob id (sha1) of a small file


def models_dir() -> Path:
    if os.environ.get("QVLD_MODELS"):
        return Path(os.environ["QVLD_MODELS"])
    if os.geteuid() == 0:
        return Path("/var/lib/qvld/models")
    data = os.environ.get("XDG_DATA_HOME") or str(Path.home() / ".local" / "share")
    return Path(data) / "qvld" / "models"


def resolve_name(name: str) -> tuple[str, str | None]:
    """(repository, revision) for a known model name, else the name as a repository."""
    if name in KNOWN:
        return KNOWN[name]
    repo, _, revision = name.partition("@")
    if repo.count("/") != 1:
        known = ", ".join(KNOWN)
        raise PullError(f"{name!r} is neither a known model ({known}) nor a hub "
                        "repository (ORG/NAME, optionally @REVISION)")
    return repo, revision or None


def _git_blob_id(path: Path) -> str:
    digest = hashlib.sha1(f"blob {path.stat().st_size}\0".encode(), usedforsecurity=False)
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def mismatch(path: Path, expected: HubFile) -> str | None:
    """Why ``path`` is not the file the hub describes, or None."""
    size = path.stat().st_size
    if expected.size is not None and size != expected.size:
        return f"{size} bytes, the hub says {expected.size}"
    if expected.sha256 is not None:
        got = _sha256(path)
        if got != expected.sha256:
            return f"sha256 {got[:16]}…, the hub says {expected.sha256[:16]}…"
    elif expected.blob_id is not None:
        got = _git_blob_id(path)
        if got != expected.blob_id:
            return f"git blob {got[:12]}…, the hub says {expected.blob_id[:12]}…"
    return None


def hub_files(repo: str, revision: str | None) -> tuple[str, list[HubFile]]:
    """The commit ``revision`` resolves to, and its files as the hub describes them."""
    from huggingface_hub import HfApi
    from huggingface_hub.errors import HfHubHTTPError, RepositoryNotFoundError

    try:
        info = HfApi().model_info(repo, revision=revision, files_metadata=True)
    except RepositoryNotFoundError:
        raise PullError(f"the hub has no repository {repo} (or it needs HF_TOKEN)") from None
    except HfHubHTTPError as exc:
        raise PullError(f"the hub refused {repo}: {str(exc).splitlines()[0]}") from None
    except OSError as exc:  # no route, DNS, a proxy refusing
        raise PullError(f"cannot reach the hub ({_endpoint()}): {exc}") from None
    files = [HubFile(s.rfilename, s.size if s.lfs is None else s.lfs.size,
                     s.lfs.sha256 if s.lfs is not None else None, s.blob_id)
             for s in info.siblings or []]
    assert info.sha is not None
    return info.sha, files


def _endpoint() -> str:
    return os.environ.get("HF_ENDPOINT", "https://huggingface.co")


def wanted(files: list[HubFile], repo: str) -> list[HubFile]:
    """The files qvld reads, or PullError when the repository is no OpenVINO export."""
    names = {f.name for f in files}
    if not all(n in names for n in NEEDED):
        if "config.json" in names and any(n.endswith(".safetensors") for n in names):
            raise CheckpointRepository(
                f"{repo} holds a transformers checkpoint, not an OpenVINO export: "
                f"`qvlctl model convert {repo} DIR` converts it, and `pull` does so itself "
                "where the convert extra is installed (pip install 'qvld[convert]')")
        missing = ", ".join(n for n in NEEDED if n not in names)
        raise PullError(f"{repo} is not an OpenVINO export of Qwen3-VL (no {missing})")
    return top_level(files)


def top_level(files: list[HubFile]) -> list[HubFile]:
    """Top-level files only: READMEs' pictures and other exports' subfolders are not read."""
    return [f for f in files if "/" not in f.name and not f.name.startswith(".")]


def pull(name: str, dst: Path | None = None, check: bool = True,
         out: Any = sys.stderr, convert: bool = True) -> Path:
    """Download ``name`` into ``dst`` (default: the models directory), checked, renamed
    into place, then loaded once. Returns the directory. A checkpoint repository is
    converted when ``convert`` and the extra allow, else refused."""
    repo, revision = resolve_name(name)
    commit, files = hub_files(repo, revision)
    checkpoint = False
    try:
        files = wanted(files, repo)
    except CheckpointRepository:
        if not (convert and can_convert()):
            raise
        checkpoint = True
        files = top_level(files)
    if dst is None:
        dst = models_dir() / repo.replace("/", "--")
    record = dst / RECORD
    if dst.exists():
        if record.is_file() and json.loads(record.read_text()).get("commit") == commit:
            print(f"{dst}: {repo}@{commit[:12]} already pulled", file=out)
            return dst
        raise PullError(f"{dst} exists: remove it, or pull into another directory")
    kind = "checkpoint" if checkpoint else "partial"
    staging = dst.with_name(f"{dst.name}.{kind}-{commit[:12]}")
    staging.mkdir(parents=True, exist_ok=True)
    total = sum(f.size or 0 for f in files)
    print(f"pulling {repo}@{commit[:12]} ({len(files)} files, {total / 1e6:.1f} MB) "
          f"into {staging if checkpoint else dst}", file=out)
    t0 = time.monotonic()
    download(repo, commit, files, staging)
    print(f"{staging if checkpoint else dst}: {len(files)} files checked "
          f"({time.monotonic() - t0:.1f} s)", file=out)
    source = {"repository": repo, "revision": revision, "commit": commit,
              "endpoint": _endpoint(),
              "pulled": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
              "files": {f.name: f.sha256 or f.blob_id for f in files}}
    if checkpoint:
        return _converted(staging, dst, source, out)
    (staging / RECORD).write_text(json.dumps(source, indent=1) + "\n")
    os.rename(staging, dst)
    if check:
        from qvld.modeltools.convert import check_serves

        answer = check_serves(dst)
        print(f"{dst}: loads and answers ({answer[:40]!r})", file=out)
    return dst


def download(repo: str, commit: str, files: list[HubFile], into: Path) -> None:
    """Each file of ``repo`` at ``commit`` into ``into``, checked against the hub's size
    and hash (a mismatched file is removed and the pull refused)."""
    from huggingface_hub import hf_hub_download

    for f in files:
        # Resumed from ``into`` (its .cache keeps what each file was): a range
        # request for the rest of a file cut short.
        path = Path(hf_hub_download(repo, f.name, revision=commit, local_dir=into))
        why = mismatch(path, f)
        if why is not None:
            path.unlink()
            raise PullError(f"{f.name} from {repo} is not what the hub describes ({why}): "
                            "removed; nothing was put in place")
    shutil.rmtree(into / ".cache", ignore_errors=True)


def _converted(checkpoint: Path, dst: Path, source: dict[str, Any], out: Any) -> Path:
    """The checkpoint downloaded into ``checkpoint`` converted into ``dst`` as ``qvlctl
    model convert`` does (its default recipe; checked to answer before it is renamed
    into place); the checkpoint is removed once converted."""
    from qvld.modeltools.convert import Recipe, convert

    recipe = Recipe()
    print(f"{source['repository']} is a transformers checkpoint: converting it "
          f"({recipe.describe()} weights)", file=out)
    if convert(str(checkpoint), dst, recipe) != 0:
        raise PullError(f"converting {source['repository']} failed; the checkpoint stays "
                        f"in {checkpoint} (a second pull resumes from it)")
    (dst / RECORD).write_text(json.dumps({**source, "converted": recipe.describe()},
                                         indent=1) + "\n")
    shutil.rmtree(checkpoint, ignore_errors=True)
    return dst


def pulled(name: str) -> Path | None:
    """The directory under the models directory that ``name`` (a known name, ORG/NAME,
    or the directory's own name) was pulled into, or None."""
    root = models_dir()
    names = [name.replace("/", "--")]
    if name in KNOWN:
        names.insert(0, KNOWN[name][0].replace("/", "--"))
    for candidate in names:
        path = root / candidate
        if (path / RECORD).is_file() or (path / "openvino_language_model.xml").is_file():
            return path
    return None


def listing(root: Path | None = None) -> list[dict[str, Any]]:
    """The models under ``root`` (default: the models directory): name, where, size, and
    where each was pulled from."""
    root = root or models_dir()
    rows = []
    found = sorted(p for p in root.glob("*") if p.is_dir() and ".partial-" not in p.name
                   and ".checkpoint-" not in p.name)
    for path in found if root.is_dir() else []:
        record = path / RECORD
        source = json.loads(record.read_text()) if record.is_file() else {}
        if not source and not (path / "openvino_language_model.xml").is_file():
            continue  # a partial download, or not a model
        size = sum(p.stat().st_size for p in path.rglob("*") if p.is_file())
        rows.append({"name": path.name, "path": str(path), "bytes": size,
                     "repository": source.get("repository"),
                     "commit": source.get("commit"), "pulled": source.get("pulled")})
    return rows


def render_listing(rows: list[dict[str, Any]], root: Path) -> str:
    if not rows:
        return f"no models under {root} (qvlctl model pull NAME)"
    lines = [f"{'NAME':40} {'SIZE':>9}  SOURCE"]
    for row in rows:
        source = (f"{row['repository']}@{row['commit'][:12]}, {row['pulled']}"
                  if row["repository"] else "(not pulled)")
        lines.append(f"{row['name']:40} {row['bytes'] / 1e9:>7.2f}GB  {source}")
    return "\n".join(lines)
