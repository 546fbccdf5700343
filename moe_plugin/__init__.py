"""moe_plugin: hybrid expert parallelism for Megatron-Core GPT training on the DeepSpeed engine."""
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
__all__ = ["ConfigError", "MoEConfig", "ParallelSizes", "RankLayout", "__version__", "alike_on_every_rank",
           "exit_on_config_error", "exit_on_error", "initialize", "raised_alike", "report_config_error", "report_error",
           "transformer_config"]


def __getattr__(name: str):
    # initialize imports torch and DeepSpeed: only on first use, so the CLI and config checks stay light.
    if name == "initialize":
        from moe_plugin.integration.deepspeed import initialize

        return initialize
    if name == "transformer_config":   # imports Megatron-Core
        from moe_plugin.integration.megatron import transformer_config

        return transformer_config
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
