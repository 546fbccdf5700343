"""``initialize``: ``deepspeed.initialize`` for a model with the plugin's MoE layers.

    engine, optimizer, _, lr_scheduler = run = moe_plugin.initialize(ds_config, model_provider)

Mistakes in the configs, the world size or the batch split are a ``ConfigError`` before any process group
exists; then groups are built and registered, the model built, its parameters split into dense and expert
groups, and DeepSpeed's engine (or ``PipelineEngine``) started. ZeRO 0/1/2 (0/1 with PP), fp32/fp16/bf16,
any ``moe.parallel`` layout. Design: docs/design/integration_deepspeed.md.
"""
from __future__ import annotations

import atexit
import copy
import logging
import datetime
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, Optional, Union

import deepspeed
import torch
import torch.distributed as dist
from deepspeed.accelerator import get_accelerator
from deepspeed.pipe import PipelineModule
from torch import nn

from moe_plugin.compat.deepspeed_zero import is_zero_optimizer, share_fp32_masters
from moe_plugin.compat.shm_buffers import job_uses_shm, remove_shm_buffers
from moe_plugin.configs.batch import batch_sizes
from moe_plugin.configs.errors import ConfigError
from moe_plugin.configs.report import alike_on_every_rank, process_rank
from moe_plugin.configs.schema import ROOT_KEY, MoEConfig, load_ds_config
from moe_plugin.groups.adapters import (
    GroupsMPU,
    check_megatron_groups,
    megatron_holds_groups,
    register,
    register_with_deepspeed,
    unregister,
)
from moe_plugin.groups.builder import build_process_groups, destroy_process_groups
from moe_plugin.groups.layout import RankLayout
from moe_plugin.groups.process_groups import ProcessGroups
from moe_plugin.integration.expert_params import (
    check_optimizer_groups,
    mark_every_stage,
    moe_param_groups,
    prepare_model,
    follow_loss_scale,
)
from moe_plugin.integration.grad_norm import GlobalNormClipping
from moe_plugin.integration.guard import GradientWatch, TrainingGuard
from moe_plugin.integration.pipe_topology import check_topology
from moe_plugin.integration.seeding import seed_megatron_rng
from moe_plugin.integration.sp_grads import sequence_parallel_grad_hooks
from moe_plugin.integration.step_boundary import StepBoundary
from moe_plugin.integration.memory_estimate import available_bytes, check_fits, runtime_baseline
from moe_plugin.integration.summary import MemoryInputs, RunSummary, run_summary

logger = logging.getLogger(__name__)
ModelProvider = Callable[[MoEConfig, ProcessGroups], nn.Module]
SUPPORTED_ZERO_STAGES = (0, 1, 2)
PIPELINE_ZERO_STAGES = (0, 1)  # DeepSpeed's PipelineEngine asserts stage < 2
# deepspeed.initialize arguments that initialize sets itself.
_OWN_ARGUMENTS = ("model", "mpu", "config", "config_params", "dist_init_required")


@dataclass
class Initialized:
    """What ``initialize`` returns; unpacks like ``deepspeed.initialize``'s four results."""

    engine: Any
    optimizer: Any
    training_dataloader: Any
    lr_scheduler: Any
    moe_config: MoEConfig
    groups: ProcessGroups
    mpu: GroupsMPU
    guard: Optional[TrainingGuard] = None
    summary: Optional[RunSummary] = None
    step_boundary: Optional[StepBoundary] = None
    saves: Any = None   # the background writer of asynchronous checkpoint saves (checkpoint.background)
    hf_origin: Any = None   # the loaded checkpoint's import-hf record and tokenizer files (checkpoint.api.hf_origin)
    _hooks: list = field(default_factory=list, repr=False)
    _closed: bool = field(default=False, repr=False)

    @property
    def data_parallel_rank(self) -> int:
        """This rank's data-parallel replica, whose share of each global batch a data loader feeds."""
        return self.groups.rank_in("dp")

    @property
    def data_parallel_size(self) -> int:
        """The number of data-parallel replicas (DeepSpeed's ``engine.dp_world_size``)."""
        return self.groups.size("dp")

    def end_step(self) -> None:
        """Apply the step boundary now (collective): for a loop whose optimizer steps outside ``engine.step()``."""
        if self.step_boundary is not None:
            self.step_boundary.apply()

    def __iter__(self) -> Iterator[Any]:
        return iter((self.engine, self.optimizer, self.training_dataloader, self.lr_scheduler))

    def close(self) -> None:
        """Remove the hooks, unregister and destroy the plugin's groups (collective). The default group and
        groups the script made with ``initialize_model_parallel`` stay; the engine is unusable afterwards."""
        if self._closed:
            return
        self._closed = True
        if self.saves is not None:   # a save in flight is finished first (its failure logged)
            self.saves.close()
            self.saves = None
        for hook in self._hooks:
            hook.remove()
        self._hooks.clear()
        unregister()
        destroy_process_groups(self.groups)
        remove_shm_buffers([self.groups.rank])   # normally gone already (initialize unlinks them)


