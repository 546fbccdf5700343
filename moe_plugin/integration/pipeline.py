"""A Megatron-Core GPT with the plugin's MoE layers as a DeepSpeed ``PipelineModule``.

    engine, *_ = moe_plugin.initialize(ds_config, lambda moe_config, groups: gpt_pipeline_module(
        config, moe_config, groups, vocab_size=V, max_sequence_length=S))      # a PipelineEngine
    loss = engine.train_batch(iter(batches))   # each item: ((tokens_BS, position_ids_BS), labels_BS)

Megatron's stage split, ``GPTModel``'s state-dict names under a piece prefix, and the one-rank
``GPTModel``'s weights under the same seed. Design: docs/design/pipeline_deepspeed.md.
"""
from __future__ import annotations

import logging
import re
from typing import Any, Mapping, Optional, Sequence

import torch
import torch.distributed as dist
from deepspeed.runtime.pipe.module import LayerSpec
from megatron.core import tensor_parallel
from megatron.core.models.common.embeddings.language_model_embedding import LanguageModelEmbedding
from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding
from megatron.core.transformer.spec_utils import build_module
from megatron.core.transformer.transformer_block import get_num_layers_to_build
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.core.transformer.transformer_layer import get_transformer_layer_offset
from torch import Tensor, nn

from moe_plugin.compat.deepspeed_pipe import GivenPartsPipelineModule
from moe_plugin.configs import MoEConfig
from moe_plugin.data.packing import packed_seq_params
from moe_plugin.groups.process_groups import ProcessGroups
from moe_plugin.integration.megatron import check_against_model, gpt_moe_spec
from moe_plugin.integration.packed import weighted_sum
from moe_plugin.integration.pipe_topology import pipeline_topology
from moe_plugin.integration.seeding import resolve_seed, seeded

logger = logging.getLogger(__name__)

# PipelineModule arguments that gpt_pipeline_module sets itself.
_OWN_ARGUMENTS = ("layers", "num_stages", "topology", "loss_fn", "partition_method", "seed_layers")


# --- the pieces ------------------------------------------------------------------------------------
class EmbeddingPipe(nn.Module):
    """Megatron's ``LanguageModelEmbedding`` (learned absolute positions unless ``rope``, which the layers apply)."""

    def __init__(self, config: TransformerConfig, vocab_size: int, max_sequence_length: int, seed: int,
                 position_embedding_type: str = "learned_absolute"):
        super().__init__()
        with seeded(seed):   # GPTModel's first draws after torch.manual_seed(seed)
            self.embedding = LanguageModelEmbedding(config, vocab_size, max_sequence_length,
                                                    position_embedding_type=position_embedding_type)

    def forward(self, inputs: tuple[Tensor, ...]):
        """(tokens_BS, position_ids_BS) -> hidden_SBH (replicated over TP); packed
        (tokens_1T, position_ids_1T, document_ids_1T) -> (hidden_T1H, document_ids_1T)."""
        if not (isinstance(inputs, (tuple, list)) and len(inputs) in (2, 3)):
            raise TypeError("the first pipeline stage takes (tokens [B, S], position_ids [B, S]) or, packed, (tokens, "
                            f"position_ids, document_ids) as a micro-batch's inputs, got {type(inputs).__name__}")
        hidden_SBH = self.embedding(inputs[0], inputs[1])
        return hidden_SBH if len(inputs) == 2 else (hidden_SBH, inputs[2])


class TransformerLayerPipe(nn.Module):
    """Global layer ``layer_index`` of the spec; with ``rotary_base`` it computes RoPE's angles as ``GPTModel``."""

    def __init__(self, config: TransformerConfig, layer_spec: Any, layer_index: int, stage_offset: int,
                 rotary_base: Optional[float] = None, rotary_percent: float = 1.0):
        super().__init__()
        self.layer = build_module(layer_spec, config=config, layer_number=layer_index - stage_offset + 1)
        if self.layer.layer_number != layer_index + 1:
            raise RuntimeError(f"layer {layer_index} was built as Megatron layer number {self.layer.layer_number}: "
                               "the pipeline stage and Megatron's pipeline rank disagree")
        self.rotary_pos_emb = None if rotary_base is None else RotaryEmbedding(
            kv_channels=config.kv_channels, rotary_percent=rotary_percent, rotary_interleaved=config.rotary_interleaved,
            rotary_base=rotary_base, use_cpu_initialization=config.use_cpu_initialization)

    def forward(self, hidden):
        """hidden_SBH -> hidden_SBH; packed (hidden_T1H, document_ids_1T) -> the same pair, per conversation."""
        packed = isinstance(hidden, (tuple, list))
        hidden_SBH, documents = hidden if packed else (hidden, None)
        params = packed_seq_params(documents[0]) if packed else None
        rotary = None
        if self.rotary_pos_emb is not None:   # GPTModel's get_rotary_seq_len: the full sequence
            config = self.layer.config
            length = hidden_SBH.shape[0] * (config.tensor_model_parallel_size if config.sequence_parallel else 1)
            rotary = self.rotary_pos_emb(params.max_seqlen_q if packed else length, packed_seq=packed)
        extra = dict(packed_seq_params=params, padding_mask=documents) if packed else {}
        out_SBH, _context = self.layer(hidden_states=hidden_SBH, attention_mask=None, rotary_pos_emb=rotary, **extra)
        return (out_SBH, documents) if packed else out_SBH


