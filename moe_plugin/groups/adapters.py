"""The one module that writes Megatron-Core's and DeepSpeed's global group registries.

``register(groups)`` makes their getters return exactly our groups:

* ``megatron.core.parallel_state``: its module-level group variables and rank lists, set the
  way ``initialize_model_parallel`` sets them, so ``get_tensor_model_parallel_group()``,
  ``get_expert_model_parallel_group()`` ... and ``ProcessGroupCollection.use_mpu_process_groups()``
  return our handles. No Megatron function is replaced.
* ``deepspeed.utils.groups``: the expert-parallel and expert-data-parallel dicts under
  ``groups.expert_group_name`` (``"ep_size_{ep}"``), so DeepSpeed's MoE/ZeRO code finds our
  groups instead of creating its own, and ``groups.mpu``, an object with the methods DeepSpeed
  calls on a Megatron ``mpu`` (also what to pass as ``deepspeed.initialize(mpu=...)``).

Megatron and DeepSpeed are imported inside the functions: importing this module is cheap.
"""
from __future__ import annotations

import sys
from typing import Optional

import torch
import torch.distributed as dist

from moe_plugin.groups.builder import rank_lists
from moe_plugin.groups.layout import RankLayout
from moe_plugin.groups.process_groups import ProcessGroups


def _my_ranks(groups: ProcessGroups, kind: str) -> Optional[list[int]]:
    """This rank's list of ``kind`` (layout kinds and the builder's Megatron-only kinds)."""
    return next((r for r in rank_lists(groups.layout)[kind] if groups.rank in r), None)


def _unique(handles) -> list:
    """Each handle once (handles are shared between kinds with the same ranks)."""
    out: list = []
    for h in handles:
        if all(h is not o for o in out):
            out.append(h)
    return out


# --- Megatron-Core ----------------------------------------------------------------------------
# What parallel_state held before ``register_with_megatron(..., over_existing=True)``: the user's
# own groups (their initialize_model_parallel call), put back by ``unregister_megatron``.
_SAVED_MEGATRON_STATE: Optional[dict] = None


