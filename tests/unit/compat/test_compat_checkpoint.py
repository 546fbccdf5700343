"""Version guard of ``moe_plugin/compat/deepspeed_checkpoint.py``: what the checkpoints rely on in
DeepSpeed's checkpoint code (file names, the MoE loader's ``num_local_experts``, the loader taking one
module file per model-parallel rank as it is). A failure here means the installed DeepSpeed changed
it: adapt ``compat/deepspeed_checkpoint.py`` (and check ``tests/unit/checkpoint/test_checkpoint.py``)."""
from __future__ import annotations

import inspect
import os
import types

import pytest
import torch
from deepspeed.moe.layer import MoE
from deepspeed.runtime.engine import DeepSpeedEngine
from deepspeed.runtime.state_dict_factory import SDLoaderFactory

from moe_plugin.compat.deepspeed_checkpoint import (
    MODEL_FILE,
    is_recovery_script,
    model_file_name,
    no_local_experts,
    one_file_per_mp_rank,
    optimizer_file_name,
)

CHANGED = "DeepSpeed changed what moe_plugin/compat/deepspeed_checkpoint.py relies on: "


def _engine_like(mp_rank: int, mp_world_size: int = 4) -> types.SimpleNamespace:
    """What DeepSpeed's name functions read of an engine (ZeRO 0-2, no universal checkpoint)."""
    engine = types.SimpleNamespace(checkpoint_mp_rank=mp_rank, mp_world_size=mp_world_size,
                                   zero_optimization_partition_weights=lambda: False,
                                   load_universal_checkpoint=lambda: False)
    engine._get_ckpt_name = types.MethodType(_upstream("_get_ckpt_name"), engine)
    return engine


def _upstream(name: str):
    fn = getattr(DeepSpeedEngine, name, None)
    assert fn is not None, CHANGED + f"DeepSpeedEngine.{name} is gone"
    return fn


@pytest.mark.parametrize("mp_rank", [0, 3, 12])
def test_model_file_name_is_deepspeeds(mp_rank):
    path = _upstream("_get_ckpt_name")(_engine_like(mp_rank), "/ckpt", "tag")
    assert os.path.basename(path) == model_file_name(mp_rank), CHANGED + f"module file name {path}"
    assert MODEL_FILE.fullmatch(os.path.basename(path)), CHANGED + f"module file name {path}"


@pytest.mark.parametrize("mp_rank, ep_rank", [(0, 0), (5, 0), (2, 3)])
def test_optimizer_file_name_is_deepspeeds(mp_rank, ep_rank):
    path = _upstream("_get_optimizer_ckpt_name")(_engine_like(mp_rank), "/ckpt", "tag", ep_rank)
    assert os.path.basename(path) == optimizer_file_name(mp_rank, ep_rank), CHANGED + f"optimizer file name {path}"


def test_recovery_scripts_are_the_ones_deepspeed_copies():
    source = inspect.getsource(_upstream("_copy_recovery_script"))
    for script in ("zero_to_fp32.py", "zero_to_torch.py"):
        assert f'"{script}"' in source, CHANGED + f"DeepSpeed no longer copies {script} into a save directory"
        assert is_recovery_script(script)
    assert not is_recovery_script("latest") and not is_recovery_script(model_file_name(0))


def test_moe_loader_reads_num_local_experts_of_every_moe_module():
    """``no_local_experts`` works because ``load_moe_state_dict`` looks for expert files of
    ``module.num_local_experts`` experts of every ``MoE`` module, and ``_load_checkpoint`` calls it."""
    loader = _upstream("load_moe_state_dict")
    params = list(inspect.signature(loader).parameters)
    assert params[:5] == ["checkpoint_path", "tag", "state_dict", "old_moe_load", "model"], \
        CHANGED + f"load_moe_state_dict{inspect.signature(loader)}"
    source = inspect.getsource(loader)
    assert "isinstance(module, MoE)" in source and "range(num_local_experts)" in source \
        and "module.num_local_experts" in source, CHANGED + "load_moe_state_dict no longer reads num_local_experts"
    assert "load_moe_state_dict(" in inspect.getsource(_upstream("_load_checkpoint")), \
        CHANGED + "_load_checkpoint no longer calls load_moe_state_dict"


def test_no_local_experts_zeroes_and_restores():
    marker = torch.nn.Module()
    marker.num_local_experts = 4
    assert issubclass(MoE, torch.nn.Module), CHANGED + "deepspeed.moe.layer.MoE is no torch module"
    with no_local_experts([marker]):
        assert marker.num_local_experts == 0
    assert marker.num_local_experts == 4
    with pytest.raises(KeyError), no_local_experts([marker]):
        raise KeyError("a failed load")
    assert marker.num_local_experts == 4


def test_load_checkpoint_signature():
    params = inspect.signature(_upstream("load_checkpoint")).parameters
    for name in ("load_dir", "tag", "load_module_strict", "load_optimizer_states", "load_lr_scheduler_states",
                 "load_module_only"):
        assert name in params, CHANGED + f"DeepSpeedEngine.load_checkpoint has no {name!r}"


@pytest.mark.parametrize("mp_rank", [0, 1])
def test_one_file_per_mp_rank_is_loaded_as_it_is(tmp_path, mp_rank):
    """A tag saved at 4 model-parallel ranks, loaded at 2: DeepSpeed's glob of the staged directory
    finds 2 module files and its loader returns this rank's content unmerged (with 4 files it would
    merge them for Megatron-LM's key names)."""
    tag = tmp_path / "tag"
    tag.mkdir()
    for r in range(4):
        torch.save({"module": {"w": torch.full((2,), float(r))}}, tag / model_file_name(r))
    torch.save({"optimizer": 1}, tag / optimizer_file_name(0))
    engine = _engine_like(mp_rank, mp_world_size=2)
    mine = {"module": {"w": torch.full((2,), 10.0 + mp_rank)}, "global_steps": 7}
    with one_file_per_mp_rank(str(tmp_path), "tag", engine, mine) as staging:
        files = _upstream("_get_all_ckpt_names")(engine, staging, "tag")
        assert [os.path.basename(f) for f in files] == [model_file_name(r) for r in range(2)], CHANGED + str(files)
        assert os.path.isfile(os.path.join(staging, "tag", optimizer_file_name(0)))
        loader = SDLoaderFactory.get_sd_loader(files, checkpoint_engine=None)
        load_path, state, _ = loader.load(engine.mp_world_size, mp_rank, is_pipe_parallel=False)
        assert os.path.basename(load_path) == model_file_name(mp_rank), CHANGED + f"loaded {load_path}"
        assert torch.equal(state["module"]["w"], mine["module"]["w"]) and state["global_steps"] == 7, \
            CHANGED + "the loader changed the one module file it was given"
        assert state["mp_world_size"] == 2
    assert not os.path.exists(staging)
