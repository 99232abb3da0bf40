"""Make every RECORD in a virtualenv's site-packages match the files as they now are.

pip writes each installed file's hash into its distribution's RECORD. build.sh then
rewrites the console scripts' shebangs (the staging path becomes the installed one) and
removes direct_url.json, so those entries would be wrong, and would differ from one build
to the next. This drops the entries of removed files and hashes the rest again.

    python3 fix-records.py VENV
"""

from __future__ import annotations

import base64
import csv
import hashlib
import io
import sys
from pathlib import Path


def digest(path: Path) -> str:
    raw = hashlib.sha256(path.read_bytes()).digest()
    return "sha256=" + base64.urlsafe_b64encode(raw).rstrip(b"=").decode()


def fix(record: Path) -> None:
    base = record.parent.parent  # RECORD paths are relative to site-packages
    rows = []
    for row in csv.reader(io.StringIO(record.read_text())):
        if not row:
            continue
        name = row[0]
        path = (base / name).resolve() if not Path(name).is_absolute() else Path(name)
        if path == record:
            rows.append([name, "", ""])
        elif path.is_file():
            rows.append([name, digest(path), str(path.stat().st_size)])
    out = io.StringIO()
    csv.writer(out, lineterminator="\n").writerows(rows)
    record.write_text(out.getvalue())


def main(argv: list[str] | None = None) -> int:
    venv = Path((argv or sys.argv[1:])[0])
    for record in sorted(venv.glob("lib/python3*/site-packages/*.dist-info/RECORD")):
        fix(record)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
