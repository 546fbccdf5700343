"""DeepSpeed 0.19.8's shared-memory all-reduce buffers on CPU (``/dev/shm/deepspeed_allreduce_buffer_*``,
never unlinked by DeepSpeed), and their removal by name once every rank has mapped them. Details:
docs/design/compat_upstream.md.
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Iterable, Optional

SHM_DIR = Path("/dev/shm")
BUFFER_PREFIX = "deepspeed_allreduce_buffer"   # shm.cpp's SHM_BUFFER_NAME
DEEPSPEED_SOURCE = "ops/csrc/cpu/comm/shm.cpp"   # where the version-guard test reads the pattern


def shm_buffer_name(rank: int, master_addr: Optional[str] = None, master_port: Optional[str] = None,
                    uid: Optional[int] = None) -> str:
    """The segment name rank ``rank`` of a job creates (default: ``MASTER_ADDR`` / ``MASTER_PORT``)."""
    addr = os.environ.get("MASTER_ADDR", "") if master_addr is None else master_addr
    port = os.environ.get("MASTER_PORT", "") if master_port is None else str(master_port)
    return f"{BUFFER_PREFIX}_{os.getuid() if uid is None else uid}_{addr}_{port}_{rank}"


def job_uses_shm(world_size: int) -> bool:
    """Whether DeepSpeed creates the buffers: the CPU accelerator and all ranks local."""
    from deepspeed.accelerator import get_accelerator

    return get_accelerator().device_name() == "cpu" and os.environ.get("LOCAL_SIZE") == str(world_size)


def remove_shm_buffers(ranks: Iterable[int], master_addr: Optional[str] = None,
                       master_port: Optional[str] = None, directory: Path = SHM_DIR) -> list[Path]:
    """Unlink the segments of ``ranks`` of this job; returns the files removed (missing ones skipped)."""
    removed = []
    for rank in ranks:
        path = Path(directory) / shm_buffer_name(rank, master_addr, master_port)
        try:
            path.unlink()
        except FileNotFoundError:
            continue
        removed.append(path)
    return removed


def job_shm_buffers(master_addr: Optional[str] = None, master_port: Optional[str] = None,
                    directory: Path = SHM_DIR) -> list[Path]:
    """The segments of this job's address and port that exist now, any rank."""
    stem = shm_buffer_name(0, master_addr, master_port)[:-1]
    return sorted(p for p in Path(directory).glob(f"{stem}*") if p.name[len(stem):].isdigit())