class FinalNormPipe(nn.Module):
    """The block spec's final norm (what ``TransformerBlock`` builds on the last stage)."""

    def __init__(self, config: TransformerConfig, norm_spec: Any):
        super().__init__()
        with torch.random.fork_rng(devices=[]):   # a norm draws nothing; should one, the stream stays
            self.final_layernorm = build_module(norm_spec, config=config, hidden_size=config.hidden_size,
                                                eps=config.layernorm_epsilon)

    def forward(self, hidden) -> Tensor:
        """hidden_SBH, or packed (hidden_T1H, document_ids), -> the normed hidden states."""
        return self.final_layernorm(hidden[0] if isinstance(hidden, (tuple, list)) else hidden)


class OutputLayerPipe(nn.Module):
    """``GPTModel``'s column-parallel output layer (logits stay split); ``tied``: a copy of the word embedding."""

    def __init__(self, config: TransformerConfig, vocab_size: int, max_sequence_length: int, seed: int,
                 tied: bool = False, position_embedding_type: str = "learned_absolute"):
        super().__init__()
        with seeded(seed):
            embedding = LanguageModelEmbedding(config, vocab_size, max_sequence_length,
                                               position_embedding_type=position_embedding_type)
            self.output_layer = tensor_parallel.ColumnParallelLinear(
                config.hidden_size, vocab_size, config=config, init_method=config.init_method, bias=False,
                skip_bias_add=False, gather_output=False)
        if tied:
            self.output_layer.weight.data.copy_(embedding.word_embeddings.weight.data)

    def forward(self, hidden_SBH: Tensor) -> Tensor:
        logits_SBV, _bias = self.output_layer(hidden_SBH)
        return logits_SBV


def gpt_loss(logits_SBV: Tensor, labels) -> Tensor:
    """Mean token cross entropy of a micro-batch, vocab-parallel under TP; with ``labels`` = (labels_BS,
    weights_BS) (packed or masked batches) the sum of each token's loss times its weight."""
    labels_BS, weights_BS = labels if isinstance(labels, (tuple, list)) else (labels, None)
    losses_SB = tensor_parallel.vocab_parallel_cross_entropy(logits_SBV.float(), labels_BS.transpose(0, 1).contiguous())
    if weights_BS is None:
        return losses_SB.mean()
    return weighted_sum(losses_SB, weights_BS.transpose(0, 1))


# --- stages ------------------------------------------------------------------------------------------
def stage_layers(config: TransformerConfig) -> list[range]:
    """Global layer indices of each pipeline stage, as Megatron splits ``config.num_layers``."""
    pp = config.pipeline_model_parallel_size
    if config.virtual_pipeline_model_parallel_size is not None:
        raise ValueError("virtual_pipeline_model_parallel_size: DeepSpeed's PipelineEngine runs one model chunk "
                         "per stage (no interleaved schedule); leave it None")
    if config.pipeline_model_parallel_layout is not None:
        raise ValueError("pipeline_model_parallel_layout: not supported with DeepSpeed's pipeline (the embedding "
                         "and loss go to the first and last stage); use num_layers_in_first/last_pipeline_stage")
    out = []
    for stage in range(pp):
        first = get_transformer_layer_offset(config, None, pp_rank=stage) if pp > 1 else 0
        out.append(range(first, first + get_num_layers_to_build(config, vp_stage=None, pp_rank=stage)))
    if [i for r in out for i in r] != list(range(config.num_layers)):
        raise RuntimeError(f"Megatron splits {config.num_layers} layers into {[(r.start, r.stop) for r in out]}: "
                           "not consecutive; unsupported megatron-core version")
    return out


