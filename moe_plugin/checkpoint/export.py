"""A checkpoint of any layout as one fp32 state dict of the 1-rank ``GPTModel``, and its config.

    export_checkpoint("ckpt", "exported")            # or: moe-plugin export ckpt --out exported
    state, config = load_export("exported")
    tc = exported_transformer_config(config)         # and exported_moe_config(config) for gpt_moe_spec
    model.load_state_dict(state)                     # a GPTModel built from them under a 1-rank layout

Writes ``model.safetensors`` (floats as fp32; TP shards joined, pipeline pieces renamed, experts stacked
by global id) and ``config.json`` (what rebuilding the model on one rank needs), after checking every
file against its checksum; one tensor at a time, one process, no Megatron import. Usage:
docs/checkpoints.md; how: docs/design/checkpoint_format.md.
"""
from __future__ import annotations

import contextlib
import copy
import json
import logging
import os
from typing import Any, Callable, Optional

import torch

from moe_plugin.checkpoint.confine import inside, write_new
from moe_plugin.checkpoint.errors import CheckpointError
from moe_plugin.checkpoint.files import verify_all
from moe_plugin.checkpoint.metadata import (
    POSITION_DEFAULTS,
    module_files,
    named_function,
    placement_key,
    read_latest,
    read_metadata,
)
from moe_plugin.checkpoint.readers import is_lazy, open_expert, open_module
from moe_plugin.checkpoint.shards import tp_join
from moe_plugin.checkpoint.tensor_files import PART, TensorFile, TensorWriter, nbytes
from moe_plugin.checkpoint.trust import trust_argument

logger = logging.getLogger(__name__)

EXPORT_FORMAT, EXPORT_VERSION = "moe_plugin.export", 1
WEIGHTS_FILE, CONFIG_FILE = "model.safetensors", "config.json"
# TransformerConfig fields a 1-rank model sets itself.
ONE_RANK = {"tensor_model_parallel_size": 1, "pipeline_model_parallel_size": 1, "sequence_parallel": False,
            "virtual_pipeline_model_parallel_size": None, "num_layers_in_first_pipeline_stage": None,
            "num_layers_in_last_pipeline_stage": None, "context_parallel_size": 1, "expert_model_parallel_size": 1,
            "expert_tensor_parallel_size": 1, "pipeline_model_parallel_layout": None,
            "use_cpu_initialization": True}


@trust_argument
def export_checkpoint(ckpt_dir: os.PathLike | str, out_dir: os.PathLike | str, tag: Optional[str] = None,
                      progress: Optional[Callable[[str], None]] = None) -> dict[str, str]:
    """Write ``ckpt_dir/tag`` (default ``latest``) as ``out_dir/model.safetensors`` and ``config.json``;
    returns their paths. ``progress``: one line per stage and file (default: the logger)."""
    say = progress or logger.info
    out_dir = os.fspath(out_dir)
    source = CheckpointSource(ckpt_dir, tag, say)
    specs = {k: (torch.float32 if dtype.is_floating_point else dtype, shape)
             for k, (dtype, shape) in sorted(source.specs().items())}
    created = not os.path.exists(out_dir)
    os.makedirs(out_dir, exist_ok=True)
    try:
        return _write_export(source, specs, out_dir, say)
    except BaseException:   # the writer left nothing; nor does the directory made for it
        if created:
            with contextlib.suppress(OSError):
                os.rmdir(out_dir)
        raise


