"""What a moe_plugin checkpoint says about itself (``moe_plugin.json``), and whether it fits the running model.

The metadata records the model's full shapes per pipeline stage, the ``moe`` block, the layout, the
ZeRO stage, the engine kind and the expert placements. ``check_fits`` compares it with the running
model; ``check_optimizer_can_follow`` whether the saved optimizer state can follow a layout change.
Nothing here writes or changes the model. Format: docs/design/checkpoint_format.md.
"""
from __future__ import annotations

import dataclasses
import json
import os
from typing import Any, Optional

import torch
import torch.distributed as dist
from torch import nn

from moe_plugin.checkpoint.confine import check_tree, inside, not_a_link
from moe_plugin.checkpoint.errors import CheckpointError, first_line
from moe_plugin.checkpoint.experts import expert_weights
from moe_plugin.checkpoint.optimizer import basic_optimizer, check_record_loads, record_kind
from moe_plugin.checkpoint.tensor_files import SUFFIX
from moe_plugin.checkpoint.trust import trusted
from moe_plugin.compat.deepspeed_checkpoint import model_file_name

# Version 3: the plugin's own files are safetensors and JSON (``plain_files`` for the optimizer record
# and the rng files), DeepSpeed's ``torch.save`` files beside them. No release wrote another version,
# so no other is read (docs/checkpoints.md, "Format versions").
FORMAT, FORMAT_VERSION, READ_VERSIONS = "moe_plugin.checkpoint", 3, (3,)
META_FILE, EXPERT_DIR, RNG_DIR, LATEST = "moe_plugin.json", "experts", "rng", "latest"
DENSE_DIR, SAFE = "model", "safetensors"   # a conversion's dense files; the metadata's "expert_files"
# Keys of the "moe" block that change the function the model computes (parallel sizes do not).
# A key a checkpoint lacks (saved before the field existed) counts as its default, ``SINCE_DEFAULTS``.
MODEL_KEYS = ("num_experts", "top_k", "router", "normalize_gates", "second_expert_policy", "activation",
              "ffn_hidden_size", "shared_expert_ffn_hidden_size", "shared_expert_gate", "layer_interval", "layers",
              "score_function", "gate_scale", "group_topk", "router_groups", "group_score")
SINCE_DEFAULTS = {"score_function": "softmax", "gate_scale": 1.0, "group_score": "top2_sum"}
# The model's architecture beyond its shapes, from the ``"model"`` record: TransformerConfig fields
# and GPTModel's position arguments (``rotary_base`` compared under RoPE only). A record without a
# position key (saved before it was recorded) counts as GPTModel's default.
ARCHITECTURE_KEYS = ("normalization", "layernorm_epsilon", "gated_linear_unit", "activation_func", "add_bias_linear",
                     "num_query_groups", "qk_layernorm")
POSITION_DEFAULTS = {"position_embedding_type": "learned_absolute", "rotary_base": 10000, "rotary_percent": 1.0}
# Which tokens a rank sees (and so its RNG streams: dropout, router noise) depends on these only.
TOKEN_LAYOUT_KEYS = ("world_size", "tp", "pp", "dp", "order")


def read_json(path: str) -> Any:
    """A JSON file of a checkpoint; failures name the path."""
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except FileNotFoundError:
        raise CheckpointError(f"{path}: missing") from None
    except (ValueError, OSError) as exc:  # JSONDecodeError, UnicodeDecodeError
        raise CheckpointError(f"{path}: unreadable JSON, truncated or damaged ({type(exc).__name__}: "
                              f"{first_line(exc)})") from exc


def rng_file(path: str, rank: int) -> str:
    """A rank's random streams."""
    return os.path.join(path, RNG_DIR, f"rank_{rank:05d}{SUFFIX}")


def deepspeed_model_file(path: str, engine: Any) -> str:
    """DeepSpeed's module file of this rank's model-parallel slice (one per stage and TP rank)."""
    return os.path.join(path, model_file_name(engine.checkpoint_mp_rank))


