"""Megatron-Core GPT specs whose MLP is the plugin's ``MoELayer`` on the layers the config names.

    model = GPTModel(config, gpt_moe_spec(moe_config, config, groups), vocab_size=..., max_sequence_length=...)

A layer decides at build time, from its global index, whether its MLP is MoE: one layer spec serves
every pipeline stage and Megatron-LM's ``--spec``. Design: docs/design/integration_megatron.md.
"""
from __future__ import annotations

import dataclasses
import math
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Optional, Union

import torch
import torch.distributed as dist

from megatron.core import parallel_state
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.process_groups_config import ProcessGroupCollection
from megatron.core.transformer.dot_product_attention import DotProductAttention
from megatron.core.transformer.identity_op import IdentityOp
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.torch_norm import WrappedTorchNorm
from megatron.core.transformer.transformer_block import (
    LayerNormImpl,
    TransformerBlock,
    TransformerBlockSubmodules,
    get_num_layers_to_build,
)
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.core.transformer.transformer_layer import TransformerLayer, TransformerLayerSubmodules

from moe_plugin.compat.megatron_layer import BuildSpec, check_layer_number, global_layer_index
from moe_plugin.configs import ConfigError, MoEConfig
from moe_plugin.groups.process_groups import ProcessGroups
from moe_plugin.integration.cpu_modules import ProjectionQKNorm, SDPAttention, TorchNorm, TorchQKNorm
from moe_plugin.integration.seeding import layer_seed, resolve_seed, seed_megatron_rng, seeded
from moe_plugin.layers.moe_layer import MoELayer

Spec = Union[ModuleSpec, TransformerBlockSubmodules]
DS_CONFIG_ENV = "MOE_PLUGIN_DS_CONFIG"
CPU_SWAPS = {DotProductAttention: SDPAttention, WrappedTorchNorm: TorchNorm}
# on every device: Megatron's torch norm (its choice without apex) asserts not sequence_parallel
NORM_SWAPS = {WrappedTorchNorm: TorchNorm}


# --- the MoE MLP as Megatron builds it -------------------------------------------------------
class MegatronMoEMLP(MoELayer):
    """``MoELayer`` as a ``TransformerLayer``'s MLP: sizes and init from the config, seeded by global layer index."""

    def __init__(self, config: TransformerConfig, submodules: Any = None, *, moe_config: MoEConfig,
                 layer_index: int, groups: Optional[ProcessGroups] = None, seed: int = 0,
                 placement: Optional[Sequence[int]] = None, **_megatron_kwargs):
        super().__init__(moe_config, config.hidden_size, config.ffn_hidden_size, groups,
                         seed=seed * 1_000_003 + layer_index, init_std=config.init_method_std,
                         output_init_std=config.init_method_std / math.sqrt(2.0 * config.num_layers),
                         placement=None if placement is None else torch.as_tensor(placement))
        self.layer_index = layer_index
        self.to("cpu" if config.use_cpu_initialization else _accelerator_device())
        for param in self.parameters():  # buffers (the router's expert bias) stay fp32
            param.data = param.data.to(config.params_dtype)

    def forward(self, hidden_states: torch.Tensor, padding_mask: Optional[torch.Tensor] = None):
        """[S, B, H] (S/TP under sequence parallelism) -> (output, None). ``padding_mask`` [B, S]: bool, True on
        padding, or integer document ids, -1 on padding (packed conversations)."""
        if padding_mask is None:
            return super().forward(hidden_states)
        S, B = hidden_states.shape[:2]
        p = self.parallel
        if p.sequence_parallel and p.tp_size > 1 and tuple(padding_mask.shape) == (B, S * p.tp_size):
            padding_mask = padding_mask.chunk(p.tp_size, dim=1)[dist.get_rank(group=p.tp)]
        if tuple(padding_mask.shape) != (B, S) or padding_mask.is_floating_point():
            raise ValueError(f"MegatronMoEMLP padding_mask must be [batch, sequence] = {[B, S]} (bool: True on "
                             f"padding; or integer document ids, -1 on padding); got {padding_mask.dtype} "
                             f"{list(padding_mask.shape)}")
        if padding_mask.dtype == torch.bool:
            column_B1 = torch.arange(B, device=padding_mask.device)[:, None]
            padding_mask = torch.where(padding_mask, -1, column_B1)
        return super().forward(hidden_states, document_T=padding_mask.t().reshape(-1))


