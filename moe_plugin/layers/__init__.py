"""MoE layers: router, the token exchange (``Wire`` x ``Schedule`` x shadowing), grouped experts, the MoE
layer and its reference oracle.

Shape suffixes, one meaning per letter in all of ``moe_plugin`` (listed here only; the other
modules point here). A tensor's name ends in its dimensions: ``x_TH`` is [tokens, hidden].

    B  batch: sequences in a micro-batch         S  sequence: positions in a sequence
    T  tokens (S * B, or this rank's share)      H  hidden size
    E  experts, by expert id                     D  expert slots: the experts in placement order
    L  local experts: this EP rank's slots       K  choices per token (top-k)
    R  kept routes: rows in slot order           N  the rows a gather reads from (tokens or received rows)
    F  expert FFN width                          F1 the first expert GEMM's width (F, or 2F for swiglu)
    P  EP peers: the ranks of an EP group        Q  ETP peers: the ranks of an ETP group
    G  senders of received rows (Q * P, ETP peer major)
    U  unique rows: distinct (EP peer, token) pairs (``token_wire.py``)
    C  a chunk of tokens or rows, worked on at once
    M  MoE layers of a model                     I  steps (iterations) of a trace
    V  vocabulary                                W  parameters (weights) of a model
    X, Y  any other width, e.g. a flattened one (said where the tensor is made)

A digit after a letter adds that many (``count_D1``: D + 1 entries). A tensor over part of an
axis keeps the axis's letter (``tied_T``: the tokens with a tie; ``exchanged_R``).
"""
from moe_plugin.layers.counts_wire import CountsWire, source_to_expert_order
from moe_plugin.layers.dispatcher import Dispatcher
from moe_plugin.layers.exchange_factory import build_dispatcher
from moe_plugin.layers.expert_backend import choose_backend
from moe_plugin.layers.experts import GroupedExperts, SharedExpert, ffn_shard
from moe_plugin.layers.moe_layer import AttachAuxLoss, MoELayer, MoEStats, StatsSum, moe_layers, reduce_stats
from moe_plugin.layers.overlapped import Overlapped
from moe_plugin.layers.padded_wire import PaddedWire
from moe_plugin.layers.parallel import LayerParallelism
from moe_plugin.layers.reference import ReferenceResult, reference_moe
from moe_plugin.layers.router import Router, RouterNoise, RoutingPlan, expert_capacity, route
from moe_plugin.layers.schedule import OneExchange, Schedule
from moe_plugin.layers.shadow import ShadowExperts, Shadowing
from moe_plugin.layers.token_wire import TokenWire
from moe_plugin.layers.wire import LocalWire, Wire

__all__ = [
    "AttachAuxLoss", "CountsWire", "Dispatcher", "GroupedExperts", "LayerParallelism", "LocalWire", "MoELayer",
    "MoEStats", "OneExchange", "Overlapped", "PaddedWire", "ReferenceResult", "Router", "RouterNoise", "RoutingPlan",
    "Schedule", "ShadowExperts", "Shadowing", "SharedExpert", "StatsSum", "TokenWire", "Wire", "build_dispatcher",
    "choose_backend", "expert_capacity", "ffn_shard", "moe_layers", "reduce_stats", "reference_moe", "route",
    "source_to_expert_order",
]
