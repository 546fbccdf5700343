"""A checkpoint written without a training run, as if the model had been saved on one rank, one
tensor at a time.

    write_one_rank("ckpt", "step0", plan, moe_config, model, record={...})

``plan`` (``OneRankPlan``) names every tensor of the 1-rank ``GPTModel`` before any is made and makes
each when asked, so the peak holds one tensor whatever the model's size. No optimizer or lr scheduler
state is written (``fresh_states``); ``load_checkpoint`` cuts the result for any layout. Nothing is
left behind on failure. Files and arguments: docs/design/checkpoint_format.md.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch

from moe_plugin.checkpoint.files import copy_files, tag_written_here, write_metadata
from moe_plugin.checkpoint.metadata import FORMAT, FORMAT_VERSION, SAFE, dense_file_name, expert_file, placement_key
from moe_plugin.checkpoint.readers import expert_file_metadata, expert_file_specs
from moe_plugin.checkpoint.tensor_files import TensorWriter
from moe_plugin.configs import MoEConfig, ParallelConfig, ParallelSizes

Spec = tuple[torch.dtype, list[int]]


@dataclass
class OneRankPlan:
    """Every tensor of the 1-rank model with its dtype and shape, each made when asked."""

    dense: dict[str, Spec]
    plain: dict[str, Any]
    experts: dict[str, Spec]
    num_experts: int
    read_dense: Callable[[str], torch.Tensor]
    read_expert: Callable[[str, int], torch.Tensor]


def write_one_rank(out_dir: os.PathLike | str, tag: str, plan: OneRankPlan, moe: MoEConfig, model: dict,
                   record: dict, extra_files: Optional[dict[str, str]] = None,
                   say: Callable[[str], None] = lambda line: None, *, saved: Optional[dict] = None, steps: int = 0,
                   instead: str = "write into another directory") -> str:
    """Write the checkpoint into ``out_dir/tag``; returns its path. ``saved``: a source module file whose
    counters, lr scheduler and client state are kept; ``extra_files``: {name: source path} copied in."""
    with tag_written_here(os.fspath(out_dir), tag, instead) as tmp:
        _write_files(tmp, plan, saved, say)
        copy_files(tmp, extra_files or {})
        write_metadata(tmp, _metadata(moe, tag, steps, saved is not None, plan, model, record))
    return os.path.join(os.fspath(out_dir), tag)


def _write_files(tmp: str, plan: OneRankPlan, saved: Optional[dict], say: Callable[[str], None]) -> None:
    from moe_plugin.compat.deepspeed_checkpoint import model_file_name, one_rank_moe_file

    buffers = [k for k in plan.dense if k.endswith(("router.expert_bias", "experts.placement"))]
    content = one_rank_moe_file(saved or {}, dict(sorted(plan.plain.items())), buffers, plan.num_experts,
                                keep_steps=saved is not None)
    torch.save(content, os.path.join(tmp, model_file_name(0)))
    dense = os.path.join(tmp, dense_file_name(0, 0))
    os.makedirs(os.path.dirname(dense), exist_ok=True)
    with TensorWriter(dense, dict(sorted(plan.dense.items()))) as out:
        for n, key in enumerate(sorted(plan.dense), 1):
            out.write(key, plan.read_dense(key))
            if n % 64 == 0 or n == len(plan.dense):
                say(f"dense tensors {n}/{len(plan.dense)}")
    if not plan.experts:
        return
    # every expert file open at once, filled weight by weight: one layer's weights are made for all
    # experts together (upcycle cuts them from that layer's dense MLP, read once)
    specs = expert_file_specs(plan.experts, {})
    writers = [TensorWriter(expert_file(tmp, e, 0), specs, expert_file_metadata(e, 0, {"ep_rank": 0, "slot": e}))
               for e in range(plan.num_experts)]
    try:
        for n, key in enumerate(specs, 1):
            for e, out in enumerate(writers):
                out.write(key, plan.read_expert(key, e))
            say(f"expert weights {n}/{len(specs)}")
        for out in writers:
            out.close()
    except BaseException:
        for out in writers:
            out.abandon()
        raise
    say(f"expert files {plan.num_experts}/{plan.num_experts}")


def _metadata(moe: MoEConfig, tag: str, steps: int, kept_steps: bool, plan: OneRankPlan, model: dict,
              record: dict) -> dict:
    from moe_plugin.compat.deepspeed_checkpoint import model_file_name

    sizes = ParallelSizes.resolve(ParallelConfig(order=moe.parallel.order), 1)
    E = plan.num_experts
    placements = {placement_key(k): list(range(E)) for k in plan.experts if k.endswith("weight1")}
    return {
        "format": FORMAT, "version": FORMAT_VERSION, "tag": tag, "global_steps": steps, "zero_stage": 0,
        "pipeline_module": False, "num_experts": E, "moe": moe.resolved_dict(), "layout": sizes.model_dump(),
        "stages": {"0": {"dense": {k: list(shape) for k, (_d, shape) in sorted(plan.dense.items())},
                         "experts": {k: [E, *shape] for k, (_d, shape) in sorted(plan.experts.items())},
                         "tp_split": {}, "placements": placements,
                         "dtypes": {k: str(d) for k, (d, _shape) in sorted({**plan.dense, **plan.experts}.items())}}},
        "model": model, "model_files": {"0": [model_file_name(0)]},
        "dense_files": {"0": [dense_file_name(0, 0)]}, "expert_files": SAFE,
        "placement": {"policy": "static", "ep_size": 1,
                      "experts": [{"id": e, "ep_rank": 0, "slot": e} for e in range(E)]},
        "expert_optimizer_state": False,
        # what load_checkpoint starts fresh whatever it is asked (api.load_checkpoint)
        "fresh_states": ["optimizer"] if kept_steps else ["optimizer", "lr_scheduler"],
        **record,
    }