def _write_export(source: "CheckpointSource", specs: dict, out_dir: str, say: Callable[[str], None]) -> dict:
    weights, config = os.path.join(out_dir, WEIGHTS_FILE), os.path.join(out_dir, CONFIG_FILE)
    size = sum(nbytes(*spec) for spec in specs.values())
    say(f"writing {weights}: {len(specs)} tensors, {size / 2 ** 20:.1f} MiB")
    with TensorWriter(weights, specs, {"format": EXPORT_FORMAT, "source": source.path}) as out:
        for n, key in enumerate(specs, 1):
            if source.is_expert(key):   # row by row: one expert at a time
                for e in range(source.num_experts):
                    out.write_rows(key, e, source.read_expert(key, e).to(specs[key][0]).unsqueeze(0))
            else:
                out.write(key, source.read(key).to(specs[key][0]).contiguous())
            if n % 64 == 0 or n == len(specs):
                say(f"tensors {n}/{len(specs)}")
    with contextlib.suppress(FileNotFoundError):
        os.remove(config + PART)   # a stale one: the link itself if it is one
    write_new(config + PART, json.dumps(export_config(source.meta, source.path), indent=1).encode())
    os.replace(config + PART, config)   # a link at config.json is replaced, not written through
    say(f"writing {config}")
    return {"weights": weights, "config": config}


