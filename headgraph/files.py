"""File-system checks made before long work, so that a path the user cannot write fails at once."""

from __future__ import annotations

import tempfile
from pathlib import Path


def writable_folder(path: str | Path) -> Path | None:
    """The nearest existing folder at or above `path` when a new file can be created in it (tried for real:
    permission bits say nothing for root or a read-only mount), else None."""
    existing = next(p for p in (Path(path).absolute(), *Path(path).absolute().parents) if p.exists())
    try:
        with tempfile.TemporaryFile(dir=existing):
            return existing
    except OSError:
        return None
