"""The files of a checkpoint tag: checksums written at save and verified at load, the commit of a tag,
and what an interrupted save leaves behind.

``checksums`` and ``verify`` are collective, each file hashed by one rank; a bad file is the same
``CheckpointError`` on every rank naming it. ``commit_tag`` renames a finished ``.tmp-TAG`` and then
points ``latest`` at it; ``remove_stale`` clears what dead saves left, refusing links. Design:
docs/design/checkpoint_format.md.
"""
from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import shutil
from collections.abc import Iterator
from typing import Optional

import torch.distributed as dist

from moe_plugin.checkpoint.confine import copy_new, refuse_link, write_new
from moe_plugin.checkpoint.errors import CheckpointError, agree
from moe_plugin.checkpoint.metadata import EXPERT_DIR, LATEST, META_FILE

logger = logging.getLogger(__name__)

CHUNK = 8 << 20
TMP_PREFIX, OLD_PREFIX = ".tmp-", ".old-"


# -- checksums ------------------------------------------------------------------------------------
def file_digest(path: str) -> dict:
    """{"bytes": size, "sha256": hex digest} of ``path``, read in chunks into one reused buffer."""
    digest, size = hashlib.sha256(), 0
    buffer = bytearray(CHUNK)
    view = memoryview(buffer)
    with open(path, "rb", buffering=0) as f:
        while n := f.readinto(buffer):
            digest.update(view[:n])
            size += n
    return {"bytes": size, "sha256": digest.hexdigest()}


def digests(path: str, names: list[str]) -> dict[str, dict]:
    """``file_digest`` of each of ``names`` (relative to ``path``), in threads, the largest first."""
    from concurrent.futures import ThreadPoolExecutor

    order = sorted(names, key=lambda name: -os.path.getsize(os.path.join(path, name)) if
                   os.path.isfile(os.path.join(path, name)) else 0)
    workers = max(1, min(len(order), os.cpu_count() or 1, 8))
    with ThreadPoolExecutor(workers) as pool:
        found = dict(zip(order, pool.map(lambda name: file_digest(os.path.join(path, name)), order)))
    return {name: found[name] for name in names}


def tag_files(path: str) -> dict[str, int]:
    """{path relative to the tag: size} of every file under ``path`` but the metadata file."""
    out = {}
    for root, _dirs, names in os.walk(path):
        for name in names:
            full = os.path.join(root, name)
            relative = os.path.relpath(full, path)
            if relative != META_FILE and not name.endswith(".part"):
                out[relative] = os.path.getsize(full)
    return dict(sorted(out.items()))


def share(sizes: dict[str, int], world_size: int, rank: int) -> list[str]:
    """The files ``rank`` hashes: largest first, each to the rank with the fewest bytes so far."""
    load = [0] * world_size
    mine = []
    for name, size in sorted(sizes.items(), key=lambda item: (-item[1], item[0])):
        owner = min(range(world_size), key=lambda r: (load[r], r))
        load[owner] += size
        if owner == rank:
            mine.append(name)
    return mine


