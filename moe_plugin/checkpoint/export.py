"""A checkpoint of any layout as one fp32 state dict of the 1-rank ``GPTModel``, and its config.

    export_checkpoint("ckpt", "exported")            # or: moe-plugin export ckpt --out exported
    state, config = load_export("exported")
    model = GPTModel(exported_transformer_config(config), gpt_moe_spec(exported_moe_config(config), ...),
                     vocab_size=config["vocab_size"], max_sequence_length=config["max_sequence_length"],
                     share_embeddings_and_output_weights=config["share_embeddings_and_output_weights"],
                     position_embedding_type=config["position_embedding_type"], rotary_base=config["rotary_base"])
    model.load_state_dict(state)                     # under a 1-rank layout: every parallel size 1

Written into ``out_dir``: ``model.safetensors`` (every tensor of the ``GPTModel``'s state dict,
floating point ones as fp32) and ``config.json`` (``transformer_config``: the TransformerConfig
fields JSON can hold, parallel sizes set to 1; ``vocab_size``; ``max_sequence_length``;
``share_embeddings_and_output_weights``; ``position_embedding_type`` and ``rotary_base`` (GPTModel's
arguments); the ``moe`` block with parallel sizes 1; ``source``: the
checkpoint, tag, step and saved layout).

How: every file is first checked against the checksums the save recorded. Dense weights come
from DeepSpeed's module files, one per (pipeline stage, TP rank): TP shards are joined by the cut
the save recorded per key (``tp_split``: dim and stride), pipeline pieces renamed to ``GPTModel``
keys (``pipeline.gpt_state_dict_key``). Experts come from the global-id files: expert e of every
MoE layer, stacked in id order, so the 1-rank model's placement is the identity (the saved
placement only said which rank held which expert). A tied model (the word embedding is also the
output layer) has no ``output_layer.weight``: a pipeline's last stage keeps a copy of the
embedding, which is dropped here (checked equal first). One process, no process group, no
Megatron import. fp16/bf16 runs export the module's weights, cast to fp32 (not ZeRO's master
copies). DeepSpeed's ``zero_to_fp32.py`` does not understand these checkpoints (the experts are
in our files): use this.
"""
from __future__ import annotations

import copy
import importlib
import json
import logging
import os
from typing import Any, Callable, Optional

import torch

from moe_plugin.checkpoint.errors import CheckpointError
from moe_plugin.checkpoint.files import read_torch, verify_all
from moe_plugin.checkpoint.metadata import (POSITION_DEFAULTS, expert_file, placement_key, read_latest, read_metadata,
                                            saved_model_files)
from moe_plugin.checkpoint.shards import tp_join

logger = logging.getLogger(__name__)

EXPORT_FORMAT, EXPORT_VERSION = "moe_plugin.export", 1
WEIGHTS_FILE, CONFIG_FILE = "model.safetensors", "config.json"
# TransformerConfig fields a 1-rank model sets itself.
ONE_RANK = {"tensor_model_parallel_size": 1, "pipeline_model_parallel_size": 1, "sequence_parallel": False,
            "virtual_pipeline_model_parallel_size": None, "num_layers_in_first_pipeline_stage": None,
            "num_layers_in_last_pipeline_stage": None, "context_parallel_size": 1, "expert_model_parallel_size": 1,
            "expert_tensor_parallel_size": 1, "pipeline_model_parallel_layout": None,
            "use_cpu_initialization": True}


def export_checkpoint(ckpt_dir: os.PathLike | str, out_dir: os.PathLike | str, tag: Optional[str] = None,
                      progress: Optional[Callable[[str], None]] = None) -> dict[str, str]:
    """Write ``ckpt_dir/tag`` (default: its ``latest``) as ``out_dir/model.safetensors`` and
    ``out_dir/config.json``; returns their paths. ``progress``: called with one line per stage
    and file (default: the module's logger)."""
    from safetensors.torch import save_file

    say = progress or logger.info
    out_dir = os.fspath(out_dir)
    state, _extras, meta, path = read_full_state(ckpt_dir, tag, say)
    state = {k: (v.float() if v.is_floating_point() else v).contiguous().clone() for k, v in sorted(state.items())}
    os.makedirs(out_dir, exist_ok=True)
    weights, config = os.path.join(out_dir, WEIGHTS_FILE), os.path.join(out_dir, CONFIG_FILE)
    size = sum(v.numel() * v.element_size() for v in state.values())
    say(f"writing {weights}: {len(state)} tensors, {size / 2 ** 20:.1f} MiB")
    save_file(state, weights, metadata={"format": EXPORT_FORMAT, "source": path})
    with open(config, "w") as f:
        json.dump(export_config(meta, path), f, indent=1)
    say(f"writing {config}")
    return {"weights": weights, "config": config}