def stage_boundaries(config: TransformerConfig) -> list[int]:
    """DeepSpeed's ``parts``: stage s runs pieces ``parts[s] .. parts[s + 1] - 1``."""
    ranges = stage_layers(config)
    return [0] + [1 + r.start for r in ranges[1:]] + [config.num_layers + 3]


class GPTPipelineModule(GivenPartsPipelineModule):
    """A ``PipelineModule`` with given stage boundaries ``parts``; ``tie``: (group, ranks) of tied embeddings."""

    def __init__(self, layers: list, *, parts: list[int], tie: Optional[tuple[Any, list[int]]] = None,
                 position_embedding_type: str = "learned_absolute", rotary_base: float = 10000,
                 rotary_percent: float = 1.0, **kwargs: Any):
        super().__init__(layers, parts=parts, **kwargs)
        self.tied_weights: list[tuple[nn.Parameter, Any]] = []
        self.share_embeddings_and_output_weights = tie is not None   # on every stage, as GPTModel's attribute
        self.position_embedding_type, self.rotary_base = position_embedding_type, rotary_base   # the same
        self.rotary_percent = rotary_percent
        if tie is not None:
            self._tie_embedding(*tie)

    def _tie_embedding(self, group: Any, ranks: list[int]) -> None:
        pieces = dict(self.named_children())
        embedding, output = pieces.get("0"), pieces.get(str(self.parts[-1] - 1))
        if embedding is not None and output is not None:   # one stage: one parameter
            output.output_layer.weight = embedding.embedding.word_embeddings.weight
            return
        if embedding is None and output is None:           # a middle stage
            return
        weight = embedding.embedding.word_embeddings.weight if embedding is not None else output.output_layer.weight
        with torch.no_grad():
            dist.broadcast(weight.data, src=ranks[0], group=group)
        weight.shared_embedding = True
        weight.ds_pipe_replicated = output is not None
        self.tied_weights = [(weight, group)]

    def get_tied_weights_and_groups(self) -> list:
        """DeepSpeed's hook: (weight, group) pairs whose gradients the engine all-reduces."""
        return super().get_tied_weights_and_groups() + list(self.tied_weights)

    def allreduce_tied_weight_gradients(self) -> None:
        super().allreduce_tied_weight_gradients()
        for weight, group in self.tied_weights:
            if weight.grad is not None:
                dist.all_reduce(weight.grad, group=group)


