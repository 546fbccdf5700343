"""DeepSpeed 0.19.8's ZeRO-1/2 flat buffers and partitions (``runtime/zero/stage_1_and_2.py``), read and
edited in place. Layout, and why each edit is safe: docs/design/compat_upstream.md.
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
    """{state name: tensor} of group ``i``'s fp32 master partition and its states (a shared master left out)."""
    fp32 = optimizer.single_partition_of_fp32_groups[i]
    state = optimizer.optimizer.state.get(fp32, {})
    master = [] if master_is_weights(optimizer, i) else [fp32.data]
    return master + [state[k] for k in sorted(state)
                     if isinstance(state[k], Tensor) and state[k].numel() == fp32.numel() and state[k].dim() > 0]


def share_fp32_masters(optimizer) -> int:
    """Make each fp32 master of a fp32 run the weights' own partition (bit for bit); returns the bytes freed."""
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
    """Element offset of ``param``'s storage inside param group ``i``'s flat buffer."""
    flat = optimizer.bit16_groups_flat[i]
    delta = param.data.data_ptr() - flat.data_ptr()
    size = flat.element_size()
    if delta % size or not 0 <= delta // size <= flat.numel() - param.numel() or not param.data.is_contiguous():
        raise RuntimeError(f"an expert parameter of shape {tuple(param.shape)} is not a contiguous view into "
                           "DeepSpeed's flat ZeRO buffer of its param group; this DeepSpeed version lays out "
                           "ZeRO-1/2 parameters in a way migration does not know")
    return delta // size


def has_hp_mapping(params) -> bool:
    """Whether every parameter is linked to a fp32 master (``safe_get_full_*`` / ``safe_set_full_*`` work)."""
    return all(hasattr(p, "_hp_mapping") and hasattr(p, "get_full_hp_param") for p in params)


def fill_inner_state(optimizer, names: list[str], scalars: dict) -> None:
    """Give every fp32 partition the states ``names`` (zeros) and ``scalars``, linked, before any step."""
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
    """Link every param group's inner state to the parameters (DeepSpeed links the first group only)."""
    optimizer._hp_optimizer_states_linked = False
    optimizer._lazy_init_hp_params_optimizer_state()