def register_with_megatron(groups: ProcessGroups, over_existing: bool = False) -> None:
    """Point ``megatron.core.parallel_state`` at our groups (context parallel size 1).

    ``over_existing``: parallel_state may already hold groups (the user's ``initialize_model_parallel``;
    ``check_megatron_groups`` checked that their rank lists are ours): they are set aside, not
    destroyed, and ``unregister_megatron`` puts them back."""
    from megatron.core import parallel_state as ps

    global _SAVED_MEGATRON_STATE
    h = groups.handles
    theirs = ps._TENSOR_MODEL_PARALLEL_GROUP is not None and ps._TENSOR_MODEL_PARALLEL_GROUP is not h["tp"]
    if theirs and not over_existing:
        raise RuntimeError("megatron.core.parallel_state already holds other groups "
                           "(initialize_model_parallel?); call unregister_megatron() first, or check them with "
                           "check_megatron_groups and register with over_existing=True")
    # Megatron keeps separate gloo copies of the DP groups; on a gloo job ours are gloo already.
    gloo = groups.backend == "gloo"
    values = {
        "_TENSOR_MODEL_PARALLEL_GROUP": h["tp"],
        "_TENSOR_MODEL_PARALLEL_GLOBAL_RANKS": groups.ranks("tp"),
        "_PIPELINE_MODEL_PARALLEL_GROUP": h["pp"],
        "_PIPELINE_GLOBAL_RANKS": groups.ranks("pp"),
        "_MODEL_PARALLEL_GROUP": h["mp"],
        "_MODEL_PARALLEL_GLOBAL_RANKS": groups.ranks("mp"),
        # Only the first and last stage are members; the others keep None, as in Megatron.
        "_EMBEDDING_GROUP": h.get("embedding"),
        "_EMBEDDING_GLOBAL_RANKS": _my_ranks(groups, "embedding"),
        "_POSITION_EMBEDDING_GROUP": h.get("pos_embedding"),
        "_POSITION_EMBEDDING_GLOBAL_RANKS": _my_ranks(groups, "pos_embedding"),
        "_DATA_PARALLEL_GROUP": h["dp"],
        "_DATA_PARALLEL_GROUP_GLOO": h["dp"] if gloo else None,
        "_DATA_PARALLEL_GLOBAL_RANKS": groups.ranks("dp"),
        # Context parallel is 1: "with CP" groups are the plain ones.
        "_CONTEXT_PARALLEL_GROUP": h["cp"],
        "_CONTEXT_PARALLEL_GLOBAL_RANKS": [groups.rank],
        "_HIERARCHICAL_CONTEXT_PARALLEL_GROUPS": None,
        "_DATA_PARALLEL_GROUP_WITH_CP": h["dp"],
        "_DATA_PARALLEL_GROUP_WITH_CP_AG": None,
        "_DATA_PARALLEL_GROUP_WITH_CP_GLOO": h["dp"] if gloo else None,
        "_DATA_PARALLEL_GLOBAL_RANKS_WITH_CP": groups.ranks("dp"),
        # One distributed-optimizer instance: the "partial" DP groups are the whole DP groups.
        "_INTRA_PARTIAL_DATA_PARALLEL_GROUP_WITH_CP": h["dp"],
        "_INTRA_PARTIAL_DATA_PARALLEL_GROUP_WITH_CP_GLOO": h["dp"] if gloo else None,
        "_TENSOR_AND_DATA_PARALLEL_GROUP": h["tp_dp"],
        "_TENSOR_AND_DATA_PARALLEL_GROUP_WITH_CP": h["tp_dp"],
        "_TENSOR_AND_CONTEXT_PARALLEL_GROUP": h["tp"],
        "_EXPERT_MODEL_PARALLEL_GROUP": h["ep"],
        "_EXPERT_MODEL_PARALLEL_RANKS": groups.ranks("ep"),
        "_EXPERT_TENSOR_PARALLEL_GROUP": h["etp"],
        "_EXPERT_TENSOR_AND_MODEL_PARALLEL_GROUP": h["etp_ep"],
        "_EXPERT_TENSOR_MODEL_PIPELINE_PARALLEL_GROUP": h["etp_ep_pp"],
        "_EXPERT_DATA_PARALLEL_GROUP": h["edp"],
        "_EXPERT_DATA_PARALLEL_GROUP_GLOO": h["edp"] if gloo else None,
        "_INTRA_PARTIAL_EXPERT_DATA_PARALLEL_GROUP": h["edp"],
        "_INTRA_PARTIAL_EXPERT_DATA_PARALLEL_GROUP_GLOO": h["edp"] if gloo else None,
        "_INTER_PARTIAL_EXPERT_DATA_PARALLEL_GROUP": None,
        "_INTRA_DISTRIBUTED_OPTIMIZER_INSTANCE_GROUP": dist.group.WORLD,
        # Sizes and ranks come from the groups, not from overrides.
        "_MPU_TENSOR_MODEL_PARALLEL_WORLD_SIZE": None,
        "_MPU_TENSOR_MODEL_PARALLEL_RANK": None,
        "_MPU_PIPELINE_MODEL_PARALLEL_WORLD_SIZE": None,
        "_MPU_PIPELINE_MODEL_PARALLEL_RANK": None,
        "_MPU_DATA_PARALLEL_WORLD_SIZE": None,
        "_MPU_DATA_PARALLEL_RANK": None,
        "_MPU_EXPERT_MODEL_PARALLEL_WORLD_SIZE": None,
        "_MPU_EXPERT_MODEL_PARALLEL_RANK": None,
        "_MPU_EXPERT_TENSOR_PARALLEL_WORLD_SIZE": None,
        "_MPU_EXPERT_TENSOR_PARALLEL_RANK": None,
        "_global_process_group_list": [None] + _unique(h.values()),
    }
    for name in values:
        if not hasattr(ps, name):
            raise RuntimeError(f"megatron.core.parallel_state has no {name}: unsupported megatron-core version")
    if theirs:
        _SAVED_MEGATRON_STATE = {name: getattr(ps, name) for name in values}
    for name, value in values.items():
        setattr(ps, name, value)
    if ps._GLOBAL_MEMORY_BUFFER is None:
        ps._set_global_memory_buffer()


def unregister_megatron() -> None:
    """Empty Megatron-Core's registry without destroying our groups; where ``register_with_megatron``
    set the user's own groups aside, put them back instead (they stay alive)."""
    global _SAVED_MEGATRON_STATE
    from megatron.core import parallel_state as ps

    if _SAVED_MEGATRON_STATE is not None:
        for name, value in _SAVED_MEGATRON_STATE.items():
            setattr(ps, name, value)
        _SAVED_MEGATRON_STATE = None
        return
    # destroy_model_parallel() destroys the gloo DP groups it holds; ours are owned elsewhere.
    for name in ("_DATA_PARALLEL_GROUP_GLOO", "_DATA_PARALLEL_GROUP_WITH_CP_GLOO",
                 "_EXPERT_DATA_PARALLEL_GROUP_GLOO", "_INTRA_PARTIAL_EXPERT_DATA_PARALLEL_GROUP_GLOO"):
        setattr(ps, name, None)
    ps.destroy_model_parallel()
    # Rank lists and groups destroy_model_parallel() leaves set.
    for name in ("_TENSOR_MODEL_PARALLEL_GLOBAL_RANKS", "_PIPELINE_GLOBAL_RANKS", "_MODEL_PARALLEL_GLOBAL_RANKS",
                 "_EMBEDDING_GLOBAL_RANKS", "_DATA_PARALLEL_GLOBAL_RANKS", "_DATA_PARALLEL_GLOBAL_RANKS_WITH_CP",
                 "_EXPERT_MODEL_PARALLEL_RANKS", "_INTRA_PARTIAL_DATA_PARALLEL_GROUP_WITH_CP",
                 "_INTRA_PARTIAL_DATA_PARALLEL_GROUP_WITH_CP_GLOO", "_HIERARCHICAL_CONTEXT_PARALLEL_GROUPS",
                 "_MPU_DATA_PARALLEL_WORLD_SIZE", "_MPU_DATA_PARALLEL_RANK"):
        setattr(ps, name, None)