def saved_model_files(path: str, meta: dict, stage: int) -> list[str]:
    """DeepSpeed's module files of ``stage``, one per saved TP rank, in TP rank order."""
    names = meta.get("model_files", {}).get(str(stage))
    if names is None:
        tp = meta["layout"]["tp"]
        names = [model_file_name(stage * tp + r) for r in range(tp)]
    return [os.path.join(path, name) for name in names]


def dense_file_name(stage: int, tp_rank: int) -> str:
    return f"{DENSE_DIR}/dense_pp_{stage:02d}_tp_{tp_rank:02d}{SUFFIX}"


def expert_file(path: str, expert_id: int, stage: int) -> str:
    """One full expert (every MoE layer of ``stage``) under its global id."""
    return os.path.join(path, EXPERT_DIR, f"expert_{expert_id:05d}_pp_{stage:02d}{SUFFIX}")


def module_files(path: str, meta: dict, stage: int) -> list[str]:
    """The files holding stage ``stage``'s dense tensors, one per saved TP rank."""
    dense = meta.get("dense_files", {}).get(str(stage))
    if dense is not None:
        return [os.path.join(path, name) for name in dense]
    return saved_model_files(path, meta, stage)


def stages_changed(meta: dict, groups: Any) -> bool:
    """Whether the saved stages hold other pieces than the running ones (pipeline size or model kind)."""
    return meta["layout"]["pp"] != groups.layout.sizes.pp or "kind_from" in meta


def dense_recut(meta: dict, groups: Any) -> bool:
    """Whether the dense weights are joined and cut again, or read from a conversion's files."""
    return (meta["layout"]["tp"] != groups.layout.sizes.tp or stages_changed(meta, groups)
            or "dense_files" in meta)


def is_pipeline(engine: Any) -> bool:
    from deepspeed.runtime.pipe.module import PipelineModule

    return isinstance(engine.module, PipelineModule)


def layout(groups: Any) -> dict:
    """The layout sizes (``ParallelSizes``' fields: world_size, tp, pp, dp, ep, etp, edp, order)."""
    return groups.layout.sizes.model_dump()


def full_shapes(model: nn.Module, groups: Any) -> dict:
    """This rank's state-dict keys -> unsharded shapes, dense and experts apart."""
    s = groups.layout.sizes
    weights = expert_weights(model)
    experts = {w.key: w.full_shape(s.etp) for w in weights}
    dtypes = {w.key: str(w.param.dtype) for w in weights}
    dense, tp_split = {}, {}
    for key, value in model.state_dict(keep_vars=True).items():
        if key in experts or not isinstance(value, torch.Tensor):
            continue
        shape = list(value.shape)
        if getattr(value, "tensor_model_parallel", False):
            shape[value.partition_dim] *= s.tp
            tp_split[key] = [int(value.partition_dim), int(getattr(value, "partition_stride", 1))]
        dense[key], dtypes[key] = shape, str(value.dtype)
    # tp_split: how each tensor-parallel entry is cut (dim, stride), for readers without the model;
    # dtypes: what each weight's file holds (a reader refuses another, ``readers.check_claims``)
    return {"dense": dense, "experts": experts, "tp_split": tp_split, "dtypes": dict(sorted(dtypes.items()))}


