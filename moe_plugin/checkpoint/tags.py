"""Which tag a load takes, which tags a save keeps, and a save that fails.

``choose_tag`` (collective) falls back from a ``latest`` that fails verification to the newest tag that
verifies, unless ``strict``; ``prune`` (rank 0) removes the tags beyond ``keep_last``, never the one just
written nor ``latest``'s; ``saving`` (collective) turns an ``OSError`` on any rank into one
``CheckpointError`` on every rank. Assumes one file system shared by every node. Rules:
docs/checkpoints.md; design: docs/design/checkpoint_format.md.
"""
from __future__ import annotations

import errno
import logging
import os
import shutil
from typing import Any, Callable, Optional

import torch.distributed as dist

from moe_plugin.checkpoint.errors import CheckpointError, agree
from moe_plugin.checkpoint.files import TMP_PREFIX, verify
from moe_plugin.checkpoint.metadata import LATEST, read_latest, read_metadata

logger = logging.getLogger(__name__)


def check_keep_last(keep_last: Optional[int], name: str = "keep_last") -> None:
    """Refuse a ``keep_last`` below 1 (``name``: how the caller calls it, e.g. ``--keep-last``)."""
    if keep_last is not None and (isinstance(keep_last, bool) or not isinstance(keep_last, int) or keep_last < 1):
        raise CheckpointError(f"{name}: got {keep_last!r}; expected an integer >= 1 (the number of newest tags "
                              "to keep), or None to keep every tag")


def tag_steps(directory: str) -> dict[str, int]:
    """{tag: the step its metadata records} of every tag of ``directory`` whose metadata reads."""
    out = {}
    for name in sorted(os.listdir(directory)) if os.path.isdir(directory) else []:
        if name.startswith(".") or not os.path.isdir(os.path.join(directory, name)):
            continue
        try:
            step = read_metadata(directory, name).get("global_steps")
        except CheckpointError:
            continue
        if isinstance(step, int) and not isinstance(step, bool):
            out[name] = step
    return out


def newest_first(steps: dict[str, int]) -> list[str]:
    """Tags by recorded step, highest first; ties by name."""
    return sorted(steps, key=lambda tag: (-steps[tag], tag))


# -- load ----------------------------------------------------------------------------------------
def choose_tag(load_dir: str, tag: Optional[str], strict: bool) -> tuple[str, bool]:
    """The tag to load, and whether its files were verified here (collective)."""
    if tag is not None or strict:
        return agree(lambda: tag if tag is not None else read_latest(load_dir)), False
    latest, failed = agree(lambda: _latest(load_dir))
    failures = [] if failed is None else [(LATEST, failed)]
    if latest is not None:
        try:
            _verify_tag(load_dir, latest, fallback=False)
            return latest, True
        except CheckpointError as err:
            failures.append((latest, str(err)))
    listed = [newest_first(tag_steps(load_dir)) if dist.get_rank() == 0 else None]   # only now: a damaged latest
    dist.broadcast_object_list(listed, src=0)
    for candidate in (t for t in listed[0] if t != latest):
        try:
            _verify_tag(load_dir, candidate, fallback=True)
        except CheckpointError as err:
            failures.append((candidate, str(err)))
            continue
        if dist.get_rank() == 0:
            logger.warning(_fallback_line(load_dir, failures, candidate))
        return candidate, True
    _first, message = failures[0]
    others = [t for t, _ in failures[1:]]
    raise CheckpointError(f"{message}; no other tag of {load_dir} verifies"
                          + (f" (tried {', '.join(others)})" if others else ""))


def _latest(load_dir: str) -> tuple[Optional[str], Optional[str]]:
    """(``latest``'s tag, None) or (None, why it cannot be read); a missing ``latest`` raises."""
    if not os.path.isfile(os.path.join(load_dir, LATEST)):
        read_latest(load_dir)   # raises: no checkpoint was committed here, nothing to fall back from
    try:
        return read_latest(load_dir), None
    except CheckpointError as err:
        return None, str(err)


