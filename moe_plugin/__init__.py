"""moe_plugin: hybrid expert parallelism for Megatron-Core GPT training on the DeepSpeed engine."""
from moe_plugin.configs import ConfigError, MoEConfig, ParallelSizes
from moe_plugin.configs.report import exit_on_config_error, report_config_error
from moe_plugin.groups.layout import RankLayout

__version__ = "0.1.0"
__all__ = ["ConfigError", "MoEConfig", "ParallelSizes", "RankLayout", "__version__", "exit_on_config_error",
           "initialize", "report_config_error"]


def __getattr__(name: str):
    # initialize imports torch and DeepSpeed: only on first use, so the CLI and config checks stay light.
    if name == "initialize":
        from moe_plugin.integration.deepspeed import initialize

        return initialize
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
