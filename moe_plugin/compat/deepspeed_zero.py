"""DeepSpeed's ZeRO-1/2 flat buffers and partitions, read and edited in place.

Relies on deepspeed 0.19.8's ``DeepSpeedZeroOptimizer`` (``runtime/zero/stage_1_and_2.py``): each
param group's parameters are flattened into one buffer ``bit16_groups_flat[i]`` (parameters in
group order, each padded to 16 bytes, the whole padded to a multiple of the group's
data-parallel size), every parameter of ``bit16_groups[i]`` has its ``.data`` viewing into it. The
buffer is cut into ``dp`` equal partitions of ``partition_size[i]`` elements; rank ``j`` of
``real_dp_process_group[i]`` owns partition ``j``: the fp32 master copy
``single_partition_of_fp32_groups[i]`` and the inner optimizer's (``optimizer.optimizer``) state
of that tensor (Adam's ``exp_avg``, ``exp_avg_sq``: same shape; ``step``: a scalar). The inner
optimizer's param groups keep the ``'moe'`` key of the groups given to ``deepspeed.initialize``.
Its inner optimizer's state is linked to the parameters (``_hp_mapping``) lazily, at the first
step (``_lazy_init_hp_params_optimizer_state``); DeepSpeed's ``BF16_Optimizer`` the same way
(``link_inner_state``, ``fill_inner_state``).
"""
from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor, nn

ZERO_ATTRIBUTES = ("bit16_groups", "bit16_groups_flat", "partition_size", "single_partition_of_fp32_groups",
                   "real_dp_process_group", "parallel_partitioned_bit16_groups")


def is_zero_optimizer(optimizer) -> bool:
    """Whether ``optimizer`` is DeepSpeed's ZeRO-1/2 optimizer with the attributes read here."""
    return all(hasattr(optimizer, a) for a in ZERO_ATTRIBUTES)


def expert_group_indices(optimizer) -> list[int]:
    """Indices of the param groups that hold expert parameters (``'moe': True``)."""
    return [i for i, g in enumerate(optimizer.optimizer.param_groups) if g.get("moe", False)]


def group_params(optimizer, i: int) -> list[nn.Parameter]:
    """The parameters of param group ``i``, in their flat buffer's order."""
    return optimizer.bit16_groups[i]


def partition_size(optimizer, i: int) -> int:
    """Elements of each data-parallel partition of param group ``i``'s flat buffer."""
    return int(optimizer.partition_size[i])


def partition_state(optimizer, i: int) -> list[Tensor]:
    """The fp32 master partition of group ``i`` and every optimizer state tensor of its size, by
    state name (the same list on every rank that has stepped as often); edited in place. A master
    that is the weights' own partition (``share_fp32_masters``) is not in the list: it moves with
    the weights."""
    fp32 = optimizer.single_partition_of_fp32_groups[i]
    state = optimizer.optimizer.state.get(fp32, {})
    master = [] if master_is_weights(optimizer, i) else [fp32.data]
    return master + [state[k] for k in sorted(state)
                     if isinstance(state[k], Tensor) and state[k].numel() == fp32.numel() and state[k].dim() > 0]


def share_fp32_masters(optimizer) -> int:
    """Make each fp32 master partition of a fp32 run the weights' own partition; returns the bytes freed.

    DeepSpeed's ZeRO-1/2 optimizer clones this rank's partition of every param group's flat buffer
    into ``single_partition_of_fp32_groups[i]`` whatever the weights' dtype; in a fp32 run that is
    a second copy of the weights it steps (4 bytes per parameter over dp) and copies back into the
    flat buffer after every step. Here the master's ``.data`` becomes that partition of the flat
    buffer itself (same dtype, device and size, equal values: the clone is dropped), so the inner
    optimizer steps the weights in place and the copy back is a copy onto itself: every value is
    the same as before, bit for bit. Groups whose master differs in dtype, device (CPU offload) or
    size keep their copy. Every parameter's link to its master (``_hp_mapping``, which DeepSpeed
    builds once in ``_link_all_hp_params`` from views of the masters) is built again, else those
    views would keep the clones alive and ``safe_get_full_fp32_param`` would read them."""
    freed = 0
    for i, fp32 in enumerate(optimizer.single_partition_of_fp32_groups):
        own = optimizer.parallel_partitioned_bit16_groups[i][my_partition(optimizer, i)]
        if master_is_weights(optimizer, i) or (fp32.dtype, fp32.device, fp32.numel()) != (own.dtype, own.device,
                                                                                          own.numel()):
            continue
        if not torch.equal(fp32.data, own.data):
            raise RuntimeError(f"DeepSpeed's fp32 master of param group {i} differs from the weights it was cloned "
                               "from; this DeepSpeed version keeps ZeRO masters in a way the plugin does not know")
        freed += fp32.data.nbytes
        fp32.data = own.data.view(fp32.shape)
    if freed:   # each parameter's ``_hp_mapping`` holds views of the old masters: link them to the new ones
        optimizer._link_all_hp_params()
    return freed


