"""A checkpoint written without a training run, as if the model had been saved on one rank.

    write_one_rank("ckpt", "step0", module, experts, moe_config, model, record={...})

``module``: the 1-rank ``GPTModel``'s state-dict entries but the expert weights (``_extra_state``
entries included); ``experts``: {``decoder.layers.N.mlp.experts.weight1``/``2``: [E, ...]} stacked
by expert id; ``model``: the metadata's model description (``metadata.model_description``'s keys).
Written: DeepSpeed's module file of model-parallel rank 0 with step counters at 0 and no optimizer
or lr scheduler state (``fresh_states`` tells ``load_checkpoint``), one file per expert, and
``moe_plugin.json`` (``record`` merged in), all into ``OUT/.tmp-TAG`` and renamed to ``OUT/TAG``
at the end, with ``latest`` pointing at it. ``load_checkpoint`` cuts it for any layout. Files of
``extra_files`` ({name in the tag: source path}) are copied in too (and checksummed). Nothing is
left behind on failure. ``saved`` (upcycle's ``keep_iteration``): the module file of the checkpoint
the model was made from, whose step counters, lr scheduler and client state are kept, at step
``steps`` (only the optimizer starts fresh). ``instead``: what to do when the tag exists.
"""
from __future__ import annotations

import os
from typing import Callable, Optional

import torch

from moe_plugin.checkpoint.files import copy_files, tag_written_here, write_metadata
from moe_plugin.checkpoint.metadata import FORMAT, FORMAT_VERSION, expert_file, placement_key
from moe_plugin.configs import MoEConfig, ParallelConfig, ParallelSizes


def write_one_rank(out_dir: os.PathLike | str, tag: str, module: dict, experts: dict, moe: MoEConfig, model: dict,
                   record: dict, extra_files: Optional[dict[str, str]] = None,
                   say: Callable[[str], None] = lambda line: None, *, saved: Optional[dict] = None, steps: int = 0,
                   instead: str = "write into another directory") -> str:
    """Write the checkpoint (module docstring); returns the tag's path."""
    with tag_written_here(os.fspath(out_dir), tag, instead) as tmp:
        _write_files(tmp, module, experts, moe.num_experts, saved, say)
        copy_files(tmp, extra_files or {})
        write_metadata(tmp, _metadata(moe, tag, steps, saved is not None, module, experts, model, record))
    return os.path.join(os.fspath(out_dir), tag)


def _write_files(tmp: str, module: dict, experts: dict, num_experts: int, saved: Optional[dict],
                 say: Callable[[str], None]) -> None:
    from moe_plugin.compat.deepspeed_checkpoint import model_file_name, one_rank_moe_file

    buffers = [k for k in module if k.endswith(("router.expert_bias", "experts.placement"))]
    content = one_rank_moe_file(saved or {}, dict(sorted(module.items())), buffers, num_experts,
                                keep_steps=saved is not None)
    torch.save(content, os.path.join(tmp, model_file_name(0)))
    if experts:
        for e in range(num_experts):
            torch.save({"expert_id": e, "stage": 0, "optimizer": {}, "placement": {"ep_rank": 0, "slot": e},
                        "weights": {k: w[e].contiguous().clone() for k, w in experts.items()}},
                       expert_file(tmp, e, 0))
    say(f"wrote {model_file_name(0)} ({len(module)} entries)" + (f" and {num_experts} expert files" if experts else ""))


def _metadata(moe: MoEConfig, tag: str, steps: int, kept_steps: bool, module: dict, experts: dict, model: dict,
              record: dict) -> dict:
    from moe_plugin.compat.deepspeed_checkpoint import model_file_name

    shapes = {k: list(v.shape) for k, v in module.items() if isinstance(v, torch.Tensor)}
    sizes = ParallelSizes.resolve(ParallelConfig(order=moe.parallel.order), 1)
    E = moe.num_experts
    placements = {placement_key(k): list(range(E)) for k in experts if k.endswith("weight1")}
    return {
        "format": FORMAT, "version": FORMAT_VERSION, "tag": tag, "global_steps": steps, "zero_stage": 0,
        "pipeline_module": False, "num_experts": E, "moe": moe.resolved_dict(), "layout": sizes.model_dump(),
        "stages": {"0": {"dense": shapes, "experts": {k: list(v.shape) for k, v in experts.items()}, "tp_split": {},
                         "placements": placements}},
        "model": model, "model_files": {"0": [model_file_name(0)]},
        "placement": {"policy": "static", "ep_size": 1,
                      "experts": [{"id": e, "ep_rank": 0, "slot": e} for e in range(E)]},
        "expert_optimizer_state": False,
        # what load_checkpoint starts fresh whatever it is asked (api.load_checkpoint)
        "fresh_states": ["optimizer"] if kept_steps else ["optimizer", "lr_scheduler"],
        **record,
    }