def read_full_state(ckpt_dir: os.PathLike | str, tag: Optional[str] = None,
                    progress: Optional[Callable[[str], None]] = None) -> tuple[dict, dict, dict, str]:
    """Any checkpoint (``ckpt_dir/tag``, default: its ``latest``) as the 1-rank ``GPTModel``'s state,
    after checking every file against its checksum: (tensors as saved, TP shards joined, experts
    stacked by id, under ``GPTModel`` names; the non-tensor entries of the DeepSpeed module files,
    Megatron's ``_extra_state``, under the same names; the metadata; the tag's path). One process."""
    say = progress or logger.info
    ckpt_dir = os.fspath(ckpt_dir)
    tag = read_latest(ckpt_dir) if tag is None else tag
    path = os.path.join(ckpt_dir, tag)
    if not os.path.isdir(path):
        raise CheckpointError(f"{path}: missing; no checkpoint tag {tag!r} there")
    meta = read_metadata(ckpt_dir, tag)
    model = meta.get("model")
    if not model or "transformer_config" not in model or "vocab_size" not in model:
        raise CheckpointError(f"{os.path.join(path, 'moe_plugin.json')}: records no model config (saved by an older "
                              "moe_plugin); load it into a model and save it again to export it")
    say(f"checking {len(meta.get('files', {}))} files of {path} against their checksums")
    verify_all(path, meta)
    state: dict[str, torch.Tensor] = {}
    extras: dict[str, Any] = {}
    num_layers = model["transformer_config"]["num_layers"]
    for stage in sorted(int(s) for s in meta["stages"]):
        state.update(_dense(path, meta, stage, num_layers, say, extras))
        state.update(_experts(path, meta, stage, num_layers, say))
    _untie(state, meta, path, say)
    return state, extras, meta, path


def _gpt_key(key: str, meta: dict, num_layers: int) -> str:
    if not meta.get("pipeline_module", False):
        return key
    from moe_plugin.integration.pipeline import gpt_state_dict_key

    return gpt_state_dict_key(key, num_layers)


def _dense(path: str, meta: dict, stage: int, num_layers: int, say: Callable[[str], None], extras: dict) -> dict:
    """Stage ``stage``'s dense entries, TP shards joined, under GPTModel keys; its non-tensor
    entries (TP rank 0's) go into ``extras``."""
    saved = meta["stages"][str(stage)]
    files = saved_model_files(path, meta, stage)
    say(f"stage {stage}: dense weights from {', '.join(os.path.basename(f) for f in files)}")
    modules = [read_torch(f)["module"] for f in files]
    split = saved.get("tp_split")
    if split is None and len(modules) > 1:
        raise CheckpointError(f"{path}: saved at TP {len(modules)} without the record of how each weight is cut "
                              "(an older moe_plugin); load it into a model and save it again to export it")
    out = {}
    for key, shape in saved["dense"].items():
        missing = [f for f, m in zip(files, modules) if key not in m]
        if missing:
            raise CheckpointError(f"{missing[0]}: lacks {key!r}, which the metadata records for stage {stage}")
        if key.endswith(".placement"):   # experts are written in id order below: slot e holds expert e
            value = torch.arange(shape[0], dtype=torch.long)
        elif key in (split or {}):
            dim, stride = split[key]
            value = tp_join([m[key] for m in modules], dim, stride)
        else:
            value = modules[0][key]
        if not isinstance(value, torch.Tensor):
            continue
        if list(value.shape) != list(shape):
            raise CheckpointError(f"{files[0]}: {key} joins to {list(value.shape)}, the metadata records {shape}")
        out[_gpt_key(key, meta, num_layers)] = value
    for key, value in modules[0].items():
        if key not in saved["dense"] and not isinstance(value, torch.Tensor):
            try:
                extras[_gpt_key(key, meta, num_layers)] = value
            except KeyError:   # a pipeline-only piece with no GPTModel name
                continue
    return out