def initialize(ds_config: Union[dict, str, os.PathLike, None], model_provider: ModelProvider, *,
               args: Any = None, world_size: Optional[int] = None, timeout: Optional[datetime.timedelta] = None,
               max_skipped_steps: int = 10, print_summary: bool = True, seed: Optional[int] = None,
               **deepspeed_kwargs: Any) -> Initialized:
    """Validate, build groups and model, start DeepSpeed's engine; ``ConfigError`` before any group exists.

    ``ds_config``: dict or JSON path (None: ``args.deepspeed_config``). ``model_provider(moe_config, groups)`` must
    pass ``groups`` to every MoE layer. ``world_size``: checked against the job's. ``timeout``: of the default
    group (when created here) and the plugin's groups. ``max_skipped_steps``: fp16 skips in a row that stop the run.
    ``seed``: Megatron's RNG tracker's (default ``torch.initial_seed()``). ``deepspeed_kwargs`` go to
    ``deepspeed.initialize``; ``model_parameters`` (or a callable ``model -> those``) is split like the model's."""
    # 1. Everything that can be wrong in the configs, before any group exists.
    if ds_config is None:
        ds_config = getattr(args, "deepspeed_config", None)
        if ds_config is None:
            raise ConfigError("ds_config", None, "pass the DeepSpeed config (dict or JSON path) or "
                              "args.deepspeed_config")
    ds_dict = load_ds_config(ds_config)
    moe_config = MoEConfig.from_ds_config(ds_dict)
    zero_stage = _check_zero(ds_dict)
    sizes = moe_config.check_world_size(launcher_world_size(world_size))
    batch = batch_sizes(ds_dict, sizes.dp)   # what deepspeed.initialize would assert after the groups, or truncate
    if "gradient_accumulation_steps" in batch.derived and process_rank() == 0:
        logger.warning("%s: the DeepSpeed config has no gradient_accumulation_steps, so it follows the number of "
                       "ranks; write it to have another world size refused", batch.describe())
    if isinstance(max_skipped_steps, bool) or not isinstance(max_skipped_steps, int) or max_skipped_steps < 1:
        raise ConfigError("max_skipped_steps", max_skipped_steps, "expected an integer >= 1 (fp16 steps skipped "
                          "in a row before the run stops)")
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int) or seed < 0):
        raise ConfigError("seed", seed, "expected an integer >= 0 (the run's seed, as given to torch.manual_seed)")
    if timeout is not None and (not isinstance(timeout, datetime.timedelta) or timeout.total_seconds() <= 0):
        raise ConfigError("timeout", timeout, "expected a positive datetime.timedelta")
    if sizes.pp > 1:
        _check_pipeline(ds_dict, moe_config, zero_stage)
    clashes = [name for name in _OWN_ARGUMENTS if name in deepspeed_kwargs]
    if clashes:
        raise TypeError(f"initialize sets {', '.join(clashes)} itself; pass the model through model_provider "
                        "and the config as ds_config")
    plugin_clips = zero_stage == 0 and not _enabled(ds_dict, "fp16") and not _enabled(ds_dict, "bf16", "bfloat16")
    accelerator = get_accelerator()
    _check_precision_supported(ds_dict, accelerator)

    # 2. Distributed, groups.
    if accelerator.device_name() != "cpu":   # before any work on the device (NCCL, the RNG tracker), as
        accelerator.set_device(local_rank())  # Megatron-LM does: else every rank starts on device 0
    if not dist.is_initialized():
        extra = {} if timeout is None else {"timeout": timeout}
        deepspeed.init_distributed(dist_backend=get_accelerator().communication_backend_name(), **extra)
    if dist.get_world_size() != sizes.world_size:
        raise ConfigError("world_size", sizes.world_size, f"torch.distributed runs {dist.get_world_size()} ranks")
    if job_uses_shm(sizes.world_size):   # should initialize fail before the unlink, the buffer goes at exit
        atexit.register(remove_shm_buffers, [dist.get_rank()])
    layout = RankLayout(sizes)
    device = get_accelerator().current_device_name()
    users_groups = megatron_holds_groups()   # the script called initialize_model_parallel itself
    if users_groups:
        check_megatron_groups(layout, dist.get_rank(), device)   # the same rank lists, or one ConfigError
    groups = build_process_groups(layout, timeout=timeout)
    # every rank has started (the host names' all-gather): what this node has left is shared by all of them
    memory_inputs = MemoryInputs(ds_config=ds_dict, micro_batch=batch.micro, args=args,
                                 runtime_bytes=runtime_baseline(accelerator.device_name()),
                                 available_bytes=available_bytes(accelerator.device_name(), ranks_on_this_node()))
    watch = None
    try:
        mpu = register(groups, over_existing=users_groups)   # the user's groups set aside, back at close()
        # 3, 4. Megatron's RNG tracker, model, param groups.
        seed_megatron_rng(seed, groups)
        model = model_provider(moe_config, groups)
        if not isinstance(model, nn.Module):
            raise alike_on_every_rank(TypeError(f"model_provider must return a torch.nn.Module, got "
                                                f"{type(model).__name__}"))
        pipelined = isinstance(model, PipelineModule)
        if sizes.pp > 1 and not pipelined:
            raise alike_on_every_rank(TypeError(
                f"with {ROOT_KEY}.parallel.pipeline {sizes.pp} the model_provider must return a deepspeed.pipe."
                f"PipelineModule (e.g. moe_plugin.integration.pipeline.gpt_pipeline_module), got "
                f"{type(model).__name__}"))
        if pipelined:
            check_topology(model.topology(), groups.layout)
        has_experts = prepare_model(model, moe_config, groups)
        if pipelined:   # a stage without MoE layers (dense first layers) takes DeepSpeed's MoE paths too
            mark_every_stage(model, has_experts, moe_config, groups)
        sequence_parallel_grad_hooks(model, groups)   # before DeepSpeed's own hooks on the gradients
        watch = GradientWatch(model)                  # the same: sees each gradient before ZeRO moves it
        if pipelined and zero_stage > 0:
            _check_experts_on_every_stage(has_experts, moe_config, groups)
        params = deepspeed_kwargs.pop("model_parameters", None)
        if callable(params):
            params = params(model)
        param_groups = moe_param_groups(model if params is None else params)
        client_optimizer = deepspeed_kwargs.get("optimizer")
        if has_experts and client_optimizer is not None and not callable(client_optimizer):
            check_optimizer_groups(client_optimizer)
        # 5. DeepSpeed.
        engine_config = dict(ds_dict)
        max_norm = float(ds_dict.get("gradient_clipping", 0.0))
        if plugin_clips:
            engine_config["gradient_clipping"] = 0.0
        if args is not None and getattr(args, "deepspeed_config", None) is not None:
            args = copy.copy(args)
            args.deepspeed_config = None  # the config goes as config=...; DeepSpeed takes one of the two
        # DeepSpeed takes a PipelineModule's own grid as mpu (same ranks as ours: check_topology) and
        # makes it deepspeed.utils.groups.mpu (compat/deepspeed_groups.py); registering again puts ours back.
        engine, optimizer, loader, scheduler = deepspeed.initialize(
            args=args, model=model, model_parameters=param_groups, config=engine_config,
            mpu=None if pipelined else mpu, **deepspeed_kwargs)
        if pipelined:
            mpu = register_with_deepspeed(groups)
        _check_engine(engine, zero_stage, plugin_clips)
        _spare_memory(engine, model, keep_grad_storage=plugin_clips)
        if job_uses_shm(sizes.world_size):
            dist.barrier()   # every rank has mapped every rank's buffer: the names can go
            remove_shm_buffers([groups.rank])
        guard = TrainingGuard(engine, watch, max_skipped_steps=max_skipped_steps)
        dtype = "fp16" if _enabled(ds_dict, "fp16") else "bf16" if _enabled(ds_dict, "bf16", "bfloat16") else "fp32"
        summary = run_summary(model, moe_config, groups, zero_stage, dtype, memory_inputs)   # collective
        refusal = check_fits(summary.memory_per_rank_mb, accelerator.device_name(), moe_config.memory_check)
        if refusal is not None:   # the same numbers on every rank (the busiest rank's, the least memory)
            raise alike_on_every_rank(refusal)
        if print_summary and groups.rank == 0:
            print(summary.text(), flush=True)
        result = Initialized(engine, optimizer, loader, scheduler, moe_config, groups, mpu, guard, summary)
        result._hooks.append(watch)
        result._hooks.append(follow_loss_scale(engine, model))   # aux-loss gradient: 1/gas, fp16 loss scale
        result.step_boundary = StepBoundary(engine, model)   # once per optimizer step: bias update, balance counts
        result._hooks.append(result.step_boundary)
        if plugin_clips:
            result._hooks.append(GlobalNormClipping(groups, max_norm).install(engine.optimizer))
        return result
    except BaseException:
        if watch is not None:
            watch.remove()
        unregister()
        destroy_process_groups(groups)
        raise


