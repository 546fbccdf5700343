"""Build the process groups of a DeepSpeed JSON's "moe" block on real ranks and show them.

    deepspeed --num_gpus 4 examples/gpt_moe/show_groups.py \
        --deepspeed_config examples/gpt_moe/configs/tiny_cpu_4rank.json

Every rank validates the config against the launcher's world size, builds the groups,
registers them with Megatron-Core and DeepSpeed, and then reads its groups back through
*their* getters. An all-reduce over each group checks that it holds exactly the ranks the
layout says. Rank 0 prints one line per rank: ``ep[mg]`` is what Megatron's getter returned, ``ep[ds]``
DeepSpeed's, ``mp[mpu]`` the mpu handed to ``deepspeed.initialize``.
"""
import argparse
import sys

import torch
import torch.distributed as dist

from moe_plugin import ConfigError, MoEConfig, RankLayout
from moe_plugin.groups import build_process_groups, register


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--deepspeed_config", required=True, help="DeepSpeed JSON with a \"moe\" block")
    parser.add_argument("--local_rank", type=int, default=0, help="set by the deepspeed launcher")
    return parser.parse_args()


def members(group) -> list[int]:
    return dist.get_process_group_ranks(group)


def check_group(group, expected: list[int]) -> bool:
    """All-reduce a one-hot vector of this rank over the group: the sum marks its members."""
    onehot = torch.zeros(dist.get_world_size())
    onehot[dist.get_rank()] = 1
    dist.all_reduce(onehot, group=group)
    return onehot.nonzero().flatten().tolist() == expected


def main() -> int:
    args = parse_args()
    import deepspeed
    from deepspeed.accelerator import get_accelerator
    from deepspeed.utils import groups as ds_groups
    from megatron.core import parallel_state as ps

    world_size = int(__import__("os").environ.get("WORLD_SIZE", "1"))
    try:  # checked before any process group exists
        config = MoEConfig.from_ds_config(args.deepspeed_config)
        layout = RankLayout(config.check_world_size(world_size))
    except ConfigError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2

    deepspeed.init_distributed(dist_backend=get_accelerator().communication_backend_name())
    groups = build_process_groups(layout)
    register(groups)
    name = groups.expert_group_name
    seen = {
        "tp (megatron)": ps.get_tensor_model_parallel_group(),
        "dp (megatron)": ps.get_data_parallel_group(),
        "pp (megatron)": ps.get_pipeline_model_parallel_group(),
        "ep (megatron)": ps.get_expert_model_parallel_group(),
        "edp (megatron)": ps.get_expert_data_parallel_group(),
        "ep (deepspeed)": ds_groups._get_expert_parallel_group(name),
        "edp (deepspeed)": ds_groups._get_expert_data_parallel_group(name),
        "mp (deepspeed mpu)": ds_groups.mpu.get_model_parallel_group(),
    }
    kinds = {"tp": "tp", "dp": "dp", "pp": "pp", "ep": "ep", "edp": "edp", "mp": "mp"}
    line, ok = [f"rank {groups.rank}:"], True
    for label, group in seen.items():
        expected = groups.ranks(kinds[label.split()[0]])
        good = members(group) == expected and check_group(group, expected)
        ok &= good
        kind, source = label.split(" ", 1)
        short = {"(megatron)": "mg", "(deepspeed)": "ds", "(deepspeed mpu)": "mpu"}[source]
        line.append(f"{kind}[{short}]={expected}{'' if good else ' MISMATCH'}")
    lines = [None] * dist.get_world_size()
    dist.all_gather_object(lines, (" ".join(line), ok))
    if dist.get_rank() == 0:
        print(layout.table())
        print(f"\nGroups as Megatron-Core's and DeepSpeed's getters return them (key {name!r}):")
        for text, _ in lines:
            print("  " + text)
        verdict = "all groups agree" if all(good for _, good in lines) else "MISMATCH"
        print(f"\n{verdict}: every getter returns our group, and an all-reduce over it sums exactly its ranks")
    dist.barrier()
    return 0 if all(good for _, good in lines) else 1


if __name__ == "__main__":
    from moe_plugin import run_and_exit

    run_and_exit(main)   # not sys.exit: see moe_plugin/compat/process_exit.py