def _experts(path: str, meta: dict, stage: int, num_layers: int, say: Callable[[str], None]) -> dict:
    """Stage ``stage``'s expert weights [E, ...] stacked by global id, under GPTModel keys."""
    saved = meta["stages"][str(stage)]
    keys = sorted(saved.get("experts", {}))
    if not keys:
        return {}
    num = meta["num_experts"]
    say(f"stage {stage}: {num} expert files, {len(keys)} expert weights")
    per_key: dict[str, list] = {k: [] for k in keys}
    for e in range(num):
        name = expert_file(path, e, stage)
        entry = read_torch(name)
        if entry.get("expert_id") != e or any(k not in entry.get("weights", {}) for k in keys):
            raise CheckpointError(f"{name}: does not hold expert {e} with keys {keys[:4]}")
        for k in keys:
            per_key[k].append(entry["weights"][k])
    out = {}
    for k in keys:
        value = torch.stack(per_key[k])
        if list(value.shape) != list(saved["experts"][k]):
            raise CheckpointError(f"{expert_file(path, 0, stage)}: {k} stacks to {list(value.shape)}, the metadata "
                                  f"records {saved['experts'][k]}")
        out[_gpt_key(k, meta, num_layers)] = value
        out[_gpt_key(placement_key(k), meta, num_layers)] = torch.arange(num, dtype=torch.long)
    return out


def _untie(state: dict, meta: dict, path: str, say: Callable[[str], None]) -> None:
    """A tied model keeps one weight: drop the pipeline's copy in the last stage."""
    if not meta["model"].get("tied", False) or "output_layer.weight" not in state:
        return
    copy_, word = state.pop("output_layer.weight"), state.get("embedding.word_embeddings.weight")
    if word is None or not torch.equal(copy_, word):
        diff = "no word embedding" if word is None else f"max difference {(copy_ - word).abs().max().item():.3g}"
        logger.warning("%s: the last stage's copy of the tied output weight differs from the word embedding (%s); "
                       "the word embedding is kept", path, diff)
    say("tied embeddings: the last stage's copy of the word embedding dropped (the 1-rank model shares one)")


def export_config(meta: dict, path: str) -> dict:
    """``config.json``: what rebuilding the model on one rank needs."""
    model = meta["model"]
    moe = copy.deepcopy(meta["moe"])
    moe["parallel"] = {**moe.get("parallel", {}), "tensor": 1, "pipeline": 1, "expert": 1, "expert_tensor": 1,
                       "sequence_parallel": False}
    # how the source ran, not the model: one rank has no exchange to overlap or pad and nothing to
    # place or shadow (the config refuses those settings there)
    moe.update(overlap_chunks=1, placement={})
    if moe.get("exchange") in ("padded", "token"):
        moe["exchange"] = "counts"
    return {"format": EXPORT_FORMAT, "version": EXPORT_VERSION, "weights": WEIGHTS_FILE,
            "transformer_config": {**model["transformer_config"], **ONE_RANK},
            "vocab_size": model["vocab_size"], "max_sequence_length": model["max_sequence_length"],
            "share_embeddings_and_output_weights": bool(model.get("tied", False)),
            **{k: model.get(k, default) for k, default in POSITION_DEFAULTS.items()}, "moe": moe,
            "source": {"checkpoint": path, "tag": meta["tag"], "global_steps": meta["global_steps"],
                       "layout": meta["layout"], "zero_stage": meta["zero_stage"]}}


# -- reading an export ----------------------------------------------------------------------------
def load_export(out_dir: os.PathLike | str) -> tuple[dict[str, torch.Tensor], dict]:
    """(state dict, config.json) of an export."""
    from safetensors.torch import load_file

    out_dir = os.fspath(out_dir)
    with open(os.path.join(out_dir, CONFIG_FILE)) as f:
        config = json.load(f)
    return load_file(os.path.join(out_dir, config.get("weights", WEIGHTS_FILE))), config


def exported_transformer_config(config: dict, **overrides: Any):
    """Megatron's ``TransformerConfig`` of an export (1-rank), ``overrides`` applied."""
    from megatron.core.transformer import TransformerConfig

    fields = dict(config["transformer_config"])
    for name, value in list(fields.items()):
        if isinstance(value, str) and value.startswith("torch.") and isinstance(getattr(torch, value[6:], None),
                                                                                 torch.dtype):
            fields[name] = getattr(torch, value[6:])
    if isinstance(fields.get("activation_func"), str):
        module, _, name = fields["activation_func"].partition(":")
        target: Any = importlib.import_module(module)
        for part in name.split("."):
            target = getattr(target, part)
        fields["activation_func"] = target
    return TransformerConfig(**{**fields, **overrides})


def exported_moe_config(config: dict):
    """The plugin's ``MoEConfig`` of an export (every parallel size 1)."""
    from moe_plugin.configs import MoEConfig

    return MoEConfig.from_dict(config["moe"])
