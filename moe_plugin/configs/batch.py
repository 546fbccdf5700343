"""DeepSpeed's batch arithmetic, checked before any process group exists.

    sizes = batch_sizes(ds_config, dp=sizes.dp)     # BatchSizes(micro=4, gas=2, total=16), or a ConfigError

DeepSpeed requires ``train_batch_size = train_micro_batch_size_per_gpu x
gradient_accumulation_steps x data-parallel size`` and derives whichever of the three the JSON
leaves out from the other two and the data-parallel size, with integer division (DeepSpeed
0.19.8, ``DeepSpeedConfig._set_batch_related_parameters``). It checks the result only with an
assert deep inside ``deepspeed.initialize``, after the groups and the model are built, and a
division that does not come out even is truncated first. Here the same rules run on the
config alone, with ``dp`` from the layout: a number that is no positive integer, a product that
does not hold, a derivation that does not divide evenly, and a near miss of one of the three
key names (DeepSpeed ignores ``gradient_accumulation_step`` and derives the value instead) are
a ``ConfigError`` naming the key.

Where the JSON leaves ``gradient_accumulation_steps`` out, it follows from the world size:
``{"train_batch_size": 16, "train_micro_batch_size_per_gpu": 4}`` accumulates 1 micro-batch on 4
data-parallel ranks and 2 on 2. ``BatchSizes.derived`` names what was derived; write all three
numbers to pin them, so that another world size is refused instead of followed.
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
    """The batch numbers of ``ds_config`` on ``dp`` data-parallel ranks, derived as DeepSpeed does
    and checked exactly (see the module docstring)."""
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
