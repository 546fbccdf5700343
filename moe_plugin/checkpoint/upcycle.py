"""Upcycling: an MoE checkpoint made from a dense one, whose model computes the dense model's function.

    from moe_plugin.checkpoint import upcycle_checkpoint
    upcycle_checkpoint("ckpt_dense", "ds_moe.json", "ckpt_moe", granularity=2)
    # or: moe-plugin upcycle ckpt_dense --config ds_moe.json --out ckpt_moe --granularity 2

Each MoE layer's experts start as copies of its dense MLP (cut into ``granularity`` pieces), its router
fresh with the pieces of one copy sharing a row; the rest is copied. The result is written as if saved
on one rank, so ``load_checkpoint`` cuts it for any layout. Exact at step 0 (to fp32 rounding) when no
route is dropped; the target config is checked before anything is written. The optimizer starts fresh.
Derivation: docs/design/checkpoint_upcycle.md; usage: docs/checkpoints.md.
"""
from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from typing import Any, Callable, Optional, Union

import torch
import torch.nn.functional as F

from moe_plugin.checkpoint.confine import inside
from moe_plugin.checkpoint.errors import CheckpointError
from moe_plugin.checkpoint.export import ONE_RANK, CheckpointSource
from moe_plugin.checkpoint.files import refuse_existing
from moe_plugin.checkpoint.metadata import META_FILE, named_function, saved_model_files
from moe_plugin.checkpoint.one_rank import OneRankPlan, write_one_rank
from moe_plugin.checkpoint.readers import deepspeed_header
from moe_plugin.checkpoint.trust import trust_argument
from moe_plugin.configs import ConfigError, MoEConfig
from moe_plugin.layers.experts import ffn_shard
from moe_plugin.layers.init import seeded_generator
from moe_plugin.layers.router import ROUTER_STREAM

logger = logging.getLogger(__name__)

# (Megatron's activation_func, gated_linear_unit) -> the experts' activation of the same MLP
ACTIVATIONS = {(F.gelu, False): "gelu", (F.relu, False): "relu", (F.silu, True): "swiglu"}
LAYER_SEED_MIX = 1_000_003   # a MoE MLP's seed: seed * LAYER_SEED_MIX + layer index (integration.megatron)


@dataclass(frozen=True)
class UpcycleResult:
    path: str                    # the tag directory written
    tag: str
    source: str                  # the dense tag directory read
    moe_layers: tuple[int, ...]
    num_experts: int
    granularity: int
    global_steps: int            # where training resumes
    dropped_biases: tuple[str, ...]


@dataclass(frozen=True)
class DenseModel:
    """What the checks need from the dense checkpoint's metadata."""

    num_layers: int
    hidden_size: int
    ffn_hidden_size: int
    activation: Optional[str]    # the experts' name for the dense MLP's activation; None: no equivalent
    init_std: float

    @classmethod
    def from_meta(cls, meta: dict) -> "DenseModel":
        tc = meta["model"]["transformer_config"]
        act = ACTIVATIONS.get((_function(tc.get("activation_func")), bool(tc.get("gated_linear_unit", False))))
        return cls(int(tc["num_layers"]), int(tc["hidden_size"]), int(tc.get("ffn_hidden_size") or 4 * tc["hidden_size"]),
                   act, float(tc.get("init_method_std", 0.02)))


def _function(path: Optional[str]) -> Any:
    """The function a ``transformer_config_dict`` names ``module:qualname`` (None: Megatron's default, gelu)."""
    if path is None:
        return F.gelu
    return named_function(path, "the dense checkpoint's moe_plugin.json")