class CheckpointSource:
    """Any checkpoint (``ckpt_dir/tag``, default ``latest``) as the 1-rank ``GPTModel``'s tensors, each read
    when asked, every file checked against its checksum first. ``specs()``: {key: (dtype, shape)};
    ``read(key)``; ``read_expert(key, e)``: one expert's row; ``extras``: non-tensor entries."""

    def __init__(self, ckpt_dir: os.PathLike | str, tag: Optional[str] = None,
                 progress: Optional[Callable[[str], None]] = None):
        say = progress or logger.info
        ckpt_dir = os.fspath(ckpt_dir)
        tag = read_latest(ckpt_dir) if tag is None else tag
        path = os.path.join(ckpt_dir, tag)
        if not os.path.isdir(path):
            raise CheckpointError(f"{path}: missing; no checkpoint tag {tag!r} there")
        meta = read_metadata(ckpt_dir, tag)
        model = meta.get("model")
        if not model or "transformer_config" not in model or "vocab_size" not in model:
            raise CheckpointError(f"{os.path.join(path, 'moe_plugin.json')}: records no model config (saved by an "
                                  "older moe_plugin); load it into a model and save it again to export it")
        say(f"checking {len(meta.get('files', {}))} files of {path} against their checksums")
        verify_all(path, meta)
        self.path, self.meta, self.num_experts = path, meta, int(meta.get("num_experts") or 0)
        self.extras: dict[str, Any] = {}
        self._dense: dict[str, tuple[list, Optional[tuple[int, int]], list]] = {}   # key -> (pieces, cut, shape)
        self._experts: dict[str, tuple] = {}   # key -> (stage, saved key, shape [E, ...], dtype)
        self._placements: dict[str, int] = {}
        self._open: tuple[Optional[tuple[int, int]], Any] = (None, None)
        num_layers = model["transformer_config"]["num_layers"]
        for stage in sorted(int(st) for st in meta["stages"]):
            self._stage(stage, num_layers, say)
        self._untie(say)

    def _stage(self, stage: int, num_layers: int, say: Callable[[str], None]) -> None:
        meta, path = self.meta, self.path
        saved = meta["stages"][str(stage)]
        files = module_files(path, meta, stage)
        say(f"stage {stage}: dense weights from {', '.join(os.path.basename(f) for f in files)}")
        modules = [open_module(path, meta, stage, r) for r in range(len(files))]
        split = saved.get("tp_split")
        if split is None and len(modules) > 1:
            raise CheckpointError(f"{path}: saved at TP {len(modules)} without the record of how each weight is cut "
                                  "(an older moe_plugin); load it into a model and save it again to export it")
        for key, shape in saved["dense"].items():
            missing = [f for f, m in zip(files, modules) if key not in m]
            if missing:
                raise CheckpointError(f"{missing[0]}: lacks {key!r}, which the metadata records for stage {stage}")
            gpt = _gpt_key(key, meta, num_layers)
            if key.endswith(".placement"):   # experts are written in id order: slot e holds expert e
                self._placements[gpt] = int(shape[0])
                continue
            cut = (split or {}).get(key)
            pieces = [m[key] for m in modules] if cut is not None else [modules[0][key]]
            if not is_lazy(pieces[0]):
                continue
            joined = tp_join([torch.empty(p.shape, dtype=p.dtype, device="meta") for p in pieces], *cut) \
                if cut is not None else pieces[0]
            if list(joined.shape) != list(shape):
                raise CheckpointError(f"{files[0]}: {key} joins to {list(joined.shape)}, the metadata records {shape}")
            self._dense[gpt] = (pieces, tuple(cut) if cut is not None else None, list(shape))
        for key, value in modules[0].items():
            if key not in saved["dense"] and not is_lazy(value):
                try:
                    self.extras[_gpt_key(key, meta, num_layers)] = value
                except KeyError:   # a pipeline-only piece with no GPTModel name
                    continue
        keys = sorted(saved.get("experts", {}))
        if keys:
            say(f"stage {stage}: {self.num_experts} expert files, {len(keys)} expert weights")
            first = open_expert(path, meta, 0, stage)
            for k in keys:
                if k not in first.weights:
                    raise CheckpointError(f"{first.path}: does not hold expert 0 with keys {keys[:4]}")
                if [self.num_experts, *first.weights[k].shape] != list(saved["experts"][k]):
                    raise CheckpointError(f"{first.path}: {k} stacks to {[self.num_experts, *first.weights[k].shape]}"
                                          f", the metadata records {saved['experts'][k]}")
                gpt = _gpt_key(k, meta, num_layers)
                self._experts[gpt] = (stage, k, list(saved["experts"][k]), first.weights[k].dtype)
                self._placements[_gpt_key(placement_key(k), meta, num_layers)] = self.num_experts

    def _untie(self, say: Callable[[str], None]) -> None:
        """A tied model keeps one weight: drop the pipeline's copy in the last stage."""
        if not self.meta["model"].get("tied", False) or "output_layer.weight" not in self._dense:
            return
        word_key = "embedding.word_embeddings.weight"
        copy_ = self.read("output_layer.weight")
        word = self.read(word_key) if word_key in self._dense else None
        del self._dense["output_layer.weight"]
        if word is None or not torch.equal(copy_, word):
            diff = "no word embedding" if word is None else f"max difference {(copy_ - word).abs().max().item():.3g}"
            logger.warning("%s: the last stage's copy of the tied output weight differs from the word embedding (%s);"
                           " the word embedding is kept", self.path, diff)
        say("tied embeddings: the last stage's copy of the word embedding dropped (the 1-rank model shares one)")

    def specs(self) -> dict[str, tuple[torch.dtype, list[int]]]:
        out = {k: (pieces[0].dtype, shape) for k, (pieces, _cut, shape) in self._dense.items()}
        out.update({k: (dtype, shape) for k, (_st, _k, shape, dtype) in self._experts.items()})
        out.update({k: (torch.long, [n]) for k, n in self._placements.items()})
        return out

    def keys(self) -> list[str]:
        return sorted(self.specs())

    def is_expert(self, key: str) -> bool:
        return key in self._experts

    def read(self, key: str) -> torch.Tensor:
        if key in self._placements:
            return torch.arange(self._placements[key], dtype=torch.long)
        if key in self._experts:
            return torch.stack([self.read_expert(key, e) for e in range(self.num_experts)])
        pieces, cut, _shape = self._dense[key]
        values = [p.read() for p in pieces]
        return tp_join(values, *cut) if cut is not None else values[0]

    def read_expert(self, key: str, expert_id: int) -> torch.Tensor:
        stage, saved_key, _shape, _dtype = self._experts[key]
        opened, entry = self._open
        # one expert file open at a time (one per expert would hold hundreds of descriptors); a
        # reopen reads its header only
        if opened != (expert_id, stage):
            entry = open_expert(self.path, self.meta, expert_id, stage)
            if entry.expert_id != expert_id:
                raise CheckpointError(f"{entry.path}: does not hold expert {expert_id}")
            self._open = ((expert_id, stage), entry)
        if saved_key not in entry.weights:
            raise CheckpointError(f"{entry.path}: does not hold {saved_key!r}")
        return entry.weights[saved_key].read()


