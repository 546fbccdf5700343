"""Glue to Megatron-Core and DeepSpeed: ``initialize``, the GPT specs and pipeline module, the loop's helpers.

Import the submodules directly (they import Megatron); each is listed in docs/architecture.md.
"""