def _json_value(value: Any) -> Any:
    """``value`` as JSON, or ``_SKIP`` (callables, enums, process groups: not needed to rebuild)."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, torch.dtype):
        return str(value)
    if isinstance(value, (list, tuple)):
        items = [_json_value(v) for v in value]
        return _SKIP if any(v is _SKIP for v in items) else items
    return _SKIP


_SKIP = object()


def transformer_config_dict(config: Any) -> dict:
    """The ``TransformerConfig`` fields JSON can hold, ``activation_func`` by import path (callables and
    enums left out: rebuilding takes their defaults)."""
    out = {}
    for field in dataclasses.fields(config):
        value = _json_value(getattr(config, field.name))
        if value is not _SKIP and field.init:
            out[field.name] = value
    fn = getattr(config, "activation_func", None)
    if fn is not None and getattr(fn, "__module__", None) and getattr(fn, "__qualname__", None):
        out["activation_func"] = f"{fn.__module__}:{fn.__qualname__}"
    return out


def model_description(model: nn.Module) -> dict:
    """What this rank knows of the model for rebuilding it on one rank (merged by ``merge_descriptions``)."""
    out: dict = {}
    config = getattr(model, "config", None)
    if config is None:
        config = next((m.config for m in model.modules() if dataclasses.is_dataclass(getattr(m, "config", None))),
                      None)
    if config is not None and dataclasses.is_dataclass(config):
        out["transformer_config"] = transformer_config_dict(config)
    for module in model.modules():
        if hasattr(module, "word_embeddings") and hasattr(module, "vocab_size"):
            out["vocab_size"] = int(module.vocab_size)
            out["max_sequence_length"] = int(module.max_sequence_length)
            break
    tied = getattr(model, "share_embeddings_and_output_weights", None)
    if tied is None:  # a pipeline stage: the tie marks its copy (GPTPipelineModule)
        tied = bool(getattr(model, "tied_weights", None)) or any(
            getattr(p, "shared_embedding", False) for p in model.parameters())
    out["tied"] = bool(tied)
    for key in POSITION_DEFAULTS:
        value = _json_value(getattr(model, key, None))
        if value is not None and value is not _SKIP:
            out[key] = value
    if any(type(m).__name__ == "ProjectionQKNorm" for m in model.modules()):   # (no Megatron import here)
        out["qk_layernorm_scope"] = "projection"
    if getattr(model, "rope_scaling", None):   # integration.rope.apply_rope_scaling
        out["rope_scaling"] = dict(model.rope_scaling)
    return out


def architecture_differences(saved: Optional[dict], mine: dict) -> list[str]:
    """Each key on which a checkpoint's ``"model"`` record and the running model differ."""
    if not saved or "transformer_config" not in saved or "transformer_config" not in mine:
        return []
    theirs, ours = saved["transformer_config"], mine["transformer_config"]
    out = [f"{k}: {theirs.get(k)!r} in the checkpoint, {ours.get(k)!r} in the model"
           for k in ARCHITECTURE_KEYS if theirs.get(k) != ours.get(k)]
    scopes = (saved.get("qk_layernorm_scope", "head"), mine.get("qk_layernorm_scope", "head"))
    if theirs.get("qk_layernorm") and scopes[0] != scopes[1]:
        out.append(f"qk_layernorm_scope: {scopes[0]!r} in the checkpoint, {scopes[1]!r} in the model")
    positions = {k: (saved.get(k, default), mine.get(k, default))
                 for k, default in {**POSITION_DEFAULTS, "rope_scaling": None}.items()}
    if "position_embedding_type" not in mine:   # a model of the user's own, without GPTModel's attributes
        return out
    rope = positions["position_embedding_type"] == ("rope", "rope")
    compared = ["position_embedding_type"] + (["rotary_base", "rotary_percent", "rope_scaling"] if rope else [])
    return out + [f"{k}: {positions[k][0]!r} in the checkpoint, {positions[k][1]!r} in the model"
                  for k in compared if positions[k][0] != positions[k][1]]


def merge_descriptions(parts: list[dict]) -> dict:
    """One model description from every rank's (``model_description``)."""
    out: dict = {"tied": any(p.get("tied", False) for p in parts)}
    for key in ("transformer_config", "vocab_size", "max_sequence_length", "qk_layernorm_scope", "rope_scaling",
                *POSITION_DEFAULTS):
        found = [p[key] for p in parts if key in p]
        if found:
            out[key] = found[0]
    return out


