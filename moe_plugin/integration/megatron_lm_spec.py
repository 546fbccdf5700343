"""``spec``: the MoE layer spec for Megatron-LM's ``--spec moe_plugin.integration.megatron_lm_spec spec``.

Megatron-LM takes the attribute uncalled, so it is computed on import, inside its model provider (docs/megatron_lm.md).
"""
from moe_plugin.integration.megatron import megatron_lm_spec

spec = megatron_lm_spec()
