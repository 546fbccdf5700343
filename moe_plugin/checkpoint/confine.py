"""Files from elsewhere stay inside their directory; files a save writes are created new.

Every path a checkpoint tag, an HF directory or a tokenizer record names goes through ``inside`` before
anything is read (plain relative parts resolving inside, through any links, as Python's tarfile ``data``
filter, PEP 706; no second hard link); ``check_tree`` holds a whole directory to it. ``write_new`` and
``copy_new`` never write through a link. Errors: ``CheckpointError``, ``FILE[: KEY]: what is wrong; what is valid``.
"""
from __future__ import annotations

import os
import stat
from typing import Any, Optional

from moe_plugin.checkpoint.errors import CheckpointError

CREATE_NEW = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0)
_CHUNK = 8 << 20


def _within(path: str, root: str) -> bool:
    return path == root or path.startswith(root.rstrip(os.sep) + os.sep)


def inside(root: str, name: Any, where: str, within: Optional[str] = None) -> str:
    """``root/name`` once ``name`` (named by ``where``) stays inside ``root``; links may resolve into ``within``."""
    valid = f"a path relative to {root}, inside it"
    if not isinstance(name, str) or not name or "\x00" in name:
        raise CheckpointError(f"{where}: {name!r} is not a file name; expected {valid}")
    if os.path.isabs(name):
        raise CheckpointError(f"{where}: {name!r} is an absolute path; expected {valid}")
    if ".." in name.replace(os.sep, "/").split("/"):
        raise CheckpointError(f"{where}: {name!r} leaves {root} ('..'); expected {valid}")
    full = os.path.join(root, name)
    _check_entry(full, root, within)
    return full


def _check_entry(full: str, root: str, within: Optional[str] = None) -> None:
    """Refuse an entry under ``root`` that links outside ``within`` or has a second hard link."""
    bound = os.path.realpath(within or root)
    real = os.path.realpath(full)
    if not _within(real, bound):
        raise CheckpointError(f"{full}: a link to {real}, outside {bound}; files from elsewhere are read inside "
                              "their directory only (links within it)")
    try:
        found = os.stat(real)
    except OSError:
        return
    if stat.S_ISREG(found.st_mode) and found.st_nlink > 1:
        raise CheckpointError(f"{full}: a file with {found.st_nlink} hard links, whose other names may lie outside "
                              f"{bound}; expected a file of its own (copy it, not with cp -l or ln)")


def hf_cache_root(directory: str) -> str:
    """Where the links of ``directory`` may resolve: itself, or a Hugging Face cache snapshot's repository."""
    snapshots = os.path.dirname(os.path.realpath(directory))
    repo = os.path.dirname(snapshots)
    if os.path.basename(snapshots) == "snapshots" and os.path.basename(repo).startswith("models--"):
        return repo
    return directory


def not_a_link(path: str, what: str = "a tag") -> str:
    """``path``, refused when it is a link (``what`` it should be: a directory of its own)."""
    if os.path.islink(path):
        raise CheckpointError(f"{path}: a link to {os.path.realpath(path)}; expected {what}: a directory of its own, "
                              "not a link")
    return path


def check_tree(root: str, within: Optional[str] = None) -> None:
    """Every entry under ``root`` held to ``_check_entry``'s rules, ``root`` itself no link; links not followed."""
    not_a_link(root, "a directory")
    pending = [root]
    while pending:
        try:
            entries = list(os.scandir(pending.pop()))
        except OSError:   # missing or unreadable: what reads it says so, naming it
            continue
        for entry in entries:
            _check_entry(entry.path, root, within)
            if entry.is_dir(follow_symlinks=False):
                pending.append(entry.path)


def refuse_link(path: str, what: str) -> None:
    """A stale temporary of a save (``what`` it is) that is a link: refused, neither removed nor followed."""
    if os.path.islink(path):
        raise CheckpointError(f"{path}: a link to {os.path.realpath(path)} where a save keeps {what}; a save never "
                              "writes through a link: remove it (the link, not what it points to)")


def write_new(path: str, data: bytes, fsync: bool = False) -> None:
    """``data`` as the file ``path``, created new (an existing name, a link included, is an error)."""
    fd = os.open(path, CREATE_NEW, 0o644)
    with os.fdopen(fd, "wb") as f:
        f.write(data)
        if fsync:
            f.flush()
            os.fsync(f.fileno())


def copy_new(source: str, target: str) -> None:
    """``source`` copied to ``target``, created new (``write_new``), in chunks."""
    with open(source, "rb") as src, os.fdopen(os.open(target, CREATE_NEW, 0o644), "wb") as dst:
        while chunk := src.read(_CHUNK):
            dst.write(chunk)