def metadata(run: Any, tag: str) -> dict:
    """The metadata file's content (collective: every stage's shapes are gathered)."""
    engine, groups, moe_config = run.engine, run.groups, run.moe_config
    coords = groups.layout.coords(dist.get_rank())
    per_rank: list = [None] * dist.get_world_size()
    dist.all_gather_object(per_rank, (coords["pp"], coords["tp"], os.path.basename(deepspeed_model_file("", engine)),
                                      {**full_shapes(engine.module, groups), "placements": placements(engine.module)},
                                      model_description(engine.module)))
    model_files: dict = {}
    for st, tp_rank, name, _shapes, _model in per_rank:
        model_files.setdefault(str(st), {})[tp_rank] = name
    s = groups.layout.sizes
    local = moe_config.num_experts // s.ep
    static = all(slots == list(range(len(slots)))
                 for *_where, shapes, _model in per_rank for slots in shapes["placements"].values())
    return {
        "format": FORMAT, "version": FORMAT_VERSION, "tag": tag,
        "global_steps": int(engine.global_steps), "zero_stage": int(engine.zero_optimization_stage()),
        "pipeline_module": is_pipeline(engine),
        "num_experts": moe_config.num_experts, "moe": moe_config.resolved_dict(), "layout": layout(groups),
        "stages": {str(st): shapes for st, _tp, _name, shapes, _model in per_rank},
        # what rebuilding the model on one rank needs (moe-plugin export)
        "model": merge_descriptions([m for *_rest, m in per_rank]),
        # DeepSpeed's module file of every (stage, TP rank), in TP rank order
        "model_files": {st: [names[r] for r in sorted(names)] for st, names in model_files.items()},
        # the static placement, or per layer under "stages"/"placements" (state-dict key -> slots)
        "placement": {"policy": "static", "ep_size": s.ep, "experts": [
            {"id": e, "ep_rank": e // local, "slot": e % local} for e in range(moe_config.num_experts)]}
        if static else {"policy": "per_layer", "ep_size": s.ep},
        "expert_optimizer_state": basic_optimizer(engine) is not None,
        # the layout-independent optimizer state (``optimizer``): any layout change takes it
        "optimizer_record": record_kind(engine) is not None,
    }


def read_latest(load_dir: os.PathLike | str) -> str:
    """The tag that ``save_dir/latest`` names."""
    path = os.path.join(os.fspath(load_dir), LATEST)
    if os.path.lexists(path):
        inside(os.fspath(load_dir), LATEST, path)   # a link out, a hard link: refused before it is read
    if not os.path.isfile(path):
        raise CheckpointError(f"{path}: missing; no checkpoint was committed in {os.fspath(load_dir)!r} "
                              "(pass tag= to load a given one)")
    with open(path, "rb") as f:
        raw = f.read()
    try:
        tag = raw.decode("utf-8").strip()
    except UnicodeDecodeError:
        tag = ""
    if not tag or "\x00" in tag or os.sep in tag or tag.startswith("."):
        raise CheckpointError(f"{path}: holds {raw[:40]!r}, not the name of a tag of {os.fspath(load_dir)!r} "
                              "(damaged; pass tag= to load a given one)")
    return tag


def read_metadata(load_dir: os.PathLike | str, tag: str) -> dict:
    """The metadata of ``load_dir/tag``, its format ours and the tag confined, before any file is read."""
    tag_dir = os.path.join(os.fspath(load_dir), tag)
    path = os.path.join(tag_dir, META_FILE)
    if os.path.lexists(tag_dir):
        check_tree(not_a_link(tag_dir))
    if not os.path.isfile(path):
        raise CheckpointError(f"{path}: missing; {tag_dir!r} is not a complete moe_plugin checkpoint")
    meta = read_json(path)
    if not isinstance(meta, dict) or meta.get("format") != FORMAT or meta.get("version") not in READ_VERSIONS:
        raise CheckpointError(not_read(path, meta))
    check_named_files(tag_dir, meta)
    check_recorded_sizes(tag_dir, meta)
    return meta


def not_read(path: str, meta: Any) -> str:
    """Why the metadata ``meta`` of ``path`` is not read: another format, or a version not in ``READ_VERSIONS``."""
    found, version = (meta.get("format"), meta.get("version")) if isinstance(meta, dict) else (None, None)
    number = isinstance(version, int) and not isinstance(version, bool)
    if found != FORMAT:
        why = "not the metadata of a moe_plugin checkpoint"
    elif number and version > FORMAT_VERSION:
        why = "a newer moe_plugin wrote it: upgrade to load it"
    elif number and 1 <= version < FORMAT_VERSION:
        why = ("a development version wrote it before any release; docs/checkpoints.md, \"Format versions\", "
               "says how to convert it")
    else:
        why = "no moe_plugin writes that version"
    reads = ", ".join(str(v) for v in READ_VERSIONS)
    return f"{path}: format {found!r} version {version!r}; this moe_plugin reads {FORMAT!r} version {reads} ({why})"


SIZE_LIMIT = 1 << 20   # experts, ranks: the bound the configs hold them to (configs.fields)


def _count(value: Any, most: Optional[int] = None) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0 and (most is None or value <= most)


def check_recorded_sizes(tag_dir: str, meta: dict) -> None:
    """Raise unless the recorded sizes agree with each other and with the tag's bytes, before a reader
    sizes anything by them."""
    where = os.path.join(tag_dir, META_FILE)
    experts = meta.get("num_experts", 0) if meta.get("num_experts") is not None else 0   # absent: a dense one
    if not _count(experts, SIZE_LIMIT):
        raise CheckpointError(f"{where}: num_experts: {experts!r}; expected a count up to {SIZE_LIMIT}")
    for key, value in (meta.get("layout") or {}).items():
        if key != "order" and not (_count(value, SIZE_LIMIT) and value >= 1):
            raise CheckpointError(f"{where}: layout.{key}: {value!r}; expected a count from 1 to {SIZE_LIMIT}")
    stages = meta.get("stages", {})
    if not isinstance(stages, dict) or not all(isinstance(v, dict) for v in stages.values()):
        raise CheckpointError(f"{where}: stages: {str(stages)[:80]}; expected {{\"STAGE\": {{\"dense\": ..., "
                              "\"experts\": ...}}")
    elements = 0
    for stage, record in stages.items():
        for part in ("dense", "experts"):
            shapes = record.get(part, {})
            if not isinstance(shapes, dict):
                raise CheckpointError(f"{where}: stages.{stage}.{part}: {str(shapes)[:80]}; expected {{KEY: SHAPE}}")
            for key, shape in shapes.items():
                if not (isinstance(shape, list) and len(shape) <= 8 and all(_count(d, 1 << 40) for d in shape)) or \
                        part == "experts" and experts and (not shape or shape[0] != experts):
                    deep = f", {experts} experts deep" if part == "experts" else ""
                    raise CheckpointError(f"{where}: stages.{stage}.{part}.{key}: {str(shape)[:80]}; expected a "
                                          f"shape of counts{deep}")
                n = 1
                for d in shape:
                    n *= d
                elements += n
        files = meta.get("files")
        if isinstance(files, dict) and record.get("experts"):
            missing = [e for e in range(experts)
                       if os.path.relpath(expert_file(tag_dir, e, int(stage)), tag_dir) not in files]
            if missing:
                raise CheckpointError(f"{where}: num_experts: {experts}; the tag lists no expert file for expert "
                                      f"{missing[0]} of stage {stage} ({len(missing)} missing)")
    files = meta.get("files")
    if isinstance(files, dict):
        held = sum(e["bytes"] for e in files.values())
        if elements > held:
            raise CheckpointError(f"{where}: stages: the recorded shapes hold {elements} elements; the tag's files "
                                  f"hold {held} bytes (each element takes at least one)")


# Every field of the metadata that names files of the tag (``files``: {name: digest}; the others:
# {stage: [name per TP rank]}, or a list).
PATH_FIELDS = ("files", "model_files", "dense_files", "hf.tokenizer_files")


def check_named_files(tag_dir: str, meta: dict) -> None:
    """Refuse a path field of another shape than this version writes, or a name leaving ``tag_dir``."""
    where = os.path.join(tag_dir, META_FILE)
    for field in PATH_FIELDS:
        value: Any = meta
        for part in field.split("."):
            value = value.get(part) if isinstance(value, dict) else None
        if value is None:
            continue
        if field == "files":
            ok = isinstance(value, dict) and all(
                isinstance(e, dict) and isinstance(e.get("bytes"), int) and not isinstance(e.get("bytes"), bool)
                and e["bytes"] >= 0 and isinstance(e.get("sha256"), str) for e in value.values())
            names, shape = list(value) if ok else [], '{"NAME": {"bytes": N, "sha256": "HEX"}}'
        elif field == "hf.tokenizer_files":
            ok = isinstance(value, list)
            names, shape = value if ok else [], '["NAME", ...]'
        else:
            ok = isinstance(value, dict) and all(isinstance(v, list) for v in value.values())
            names, shape = [n for v in value.values() for n in v] if ok else [], '{"STAGE": ["NAME", ...]}'
        if not ok:
            raise CheckpointError(f"{where}: {field}: {str(value)[:80]}; expected {shape}, names relative to the tag")
        for name in names:
            inside(tag_dir, name, f"{where}: {field}")


# Modules a recorded ``activation_func`` (``module:qualname``) may name: importing any other one would
# run its code (a checkpoint's or an export's JSON must not choose what is imported).
FUNCTION_MODULES = ("torch", "megatron.core", "moe_plugin")


def named_function(path: Optional[str], where: str) -> Any:
    """The function ``path`` (``module:qualname``) names, from ``FUNCTION_MODULES`` only unless trusted."""
    import importlib

    module, _, name = str(path).partition(":")
    if not any(module == m or module.startswith(m + ".") for m in FUNCTION_MODULES) and not trusted():
        raise CheckpointError(f"{where}: activation_func {path!r} names a module outside {list(FUNCTION_MODULES)}, "
                              "which is not imported (that would run its code); pass --trust-checkpoint (trust=True) "
                              "if you trust this file")
    target: Any = importlib.import_module(module)
    for part in name.split("."):
        target = getattr(target, part, None)
    return target


def _differences(what: str, saved: dict, mine: dict) -> list[str]:
    out = [f"{what} {k}: shape {saved[k]} in the checkpoint, {mine[k]} in the model"
           for k in mine if k in saved and list(saved[k]) != list(mine[k])]
    missing = [k for k in mine if k not in saved]
    extra = [k for k in saved if k not in mine]
    if missing:
        out.append(f"{what} keys of the model missing from the checkpoint: {missing[:4]}")
    if extra:
        out.append(f"{what} keys of the checkpoint the model lacks: {extra[:4]}")
    return out


def placements(model: nn.Module) -> dict[str, list[int]]:
    """{state-dict key of each MoE layer's ``experts.placement`` buffer: its slots}."""
    return {placement_key(w.key): w.module.placement.tolist() for w in expert_weights(model)}


def placement_key(weight_key: str) -> str:
    """``...experts.weight1`` -> ``...experts.placement``."""
    return weight_key.rsplit(".", 1)[0] + ".placement"


def stage_view(meta: dict, model: nn.Module, groups: Any) -> Optional[dict]:
    """The checkpoint as this rank's stage sees it: ``dense``, ``experts``, ``placements`` by key, and
    ``from`` (expert weight key -> the saved stage holding it)."""
    stage = groups.layout.coords(dist.get_rank())["pp"]
    if not stages_changed(meta, groups):
        saved = meta["stages"].get(str(stage))
        return None if saved is None else {**saved, "from": {k: stage for k in saved.get("experts", {})}}
    keys = set(model.state_dict().keys())
    view: dict = {"dense": {}, "experts": {}, "placements": {}, "from": {}}
    for number, saved in sorted(meta["stages"].items(), key=lambda item: int(item[0])):
        for part in ("dense", "experts", "placements"):
            for key, value in saved.get(part, {}).items():
                if key in keys:
                    view[part][key] = value
                    if part == "experts":
                        view["from"][key] = int(number)
    return view


def saved_stages(meta: dict, groups: Any) -> list[int]:
    """The saved stages this rank's stage reads dense weights from (all of them after a stage change)."""
    if stages_changed(meta, groups):
        return list(range(meta["layout"]["pp"]))
    return [groups.layout.coords(dist.get_rank())["pp"]]


def saved_local_ids(meta: dict, model: nn.Module, groups: Any) -> dict[str, list[int]]:
    """{expert weight key: global ids this rank holds under the checkpoint's placement}."""
    coords = groups.layout.coords(dist.get_rank())
    saved = (stage_view(meta, model, groups) or {}).get("placements", {})
    out = {}
    for w in expert_weights(model):
        num_local = w.module.num_local
        slots = saved.get(placement_key(w.key), list(range(w.module.num_experts)))
        order = torch.argsort(torch.tensor(slots)).tolist()
        out[w.key] = order[coords["ep"] * num_local:(coords["ep"] + 1) * num_local]
    return out


def local_ids(meta: dict, model: nn.Module, groups: Any) -> list[int]:
    """Global ids of every expert file this rank reads (all MoE layers of its stage)."""
    return sorted({e for ids in saved_local_ids(meta, model, groups).values() for e in ids})


def check_fits(run: Any, path: str, tag: str) -> dict:
    """The metadata of ``path``, once it is known to fit the running model on this rank."""
    engine, groups, moe_config = run.engine, run.groups, run.moe_config
    if not os.path.isdir(path):
        raise CheckpointError(f"{path}: missing; no checkpoint tag {tag!r} there")
    from moe_plugin.checkpoint.keys import as_running_kind   # imports Megatron: not for ``export``

    meta = read_metadata(os.path.dirname(path), tag)
    meta = as_running_kind(meta, is_pipeline(engine), bool(getattr(engine.module, "share_embeddings_and_output_weights",
                                                                       False)))
    mine = moe_config.resolved_dict()
    saved = {k: meta["moe"].get(k, SINCE_DEFAULTS.get(k)) for k in MODEL_KEYS}
    problems = [f"moe.{k}: {saved[k]!r} in the checkpoint, {mine.get(k)!r} in the model"
                for k in MODEL_KEYS if saved[k] != mine.get(k)]
    running = model_description(engine.module)
    if meta.get("architecture"):   # import-hf's record: every field the flags set, named with its flag
        from moe_plugin.checkpoint.architecture import architecture_problems

        problems += architecture_problems(meta, running)
    else:
        problems += architecture_differences(meta.get("model"), running)
    stage = stage_view(meta, engine.module, groups) if not problems else None
    if stage is not None:
        shapes = full_shapes(engine.module, groups)
        problems += _differences("dense", stage["dense"], shapes["dense"])
        problems += _differences("expert", stage["experts"], shapes["experts"])
    if not problems:
        if dense_recut(meta, groups):
            model_files = [f for st in saved_stages(meta, groups)
                           for f in saved_model_files(path, meta, st) + module_files(path, meta, st)]
        else:
            model_files = [deepspeed_model_file(path, engine)]
        expert_stages = (sorted(set(stage["from"].values())) if stage is not None
                         else [groups.layout.coords(dist.get_rank())["pp"]])
        needed = sorted(set(model_files)) + [expert_file(path, e, st)
                                             for e in local_ids(meta, engine.module, groups) for st in expert_stages]
        problems += [f"{p}: missing" for p in needed if not os.path.isfile(p)]
    if problems:
        raise CheckpointError(f"checkpoint {path} does not fit the model: " + "; ".join(problems))
    return meta


def check_optimizer_can_follow(run: Any, meta: dict) -> None:
    """Raise unless the saved optimizer state can be re-cut for the running layout: it must be in the
    optimizer record, and the engine must take one."""
    engine = run.engine
    if meta.get("optimizer_record", False):
        check_record_loads(engine)
        return
    changed = {k: (meta["layout"][k], v) for k, v in layout(run.groups).items() if meta["layout"][k] != v}
    stage = engine.zero_optimization_stage()
    if meta["zero_stage"] != stage:
        changed["ZeRO stage"] = (meta["zero_stage"], stage)
    if "kind_from" in meta:
        changed["model kind"] = ("PipelineModule" if meta["kind_from"] else "plain module",
                                 "PipelineModule" if meta["pipeline_module"] else "plain module")
    what = ", ".join(f"{k} {a} -> {b}" for k, (a, b) in changed.items())
    raise CheckpointError(
        f"the optimizer state cannot follow the layout change ({what}): the checkpoint has no optimizer record "
        "(its run was fp16 or had no optimizer), only DeepSpeed's files of the saved layout. Load weights only: "
        "load_checkpoint(..., load_optimizer_states=False) (lr scheduler and step counters still load)")