@dataclass(frozen=True)
class MoEPlan:
    """What ``MoEAwareTransformerLayer`` needs to build MoE MLPs (the spec's ``moe`` param; see ``moe_layer_spec``)."""

    moe_config: MoEConfig
    groups: Optional[ProcessGroups] = None
    seed: int = 0
    norm: Optional[type] = None
    placements: Optional[Mapping[int, Sequence[int]]] = None


class MoEAwareTransformerLayer(TransformerLayer):
    """A ``TransformerLayer`` whose MLP is ``MegatronMoEMLP`` where ``moe.moe_config`` names its global index."""

    def __init__(self, config: TransformerConfig, submodules: TransformerLayerSubmodules, layer_number: int = 1,
                 hidden_dropout: Optional[float] = None, pg_collection: Optional[ProcessGroupCollection] = None,
                 vp_stage: Optional[int] = None, *, moe: MoEPlan, **kwargs):
        index, pg_collection = global_layer_index(config, layer_number, vp_stage, pg_collection)
        check_against_model(moe.moe_config, config)
        is_moe = moe.moe_config.is_moe_layer(index)
        if is_moe:
            submodules = _with_moe_mlp(submodules, moe, index)
        with seeded(layer_seed(moe.seed, index)):   # the same weights on whichever pipeline stage builds it
            super().__init__(config, submodules, layer_number, hidden_dropout, pg_collection, vp_stage, **kwargs)
        check_layer_number(self, index)
        self.moe_layer_index = index if is_moe else None


def transformer_config(source: Any, **fields: Any) -> TransformerConfig:
    """Megatron's ``TransformerConfig`` of ``fields`` and the ``"moe"`` block's parallel sizes (a ``MoEConfig``,
    ``initialize``'s result or a DeepSpeed config); a size also in ``fields`` must agree. MLA: its MLA config."""
    moe_config = _moe_config_of(source)
    parallel = moe_config.megatron_parallel_fields()
    keys = {"tensor_model_parallel_size": "tensor", "pipeline_model_parallel_size": "pipeline",
            "sequence_parallel": "sequence_parallel"}
    for name, value in parallel.items():
        if name in fields and fields[name] != value:
            raise ConfigError(f"moe.parallel.{keys[name]}", value, f"transformer_config was also given "
                              f"{name}={fields[name]!r}; leave it out (the \"moe\" block sets it) or make them agree")
    if fields.get("multi_latent_attention"):   # DeepSeek-V2/V3's attention: Megatron's MLA config
        from megatron.core.transformer.transformer_config import MLATransformerConfig

        return MLATransformerConfig(**{"rope_type": "rope", **fields, **parallel})
    return TransformerConfig(**{**fields, **parallel})


def mla_fields(*, q_lora_rank: Optional[int], kv_lora_rank: int, qk_head_dim: int, qk_pos_emb_head_dim: int,
               v_head_dim: int, rotary_base: float, rope_scaling: Optional[dict] = None) -> dict:
    """``transformer_config`` fields of multi-latent attention; with ``rope_scaling`` (YaRN) also YaRN's."""
    fields = dict(multi_latent_attention=True, q_lora_rank=q_lora_rank, kv_lora_rank=kv_lora_rank,
                  qk_head_dim=qk_head_dim, qk_pos_emb_head_dim=qk_pos_emb_head_dim, v_head_dim=v_head_dim,
                  rotary_base=rotary_base, rope_type="rope")
    if rope_scaling:
        from moe_plugin.integration.rope import RopeScaling

        yarn = RopeScaling.from_dict(rope_scaling)
        fields.update(rope_type="yarn", rotary_scaling_factor=yarn.factor, beta_fast=yarn.beta_fast,
                      beta_slow=yarn.beta_slow, mscale=yarn.mscale or 1.0, mscale_all_dim=yarn.mscale_all_dim or 0.0,
                      original_max_position_embeddings=yarn.original_max_position_embeddings)
    return fields