def master_is_weights(optimizer, i: int) -> bool:
    """Whether param group ``i``'s fp32 master shares its storage with the weights (``share_fp32_masters``)."""
    fp32 = optimizer.single_partition_of_fp32_groups[i]
    flat = optimizer.bit16_groups_flat[i]
    return fp32.untyped_storage().data_ptr() == flat.untyped_storage().data_ptr()


def my_partition(optimizer, i: int) -> int:
    """The partition of param group ``i`` this rank owns."""
    return dist.get_rank(group=optimizer.real_dp_process_group[i])


def flat_offset(optimizer, i: int, param: nn.Parameter) -> int:
    """Element offset of ``param``'s storage inside param group ``i``'s flat buffer (read from the
    storage: DeepSpeed's per-parameter padding and order need no modelling)."""
    flat = optimizer.bit16_groups_flat[i]
    delta = param.data.data_ptr() - flat.data_ptr()
    size = flat.element_size()
    if delta % size or not 0 <= delta // size <= flat.numel() - param.numel() or not param.data.is_contiguous():
        raise RuntimeError(f"an expert parameter of shape {tuple(param.shape)} is not a contiguous view into "
                           "DeepSpeed's flat ZeRO buffer of its param group; this DeepSpeed version lays out "
                           "ZeRO-1/2 parameters in a way migration does not know")
    return delta // size


def has_hp_mapping(params) -> bool:
    """Whether every parameter was linked to a fp32 master by DeepSpeed's ZeRO-1/2 or bf16 optimizer
    (``utils.mixed_precision_linkage.link_hp_params``: ``_hp_mapping`` and ``get_full_hp_param``),
    so ``deepspeed.utils.safe_get_full_*`` / ``safe_set_full_*`` reach its master and state."""
    return all(hasattr(p, "_hp_mapping") and hasattr(p, "get_full_hp_param") for p in params)


def fill_inner_state(optimizer, names: list[str], scalars: dict) -> None:
    """Give every fp32 partition of ``optimizer`` (ZeRO-1/2 or bf16: its inner torch optimizer
    ``optimizer.optimizer`` steps the partitions) the state tensors ``names`` (zeros where absent)
    and ``scalars`` (Adam's ``step``), then link them to the parameters again, as DeepSpeed does
    lazily at its first step (``_lazy_init_hp_params_optimizer_state``, guarded by
    ``_hp_optimizer_states_linked``), so ``safe_set_full_optimizer_state`` can write them before one."""
    inner = optimizer.optimizer
    for group in inner.param_groups:
        for flat in group["params"]:
            state = inner.state[flat]
            for name in names:
                if name not in state:
                    state[name] = torch.zeros_like(flat)
            for key, value in scalars.items():
                state[key] = value.clone() if isinstance(value, Tensor) else value
    link_inner_state(optimizer)


def link_inner_state(optimizer) -> None:
    """Link the inner optimizer's state of every param group to the parameters again. DeepSpeed
    links it once, after the first step of the first param group it steps (``_optimizer_step``
    steps one group at a time), so the expert groups' state stays unlinked and
    ``safe_get_full_optimizer_state`` cannot find it."""
    optimizer._hp_optimizer_states_linked = False
    optimizer._lazy_init_hp_params_optimizer_state()
