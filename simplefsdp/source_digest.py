"""A hash of our own source, for caches whose entries a code change must make
unreachable: Inductor's graphs compiled with our passes (``compiler.backend``) and the
planner's figures on disk (``plan.disk_cache``)."""

from __future__ import annotations

import functools
import hashlib
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent


@functools.cache
def source_digest(folder: str = "") -> str:
    """The sha256 of every ``simplefsdp/<folder>/**/*.py`` (the whole package when
    ``folder`` is empty), names and bytes, once per process."""
    digest = hashlib.sha256()
    root = PACKAGE / folder
    for path in sorted(root.rglob("*.py")):
        digest.update(path.relative_to(PACKAGE).as_posix().encode())
        digest.update(path.read_bytes())
    return digest.hexdigest()
