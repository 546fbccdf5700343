"""Checkpoints of a model with the plugin's MoE layers, through DeepSpeed's engine.

    run = moe_plugin.initialize(ds_config, model_provider)
    save_checkpoint(run, "ckpt")                       # every rank; tag default "global_step{N}"
    load_path, client_state = load_checkpoint(run, "ckpt")   # tag default: the "latest" file

What DeepSpeed 0.19.8 does by itself, and why this module exists: our engine marker
(``expert_params.DeepSpeedMoEMarker``) is a ``deepspeed.moe.layer.MoE`` without experts of its own,
so ``engine.save_checkpoint`` writes no expert files (``_save_moe_checkpoint`` looks for
``deepspeed_experts`` keys in the marker's empty state dict) and saves the module state from
data-parallel rank 0 only: the expert shards of the other EP ranks are lost. On load,
``load_moe_state_dict`` would look for ``layer_0_expert_{id}_...`` files that do not exist. Here:

* DeepSpeed still writes and reads everything it owns (dense weights, optimizer and ZeRO
  partitions, lr scheduler, step counters, client state); the marker reports no local experts
  while the engine loads, and a ``custom_load_fn`` puts our experts into the module state.
* Experts are stored by **global expert id**, one file per id holding the full expert (ETP shards
  joined) of every MoE layer, with its placement (EP rank, local slot; today static: expert ``e``
  on EP rank ``e // (E / EP)``). Under ZeRO-0 the files also hold the expert rows of the basic
  optimizer's state (Adam's moments), so it can follow a new expert layout.
* Each rank saves its RNG states (torch, Python, NumPy, accelerator) and its routers' noise
  generators and not-yet-applied load counts; the aux-loss-free bias is a module buffer.
* ``moe_plugin.json`` records the model's shapes (full, unsharded), the ``moe`` block, layout
  sizes, ZeRO stage and the placement. ``load_checkpoint`` checks it against the running model on
  every rank, before anything is read into the model, and fails on all ranks alike.

On disk (``tag`` a directory of ``save_dir``)::

    save_dir/latest                         the last committed tag (written last, atomically)
    save_dir/TAG/moe_plugin.json            metadata (written last inside the tag)
    save_dir/TAG/mp_rank_XX_model_states.pt ... DeepSpeed's own files (optimizer, ZeRO partitions)
    save_dir/TAG/experts/expert_{id:05d}_pp_{stage:02d}.pt   one full expert per global id and stage
    save_dir/TAG/rng/rank_{rank:05d}.pt     per-rank RNG and router state

Atomicity: everything is written into ``save_dir/.tmp-TAG``; after a barrier rank 0 renames it
to ``TAG`` and then replaces ``latest``. A run killed during a save leaves the previous tag and
``latest`` as they were (the next save removes the stale temporary directory). All ranks must
see the same file system.

Resharding: the expert layout (EP, ETP, and with them DP/EDP at the same world size) may change:
experts are cut again from the global-id files. The optimizer state follows under ZeRO-0 (expert
rows re-cut by global id, dense state as saved); ZeRO-1/2 partition the optimizer state over
(expert-)data-parallel groups that DeepSpeed cannot re-cut, so loading into another layout
raises unless ``load_optimizer_states=False`` (weights, lr scheduler and counters only). Tensor
and pipeline sizes must stay: DeepSpeed stores dense weights per model-parallel rank. Not yet:
DeepSpeed's ``PipelineEngine`` (a clear ``NotImplementedError``), fp16/bf16 (unverified).
"""
from __future__ import annotations

import contextlib
import json
import os
import random
import shutil
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist
from deepspeed.accelerator import get_accelerator
from torch import nn

from moe_plugin.integration.expert_params import DeepSpeedMoEMarker
from moe_plugin.integration.expert_state import ExpertWeight, expert_weights, full_experts, local_experts
from moe_plugin.layers.router import Router

try:
    import numpy
except ImportError:  # NumPy's RNG is then neither saved nor restored
    numpy = None

