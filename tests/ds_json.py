"""The suite's DeepSpeed JSON, built in one place.

    ds_config(batch=8, dp=2, gas=2, moe=MOE, parallel={"expert": 2})        # a dict
    write_ds_config(path, batch=8, micro=4, moe=MOE)                        # the same, written; returns str(path)

The global batch ``batch`` is micro-batch x accumulation steps x data-parallel size: give two of
``micro``, ``gas`` (and ``dp``) and the third follows. The defaults are the ones most tests train with:
AdamW at 3e-3 with weight decay 0.1, gradient clipping 1.0, ZeRO-1, no step printing. ``moe`` gets
``parallel`` where given; ``extra`` keys go to the top level as given (a scheduler, a monitor, ``pipeline``).

    conversion_config(micro=1, moe=MOE)     # what a conversion reads: the micro-batch and the "moe" block
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Optional

ADAMW = {"type": "AdamW", "params": {"lr": 3e-3, "weight_decay": 0.1}}


def ds_config(*, batch: int, micro: Optional[int] = None, gas: Optional[int] = None, dp: int = 1,
              moe: Optional[dict] = None, parallel: Optional[dict] = None, zero: Optional[int] = 1,
              optimizer: Optional[dict] = ADAMW, clip: Optional[float] = 1.0, **extra: Any) -> dict:
    if micro is None:
        micro = batch // (dp * (gas or 1))
    if gas is None:
        gas = batch // (micro * dp)
    config: dict = {"train_batch_size": batch, "train_micro_batch_size_per_gpu": micro,
                    "gradient_accumulation_steps": gas, "steps_per_print": 10 ** 6}
    if clip is not None:
        config["gradient_clipping"] = clip
    if optimizer is not None:
        config["optimizer"] = optimizer
    if zero is not None:
        config["zero_optimization"] = {"stage": zero}
    if moe is not None:
        config["moe"] = dict(moe) if parallel is None else {**moe, "parallel": parallel}
    config.update(extra)
    return config


def conversion_config(*, micro: int, moe: dict, parallel: Optional[dict] = None) -> dict:
    return {"train_micro_batch_size_per_gpu": micro,
            "moe": dict(moe) if parallel is None else {**moe, "parallel": parallel}}


def write_ds_config(path: Path | str, **fields: Any) -> str:
    Path(path).write_text(json.dumps(ds_config(**fields)))
    return str(path)