def ranks_on_this_node() -> int:
    """How many ranks of the job run on this machine (by host name; collective)."""
    import socket

    if not dist.is_initialized() or dist.get_world_size() == 1:
        return 1
    names: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(names, socket.gethostname())
    return names.count(socket.gethostname())


def local_rank() -> int:
    """This process's index on its machine: the launcher's ``LOCAL_RANK``, else 0."""
    text = os.environ.get("LOCAL_RANK", "0")
    if not text.isdigit():
        raise ConfigError("LOCAL_RANK", text, "expected an integer >= 0 (the launcher sets it)")
    return int(text)


def launcher_world_size(world_size: Optional[int] = None) -> int:
    """``world_size`` if given (it must agree with the job), else torch.distributed's, else ``WORLD_SIZE``, else 1."""
    running = None
    if dist.is_available() and dist.is_initialized():
        running = dist.get_world_size()
    elif "WORLD_SIZE" in os.environ:
        text = os.environ["WORLD_SIZE"]
        if not text.isdigit() or int(text) < 1:
            raise ConfigError("WORLD_SIZE", text, "expected a positive integer (the launcher sets it)")
        running = int(text)
    if world_size is not None and running is not None and world_size != running:
        raise ConfigError("world_size", world_size, f"the job runs {running} ranks")
    return world_size if world_size is not None else (running or 1)


