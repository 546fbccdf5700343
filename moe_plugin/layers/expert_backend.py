"""Which expert GEMM backend runs the experts, per device type and dtype (``moe.experts_backend``):
``grouped_mm``, ``bmm`` or ``loop``; ``auto`` takes ``grouped_mm`` where nothing speaks against it,
else ``loop`` on CPU and ``bmm`` elsewhere, logged once. The rules: docs/design/layers_experts.md.
"""
from __future__ import annotations

import functools
import logging
from typing import Optional, Sequence, get_args

import torch
import torch.nn.functional as F

from moe_plugin.configs.errors import ConfigError
from moe_plugin.configs.schema import ROOT_KEY, ExpertsBackend

logger = logging.getLogger(__name__)
BACKENDS = get_args(ExpertsBackend)
GROUPED_MM = getattr(F, "grouped_mm", None) or getattr(torch, "_grouped_mm", None)
GROUPED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
CUDA_GROUPED = (torch.bfloat16, (8, 0))   # the dtype and least compute capability of CUDA's grouped kernel


def device_capability(device: torch.device) -> tuple[int, int]:
    """The CUDA compute capability (major, minor) of ``device``."""
    return torch.cuda.get_device_capability(device)


@functools.cache
def probe(device_type: str, dtype: torch.dtype) -> Optional[str]:
    """None when a tiny grouped GEMM runs on this device type and dtype, else why not."""
    try:
        a_RH = torch.ones(2, 8, dtype=dtype, device=device_type)
        GROUPED_MM(a_RH, torch.ones(2, 8, 8, dtype=dtype, device=device_type),
                   offs=torch.tensor([1, 2], dtype=torch.int32, device=device_type))
    except Exception as err:   # any failure of the probe means unsupported, never a failed run
        return f"a probe call raised {type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}"
    return None


def grouped_mm_unsupported(device: torch.device, dtype: torch.dtype, sizes: Sequence[int]) -> Optional[str]:
    """Why grouped GEMM cannot run operands of ``dtype`` on ``device`` whose rows have lengths
    ``sizes``; None when it can."""
    if GROUPED_MM is None:
        return f"torch {torch.__version__} has no grouped_mm"
    if dtype not in GROUPED_DTYPES:
        return f"grouped_mm takes fp32, bf16 or fp16, not {dtype}"
    unaligned = [n for n in sizes if n * dtype.itemsize % 16]
    if unaligned:
        return f"rows of {unaligned} {dtype} values are not a multiple of 16 bytes"
    if device.type == "cuda":
        major, minor = device_capability(device)
        if dtype != CUDA_GROUPED[0] or (major, minor) < CUDA_GROUPED[1]:
            return (f"CUDA's grouped kernel needs bfloat16 on compute capability >= 8.0, got {dtype} on "
                    f"{major}.{minor} (torch's fallback there syncs the host per call)")
    elif device.type != "cpu":
        return f"grouped_mm is not tested on {device.type}"
    return probe(device.type, dtype)


def check_backend(requested: str) -> None:
    """A ``ConfigError`` unless ``requested`` names a backend."""
    if requested not in BACKENDS:
        raise ConfigError(f"{ROOT_KEY}.experts_backend", requested, f"expected one of {', '.join(map(repr, BACKENDS))}")


def choose_backend(requested: str, device: torch.device, dtype: torch.dtype, sizes: Sequence[int]) -> str:
    """The backend to run: ``requested`` unless it is ``auto``."""
    if requested in ("bmm", "loop"):
        return requested
    why_not = grouped_mm_unsupported(device, dtype, sizes)
    if requested == "grouped_mm" and why_not:
        raise ConfigError(f"{ROOT_KEY}.experts_backend", requested, f"cannot run {dtype} on {device.type} here: "
                          f"{why_not}; use 'auto', 'bmm' or 'loop'")
    backend = "grouped_mm" if why_not is None else "loop" if device.type == "cpu" else "bmm"
    _log_choice(backend, device.type, dtype, why_not)
    return backend


@functools.cache
def _log_choice(backend: str, device_type: str, dtype: torch.dtype, why_not: Optional[str]) -> None:
    if why_not is None:
        logger.info("experts on %s %s: grouped_mm (supported)", device_type, dtype)
    else:
        logger.warning("experts on %s %s: %s, not grouped_mm (%s)", device_type, dtype, backend, why_not)