class StateSource:
    """An in-memory 1-rank state dict with ``CheckpointSource``'s reading interface."""

    def __init__(self, state: dict[str, torch.Tensor]):
        self.state = state

    def specs(self) -> dict[str, tuple[torch.dtype, list[int]]]:
        return {k: (v.dtype, list(v.shape)) for k, v in self.state.items() if isinstance(v, torch.Tensor)}

    def keys(self) -> list[str]:
        return sorted(self.specs())

    def read(self, key: str) -> torch.Tensor:
        return self.state[key]

    def read_expert(self, key: str, expert_id: int) -> torch.Tensor:
        return self.state[key][expert_id]


def read_full_state(ckpt_dir: os.PathLike | str, tag: Optional[str] = None,
                    progress: Optional[Callable[[str], None]] = None) -> tuple[dict, dict, dict, str]:
    """Every tensor of ``CheckpointSource`` in memory: (tensors, non-tensor entries, metadata, tag path)."""
    source = CheckpointSource(ckpt_dir, tag, progress)
    return {k: source.read(k) for k in source.keys()}, source.extras, source.meta, source.path


def _gpt_key(key: str, meta: dict, num_layers: int) -> str:
    if not meta.get("pipeline_module", False):
        return key
    from moe_plugin.integration.pipeline import gpt_state_dict_key

    return gpt_state_dict_key(key, num_layers)


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
            **{k: model.get(k, default) for k, default in POSITION_DEFAULTS.items()},
            "qk_layernorm_scope": model.get("qk_layernorm_scope", "head"), "rope_scaling": model.get("rope_scaling"),
            "moe": moe,
            "source": {"checkpoint": path, "tag": meta["tag"], "global_steps": meta["global_steps"],
                       "layout": meta["layout"], "zero_stage": meta["zero_stage"]}}


# -- reading an export ----------------------------------------------------------------------------
def load_export(out_dir: os.PathLike | str) -> tuple[dict[str, torch.Tensor], dict]:
    """(state dict, config.json) of an export, confined to ``out_dir``; weights read as safetensors only."""
    out_dir = os.fspath(out_dir)
    config_file = inside(out_dir, CONFIG_FILE, os.path.join(out_dir, CONFIG_FILE))
    with open(config_file) as f:
        config = json.load(f)
    name = os.path.basename(str(config.get("weights", WEIGHTS_FILE)))
    with TensorFile(inside(out_dir, name, f"{config_file}: weights")) as weights:
        return {name: weights.read(name) for name in weights.names()}, config


def exported_transformer_config(config: dict, **overrides: Any):
    """Megatron's ``TransformerConfig`` (or ``MLATransformerConfig``) of an export, ``overrides`` applied."""
    from megatron.core.transformer.transformer_config import MLATransformerConfig, TransformerConfig

    fields = dict(config["transformer_config"])
    for name, value in list(fields.items()):
        if isinstance(value, str) and value.startswith("torch.") and isinstance(getattr(torch, value[6:], None),
                                                                                 torch.dtype):
            fields[name] = getattr(torch, value[6:])
    if isinstance(fields.get("activation_func"), str):
        fields["activation_func"] = named_function(fields["activation_func"], "the export's config.json")
    kind = MLATransformerConfig if fields.get("multi_latent_attention") else TransformerConfig
    return kind(**{**fields, **overrides})


def exported_moe_config(config: dict):
    """The plugin's ``MoEConfig`` of an export (every parallel size 1)."""
    from moe_plugin.configs import MoEConfig

    return MoEConfig.from_dict(config["moe"])
