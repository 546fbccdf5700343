"""DeepSpeed's batch arithmetic, checked before any process group exists.

    sizes = batch_sizes(ds_config, dp=sizes.dp)     # BatchSizes(micro=4, gas=2, total=16), or a ConfigError

``train_batch_size = micro x gradient_accumulation_steps x dp``, the number the JSON leaves out derived
as DeepSpeed 0.19.8 derives it, but exactly: what does not hold or divide evenly, or a near miss of a
key name, is a ``ConfigError`` naming the key. Rules: docs/config.md; why: docs/design/configs_checks.md.
"""
from __future__ import annotations

import difflib
from dataclasses import dataclass
from typing import Any

from moe_plugin.configs.errors import MISSING, ConfigError

TOTAL, MICRO, GAS = "train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps"


@dataclass(frozen=True)
class BatchSizes:
    """The three batch numbers DeepSpeed will run with, and which of them it derives."""

    micro: int
    gas: int
    total: int
    dp: int
    derived: tuple[str, ...] = ()

    def describe(self) -> str:
        """``global batch 16 = micro 4 x accumulation 2 x dp 2 (gradient_accumulation_steps derived)``."""
        text = f"global batch {self.total} = micro {self.micro} x accumulation {self.gas} x dp {self.dp}"
        return text + (f" ({', '.join(self.derived)} derived)" if self.derived else "")


def batch_sizes(ds_config: dict, dp: int) -> BatchSizes:
    """The batch numbers of ``ds_config`` on ``dp`` data-parallel ranks, derived as DeepSpeed does and
    checked exactly."""
    _check_near_misses(ds_config)
    total, micro, gas = (_positive(ds_config, key) for key in (TOTAL, MICRO, GAS))
    if total is None and micro is None:
        raise ConfigError(TOTAL, MISSING, f"DeepSpeed needs {TOTAL} or {MICRO} (best: both, with {GAS}); "
                          f"e.g. \"{TOTAL}\": {8 * dp}, \"{MICRO}\": 4, \"{GAS}\": 2 on {dp} data-parallel ranks")
    derived = tuple(key for key, value in ((TOTAL, total), (MICRO, micro), (GAS, gas)) if value is None)
    if total is None:
        gas = 1 if gas is None else gas
        total = micro * gas * dp
    elif micro is None:
        gas = 1 if gas is None else gas
        micro, rest = divmod(total, gas * dp)
        if rest or micro < 1:
            raise ConfigError(TOTAL, total, f"must be a multiple of {GAS} ({gas}) x data-parallel size ({dp}) = "
                              f"{gas * dp}: DeepSpeed derives {MICRO} as their quotient, and this one does not come "
                              f"out even; set {MICRO}")
    elif gas is None:
        gas, rest = divmod(total, micro * dp)
        if rest or gas < 1:
            raise ConfigError(TOTAL, total, f"must be a multiple of {MICRO} ({micro}) x data-parallel size ({dp}) "
                              f"= {micro * dp}: DeepSpeed derives {GAS} as their quotient, and this one does not "
                              "come out even")
    if total != micro * gas * dp:
        raise ConfigError(TOTAL, total, f"must equal {MICRO} ({micro}) x {GAS} ({gas}) x data-parallel size ({dp}) "
                          f"= {micro * gas * dp}; the JSON does not fit this layout's {dp} data-parallel ranks")
    return BatchSizes(micro, gas, total, dp, derived)


def _positive(ds_config: dict, key: str) -> Any:
    value = ds_config.get(key)
    if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
        raise ConfigError(key, value, "expected an integer >= 1")
    return value


def _check_near_misses(ds_config: dict) -> None:
    """A top-level key that is a slip for an absent batch key: DeepSpeed would ignore it silently."""
    for key in (TOTAL, MICRO, GAS):
        if key in ds_config:
            continue
        for other in ds_config:
            if isinstance(other, str) and other != key and other not in (TOTAL, MICRO, GAS) and \
                    difflib.SequenceMatcher(None, other.lower(), key).ratio() >= 0.8:
                raise ConfigError(other, ds_config[other], f"unknown key (did you mean {key!r}?): DeepSpeed "
                                  f"ignores it and derives {key} from the other batch numbers instead")