def _moe_config_of(source: Any) -> MoEConfig:
    if isinstance(source, MoEConfig):
        return source
    if isinstance(getattr(source, "moe_config", None), MoEConfig):
        return source.moe_config
    if isinstance(source, (dict, str, os.PathLike)):
        return MoEConfig.from_ds_config(source)
    raise TypeError(f"transformer_config takes a MoEConfig, moe_plugin.initialize's result or a DeepSpeed config, "
                    f"got {type(source).__name__}")


def check_against_model(moe_config: MoEConfig, config: TransformerConfig) -> None:
    """``ConfigError`` unless the ``"moe"`` block fits the model (layers, TP/PP/SP, query groups, recomputation)."""
    outside = [i for i in (moe_config.layers or []) if i >= config.num_layers]
    if outside:
        raise ConfigError("moe.layers", moe_config.layers, f"the model has {config.num_layers} layers (0-based "
                          f"indices 0..{config.num_layers - 1}); {outside[0]} is not one of them")
    p = moe_config.parallel
    for key, mine, theirs, megatron in (
            ("tensor", p.tensor, config.tensor_model_parallel_size, "tensor_model_parallel_size"),
            ("pipeline", p.pipeline, config.pipeline_model_parallel_size, "pipeline_model_parallel_size"),
            ("sequence_parallel", p.sequence_parallel, config.sequence_parallel, "sequence_parallel")):
        if mine != theirs:
            raise ConfigError(f"moe.parallel.{key}", mine, f"the Megatron TransformerConfig has {megatron}="
                              f"{theirs}; set both alike (the MoE layer splits tokens by it)")
    groups = config.num_query_groups or config.num_attention_heads
    if groups % p.tensor:
        raise ConfigError("moe.parallel.tensor", p.tensor, f"must divide the TransformerConfig's num_query_groups "
                          f"({groups}): each tensor-parallel rank holds whole query groups (grouped-query attention)")
    recomputed = config.recompute_granularity == "full" or (
        config.recompute_granularity == "selective" and "mlp" in (config.recompute_modules or []))
    if recomputed and moe_config.jitter_eps > 0:
        raise ConfigError("moe.jitter_eps", moe_config.jitter_eps, "must be 0 with Megatron's activation "
                          "recomputation of the MLP: the recomputed router would draw other random numbers")
    if recomputed and moe_config.router == "gshard" and moe_config.second_expert_policy == "random":
        raise ConfigError("moe.second_expert_policy", "random", "must be 'all' with Megatron's activation "
                          "recomputation of the MLP: the recomputed router would draw other random numbers")
    if recomputed and moe_config.aux_loss_scope == "global":
        raise ConfigError("moe.aux_loss_scope", "global", "cannot be used with Megatron's activation recomputation "
                          "of the MLP: the recomputed router would count its load twice; use 'micro_batch' or "
                          "'sequence', or recompute other modules")


def _with_moe_mlp(submodules: TransformerLayerSubmodules, moe: MoEPlan, index: int) -> TransformerLayerSubmodules:
    params = dict(moe_config=moe.moe_config, groups=moe.groups, seed=moe.seed, layer_index=index,
                  placement=(moe.placements or {}).get(index))
    changes: dict[str, Any] = {"mlp": BuildSpec(MegatronMoEMLP, params)}
    if _fuses_pre_mlp_norm(submodules):
        changes["pre_mlp_layernorm"] = moe.norm or _default_fused_norm()
    return dataclasses.replace(submodules, **changes)


def _fuses_pre_mlp_norm(submodules: TransformerLayerSubmodules) -> bool:
    """Whether the dense MLP's first linear applies the pre-MLP norm (TE): then MoE layers need their own."""
    fc1 = getattr(getattr(submodules.mlp, "submodules", None), "linear_fc1", None)
    return _module_of(submodules.pre_mlp_layernorm) is IdentityOp and "LayerNorm" in getattr(fc1, "__name__", "")


def _default_fused_norm() -> type:
    try:
        from megatron.core.extensions.transformer_engine import HAVE_TE, TENorm
    except ImportError:
        return TorchNorm
    return TENorm if HAVE_TE else TorchNorm


def _module_of(spec: Any) -> Any:
    return spec.module if isinstance(spec, ModuleSpec) else spec


def _accelerator_device() -> str:
    from deepspeed.accelerator import get_accelerator

    return get_accelerator().current_device_name()


