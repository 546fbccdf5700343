"""The one module that writes Megatron-Core's and DeepSpeed's global group registries (through ``compat/``).

``register(groups)`` makes ``megatron.core.parallel_state``'s getters, DeepSpeed's expert registry and
its ``mpu`` return exactly our groups; ``unregister`` undoes it, our groups alive. The user's own
Megatron groups are checked against the layout and set aside, not destroyed. Design:
docs/design/groups_layout.md.
"""
from __future__ import annotations

import sys
from typing import Optional

import torch
import torch.distributed as dist

from moe_plugin.compat.deepspeed_groups import clear_mpu, expert_groups, forget_expert_groups, registered_mpu, \
    set_expert_groups, set_mpu
from moe_plugin.compat.megatron_parallel_state import clear_parallel_state, held_tensor_parallel_group, \
    parallel_state_values, restore_parallel_state, set_parallel_state
from moe_plugin.groups.builder import rank_lists
from moe_plugin.groups.layout import RankLayout
from moe_plugin.groups.process_groups import ProcessGroups


def _my_ranks(groups: ProcessGroups, kind: str) -> Optional[list[int]]:
    """This rank's list of ``kind`` (layout kinds and the builder's Megatron-only kinds)."""
    return next((r for r in rank_lists(groups.layout)[kind] if groups.rank in r), None)


# --- Megatron-Core ----------------------------------------------------------------------------
# What parallel_state held before ``register_with_megatron(..., over_existing=True)``: the user's
# own groups (their initialize_model_parallel call), put back by ``unregister_megatron``.
_SAVED_MEGATRON_STATE: Optional[dict] = None


def register_with_megatron(groups: ProcessGroups, over_existing: bool = False) -> None:
    """Point ``megatron.core.parallel_state`` at our groups (cp 1). Groups it already holds are a
    ``RuntimeError``, or with ``over_existing`` set aside for ``unregister_megatron``."""
    global _SAVED_MEGATRON_STATE
    held = held_tensor_parallel_group()
    theirs = held is not None and held is not groups.handles["tp"]
    if theirs and not over_existing:
        raise RuntimeError("megatron.core.parallel_state already holds other groups "
                           "(initialize_model_parallel?); call unregister_megatron() first, or check them with "
                           "check_megatron_groups and register with over_existing=True")
    ranks = {kind: groups.ranks(kind) for kind in ("tp", "pp", "mp", "dp", "ep")}
    ranks.update({kind: _my_ranks(groups, kind) for kind in ("embedding", "pos_embedding")})
    before = set_parallel_state(parallel_state_values(groups.handles, ranks, groups.rank, groups.backend == "gloo"))
    if theirs:
        _SAVED_MEGATRON_STATE = before


def unregister_megatron() -> None:
    """Empty Megatron-Core's registry (our groups stay alive), or put back the user's that were set aside."""
    global _SAVED_MEGATRON_STATE
    if _SAVED_MEGATRON_STATE is not None:
        restore_parallel_state(_SAVED_MEGATRON_STATE)
        _SAVED_MEGATRON_STATE = None
        return
    clear_parallel_state()


# kind -> parallel_state's getter of this rank's group (context parallel must be 1)
_MEGATRON_GETTERS = {"tp": "get_tensor_model_parallel_group", "pp": "get_pipeline_model_parallel_group",
                     "dp": "get_data_parallel_group", "ep": "get_expert_model_parallel_group",
                     "etp": "get_expert_tensor_parallel_group", "edp": "get_expert_data_parallel_group"}


def megatron_holds_groups() -> bool:
    """Whether ``megatron.core.parallel_state`` holds groups that are not the plugin's."""
    if held_tensor_parallel_group() is None:
        return False
    return not isinstance(registered_mpu(), GroupsMPU)


def check_megatron_groups(layout: RankLayout, rank: int, device: str = "cpu") -> None:
    """Unless ``megatron.core.parallel_state``'s groups have ``layout``'s rank lists, the same ``ConfigError``
    on every rank (collective). Call it before building the plugin's groups."""
    from megatron.core import parallel_state as ps

    from moe_plugin.configs.errors import ConfigError
    from moe_plugin.configs.schema import ROOT_KEY

    theirs = {"tp": ps.get_tensor_model_parallel_world_size(), "pp": ps.get_pipeline_model_parallel_world_size(),
              "dp": ps.get_data_parallel_world_size(), "cp": ps.get_context_parallel_world_size(),
              "ep": ps.get_expert_model_parallel_world_size(), "etp": ps.get_expert_tensor_parallel_world_size(),
              "edp": ps.get_expert_data_parallel_world_size()}
    kinds = ["tp", "pp", "dp"] + (["ep", "etp", "edp"] if theirs["ep"] > 1 else [])
    differs = [float(dist.get_process_group_ranks(getattr(ps, _MEGATRON_GETTERS[k])()) != layout.group_of(k, rank))
               for k in kinds] + [float(theirs["cp"] != 1)]
    flags = torch.tensor(differs, dtype=torch.float32, device=device)
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(flags, op=dist.ReduceOp.MAX)
    wrong = [k for k, f in zip(kinds + ["cp"], flags.tolist()) if f > 0]
    if not wrong:
        return
    s = layout.sizes
    megatron = " x ".join(f"{k} {theirs[k]}" for k in ("tp", "pp", "dp", "cp", "ep", "etp", "edp"))
    ours = f"tp {s.tp} x pp {s.pp} x dp {s.dp} x ep {s.ep} x etp {s.etp} x edp {s.edp} (order {s.order})"
    raise ConfigError(f"{ROOT_KEY}.parallel", ours, f"megatron.core.parallel_state already holds groups "
                      f"(initialize_model_parallel?) of {megatron}, and their {', '.join(wrong)} groups are "
                      f"not the \"moe\" layout's; remove the initialize_model_parallel call (moe_plugin.initialize "
                      f"builds the groups and registers them with Megatron) or make its sizes and order agree "
                      f"with {ROOT_KEY}.parallel", shown=ours)


