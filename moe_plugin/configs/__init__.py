"""The ``"moe"`` block of the DeepSpeed JSON: schema, validation, presets."""
from moe_plugin.configs.errors import ConfigError
from moe_plugin.configs.schema import MoEConfig, ParallelConfig, ParallelSizes, PlacementConfig, load_ds_config

__all__ = ["ConfigError", "MoEConfig", "ParallelConfig", "ParallelSizes", "PlacementConfig", "load_ds_config"]