# --- spec transformations ----------------------------------------------------------------------
def moe_layer_spec(spec: Spec, moe_config: MoEConfig, groups: Optional[ProcessGroups] = None, *,
                   seed: Optional[int] = None, norm: Optional[type] = None,
                   placements: Optional[Mapping[int, Sequence[int]]] = None) -> Spec:
    """``spec`` (a layer spec, block spec or submodules) with MoE MLPs where ``moe_config`` says; same kind back. Its
    MLP must be dense. ``seed``: default ``torch.initial_seed()``. ``norm``: the MoE layers' pre-MLP norm where the
    base fuses it into its MLP (default TENorm, else ``TorchNorm``). ``placements``: {global layer index: slots}."""
    return _with_plan(spec, MoEPlan(moe_config, groups, resolve_seed(seed), norm, placements))


def _with_plan(spec: Spec, plan: MoEPlan) -> Spec:
    if isinstance(spec, TransformerBlockSubmodules):
        return dataclasses.replace(spec, layer_specs=[_with_plan(s, plan) for s in spec.layer_specs])
    module = _module_of(spec)
    if isinstance(spec, ModuleSpec) and isinstance(module, type) and issubclass(module, TransformerBlock):
        return dataclasses.replace(spec, submodules=_with_plan(spec.submodules, plan))
    if not (isinstance(spec, ModuleSpec) and module in (TransformerLayer, MoEAwareTransformerLayer)):
        raise TypeError(f"moe_layer_spec expects a ModuleSpec of TransformerLayer or a TransformerBlockSubmodules, "
                        f"got {module.__name__ if isinstance(module, type) else type(spec).__name__}")
    mlp = _module_of(spec.submodules.mlp)
    if getattr(mlp, "__module__", "").startswith("megatron.core.transformer.moe"):
        raise ValueError(f"the base spec's MLP is Megatron's {mlp.__name__}; build the base spec dense "
                         "(num_experts=None): the plugin's MoE layer replaces the MLP on the MoE layers")
    return ModuleSpec(module=MoEAwareTransformerLayer, params={**spec.params, "moe": plan},
                      submodules=spec.submodules, metainfo=dict(spec.metainfo))


def cpu_friendly_spec(spec: Spec) -> Spec:
    """``spec`` with the pieces that fail on CPU swapped: ``DotProductAttention`` -> ``SDPAttention``,
    ``WrappedTorchNorm`` -> ``TorchNorm``. Pass a block spec (``as_block_spec``) to swap its final norm too."""
    return _swap(spec, CPU_SWAPS)


def _swap(obj: Any, swaps: dict) -> Any:
    if isinstance(obj, type):
        return swaps.get(obj, obj)
    if isinstance(obj, ModuleSpec):
        return dataclasses.replace(obj, module=_swap(obj.module, swaps), submodules=_swap(obj.submodules, swaps))
    if isinstance(obj, list):
        return [_swap(item, swaps) for item in obj]
    if dataclasses.is_dataclass(obj) and not isinstance(obj, (type, MoEPlan)):
        return dataclasses.replace(obj, **{f.name: _swap(getattr(obj, f.name), swaps)
                                          for f in dataclasses.fields(obj) if f.init})
    return obj


def as_block_spec(layer_spec: ModuleSpec, config: TransformerConfig, *, vp_stage: Optional[int] = None,
                  pp_rank: Optional[int] = None, layer_norm: Any = None) -> TransformerBlockSubmodules:
    """The block spec Megatron would make from ``layer_spec`` for this pipeline stage, so that it can be transformed."""
    num = get_num_layers_to_build(config, vp_stage=vp_stage, pp_rank=pp_rank)
    return TransformerBlockSubmodules(layer_specs=[layer_spec] * num,
                                      layer_norm=LayerNormImpl if layer_norm is None else layer_norm)


def on_cpu() -> bool:
    """Whether DeepSpeed's accelerator is the CPU."""
    from deepspeed.accelerator import get_accelerator

    return get_accelerator().device_name() == "cpu"