# kind -> parallel_state's getter of this rank's group (context parallel must be 1)
_MEGATRON_GETTERS = {"tp": "get_tensor_model_parallel_group", "pp": "get_pipeline_model_parallel_group",
                     "dp": "get_data_parallel_group", "ep": "get_expert_model_parallel_group",
                     "etp": "get_expert_tensor_parallel_group", "edp": "get_expert_data_parallel_group"}


def megatron_holds_groups() -> bool:
    """Whether ``megatron.core.parallel_state`` holds groups that are not the plugin's (the user
    called ``initialize_model_parallel``)."""
    ps = sys.modules.get("megatron.core.parallel_state")
    if ps is None or ps._TENSOR_MODEL_PARALLEL_GROUP is None:
        return False
    return not isinstance(_registered_mpu(), GroupsMPU)


def _registered_mpu():
    ds_groups = sys.modules.get("deepspeed.utils.groups")
    return getattr(ds_groups, "mpu", None)


def check_megatron_groups(layout: RankLayout, rank: int, device: str = "cpu") -> None:
    """The groups ``megatron.core.parallel_state`` holds must have the rank lists of ``layout``:
    tp, pp, dp, and ep, etp, edp when Megatron's expert-parallel size is above 1 (where it is 1,
    Megatron has no experts to place and the plugin's expert groups take the getters' place).
    Collective over the default group, so that every rank raises the same ``ConfigError`` (one
    line naming both layouts and the fix) or none does. Call it before building the plugin's groups."""
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
    """The ``mpu`` DeepSpeed expects from Megatron, answered from a ``ProcessGroups``.

    Model parallel is TP x PP (as in DeepSpeed's pipeline grid); "slice" is DeepSpeed's name for
    TP. Groups are real handles even where the size is 1: DeepSpeed would read ``None`` as the
    whole world. There are deliberately no sequence-parallel methods: DeepSpeed then uses
    sequence parallel 1 and the data-parallel group.
    """

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
    """Fill ``deepspeed.utils.groups``' expert registries and its ``mpu``; return the mpu.

    Initialises ``deepspeed.comm`` over the existing torch process group if nobody did
    (DeepSpeed's getters assert it).
    """
    import deepspeed.comm as ds_comm
    from deepspeed.utils import groups as ds_groups

    if not ds_comm.is_initialized():
        ds_comm.init_distributed(dist_backend=groups.backend, auto_mpi_discovery=False, verbose=False)
    name = groups.expert_group_name
    for registry, kind in ((ds_groups._EXPERT_PARALLEL_GROUP, "ep"), (ds_groups._EXPERT_DATA_PARALLEL_GROUP, "edp")):
        if registry.get(name, groups.handles[kind]) is not groups.handles[kind]:
            raise RuntimeError(f"deepspeed.utils.groups already holds other {name!r} groups "
                               "(a DeepSpeed MoE layer created them?); call unregister_deepspeed() first")
    ds_groups._EXPERT_PARALLEL_GROUP[name] = groups.handles["ep"]
    ds_groups._EXPERT_PARALLEL_GROUP_RANKS[name] = groups.ranks("ep")
    ds_groups._EXPERT_DATA_PARALLEL_GROUP[name] = groups.handles["edp"]
    ds_groups._EXPERT_DATA_PARALLEL_GROUP_RANKS[name] = groups.ranks("edp")
    ds_groups.expert_tensor_parallel_world_size = groups.size("etp")
    ds_groups.mpu = make_mpu(groups)
    return ds_groups.mpu


def unregister_deepspeed() -> None:
    """Remove what ``register_with_deepspeed`` put into ``deepspeed.utils.groups``."""
    from deepspeed.utils import groups as ds_groups

    mpu = ds_groups.mpu
    if isinstance(mpu, GroupsMPU):
        name = mpu.groups.expert_group_name
        for registry, ranks in ((ds_groups._EXPERT_PARALLEL_GROUP, ds_groups._EXPERT_PARALLEL_GROUP_RANKS),
                                (ds_groups._EXPERT_DATA_PARALLEL_GROUP, ds_groups._EXPERT_DATA_PARALLEL_GROUP_RANKS)):
            if any(registry.get(name) is h for h in mpu.groups.handles.values()):
                registry.pop(name)
                ranks.pop(name, None)
        ds_groups.mpu = None
        ds_groups.expert_tensor_parallel_world_size = 1


# --- both -------------------------------------------------------------------------------------
def register(groups: ProcessGroups, over_existing: bool = False) -> GroupsMPU:
    """Register ``groups`` with Megatron-Core and DeepSpeed; return the mpu for ``deepspeed.initialize``.
    ``over_existing``: see ``register_with_megatron``."""
    register_with_megatron(groups, over_existing)
    return register_with_deepspeed(groups)


def unregister() -> None:
    """Undo ``register`` (only for the libraries already imported); our groups stay alive."""
    if "megatron.core.parallel_state" in sys.modules:
        unregister_megatron()
    if "deepspeed.utils.groups" in sys.modules:
        unregister_deepspeed()