FORMAT, FORMAT_VERSION = "moe_plugin.checkpoint", 1
META_FILE, EXPERT_DIR, RNG_DIR, LATEST = "moe_plugin.json", "experts", "rng", "latest"
TMP_PREFIX = ".tmp-"
# Keys of the "moe" block that change the function the model computes (parallel sizes do not).
MODEL_KEYS = ("num_experts", "top_k", "router", "normalize_gates", "second_expert_policy", "activation",
              "ffn_hidden_size", "shared_expert_ffn_hidden_size", "shared_expert_gate", "layer_interval", "layers")
LAYOUT_KEYS = ("world_size", "tp", "pp", "dp", "ep", "etp", "edp", "order")
# Which tokens a rank sees (and so its RNG streams: dropout, router noise) depends on these only.
TOKEN_LAYOUT_KEYS = ("world_size", "tp", "pp", "dp", "order")


class CheckpointError(ValueError):
    """A checkpoint that cannot be loaded into the running model; the message says what differs."""


def _write(obj: Any, path: str) -> None:
    """Every file of ours goes through here (one place to make a save fail in tests)."""
    torch.save(obj, path)


# -- save ----------------------------------------------------------------------------------------
def save_checkpoint(run: Any, save_dir: os.PathLike | str, tag: Optional[str] = None,
                    client_state: Optional[dict] = None, save_latest: bool = True) -> str:
    """Save ``run`` (what ``moe_plugin.initialize`` returned: ``engine``, ``groups``, ``moe_config``)
    into ``save_dir/tag``; collective, every rank calls it. Returns the tag's directory."""
    engine, groups = run.engine, run.groups
    _check_engine(engine)
    save_dir = os.fspath(save_dir)
    tag = _check_tag(f"global_step{engine.global_steps}" if tag is None else str(tag))
    tmp_tag = TMP_PREFIX + tag
    tmp_path = os.path.join(save_dir, tmp_tag)
    if dist.get_rank() == 0:
        os.makedirs(save_dir, exist_ok=True)
        shutil.rmtree(tmp_path, ignore_errors=True)  # left by a save that died
        os.makedirs(os.path.join(tmp_path, EXPERT_DIR))
        os.makedirs(os.path.join(tmp_path, RNG_DIR))
    dist.barrier()
    engine.save_checkpoint(save_dir, tag=tmp_tag, client_state=client_state or {}, save_latest=False)
    meta = _metadata(run, tag)
    _save_experts(run, tmp_path)
    _write(_rng_state(engine.module), os.path.join(tmp_path, RNG_DIR, f"rank_{dist.get_rank():05d}.pt"))
    dist.barrier()  # every file is written
    if dist.get_rank() == 0:
        _write_text(os.path.join(tmp_path, META_FILE), json.dumps(meta, indent=1))
        _commit(save_dir, tag, tmp_tag, save_latest)
    dist.barrier()
    return os.path.join(save_dir, tag)


def _check_engine(engine: Any) -> None:
    """DeepSpeed's ``PipelineEngine`` saves the module per layer and refuses ``custom_load_fn``:
    not wired here yet."""
    from deepspeed.runtime.pipe.engine import PipelineEngine

    if isinstance(engine, PipelineEngine):
        raise NotImplementedError("moe_plugin checkpoints do not support DeepSpeed's PipelineEngine yet (it "
                                  "saves the module per layer and refuses custom_load_fn); use "
                                  "engine.save_checkpoint/load_checkpoint with an unchanged layout meanwhile")


def _check_tag(tag: str) -> str:
    if not tag or tag.startswith(".") or os.sep in tag or tag == LATEST:
        raise CheckpointError(f"tag: got {tag!r}; expected a plain directory name (no '{os.sep}', not starting "
                              f"with '.', not {LATEST!r})")
    return tag