# --- DeepSpeed --------------------------------------------------------------------------------
class GroupsMPU:
    """The ``mpu`` DeepSpeed expects from Megatron, from a ``ProcessGroups`` (model parallel TP x PP, real
    handles even of size 1, no sequence-parallel methods)."""

    def __init__(self, groups: ProcessGroups):
        self.groups = groups

    def _group(self, kind: str) -> dist.ProcessGroup:
        return self.groups.handles[kind]

    def get_model_parallel_group(self): return self._group("mp")
    def get_model_parallel_world_size(self): return self.groups.size("mp")
    def get_model_parallel_rank(self): return self.groups.rank_in("mp")

    def get_tensor_model_parallel_group(self): return self._group("tp")
    def get_tensor_model_parallel_world_size(self): return self.groups.size("tp")
    def get_tensor_model_parallel_rank(self): return self.groups.rank_in("tp")
    def get_tensor_model_parallel_src_rank(self): return self.groups.ranks("tp")[0]
    get_slice_parallel_group = get_tensor_model_parallel_group
    get_slice_parallel_world_size = get_tensor_model_parallel_world_size
    get_slice_parallel_rank = get_tensor_model_parallel_rank

    def get_pipeline_model_parallel_group(self): return self._group("pp")
    def get_pipeline_model_parallel_world_size(self): return self.groups.size("pp")
    def get_pipeline_model_parallel_rank(self): return self.groups.rank_in("pp")
    get_pipe_parallel_group = get_pipeline_model_parallel_group
    get_pipe_parallel_world_size = get_pipeline_model_parallel_world_size
    get_pipe_parallel_rank = get_pipeline_model_parallel_rank

    def get_data_parallel_group(self): return self._group("dp")
    def get_data_parallel_world_size(self): return self.groups.size("dp")
    def get_data_parallel_rank(self): return self.groups.rank_in("dp")
    def get_data_parallel_group_ranks(self): return self.groups.ranks("dp")

    def __repr__(self) -> str:
        return f"GroupsMPU(rank={self.groups.rank}, {self.groups.layout.sizes!r})"


def make_mpu(groups: ProcessGroups) -> GroupsMPU:
    """An object to pass as ``deepspeed.initialize(mpu=...)``."""
    return GroupsMPU(groups)


def register_with_deepspeed(groups: ProcessGroups) -> GroupsMPU:
    """Fill ``deepspeed.utils.groups``' expert registries and ``mpu`` (initialising ``deepspeed.comm`` if
    needed); return the mpu. Other groups under the same name are a ``RuntimeError``."""
    import deepspeed.comm as ds_comm

    if not ds_comm.is_initialized():
        ds_comm.init_distributed(dist_backend=groups.backend, auto_mpi_discovery=False, verbose=False)
    name, h = groups.expert_group_name, groups.handles
    if any(theirs is not None and theirs is not h[kind] for theirs, kind in zip(expert_groups(name), ("ep", "edp"))):
        raise RuntimeError(f"deepspeed.utils.groups already holds other {name!r} groups "
                           "(a DeepSpeed MoE layer created them?); call unregister_deepspeed() first")
    set_expert_groups(name, h["ep"], groups.ranks("ep"), h["edp"], groups.ranks("edp"), groups.size("etp"))
    mpu = make_mpu(groups)
    set_mpu(mpu)
    return mpu


def unregister_deepspeed() -> None:
    """Remove what ``register_with_deepspeed`` put into ``deepspeed.utils.groups``."""
    mpu = registered_mpu()
    if isinstance(mpu, GroupsMPU):
        forget_expert_groups(mpu.groups.expert_group_name, list(mpu.groups.handles.values()))
        clear_mpu()


# --- both -------------------------------------------------------------------------------------
def register(groups: ProcessGroups, over_existing: bool = False) -> GroupsMPU:
    """Register ``groups`` with Megatron-Core and DeepSpeed; return the mpu for ``deepspeed.initialize``."""
    register_with_megatron(groups, over_existing)
    return register_with_deepspeed(groups)


def unregister() -> None:
    """Undo ``register`` (only for the libraries already imported); our groups stay alive."""
    if "megatron.core.parallel_state" in sys.modules:
        unregister_megatron()
    if "deepspeed.utils.groups" in sys.modules:
        unregister_deepspeed()