def _verify_tag(load_dir: str, tag: str, fallback: bool) -> None:
    """``CheckpointError`` on every rank unless every file ``tag`` recorded checks out (collective)."""
    path = os.path.join(load_dir, tag)

    def meta() -> dict:
        if not os.path.isdir(path):
            raise CheckpointError(f"{path}: missing; no checkpoint tag {tag!r} there")
        out = read_metadata(load_dir, tag)
        if fallback and "files" not in out:
            raise CheckpointError(f"{path}: no checksums recorded (saved by an older moe_plugin): not loaded "
                                  "in place of a damaged one")
        return out

    verify(path, agree(meta))


def _fallback_line(load_dir: str, failures: list[tuple[str, str]], chosen: str) -> str:
    first, message = failures[0]
    what = f"'{LATEST}' is unreadable" if first == LATEST else f"the latest tag {first!r} fails verification"
    others = [t for t, _ in failures[1:]]
    return (f"{load_dir}: {what} ({message}); loading {chosen!r}, the newest tag that verifies"
            + (f" ({', '.join(others)} failed too)" if others else ""))


# -- save ----------------------------------------------------------------------------------------
def saving(save_dir: str, tag: str, fn: Callable[[], Any], group: Optional[dist.ProcessGroup] = None) -> Any:
    """``fn()`` on every rank of ``group``; an ``OSError`` or ``CheckpointError`` on any is one
    ``CheckpointError`` on every rank naming ``save_dir``, once ``.tmp-TAG`` is removed."""
    try:
        return agree(fn, group)
    except CheckpointError as err:
        if dist.get_rank() == 0:   # what this save wrote; a link there (refused) is neither followed nor removed
            tmp = os.path.join(save_dir, TMP_PREFIX + tag)
            if not os.path.islink(tmp):
                shutil.rmtree(tmp, ignore_errors=True)
            with_part = os.path.join(save_dir, LATEST + ".part")
            if os.path.isfile(with_part) and not os.path.islink(with_part):
                os.remove(with_part)
        dist.barrier(group=group)
        try:
            before = f"'{LATEST}' still names {read_latest(save_dir)!r}, as before"
        except CheckpointError:
            before = "no tag was committed there before"
        hint = ("; free space there or save elsewhere, then resume" if os.strerror(errno.ENOSPC) in str(err)
                else "")
        raise CheckpointError(f"{save_dir}: saving tag {tag!r} failed, nothing was committed ({err}); {before}"
                              f"{hint}") from None


def prune(save_dir: str, keep_last: int, written: str) -> list[str]:
    """Remove the tags beyond the newest ``keep_last`` (rank 0); returns them."""
    steps = tag_steps(save_dir)
    try:
        latest = read_latest(save_dir)
    except CheckpointError:
        latest = None
    problem = _incomplete(save_dir, written)
    if problem:
        logger.warning(f"{save_dir}: keep_last {keep_last}: no tag removed, the tag just written is not complete "
                       f"({problem})")
        return []
    removed = []
    for tag in newest_first(steps)[keep_last:]:
        if tag in (written, latest):
            continue
        doomed = os.path.join(save_dir, TMP_PREFIX + tag)   # a removal cut short is a dead save's leftover
        try:
            os.rename(os.path.join(save_dir, tag), doomed)
        except OSError as err:
            logger.warning(f"{save_dir}: keep_last {keep_last}: could not remove {tag!r} ({err})")
            continue
        shutil.rmtree(doomed, ignore_errors=True)
        removed.append(tag)
    return removed


def _incomplete(save_dir: str, tag: str) -> Optional[str]:
    """Why ``tag``'s files do not match their record by size (no second read), or None."""
    path = os.path.join(save_dir, tag)
    try:
        recorded = read_metadata(save_dir, tag).get("files", {})
    except CheckpointError as err:
        return str(err)
    for name, entry in recorded.items():
        full = os.path.join(path, name)
        if not os.path.isfile(full) or os.path.getsize(full) != entry["bytes"]:
            return f"{full}: missing or not {entry['bytes']} bytes"
    return None