def _write_text(path: str, text: str) -> None:
    with open(path + ".part", "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(path + ".part", path)


def _commit(save_dir: str, tag: str, tmp_tag: str, save_latest: bool) -> None:
    """Rename the finished temporary directory to ``tag`` (replacing an older one of that name),
    then point ``latest`` at it."""
    final, tmp = os.path.join(save_dir, tag), os.path.join(save_dir, tmp_tag)
    if os.path.exists(final):
        old = os.path.join(save_dir, f".old-{tag}")
        shutil.rmtree(old, ignore_errors=True)
        os.rename(final, old)
        os.rename(tmp, final)
        shutil.rmtree(old)
    else:
        os.rename(tmp, final)
    if save_latest:
        _write_text(os.path.join(save_dir, LATEST), tag)


def _layout(groups: Any) -> dict:
    s = groups.layout.sizes
    return {k: getattr(s, k) for k in LAYOUT_KEYS}


def _full_shapes(model: nn.Module, groups: Any) -> dict:
    """This rank's state-dict keys -> unsharded shapes, dense and experts apart."""
    s = groups.layout.sizes
    experts = {w.key: w.full_shape(s.etp) for w in expert_weights(model)}
    dense = {}
    for key, value in model.state_dict(keep_vars=True).items():
        if key in experts or not isinstance(value, torch.Tensor):
            continue
        shape = list(value.shape)
        if getattr(value, "tensor_model_parallel", False):
            shape[value.partition_dim] *= s.tp
        dense[key] = shape
    return {"dense": dense, "experts": experts}


def _metadata(run: Any, tag: str) -> dict:
    """The metadata file's content (collective: every stage's shapes are gathered)."""
    engine, groups, moe_config = run.engine, run.groups, run.moe_config
    stage = groups.layout.coords(dist.get_rank())["pp"]
    per_rank: list = [None] * dist.get_world_size()
    dist.all_gather_object(per_rank, (stage, _full_shapes(engine.module, groups)))
    s = groups.layout.sizes
    local = moe_config.num_experts // s.ep
    return {
        "format": FORMAT, "version": FORMAT_VERSION, "tag": tag,
        "global_steps": int(engine.global_steps), "zero_stage": int(engine.zero_optimization_stage()),
        "num_experts": moe_config.num_experts, "moe": moe_config.resolved_dict(), "layout": _layout(groups),
        "stages": {str(st): shapes for st, shapes in per_rank},
        "placement": {"policy": "static", "ep_size": s.ep, "experts": [
            {"id": e, "ep_rank": e // local, "slot": e % local} for e in range(moe_config.num_experts)]},
        "expert_optimizer_state": _basic_optimizer(engine) is not None,
    }


def _basic_optimizer(engine: Any) -> Optional[torch.optim.Optimizer]:
    """The torch optimizer itself when DeepSpeed runs it unwrapped (ZeRO-0 in fp32), else None."""
    opt = engine.optimizer
    if engine.zero_optimization_stage() == 0 and isinstance(opt, torch.optim.Optimizer):
        return opt
    return None


def _expert_file(path: str, expert_id: int, stage: int) -> str:
    return os.path.join(path, EXPERT_DIR, f"expert_{expert_id:05d}_pp_{stage:02d}.pt")


def _save_experts(run: Any, path: str) -> None:
    """One file per global expert id (this stage's layers), written by ETP rank 0 of EDP rank 0;
    collective over the ETP group."""
    engine, groups = run.engine, run.groups
    s, coords = groups.layout.sizes, groups.layout.coords(dist.get_rank())
    optimizer = _basic_optimizer(engine)
    files: dict[int, dict] = {}
    for w in expert_weights(engine.module):
        for expert_id, full in full_experts(w.param, w, groups.etp, s.etp):
            placement = {"ep_rank": coords["ep"], "slot": expert_id - w.module.first_expert}
            entry = files.setdefault(expert_id, {"expert_id": expert_id, "stage": coords["pp"], "weights": {},
                                                 "optimizer": {}, "placement": placement})
            entry["weights"][w.key] = full
        if optimizer is not None:
            state = optimizer.state.get(w.param, {})
            for name in sorted(state):  # the same order on every ETP rank
                value = state[name]
                if isinstance(value, torch.Tensor) and value.shape == w.param.shape:
                    for expert_id, full in full_experts(value, w, groups.etp, s.etp):
                        files[expert_id]["optimizer"].setdefault(w.key, {})[name] = full
    if coords["etp"] == 0 and coords["edp"] == 0:
        for expert_id, entry in files.items():
            _write(entry, _expert_file(path, expert_id, coords["pp"]))


def _rng_state(model: nn.Module) -> dict:
    state = {"torch": torch.get_rng_state(), "python": random.getstate(),
             "numpy": numpy.random.get_state() if numpy is not None else None, "accelerator": None, "routers": {}}
    accelerator = get_accelerator()
    if accelerator.device_name() != "cpu" and accelerator.is_available():
        state["accelerator"] = accelerator.get_rng_state()
    for name, module in model.named_modules():
        if isinstance(module, Router):
            state["routers"][name] = {"generators": {str(d): g.get_state() for d, g in module._generators.items()},
                                      "load_E": module.load_E.detach().clone()}
    return state


# -- load ----------------------------------------------------------------------------------------
def read_latest(load_dir: os.PathLike | str) -> str:
    """The tag that ``save_dir/latest`` names."""
    path = os.path.join(os.fspath(load_dir), LATEST)
    if not os.path.isfile(path):
        raise CheckpointError(f"{path}: missing; no checkpoint was committed in {os.fspath(load_dir)!r} "
                              "(pass tag= to load a given one)")
    with open(path) as f:
        return f.read().strip()


def read_metadata(load_dir: os.PathLike | str, tag: str) -> dict:
    path = os.path.join(os.fspath(load_dir), tag, META_FILE)
    if not os.path.isfile(path):
        raise CheckpointError(f"{path}: missing; {os.path.join(os.fspath(load_dir), tag)!r} is not a complete "
                              "moe_plugin checkpoint")
    with open(path) as f:
        meta = json.load(f)
    if meta.get("format") != FORMAT or meta.get("version") != FORMAT_VERSION:
        raise CheckpointError(f"{path}: format {meta.get('format')!r} version {meta.get('version')!r}; this "
                              f"moe_plugin reads {FORMAT!r} version {FORMAT_VERSION}")
    return meta


def load_checkpoint(run: Any, load_dir: os.PathLike | str, tag: Optional[str] = None, *,
                    load_optimizer_states: bool = True, load_lr_scheduler_states: bool = True,
                    load_module_only: bool = False, load_rng_states: bool = True) -> tuple[str, dict]:
    """Load ``load_dir/tag`` (default: the ``latest`` tag) into ``run``; collective. Returns
    DeepSpeed's ``(load_path, client_state)``. Raises ``CheckpointError`` on every rank, before
    the model changes, when the checkpoint does not fit the model. RNG states (and the routers'
    pending load counts) come back when every rank sees the tokens it saw when saving (same world
    size, tp, dp, pp and order; EP and ETP may differ)."""
    engine, groups = run.engine, run.groups
    _check_engine(engine)
    load_dir = os.fspath(load_dir)
    tag = _agree(lambda: tag if tag is not None else read_latest(load_dir))
    path = os.path.join(load_dir, tag)
    meta = _agree(lambda: _check(run, path, tag))
    resharded = meta["layout"] != _layout(groups) or meta["zero_stage"] != engine.zero_optimization_stage()
    optimizer_follows = load_optimizer_states and not load_module_only
    recut_optimizer = False
    if resharded and optimizer_follows:
        _agree(lambda: _check_optimizer_can_follow(run, meta))
        recut_optimizer = True
    experts, expert_moments = _agree(lambda: _read_experts(run, path, meta, recut_optimizer))

    def load_module(src: dict, dst: nn.Module) -> None:
        merged = dict(src)
        merged.update(experts)
        dst.load_state_dict(merged, strict=True)

    with _marker_without_local_experts(engine.module):
        load_path, client_state = engine.load_checkpoint(
            load_dir, tag, load_module_strict=True, load_optimizer_states=optimizer_follows and not resharded,
            load_lr_scheduler_states=load_lr_scheduler_states, load_module_only=load_module_only,
            custom_load_fn=load_module)
    if load_path is None:
        raise CheckpointError(f"{path}: DeepSpeed found no model states to load")
    if recut_optimizer:
        _load_basic_optimizer(run, path, expert_moments)
    rng_path = os.path.join(path, RNG_DIR, f"rank_{dist.get_rank():05d}.pt")
    same_token_groups = all(meta["layout"][k] == _layout(groups)[k] for k in TOKEN_LAYOUT_KEYS)
    if load_rng_states and same_token_groups and os.path.isfile(rng_path):
        _set_rng_state(engine.module, torch.load(rng_path, weights_only=False))
    dist.barrier()
    return load_path, client_state


def _agree(fn: Callable[[], Any]) -> Any:
    """``fn()`` on every rank; if it raised ``CheckpointError`` on any, raise it on all."""
    error, value = None, None
    try:
        value = fn()
    except CheckpointError as exc:
        error = str(exc)
    except (OSError, RuntimeError, KeyError, EOFError) as exc:  # an unreadable file on this rank only
        error = f"{type(exc).__name__}: {exc}"
    errors: list = [None] * dist.get_world_size()
    dist.all_gather_object(errors, error)
    failed = [(r, e) for r, e in enumerate(errors) if e is not None]
    if failed:
        rank, message = failed[0]
        raise CheckpointError(message if rank == dist.get_rank() or error == message else f"rank {rank}: {message}")
    return value


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


def _check(run: Any, path: str, tag: str) -> dict:
    """The metadata, once it is known to fit the running model on this rank."""
    engine, groups, moe_config = run.engine, run.groups, run.moe_config
    if not os.path.isdir(path):
        raise CheckpointError(f"{path}: missing; no checkpoint tag {tag!r} there")
    meta = read_metadata(os.path.dirname(path), tag)
    mine = moe_config.resolved_dict()
    problems = [f"moe.{k}: {meta['moe'].get(k)!r} in the checkpoint, {mine.get(k)!r} in the model"
                for k in MODEL_KEYS if meta["moe"].get(k) != mine.get(k)]
    saved, now = meta["layout"], _layout(groups)
    for k in ("tp", "pp"):
        if saved[k] != now[k]:
            problems.append(f"moe.parallel {k}: {saved[k]} in the checkpoint, {now[k]} now; DeepSpeed stores dense "
                            f"weights per model-parallel rank, so {k} must stay")
    coords = groups.layout.coords(dist.get_rank())
    stage = meta["stages"].get(str(coords["pp"]))
    if not problems and stage is not None:
        shapes = _full_shapes(engine.module, groups)
        problems += _differences("dense", stage["dense"], shapes["dense"])
        problems += _differences("expert", stage["experts"], shapes["experts"])
    if not problems:
        ds_file = os.path.join(path, f"mp_rank_{engine.checkpoint_mp_rank:02d}_model_states.pt")
        needed = [ds_file] + [_expert_file(path, e, coords["pp"]) for e in _local_ids(engine.module)]
        problems += [f"{p}: missing" for p in needed if not os.path.isfile(p)]
    if problems:
        raise CheckpointError(f"checkpoint {path} does not fit the model: " + "; ".join(problems))
    return meta


def _local_ids(model: nn.Module) -> list[int]:
    weights = expert_weights(model)
    return list(weights[0].local_ids) if weights else []


def _check_optimizer_can_follow(run: Any, meta: dict) -> None:
    engine = run.engine
    changed = {k: (meta["layout"][k], v) for k, v in _layout(run.groups).items() if meta["layout"][k] != v}
    stage = engine.zero_optimization_stage()
    if meta["zero_stage"] != stage:
        changed["ZeRO stage"] = (meta["zero_stage"], stage)
    what = ", ".join(f"{k} {a} -> {b}" for k, (a, b) in changed.items())
    if stage > 0 or meta["zero_stage"] > 0:
        raise CheckpointError(
            f"the optimizer state cannot follow the layout change ({what}): ZeRO stage {meta['zero_stage']} "
            "partitioned it over the (expert-)data-parallel groups of the saved layout. Load weights only: "
            "load_checkpoint(..., load_optimizer_states=False) (lr scheduler and step counters still load)")
    if _basic_optimizer(engine) is None or not meta["expert_optimizer_state"]:
        raise CheckpointError(f"the optimizer state cannot follow the layout change ({what}): the checkpoint or "
                              "the engine has no basic (ZeRO-0, fp32) optimizer; load weights only: "
                              "load_checkpoint(..., load_optimizer_states=False)")


def _read_experts(run: Any, path: str, meta: dict, with_optimizer: bool) -> tuple[dict, dict]:
    """This rank's expert shards cut from the global-id files: {key: stacked tensor}, and with
    ``with_optimizer`` {key: {state name: stacked tensor}}."""
    groups = run.groups
    s, coords = groups.layout.sizes, groups.layout.coords(dist.get_rank())
    weights = expert_weights(run.engine.module)
    files = {e: torch.load(_expert_file(path, e, coords["pp"]), map_location="cpu", weights_only=False)
             for e in (_local_ids(run.engine.module))}
    for e, f in files.items():
        if f.get("expert_id") != e or any(w.key not in f["weights"] for w in weights):
            raise CheckpointError(f"{_expert_file(path, e, coords['pp'])}: does not hold expert {e} with keys "
                                  f"{[w.key for w in weights][:4]}")
    stacked = {w.key: local_experts({e: f["weights"][w.key] for e, f in files.items()}, w, coords["etp"], s.etp)
               for w in weights}
    moments: dict = {}
    if with_optimizer:
        for w in weights:
            names = set.intersection(*(set(f["optimizer"].get(w.key, {})) for f in files.values()))
            moments[w.key] = {n: local_experts({e: f["optimizer"][w.key][n] for e, f in files.items()}, w,
                                               coords["etp"], s.etp) for n in sorted(names)}
    return stacked, moments


@contextlib.contextmanager
def _marker_without_local_experts(model: nn.Module):
    """While DeepSpeed loads, our marker reports no local experts, so ``load_moe_state_dict``
    looks for no ``layer_*_expert_*`` files (ours are read by ``load_checkpoint``)."""
    markers = [m for m in model.modules() if isinstance(m, DeepSpeedMoEMarker)]
    saved = [m.num_local_experts for m in markers]
    for m in markers:
        m.num_local_experts = 0
    try:
        yield
    finally:
        for m, n in zip(markers, saved):
            m.num_local_experts = n


def _load_basic_optimizer(run: Any, path: str, moments: dict) -> None:
    """ZeRO-0 after a layout change: the dense state as saved (the same on every rank; the file of
    EP rank 0), the expert rows re-cut by global expert id. Param-group options come from the
    checkpoint except the expert group's DeepSpeed ``name``, which belongs to the new layout."""
    engine = run.engine
    optimizer = _basic_optimizer(engine)
    saved = torch.load(os.path.join(path, f"expp_rank_0_mp_rank_{engine.checkpoint_mp_rank:02d}_optim_states.pt"),
                       map_location="cpu", weights_only=False)["optimizer"]
    key_of = {id(w.param): w.key for w in expert_weights(engine.module)}
    state = {}
    if len(saved["param_groups"]) != len(optimizer.param_groups):
        raise CheckpointError(f"{path}: the optimizer had {len(saved['param_groups'])} param groups, now "
                              f"{len(optimizer.param_groups)}")
    for saved_group, group in zip(saved["param_groups"], optimizer.param_groups):
        for index, param in zip(saved_group["params"], group["params"]):
            entry = dict(saved["state"].get(index, {}))
            for name, value in moments.get(key_of.get(id(param)), {}).items():
                entry[name] = value
            if entry:
                state[index] = entry
        for option in ("name", "moe"):
            if option in group:
                saved_group[option] = group[option]
    optimizer.load_state_dict({"state": state, "param_groups": saved["param_groups"]})


def _set_rng_state(model: nn.Module, state: dict) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    if numpy is not None and state.get("numpy") is not None:
        numpy.random.set_state(state["numpy"])
    if state.get("accelerator") is not None:
        get_accelerator().set_rng_state(state["accelerator"])
    for name, module in model.named_modules():
        if isinstance(module, Router) and name in state["routers"]:
            saved = state["routers"][name]
            for device, gen_state in saved["generators"].items():
                module.generator(torch.device(device)).set_state(gen_state)
            module.load_E.copy_(saved["load_E"])


__all__ = ["CheckpointError", "load_checkpoint", "read_latest", "read_metadata", "save_checkpoint"]