@trust_argument
def upcycle_checkpoint(dense_dir: Union[os.PathLike, str], ds_config: Union[dict, os.PathLike, str],
                       out_dir: Union[os.PathLike, str], *, tag: Optional[str] = None, granularity: int = 1,
                       keep_iteration: bool = True, drop_mlp_bias: bool = False, allow_inexact: bool = False,
                       seed: int = 1234, progress: Optional[Callable[[str], None]] = None) -> UpcycleResult:
    """Write the MoE checkpoint of ``ds_config``'s ``"moe"`` block made from ``dense_dir/tag`` into
    ``out_dir``; one process. Raises ``ConfigError`` / ``CheckpointError`` before anything is written."""
    say = progress or logger.info
    if isinstance(granularity, bool) or not isinstance(granularity, int) or granularity < 1:
        raise ConfigError("granularity", granularity, "expected an integer >= 1")
    moe = MoEConfig.from_ds_config(ds_config)
    reader = CheckpointSource(dense_dir, tag, say)
    meta, source, specs = reader.meta, reader.path, reader.specs()
    dense = DenseModel.from_meta(meta)
    layers = _moe_layers(moe, dense)
    dropped = _check(moe, dense, granularity, layers, specs, drop_mlp_bias, allow_inexact, say)
    out_tag = meta["tag"] if keep_iteration else "step0"
    instead = "upcycle into another --out directory"
    refuse_existing(out_dir, out_tag, instead)   # before the conversion's work (write_one_rank asks again)
    plan = _moe_plan(reader, moe, dense, layers, granularity, seed, dropped)
    header = None
    if keep_iteration:   # its step counters, lr scheduler and client state (its module tensors left unread)
        header = deepspeed_header(saved_model_files(source, meta, 0)[0])
    steps = int(meta["global_steps"]) if keep_iteration else 0
    model = dict(meta["model"])
    model["transformer_config"] = {**model["transformer_config"], **ONE_RANK}
    record = {"upcycled_from": {"checkpoint": os.path.abspath(source), "tag": meta["tag"],
                                "global_steps": meta["global_steps"], "granularity": granularity, "seed": seed,
                                "kept_iteration": keep_iteration, "dropped_biases": list(dropped)}}
    if "hf" in meta:   # not its "architecture": that is the dense model's (its flags have --dense)
        record["hf"] = meta["hf"]
    # an imported model's tokenizer files, for export-hf
    tokenizer = {name: inside(source, name, os.path.join(source, META_FILE) + ": hf.tokenizer_files")
                 for name in meta.get("hf", {}).get("tokenizer_files", [])}
    final = write_one_rank(out_dir, out_tag, plan, moe, model, record, tokenizer, say,
                           saved=header, steps=steps, instead=instead)
    say(f"wrote {final}: {len(layers)} MoE layers x {moe.num_experts} experts (granularity {granularity}), "
        f"step {steps}, optimizer fresh")
    return UpcycleResult(final, out_tag, source, tuple(layers), moe.num_experts, granularity, steps, tuple(dropped))


# -- checks --------------------------------------------------------------------------------------
def _moe_layers(moe: MoEConfig, dense: DenseModel) -> list[int]:
    moe.check_num_layers(dense.num_layers, flag="the dense checkpoint's num_layers")
    layers = [i for i in range(dense.num_layers) if moe.is_moe_layer(i)]
    if not layers:
        raise ConfigError("moe.layer_interval", moe.layer_interval, f"names no layer of the dense model's "
                          f"{dense.num_layers}; upcycling needs at least one MoE layer")
    return layers


def _mlp(index: int, name: str) -> str:
    return f"decoder.layers.{index}.mlp.{name}"


def _check(moe: MoEConfig, dense: DenseModel, g: int, layers: list[int], state: Any, drop_mlp_bias: bool,
           allow_inexact: bool, say: Callable[[str], None]) -> list[str]:
    """Raise a ``ConfigError`` for a target that does not fit the dense model; return the biases to drop."""
    for i in layers:
        if _mlp(i, "experts.weight1") in state:
            raise CheckpointError(f"layer {i} of the checkpoint is already an MoE layer ({_mlp(i, 'experts.weight1')}); "
                                  "upcycling takes a dense checkpoint (the example's --dense)")
        if _mlp(i, "linear_fc1.weight") not in state:
            raise CheckpointError(f"the checkpoint has no dense MLP weight {_mlp(i, 'linear_fc1.weight')!r}")
    if moe.shared_expert_ffn_hidden_size:
        raise ConfigError("moe.shared_expert_ffn_hidden_size", moe.shared_expert_ffn_hidden_size,
                          "must be 0 for upcycling: the layer's function is its dense MLP's, a shared expert adds to it")
    if dense.activation is None or moe.activation != dense.activation:
        raise ConfigError("moe.activation", moe.activation, f"must be the dense MLP's activation ({dense.activation or 'one the experts lack'})")
    if moe.num_experts % g:
        raise ConfigError("moe.num_experts", moe.num_experts, f"must be a multiple of the granularity {g}")
    expert_ffn, f = moe.ffn_hidden_size or dense.ffn_hidden_size, dense.ffn_hidden_size
    if f % g or expert_ffn * g != f:
        raise ConfigError("moe.ffn_hidden_size", expert_ffn, f"must be the dense FFN size / granularity = {f} / {g}"
                          + (f" = {f // g}" if not f % g else " (which does not divide)"))
    inexact = _inexact(moe, g)
    if inexact and not allow_inexact:
        raise inexact[0]
    for err in inexact:
        say(f"warning: {err} (allow_inexact: the upcycled layers differ from the dense MLPs at step 0)")
    biases = [k for i in layers for k in (_mlp(i, "linear_fc1.bias"), _mlp(i, "linear_fc2.bias")) if k in state]
    if biases and not drop_mlp_bias:
        raise CheckpointError(f"the dense MLPs have biases ({biases[0]}, ...): the plugin's experts have none, so the "
                              "upcycled layers would compute another function. Train the dense model without them "
                              "(Megatron's add_bias_linear=False, the example's --disable-bias-linear), or drop them "
                              "(drop_mlp_bias=True, --drop-mlp-bias)")
    return biases