def _check_zero(ds_dict: dict) -> int:
    """The ZeRO stage; the settings DeepSpeed's MoE paths assert are checked here, early."""
    zero = ds_dict.get("zero_optimization", {})
    if not isinstance(zero, dict):
        raise ConfigError("zero_optimization", zero, "expected an object, e.g. {\"stage\": 1}")
    stage = zero.get("stage", 0)
    if stage not in SUPPORTED_ZERO_STAGES or isinstance(stage, bool):
        raise ConfigError("zero_optimization.stage", stage, "the MoE plugin supports ZeRO stages 0, 1 and 2 "
                          "(DeepSpeed's stage 3 does not take MoE layers other than its AutoEP)")
    if stage > 0 and zero.get("reduce_scatter", True) is not True:
        raise ConfigError("zero_optimization.reduce_scatter", zero["reduce_scatter"], "must be true with MoE "
                          "layers: ZeRO reduces expert gradients over their expert-data-parallel group only then")
    if stage == 2 and zero.get("contiguous_gradients", True) is not True:
        raise ConfigError("zero_optimization.contiguous_gradients", zero["contiguous_gradients"], "must be true "
                          "with MoE layers under ZeRO stage 2 (DeepSpeed asserts it)")
    if "gradient_clipping" in ds_dict:
        clip = ds_dict["gradient_clipping"]
        if isinstance(clip, bool) or not isinstance(clip, (int, float)) or clip < 0:
            raise ConfigError("gradient_clipping", clip, "expected a number >= 0 (0: no clipping)")
    return stage


