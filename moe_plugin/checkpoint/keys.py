"""A checkpoint of one model kind read by the other: a ``PipelineModule``'s pieces and a ``GPTModel``.

``as_running_kind`` renames the metadata's per-stage keys, ``running_state`` each file's state dict as
it is read (``decoder.layers.3.mlp...`` <-> ``4.layer.mlp...``); loading then follows the
pipeline-size-change path. A tied pipeline's copy of the word weight is dropped or made as needed; an
untied checkpoint does not load into a tied model. Design: docs/design/checkpoint_format.md.
"""
from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from moe_plugin.checkpoint.errors import CheckpointError
from moe_plugin.integration.pipeline import gpt_state_dict_key, pipeline_state_dict_key

WORD = "embedding.word_embeddings.weight"
OUTPUT = "output_layer.weight"
KIND_KEY = "kind_from"   # set on metadata read in the other kind's names: the saved kind


def _renamed(entries: Mapping[str, Any], to_pipeline: bool, num_layers: int) -> dict:
    """``entries`` in the pipeline's (``to_pipeline``) or the ``GPTModel``'s names, unnamed keys left out."""
    rename = pipeline_state_dict_key if to_pipeline else gpt_state_dict_key
    out = {}
    for key, value in entries.items():
        try:
            out[rename(key, num_layers)] = value
        except KeyError:
            continue
    return out


def as_running_kind(meta: dict, running_pipeline: bool, running_tied: bool) -> dict:
    """``meta`` with its per-stage keys in the running model's names (itself if the kinds agree)."""
    saved_pipeline = bool(meta.get("pipeline_module", False))
    saved_tied = bool(meta.get("model", {}).get("tied", False))
    if running_tied and not saved_tied:
        _check_untied_into_tied(meta)
    if saved_pipeline == running_pipeline:
        return meta
    num_layers = _num_layers(meta)
    stages = {}
    for number, saved in meta["stages"].items():
        stage = {part: _renamed(saved.get(part, {}), running_pipeline, num_layers)
                 for part in ("dense", "experts", "placements")}
        stages[number] = {**saved, **stage}
    if running_pipeline:   # a GPTModel checkpoint has the one stage of pp 1
        for saved in stages.values():
            _output_from_word(saved["dense"], num_layers)
    return {**meta, "stages": stages, "pipeline_module": running_pipeline, KIND_KEY: saved_pipeline}


def _check_untied_into_tied(meta: dict) -> None:
    if "model" in meta and not meta["model"].get("tied", False):
        raise CheckpointError("the checkpoint's output layer has a weight of its own (untied embeddings) but the "
                              "model ties it to the word embedding: its output weights would be lost; build the model "
                              "untied (share_embeddings_and_output_weights=False, the example's "
                              "--untie-embeddings-and-output-weights)")


def _num_layers(meta: dict) -> int:
    config = meta.get("model", {}).get("transformer_config", {})
    if "num_layers" not in config:
        raise CheckpointError(f"checkpoint {meta.get('tag')!r}: its metadata does not record the model's number of "
                              "layers, which reading it in the other model kind's names needs (saved by an older "
                              "moe_plugin)")
    return int(config["num_layers"])


def running_state(meta: dict, state: Mapping[str, Any]) -> dict:
    """A state dict read from one of the checkpoint's files in the running model's names."""
    if KIND_KEY not in meta:
        return dict(state)
    num_layers = _num_layers(meta)
    to_pipeline = bool(meta["pipeline_module"])
    out = _renamed(state, to_pipeline, num_layers)
    if to_pipeline:
        _output_from_word(out, num_layers)
    return out


def _output_from_word(entries: dict, num_layers: int) -> None:
    """Add the tied word weight as the last pipeline stage's output weight where ``entries`` lacks it."""
    word, output = pipeline_state_dict_key(WORD, num_layers), pipeline_state_dict_key(OUTPUT, num_layers)
    if word in entries and output not in entries:
        entries[output] = entries[word]