def gpt_moe_spec(moe_config: MoEConfig, config: TransformerConfig, groups: Optional[ProcessGroups] = None, *,
                 seed: Optional[int] = None, cpu: Optional[bool] = None, vp_stage: Optional[int] = None,
                 pp_rank: Optional[int] = None, placements: Optional[Mapping[int, Sequence[int]]] = None,
                 qk_layernorm_scope: str = "head") -> TransformerBlockSubmodules:
    """This pipeline stage's block spec: Megatron's dense local GPT layer spec with MoE MLPs where ``moe_config`` says.
    ``cpu``: CPU-friendly pieces (default: on a CPU accelerator). ``seed``: default ``torch.initial_seed()``.
    ``placements``: {global layer index: slots}. ``qk_layernorm_scope``: ``"head"`` or ``"projection"`` (OLMoE's)."""
    check_against_model(moe_config, config)
    spec = moe_layer_spec(_local_block_spec(config, vp_stage, pp_rank, qk_layernorm_scope), moe_config, groups,
                          seed=seed, placements=placements)
    return cpu_friendly_spec(spec) if (on_cpu() if cpu is None else cpu) else _swap(spec, NORM_SWAPS)


def gpt_dense_spec(config: TransformerConfig, *, cpu: Optional[bool] = None, vp_stage: Optional[int] = None,
                   pp_rank: Optional[int] = None, qk_layernorm_scope: str = "head") -> TransformerBlockSubmodules:
    """``gpt_moe_spec`` with Megatron's dense MLP on every layer: the dense baseline (the example's ``--dense``)."""
    spec = _local_block_spec(config, vp_stage, pp_rank, qk_layernorm_scope)
    return cpu_friendly_spec(spec) if (on_cpu() if cpu is None else cpu) else _swap(spec, NORM_SWAPS)


QK_LAYERNORM_SCOPES = ("head", "projection")


def _local_block_spec(config: TransformerConfig, vp_stage: Optional[int], pp_rank: Optional[int],
                      qk_layernorm_scope: str = "head"):
    if qk_layernorm_scope not in QK_LAYERNORM_SCOPES:
        raise ConfigError("qk_layernorm_scope", qk_layernorm_scope, f"expected one of {list(QK_LAYERNORM_SCOPES)}")
    if getattr(config, "multi_latent_attention", False):
        if qk_layernorm_scope != "head":
            raise ConfigError("qk_layernorm_scope", qk_layernorm_scope, "multi-latent attention normalises its "
                              "compressed query and key/value (--qk-layernorm); the scope is 'head'")
        return as_block_spec(mla_layer_spec(config.normalization, config.qk_layernorm), config, vp_stage=vp_stage,
                             pp_rank=pp_rank)
    base = get_gpt_layer_local_spec(normalization=config.normalization, qk_layernorm=config.qk_layernorm)
    if config.qk_layernorm:   # summed over TP, which the plugin's training loop needs (cpu_modules)
        attention = base.submodules.self_attention
        if qk_layernorm_scope == "projection":
            q, k = (ModuleSpec(module=ProjectionQKNorm, params={"which": w}) for w in ("query", "key"))
        else:
            q = k = TorchQKNorm
        qk = dataclasses.replace(attention.submodules, q_layernorm=q, k_layernorm=k)
        base = dataclasses.replace(base, submodules=dataclasses.replace(
            base.submodules, self_attention=dataclasses.replace(attention, submodules=qk)))
    return as_block_spec(base, config, vp_stage=vp_stage, pp_rank=pp_rank)


def mla_layer_spec(normalization: Optional[str], qk_layernorm: bool) -> ModuleSpec:
    """Megatron's local MLA layer spec (DeepSeek-V2/V3) with pieces that run on any device."""
    from moe_plugin.compat.megatron_mla import MLAttention

    base = get_gpt_layer_local_spec(normalization=normalization, qk_layernorm=qk_layernorm, multi_latent_attention=True)
    attention = base.submodules.self_attention
    norm = TorchNorm if qk_layernorm else IdentityOp
    parts = dataclasses.replace(attention.submodules, core_attention=SDPAttention, q_layernorm=norm, kv_layernorm=norm)
    return dataclasses.replace(base, submodules=dataclasses.replace(
        base.submodules, self_attention=dataclasses.replace(attention, module=MLAttention, submodules=parts)))


