"""A checkpoint of an earlier moe_plugin, whose own files are pickles, rewritten in format version 3,
which holds none, so that loading it never runs code from a file.

    convert_checkpoint("old_ckpt", "new_ckpt")   # or: moe-plugin convert-checkpoint old_ckpt --out new_ckpt

Run it once, as someone who trusts the checkpoint: it reads the pickles as torch does. The weights,
optimizer state and random streams come out bit for bit; DeepSpeed's files are copied once each is
known to hold only what a load admits. One process; nothing is left on failure. What is rewritten:
docs/design/checkpoint_format.md.
"""
from __future__ import annotations

import logging
import os
import re
import time
from typing import Callable, Optional

from moe_plugin.checkpoint.errors import CheckpointError
from moe_plugin.checkpoint.files import copy_files, read_torch, tag_files, tag_written_here, verify_all, write_metadata
from moe_plugin.checkpoint.metadata import (
    EXPERT_DIR,
    FORMAT_VERSION,
    RNG_DIR,
    SAFE,
    legacy_pickles,
    read_latest,
    read_metadata,
)
from moe_plugin.checkpoint.optimizer import RECORD_DIR, RECORD_KIND
from moe_plugin.checkpoint.plain_files import write_plain
from moe_plugin.checkpoint.readers import OPTIMIZER_MARK, expert_file_metadata, expert_file_specs
from moe_plugin.checkpoint.rng import RNG_KIND
from moe_plugin.checkpoint.tensor_files import SUFFIX, TensorWriter
from moe_plugin.checkpoint.trust import trusting
from moe_plugin.compat.torch_files import Opaque, TorchFile

logger = logging.getLogger(__name__)

EXPERT_NAME = re.compile(r"expert_(\d+)_pp_(\d+)\.pt")


def convert_checkpoint(ckpt_dir: os.PathLike | str, out_dir: os.PathLike | str, tag: Optional[str] = None,
                       progress: Optional[Callable[[str], None]] = None) -> dict:
    """Rewrite ``ckpt_dir/tag`` (default ``latest``) into ``out_dir/tag`` in format version 3; returns
    {"path", "rewritten", "copied", "seconds"}. Raises ``CheckpointError`` before anything is committed."""
    say = progress or logger.info
    began = time.perf_counter()
    ckpt_dir, out_dir = os.fspath(ckpt_dir), os.fspath(out_dir)
    tag = read_latest(ckpt_dir) if tag is None else tag
    path = os.path.join(ckpt_dir, tag)
    if not os.path.isdir(path):
        raise CheckpointError(f"{path}: missing; no checkpoint tag {tag!r} there")
    if os.path.realpath(out_dir) == os.path.realpath(ckpt_dir):
        raise CheckpointError(f"--out {out_dir}: the checkpoint's own directory; write the converted one elsewhere")
    meta = read_metadata(ckpt_dir, tag)
    pickles = legacy_pickles(path, meta)
    if not pickles:
        raise CheckpointError(f"{path}: format version {meta.get('version')} holds no pickle of moe_plugin's; "
                              "nothing to convert (it loads as it is)")
    say(f"checking {len(meta.get('files', {}))} files of {path} against their checksums")
    verify_all(path, meta)
    names = sorted(meta.get("files") or tag_files(path))
    rewritten, copied = [], []
    with tag_written_here(out_dir, tag, "convert into another directory, or remove it") as tmp:
        for i, name in enumerate(names, 1):
            source, parts = os.path.join(path, name), name.split(os.sep)
            if name in pickles:
                target = name[:-len(".pt")] + SUFFIX
                _rewrite(source, os.path.join(tmp, target), parts[0])
                rewritten.append(target)
                say(f"[{i}/{len(names)}] {name} -> {target}")
                continue
            if name.endswith(".pt"):
                TorchFile(source).close()   # outside trust: refuses anything a load would refuse
            copy_files(tmp, {name: source})
            copied.append(name)
        new = {**meta, "version": FORMAT_VERSION, "converted_from": {"version": meta.get("version", 1), "path": path}}
        if any(n.startswith(EXPERT_DIR + os.sep) for n in pickles):
            new["expert_files"] = SAFE
        write_metadata(tmp, new)
    seconds = time.perf_counter() - began
    say(f"converted {path} -> {os.path.join(out_dir, tag)}: {len(rewritten)} pickles rewritten as safetensors, "
        f"{len(copied)} files copied, in {seconds:.2f} s")
    return {"path": os.path.join(out_dir, tag), "rewritten": rewritten, "copied": copied, "seconds": seconds}


def _rewrite(source: str, target: str, folder: str) -> None:
    """One pickle of an earlier moe_plugin as its safe file, read as torch reads it (trusted)."""
    os.makedirs(os.path.dirname(target), exist_ok=True)
    with trusting():
        if folder == RNG_DIR:
            write_plain(target, read_torch(source), RNG_KIND)
        elif folder == RECORD_DIR:
            with TorchFile(source) as f:
                write_plain(target, f.content, RECORD_KIND)
        else:
            with TorchFile(source) as f:
                _expert_file(source, f.content, target)


def _expert_file(source: str, content: object, target: str) -> None:
    """A format-1 expert file's content as the safetensors expert file of the same expert and stage."""
    found = EXPERT_NAME.fullmatch(os.path.basename(source))
    if not isinstance(content, dict) or isinstance(content, Opaque) or found is None:
        raise CheckpointError(f"{source}: not an expert file")
    weights, optimizer = dict(content.get("weights") or {}), {k: dict(v) for k, v in
                                                              (content.get("optimizer") or {}).items()}
    specs = expert_file_specs({k: (v.dtype, list(v.shape)) for k, v in weights.items()},
                              {k: {n: (v.dtype, list(v.shape)) for n, v in s.items()} for k, s in optimizer.items()})
    metadata = expert_file_metadata(int(content.get("expert_id", found.group(1))), int(found.group(2)),
                                    dict(content.get("placement") or {}), content.get("weights_from_master") or None)
    with TensorWriter(target, specs, metadata) as out:
        for name in specs:
            key, _, state = name.partition(OPTIMIZER_MARK)
            out.write(name, (optimizer[key][state] if state else weights[key]).read())