def _check_pipeline(ds_dict: dict, moe_config: MoEConfig, zero_stage: int) -> None:
    """What DeepSpeed's PipelineEngine needs of the config (pp > 1)."""
    pp = moe_config.parallel.pipeline
    if zero_stage not in PIPELINE_ZERO_STAGES:
        raise ConfigError("zero_optimization.stage", zero_stage, f"with {ROOT_KEY}.parallel.pipeline {pp} the model "
                          "runs on DeepSpeed's PipelineEngine, which supports ZeRO stages 0 and 1 only")
    pipeline = ds_dict.get("pipeline", {})
    if not isinstance(pipeline, dict):
        raise ConfigError("pipeline", pipeline, "expected an object, e.g. {\"pipe_partitioned\": false}")
    if moe_config.parallel.sequence_parallel and moe_config.parallel.tensor > 1:
        for key in ("pipe_partitioned", "grad_partitioned"):
            if pipeline.get(key, True):
                raise ConfigError(f"pipeline.{key}", pipeline.get(key, True), f"must be false with "
                                  f"{ROOT_KEY}.parallel.sequence_parallel: DeepSpeed splits the tensor sent between "
                                  "stages over the TP group assuming every TP rank holds all of it, but under "
                                  "sequence parallelism each holds its own part of the sequence")


def _check_experts_on_every_stage(has_experts: bool, moe_config: MoEConfig, groups: ProcessGroups) -> None:
    """ZeRO-1 reduces its norm per param group over TP x PP: expert parameters on all stages or none."""
    flags = torch.tensor([float(has_experts), -float(has_experts)], device=get_accelerator().current_device_name())
    dist.all_reduce(flags, op=dist.ReduceOp.MAX)
    if flags[0].item() != -flags[1].item():
        key, value = (("layers", moe_config.layers) if moe_config.layers is not None
                      else ("layer_interval", moe_config.layer_interval))
        raise ConfigError(f"{ROOT_KEY}.{key}", value, f"leaves pipeline stage {groups.rank_in('pp')} "
                          f"{'with' if has_experts else 'without'} MoE layers while another stage is "
                          f"{'without' if has_experts else 'with'}; under ZeRO stage 1 with pipeline parallelism "
                          "put MoE layers on every stage or on none (ZeRO reduces its gradient norm per param "
                          "group over all stages)")


def _enabled(ds_dict: dict, *keys: str) -> bool:
    return any(isinstance(ds_dict.get(k), dict) and ds_dict[k].get("enabled", False) for k in keys)


def _check_precision_supported(ds_dict: dict, accelerator: Any) -> None:
    """fp16 or bf16 that DeepSpeed's accelerator says this device lacks, refused before any group exists."""
    for key, aliases, asked in (("fp16", ("fp16",), accelerator.is_fp16_supported),
                                ("bf16", ("bf16", "bfloat16"), accelerator.is_bf16_supported)):
        if not _enabled(ds_dict, *aliases):
            continue
        answer = asked()
        if not answer:
            name = accelerator.device_name()
            where = " (on a CPU: oneDNN has no fp16 kernels here)" if name == "cpu" and key == "fp16" else ""
            raise ConfigError(f"{next(a for a in aliases if _enabled(ds_dict, a))}.enabled", True,
                              f"DeepSpeed's {name} accelerator answers is_{key}_supported() = {answer!r} on this "
                              f"machine{where}; use " + ("bf16 or fp32" if key == "fp16" else "fp16 or fp32"))


def _spare_memory(engine: Any, model: nn.Module, keep_grad_storage: bool) -> None:
    """Drop the copies a fp32 ZeRO-1/2 run does not need: fp32 masters equal to the weights, kept expert gradients."""
    from moe_plugin.layers.experts import GroupedExperts

    if is_zero_optimizer(engine.optimizer):
        share_fp32_masters(engine.optimizer)
    for module in model.modules():
        if isinstance(module, GroupedExperts):
            module.keep_grad_storage(keep_grad_storage)


def _check_engine(engine: Any, zero_stage: int, plugin_clips: bool) -> None:
    """DeepSpeed must have read the config as ``initialize`` did."""
    fp32 = not (engine.fp16_enabled() or engine.bfloat16_enabled())
    if engine.zero_optimization_stage() != zero_stage or plugin_clips != (zero_stage == 0 and fp32):
        raise alike_on_every_rank(RuntimeError(
            f"DeepSpeed runs ZeRO stage {engine.zero_optimization_stage()} (fp32: {fp32}) but the plugin read stage "
            f"{zero_stage} from the config: unsupported DeepSpeed version?"))
