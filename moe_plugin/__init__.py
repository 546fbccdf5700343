"""moe_plugin: hybrid expert parallelism for Megatron-Core GPT training on the DeepSpeed engine."""
from moe_plugin.configs import ConfigError, MoEConfig, ParallelSizes
from moe_plugin.groups.layout import RankLayout

__version__ = "0.1.0"
__all__ = ["ConfigError", "MoEConfig", "ParallelSizes", "RankLayout", "__version__"]
