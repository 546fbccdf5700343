"""DeepSpeed's shared-memory all-reduce buffers on CPU, and their removal.

On the CPU accelerator, when every rank of the job runs on one machine (the ``deepspeed``
launcher sets ``LOCAL_SIZE`` to the world size), DeepSpeed's communication backend builds its
``ShareMemCommBuilder`` op and, as ``torch.distributed`` is initialised, each rank creates one
POSIX shared-memory segment (about 66 MB) and maps every other rank's
(``deepspeed/ops/csrc/cpu/comm/shm.cpp``, ``shm_initialize``). Their names are fixed by DeepSpeed
0.19.8::

    /dev/shm/deepspeed_allreduce_buffer_<uid>_<MASTER_ADDR>_<MASTER_PORT>_<rank>

DeepSpeed never unlinks them, so every CPU run left ``world size x 66 MB`` behind, also on
success. Once every rank has mapped them, the names are no longer needed: the memory stays
mapped until the last process of the job exits, and the kernel frees it then. So
``moe_plugin.initialize`` unlinks them right after DeepSpeed's initialisation (after a barrier:
every rank has mapped every segment), and a job that was killed before can still be cleaned up
by name (``remove_shm_buffers`` with the job's address and port), since the names depend only on
the user id, the rendezvous address and port and the rank: a concurrent job has its own port.
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
    """The segment name rank ``rank`` of a job creates (shm.cpp: ``"%s_%d_%s_%s"`` + ``"_%d"``);
    address and port default to the environment's ``MASTER_ADDR`` / ``MASTER_PORT`` (empty when
    unset, as DeepSpeed reads them)."""
    addr = os.environ.get("MASTER_ADDR", "") if master_addr is None else master_addr
    port = os.environ.get("MASTER_PORT", "") if master_port is None else str(master_port)
    return f"{BUFFER_PREFIX}_{os.getuid() if uid is None else uid}_{addr}_{port}_{rank}"


def job_uses_shm(world_size: int) -> bool:
    """Whether DeepSpeed creates the buffers for this job: the CPU accelerator and all ranks local
    (``LOCAL_SIZE`` equal to the world size, as shm_interface.cpp checks)."""
    from deepspeed.accelerator import get_accelerator

    return get_accelerator().device_name() == "cpu" and os.environ.get("LOCAL_SIZE") == str(world_size)


def remove_shm_buffers(ranks: Iterable[int], master_addr: Optional[str] = None,
                       master_port: Optional[str] = None, directory: Path = SHM_DIR) -> list[Path]:
    """Unlink the segments of ``ranks`` of this job (the environment's address and port unless
    given); returns the files removed. Missing ones are skipped: safe to call more than once and
    from several ranks."""
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
