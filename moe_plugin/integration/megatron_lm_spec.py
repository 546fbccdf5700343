"""``spec``: the MoE layer spec for Megatron-LM's ``--spec moe_plugin.integration.megatron_lm_spec spec``.

Megatron-LM resolves ``--spec MODULE NAME`` with ``megatron.core.transformer.spec_utils.import_module``,
which imports MODULE and returns its attribute NAME as it is (it does not call it). So this module
computes the spec when it is imported -- inside Megatron-LM's model provider, after arguments and
process groups exist. See ``moe_plugin.integration.megatron.megatron_lm_spec`` and docs/megatron_lm.md.
"""
from moe_plugin.integration.megatron import megatron_lm_spec

spec = megatron_lm_spec()