def gpt_pipeline_module(config: TransformerConfig, moe_config: MoEConfig, groups: ProcessGroups, *,
                        vocab_size: int, max_sequence_length: int, seed: Optional[int] = None,
                        share_embeddings_and_output_weights: bool = False,
                        position_embedding_type: str = "learned_absolute", rotary_base: float = 10000,
                        rotary_percent: float = 1.0, cpu: Optional[bool] = None, placements: Optional[Mapping[int, Sequence[int]]] = None,
                        qk_layernorm_scope: str = "head", **pipeline_kwargs: Any) -> GPTPipelineModule:
    """This rank's stage of a GPT with MoE layers as a ``PipelineModule`` (collective: DeepSpeed creates its grid).

    ``config``'s pp and tp must be the layout's; ``groups``: the plugin's, registered. The stages hold the weights of
    ``GPTModel(config, gpt_moe_spec(..., seed=seed), ...)`` built after ``torch.manual_seed(seed)``; the other arguments
    are ``GPTModel``'s and ``gpt_moe_spec``'s, ``pipeline_kwargs`` ``PipelineModule``'s. Needs ``LOCAL_RANK`` set."""
    clashes = [name for name in _OWN_ARGUMENTS if name in pipeline_kwargs]
    if clashes:
        raise TypeError(f"gpt_pipeline_module sets {', '.join(clashes)} itself")
    check_against_model(moe_config, config)
    if position_embedding_type not in ("learned_absolute", "rope"):
        raise ValueError(f"position_embedding_type {position_embedding_type!r}: gpt_pipeline_module supports "
                         "'learned_absolute' and 'rope'")
    sizes = groups.layout.sizes
    if (sizes.pp, sizes.tp) != (config.pipeline_model_parallel_size, config.tensor_model_parallel_size):
        raise ValueError(f"the groups are for pp {sizes.pp} x tp {sizes.tp} but the TransformerConfig has "
                         f"pipeline_model_parallel_size {config.pipeline_model_parallel_size}, "
                         f"tensor_model_parallel_size {config.tensor_model_parallel_size}")
    topology = pipeline_topology(groups.layout)
    stage = groups.rank_in("pp")
    if topology.get_coord(groups.rank).pipe != stage:
        raise RuntimeError(f"rank {groups.rank}: DeepSpeed's stage {topology.get_coord(groups.rank).pipe} is not "
                           f"the pipeline rank {stage}")
    seed = resolve_seed(seed)
    ranges = stage_layers(config)
    # Specs are pure descriptions: the layer spec is the same for every layer, the final norm's is
    # the block's (taken from a stage that has layers: Megatron's list has one spec per layer).
    with_layers = next(s for s, r in enumerate(ranges) if len(r))
    block = gpt_moe_spec(moe_config, config, groups, seed=seed, cpu=cpu, pp_rank=with_layers, placements=placements,
                         qk_layernorm_scope=qk_layernorm_scope)
    layer_spec, norm_spec = block.layer_specs[0], block.layer_norm
    num = config.num_layers
    tied = share_embeddings_and_output_weights
    positions = position_embedding_type
    # multi-latent attention rotates inside the attention (its own rotary embedding), as in GPTModel
    rotary = rotary_base if positions == "rope" and not config.multi_latent_attention else None
    pieces: list = [LayerSpec(EmbeddingPipe, config, vocab_size, max_sequence_length, seed, positions)]
    stage_of = {i: s for s, r in enumerate(ranges) for i in r}
    for i in range(num):
        pieces.append(LayerSpec(TransformerLayerPipe, config, layer_spec, i, ranges[stage_of[i]].start, rotary,
                                rotary_percent))
    pieces.append(LayerSpec(FinalNormPipe, config, norm_spec))
    pieces.append(LayerSpec(OutputLayerPipe, config, vocab_size, max_sequence_length, seed, tied, positions))
    if groups.rank == 0:
        logger.info("GPT pipeline: %d stages, layers per stage %s, MoE layers %s, embeddings %s", sizes.pp,
                    [(r.start, r.stop) for r in ranges], [i for i in range(num) if moe_config.is_moe_layer(i)],
                    "tied" if tied else "untied")
    tie = (groups.handles.get("embedding"), groups.ranks("embedding")) if tied else None
    return GPTPipelineModule(pieces, parts=stage_boundaries(config), topology=topology, loss_fn=gpt_loss, tie=tie,
                             position_embedding_type=positions, rotary_base=rotary_base, rotary_percent=rotary_percent,
                             **pipeline_kwargs)


# --- names -------------------------------------------------------------------------------------------
_PIPE_KEY = re.compile(r"^(\d+)\.(embedding|layer|final_layernorm|output_layer)\.(.+)$")


def gpt_state_dict_key(pipe_key: str, num_layers: int) -> str:
    """The ``GPTModel`` state-dict key of a pipeline key (``{1+i}.layer.X`` -> ``decoder.layers.{i}.X``, ...)."""
    match = _PIPE_KEY.match(pipe_key)
    if match is None:
        raise KeyError(f"{pipe_key!r} is no key of gpt_pipeline_module's pieces")
    piece, kind, rest = int(match.group(1)), match.group(2), match.group(3)
    expected = {"embedding": piece == 0, "layer": 1 <= piece <= num_layers,
                "final_layernorm": piece == num_layers + 1, "output_layer": piece == num_layers + 2}[kind]
    if not expected:
        raise KeyError(f"{pipe_key!r}: piece {piece} is no {kind} in a pipe of {num_layers} layers")
    if kind == "layer":
        return f"decoder.layers.{piece - 1}.{rest}"
    if kind == "final_layernorm":
        return f"decoder.final_layernorm.{rest}"
    return f"{kind}.{rest}"


def pipeline_state_dict_key(gpt_key: str, num_layers: int) -> str:
    """The inverse of ``gpt_state_dict_key``."""
    if gpt_key.startswith("decoder.layers."):
        index, rest = gpt_key[len("decoder.layers."):].split(".", 1)
        return f"{1 + int(index)}.layer.{rest}"
    if gpt_key.startswith("decoder.final_layernorm."):
        return f"{num_layers + 1}.{gpt_key[len('decoder.'):]}"
    if gpt_key.startswith("embedding."):
        return f"0.{gpt_key}"
    if gpt_key.startswith("output_layer."):
        return f"{num_layers + 2}.{gpt_key}"
    raise KeyError(f"{gpt_key!r} is no GPTModel key that gpt_pipeline_module has")