def checksums(path: str, group: Optional[dist.ProcessGroup] = None) -> dict[str, dict]:
    """{relative path: {"bytes", "sha256"}} of every file of tag ``path``; collective over ``group``
    (default the world), once every rank has finished writing."""
    listing = [tag_files(path) if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(listing, src=0, group=group)
    mine = digests(path, share(listing[0], dist.get_world_size(group), dist.get_rank(group)))
    gathered: list = [None] * dist.get_world_size(group)
    dist.all_gather_object(gathered, mine, group=group)
    return dict(sorted((name, digest) for part in gathered for name, digest in part.items()))


def check_files(path: str, recorded: dict[str, dict], names: list[str]) -> None:
    """Raise a ``CheckpointError`` naming what is wrong with the files ``names`` of tag ``path``."""
    out, whole = [], []
    for name in names:
        full, expected = os.path.join(path, name), recorded[name]
        if not os.path.isfile(full):
            out.append(f"{full}: missing (the save recorded {expected['bytes']} bytes)")
            continue
        size = os.path.getsize(full)
        if size != expected["bytes"]:
            out.append(f"{full}: {size} bytes, the save recorded {expected['bytes']} (truncated or overwritten)")
            continue
        whole.append(name)
    hashed = digests(path, whole)
    for name in whole:
        full, expected, found = os.path.join(path, name), recorded[name], hashed[name]["sha256"]
        if found != expected["sha256"]:
            out.append(f"{full}: sha256 {found}, the save recorded {expected['sha256']} (the content changed)")
    if out:
        raise CheckpointError(f"checkpoint {path} is damaged: " + "; ".join(out))


def verify(path: str, meta: dict) -> None:
    """Check every file in ``meta["files"]`` (collective); a ``CheckpointError`` on every rank names the
    bad ones. Without the record: unverified, with a warning."""
    recorded = meta.get("files")
    if recorded is None:
        if dist.get_rank() == 0:
            logger.warning("%s: no checksums recorded (saved by an older moe_plugin); loading it unverified", path)
        return
    names = share({name: entry["bytes"] for name, entry in recorded.items()}, dist.get_world_size(), dist.get_rank())
    agree(lambda: check_files(path, recorded, names))


def verify_all(path: str, meta: dict) -> None:
    """``verify`` in one process (no process group): every recorded file."""
    recorded = meta.get("files")
    if recorded is None:
        logger.warning("%s: no checksums recorded (saved by an older moe_plugin); reading it unverified", path)
        return
    check_files(path, recorded, sorted(recorded))


# -- committing a tag ----------------------------------------------------------------------------
def write_text(path: str, text: str) -> None:
    """``text`` as ``path``, whole or not at all: written to ``path.part``, created new, then renamed."""
    part = path + ".part"
    refuse_link(part, "a file being written")
    if os.path.lexists(part):
        os.remove(part)
    write_new(part, text.encode("utf-8"), fsync=True)
    os.replace(part, path)


def commit_tag(save_dir: str, tag: str, tmp_tag: str, save_latest: bool) -> None:
    """Rename the finished temporary directory to ``tag`` (replacing an older one), then write ``latest``."""
    final, tmp = os.path.join(save_dir, tag), os.path.join(save_dir, tmp_tag)
    if os.path.lexists(final):
        old = os.path.join(save_dir, OLD_PREFIX + tag)
        refuse_link(old, "a tag being replaced")
        shutil.rmtree(old, ignore_errors=True)
        os.rename(final, old)
        os.rename(tmp, final)
        if os.path.islink(old):   # a link planted at the tag's name: replaced, what it points to untouched
            os.remove(old)
        else:
            shutil.rmtree(old)
    else:
        os.rename(tmp, final)
    if save_latest:
        write_text(os.path.join(save_dir, LATEST), tag)


# -- a tag written by one process (upcycle, import-hf) --------------------------------------------
@contextlib.contextmanager
def tag_written_here(out_dir: str, tag: str, instead: str) -> Iterator[str]:
    """Yield a temporary tag directory to fill, from one process (``write_metadata`` last); it becomes
    ``out_dir/tag`` with ``latest`` on success, and nothing is left on failure. An existing tag is refused."""
    refuse_existing(out_dir, tag, instead)
    os.makedirs(out_dir, exist_ok=True)
    remove_stale(out_dir)
    tmp = os.path.join(out_dir, TMP_PREFIX + tag)
    os.mkdir(tmp)   # new: remove_stale removed an old one, refused a link
    os.mkdir(os.path.join(tmp, EXPERT_DIR))
    try:
        yield tmp
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    commit_tag(out_dir, tag, TMP_PREFIX + tag, save_latest=True)


def refuse_existing(out_dir: str, tag: str, instead: str) -> None:
    """``tag_written_here``'s refusal of an existing ``out_dir/tag``, to ask before a conversion's work."""
    final = os.path.join(os.fspath(out_dir), tag)
    if os.path.lexists(final):
        raise CheckpointError(f"{final}: exists; {instead} (nothing was written)")


def copy_files(tmp: str, sources: dict[str, str]) -> None:
    """Copy ``sources`` ({name in the tag: confined source path}) into ``tmp``, each file created new."""
    for name, source in sources.items():
        os.makedirs(os.path.dirname(os.path.join(tmp, name)), exist_ok=True)
        copy_new(source, os.path.join(tmp, name))


def write_metadata(tmp: str, meta: dict) -> None:
    """``meta`` with the size and sha256 of every file already in ``tmp``, as ``moe_plugin.json``."""
    meta["files"] = digests(tmp, list(tag_files(tmp)))
    write_new(os.path.join(tmp, META_FILE), json.dumps(meta, indent=1).encode("utf-8"))


# -- interrupted saves ----------------------------------------------------------------------------
def remove_stale(directory: str) -> list[str]:
    """Remove what dead saves left in ``directory`` (``.old-TAG`` put back where ``TAG`` is missing); a
    link there is a ``CheckpointError``. Returns one line per action; call on one rank."""
    done = []
    if not os.path.isdir(directory):
        return done
    for name in sorted(os.listdir(directory)):
        full = os.path.join(directory, name)
        if name.startswith((TMP_PREFIX, OLD_PREFIX)) or name == LATEST + ".part":
            refuse_link(full, "a temporary of a save" if name.startswith(TMP_PREFIX) else
                        "a tag being replaced" if name.startswith(OLD_PREFIX) else "the next 'latest'")
        if not os.path.isdir(full):
            continue
        if name.startswith(TMP_PREFIX):
            shutil.rmtree(full, ignore_errors=True)
            done.append(f"removed {full}, left by an interrupted save")
        elif name.startswith(OLD_PREFIX):
            tag = os.path.join(directory, name[len(OLD_PREFIX):])
            if os.path.exists(tag):
                shutil.rmtree(full, ignore_errors=True)
                done.append(f"removed {full}, left by an interrupted save")
            else:
                os.rename(full, tag)
                done.append(f"restored {tag} from {full}, left by a save interrupted while replacing it")
    for line in done:
        logger.warning(line)
    return done


def remove_stale_collective(directory: str) -> Optional[list[str]]:
    """``remove_stale`` on rank 0, the others wait for it (its refusal raised on every rank)."""
    return agree(lambda: remove_stale(directory) if dist.get_rank() == 0 else None)
