"""moe_plugin: hybrid expert parallelism for Megatron-Core GPT training on the DeepSpeed engine.

What a training script needs is here by name: ``moe_plugin.initialize``, ``moe_plugin.gpt_moe_spec``,
``moe_plugin.save_checkpoint``, ... Importing the package imports neither torch nor DeepSpeed nor
Megatron-Core (the ``moe-plugin`` command and the config checks stay light): the names that do
are imported on first use.
"""
import importlib

from moe_plugin.configs import ConfigError, MoEConfig, ParallelSizes
from moe_plugin.configs.report import (
    alike_on_every_rank,
    exit_on_config_error,
    exit_on_error,
    raised_alike,
    report_config_error,
    report_error,
)
from moe_plugin.groups.layout import RankLayout

__version__ = "0.1.0"

# name -> "module:attribute", imported on first use (each imports torch, DeepSpeed or Megatron-Core)
_LAZY = {
    "initialize": "moe_plugin.integration.deepspeed:initialize",
    "transformer_config": "moe_plugin.integration.megatron:transformer_config",
    "gpt_moe_spec": "moe_plugin.integration.megatron:gpt_moe_spec",
    "gpt_pipeline_module": "moe_plugin.integration.pipeline:gpt_pipeline_module",
    "MoELayer": "moe_plugin.layers.moe_layer:MoELayer",
    "ExpertMetrics": "moe_plugin.integration.monitor:ExpertMetrics",
    "training_placement": "moe_plugin.integration.placement:training_placement",
    "TrainingStopped": "moe_plugin.integration.guard:TrainingStopped",
    "save_checkpoint": "moe_plugin.checkpoint:save_checkpoint",
    "load_checkpoint": "moe_plugin.checkpoint:load_checkpoint",
    "checkpoint_exists": "moe_plugin.checkpoint:checkpoint_exists",
    "CheckpointError": "moe_plugin.checkpoint:CheckpointError",
}

__all__ = ["ConfigError", "MoEConfig", "ParallelSizes", "RankLayout", "__version__", "alike_on_every_rank",
           "exit_on_config_error", "exit_on_error", "raised_alike", "report_config_error", "report_error", *_LAZY]


def __getattr__(name: str):
    if name not in _LAZY:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    module, attribute = _LAZY[name].split(":")
    return getattr(importlib.import_module(module), attribute)


def __dir__() -> list[str]:
    return sorted({*globals(), *_LAZY})