def _inexact(moe: MoEConfig, g: int) -> list[ConfigError]:
    """Why the gates of ``moe`` would not reproduce the dense MLP (first reason first)."""
    out = []
    if moe.gate_scale != g:
        out.append(ConfigError("moe.gate_scale", moe.gate_scale, f"must be the granularity {g}: each copy's {g} "
                               "pieces share its gate, normalised over the pieces"))
    if moe.router == "switch" or (moe.router == "topk" and not moe.normalize_gates):
        key, value = ("moe.router", "switch") if moe.router == "switch" else ("moe.normalize_gates", False)
        out.append(ConfigError(key, value, "the gates must be normalised to sum 1 for the copies to add up to the "
                               "dense MLP (router 'topk' with normalize_gates true, or 'gshard')"))
    if moe.k % g:
        out.append(ConfigError("moe.top_k", moe.k, f"must be a multiple of the granularity {g}, so that whole "
                               "copies are chosen"))
    if moe.router == "gshard" and moe.second_expert_policy == "random" and g != 2:
        out.append(ConfigError("moe.second_expert_policy", "random", f"must be 'all' at granularity {g}: random "
                               "routing drops second choices whose gate is below 1/2"))
    return out


# -- the MoE model's state -----------------------------------------------------------------------
def _moe_plan(source: CheckpointSource, moe: MoEConfig, dense: DenseModel, layers: list[int], g: int, seed: int,
              dropped: list[str]) -> OneRankPlan:
    """The MoE model's tensors: the dense model's, each MoE layer with a fresh router and experts."""
    mlp_keys = {_mlp(i, n) for i in layers for n in ("linear_fc1.weight", "linear_fc1.bias", "linear_fc1._extra_state",
                                                    "linear_fc2.weight", "linear_fc2.bias", "linear_fc2._extra_state")}
    specs = source.specs()
    module = {k: spec for k, spec in specs.items() if k not in mlp_keys}
    plain = {k: v for k, v in source.extras.items() if k not in mlp_keys}
    made: dict[str, Callable[[], torch.Tensor]] = {}
    experts: dict = {}
    E, copies = moe.num_experts, moe.num_experts // g
    for i in layers:
        dtype, (f1, h) = specs[_mlp(i, "linear_fc1.weight")]
        f = specs[_mlp(i, "linear_fc2.weight")][1][1]
        experts[_mlp(i, "experts.weight1")] = (dtype, [h, f1 // g])
        experts[_mlp(i, "experts.weight2")] = (dtype, [f // g, h])

        def router(i: int = i) -> torch.Tensor:
            gen = seeded_generator(seed * LAYER_SEED_MIX + i, ROUTER_STREAM)
            rows_CH = torch.randn(copies, dense.hidden_size, generator=gen) * dense.init_std
            return rows_CH.repeat_interleave(g, dim=0)   # virtual groups

        made[_mlp(i, "router.weight")] = router
        made[_mlp(i, "router.expert_bias")] = lambda: torch.zeros(E)
        made[_mlp(i, "experts.placement")] = lambda: torch.arange(E)
        module[_mlp(i, "router.weight")] = (torch.float32, [E, dense.hidden_size])
        module[_mlp(i, "router.expert_bias")] = (torch.float32, [E])
        module[_mlp(i, "experts.placement")] = (torch.long, [E])
    pieces: dict[int, list] = {}   # one layer's pieces at a time (one_rank writes a weight for every expert in turn)

    def expert(key: str, e: int) -> torch.Tensor:
        i = int(key.split(".")[2])
        if i not in pieces:
            pieces.clear()
            w1_HF1 = source.read(_mlp(i, "linear_fc1.weight")).t()
            w2_FH = source.read(_mlp(i, "linear_fc2.weight")).t()
            pieces[i] = [ffn_shard(w1_HF1, w2_FH, moe.activation, g, p) for p in range(g)]
        return pieces[i][e % g][0 if key.endswith("weight1") else 1].contiguous()

    return OneRankPlan(module, plain, experts, E, lambda key: made[key]() if key in made else source.read(key),
                       expert)