# --- Megatron-LM --spec -------------------------------------------------------------------------
def megatron_lm_spec() -> ModuleSpec:
    """Megatron-LM's ``--spec`` layer spec, from the JSON in ``MOE_PLUGIN_DS_CONFIG`` (else ``args.deepspeed_config``).
    Builds the groups when none are registered (collective) and checks them against Megatron's; docs/megatron_lm.md."""
    args = _megatron_lm_args()
    path = os.environ.get(DS_CONFIG_ENV) or getattr(args, "deepspeed_config", None)
    if not path:
        raise ConfigError(DS_CONFIG_ENV, None, "set it to the DeepSpeed JSON with the \"moe\" block (or pass "
                          "--deepspeed_config to Megatron-DeepSpeed)", shown="unset")
    moe_config = MoEConfig.from_ds_config(path)
    groups = _groups_for_megatron_lm(moe_config)
    mla = bool(getattr(args, "multi_latent_attention", False))
    if args is not None and getattr(args, "transformer_impl", "local") == "transformer_engine":
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_with_transformer_engine_spec

        base = get_gpt_layer_with_transformer_engine_spec(qk_layernorm=args.qk_layernorm, multi_latent_attention=mla)
    elif mla:   # --multi-latent-attention: Megatron's MLA with the pieces that run on any device
        base = mla_layer_spec(getattr(args, "normalization", None), bool(getattr(args, "qk_layernorm", False)))
    else:
        base = get_gpt_layer_local_spec(normalization=getattr(args, "normalization", None),
                                        qk_layernorm=getattr(args, "qk_layernorm", False))
        if on_cpu():
            base = cpu_friendly_spec(base)
    if on_cpu():   # Megatron-LM seeds its RNG tracker on GPUs only
        seed_megatron_rng(getattr(args, "seed", None), groups)
    return moe_layer_spec(base, moe_config, groups)


def _megatron_lm_args() -> Optional[Any]:
    """Megatron-LM's parsed arguments, or None without Megatron-LM or before it parsed them."""
    try:
        from megatron.training import get_args
    except ImportError:
        return None
    try:
        return get_args()
    except AssertionError:  # "args is not initialized"
        return None


def registered_groups() -> Optional[ProcessGroups]:
    """The groups ``moe_plugin.groups.register`` put into DeepSpeed's registry, if any."""
    from moe_plugin.compat.deepspeed_groups import registered_mpu
    from moe_plugin.groups.adapters import GroupsMPU

    mpu = registered_mpu()
    return mpu.groups if isinstance(mpu, GroupsMPU) else None


def _groups_for_megatron_lm(moe_config: MoEConfig) -> ProcessGroups:
    from moe_plugin.groups.builder import build_process_groups
    from moe_plugin.groups.layout import RankLayout

    groups = registered_groups()
    if groups is None:
        groups = build_process_groups(RankLayout(moe_config.check_world_size(dist.get_world_size())))
    if parallel_state.model_parallel_is_initialized():
        _check_same_groups(groups, moe_config)
    return groups


# kind -> (the "moe" key that sizes it, Megatron-LM's argument, Megatron's getter)
_MEGATRON_GROUPS = {
    "tp": ("moe.parallel.tensor", "--tensor-model-parallel-size", "get_tensor_model_parallel_group"),
    "pp": ("moe.parallel.pipeline", "--pipeline-model-parallel-size", "get_pipeline_model_parallel_group"),
    "dp": ("moe.parallel", "the world size", "get_data_parallel_group"),
    "ep": ("moe.parallel.expert", "--expert-model-parallel-size", "get_expert_model_parallel_group"),
    "edp": ("moe.parallel.expert", "--expert-model-parallel-size", "get_expert_data_parallel_group"),
}


def _check_same_groups(groups: ProcessGroups, moe_config: MoEConfig) -> None:
    """Our groups must be Megatron's: attention runs on Megatron's, the MoE layers on ours (EP, EDP: with EP only)."""
    kinds = ["tp", "pp", "dp"] + (["ep", "edp"] if groups.size("ep") > 1 else [])
    for kind in kinds:
        key, flag, getter = _MEGATRON_GROUPS[kind]
        theirs = dist.get_process_group_ranks(getattr(parallel_state, getter)())
        if theirs != groups.ranks(kind):
            raise ConfigError(key, moe_config.resolved_dict()["parallel"], f"gives rank {groups.rank} the {kind} "
                              f"group {groups.ranks(kind)} but Megatron's is {theirs}; make moe.parallel (sizes "
                              f"and order) match Megatron-LM's {flag}", shown=groups.layout.table().splitlines()[0])
