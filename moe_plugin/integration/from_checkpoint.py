"""The model a checkpoint records, built for any layout: a script of one's own needs no model flags.

    run = moe_plugin.initialize("ds.json", checkpoint_model_provider("ckpt"))
    moe_plugin.load_checkpoint(run, "ckpt")
"""
from __future__ import annotations

import os
from typing import Any, Callable, Optional

import torch

# TransformerConfig fields that describe the saving run's layout or device, not the model
RUN_FIELDS = ("tensor_model_parallel_size", "pipeline_model_parallel_size", "sequence_parallel",
              "use_cpu_initialization", "pipeline_dtype", "perform_initialization")


def checkpoint_model(directory: os.PathLike | str, tag: Optional[str] = None) -> dict:
    """The model record of ``directory``'s tag (default: its ``latest``): ``metadata.model_description``'s keys."""
    from moe_plugin.checkpoint.errors import CheckpointError
    from moe_plugin.checkpoint.metadata import read_latest, read_metadata

    tag = tag if tag is not None else read_latest(directory)
    model = read_metadata(directory, tag).get("model")
    if not isinstance(model, dict) or not isinstance(model.get("transformer_config"), dict):
        raise CheckpointError(f"{os.path.join(os.fspath(directory), tag)}: its metadata records no model "
                              "(\"model\" with \"transformer_config\"); build the model from its flags instead")
    return model


def checkpoint_model_provider(directory: os.PathLike | str, tag: Optional[str] = None, *,
                              seed: int = 0) -> Callable[[Any, Any], torch.nn.Module]:
    """``model_provider(moe_config, groups)``: the recorded model under the run's layout (fp32, CPU-initialised)."""
    record = checkpoint_model(directory, tag)

    def provider(moe_config, groups):
        from moe_plugin.checkpoint.export import exported_transformer_config
        from moe_plugin.integration.megatron import gpt_moe_spec
        from moe_plugin.integration.rope import RopeScaling, apply_rope_scaling

        fields = {k: v for k, v in record["transformer_config"].items() if k not in RUN_FIELDS}
        config = exported_transformer_config({"transformer_config": fields}, **moe_config.megatron_parallel_fields(),
                                             use_cpu_initialization=True, pipeline_dtype=torch.float32)
        position = dict(position_embedding_type=record.get("position_embedding_type", "learned_absolute"),
                        rotary_base=record.get("rotary_base", 10000), rotary_percent=record.get("rotary_percent", 1.0))
        common = dict(vocab_size=record["vocab_size"], max_sequence_length=record["max_sequence_length"],
                      share_embeddings_and_output_weights=bool(record.get("tied", False)), **position)
        if moe_config.parallel.pipeline > 1:
            from moe_plugin.integration.pipeline import gpt_pipeline_module

            model = gpt_pipeline_module(config, moe_config, groups, seed=seed,
                                        qk_layernorm_scope=record.get("qk_layernorm_scope", "head"), **common)
        else:
            from megatron.core.models.gpt import GPTModel

            torch.manual_seed(seed)
            model = GPTModel(config, gpt_moe_spec(moe_config, config, groups,
                                                  qk_layernorm_scope=record.get("qk_layernorm_scope", "head")),
                             **common)
        scaling = record.get("rope_scaling")
        if scaling:
            model = apply_rope_scaling(model, RopeScaling.from_dict(scaling, "the checkpoint's rope_scaling"),
                                       rotary_base=position["rotary_base"])
        return model

    return provider
