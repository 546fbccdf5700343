"""The ``"moe"`` block of the DeepSpeed JSON: schema, validation, presets."""
from moe_plugin.configs.batch import BatchSizes, batch_sizes
from moe_plugin.configs.capacity import expert_capacity
from moe_plugin.configs.errors import ConfigError
from moe_plugin.configs.schema import MoEConfig, ParallelConfig, ParallelSizes, PlacementConfig, load_ds_config

__all__ = ["BatchSizes", "ConfigError", "MoEConfig", "ParallelConfig", "ParallelSizes", "PlacementConfig",
           "batch_sizes", "expert_capacity", "load_ds_config"]
