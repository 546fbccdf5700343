"""The one place a layer's dispatcher is built: wire format x schedule x shadowing, by the config's
rules (layout and placement options, ``MoEConfig.exchange_unfit``) and the layer's at run time
(``exchange_rules.py``); ``auto`` takes padded where allowed on gloo, else counts. Built again when
the shadowed experts or the traffic reader change: what no longer combines raises, nothing changed.
"""
from __future__ import annotations

from typing import Optional

import torch.distributed as dist

from moe_plugin.layers.counts_wire import CountsWire
from moe_plugin.layers.dispatcher import Dispatcher
from moe_plugin.layers.exchange_rules import exchange_unfit, overlap_unfit, shadow_unfit
from moe_plugin.layers.overlapped import Overlapped
from moe_plugin.layers.padded_wire import PaddedWire, log_choice
from moe_plugin.layers.parallel import LayerParallelism
from moe_plugin.layers.schedule import OneExchange
from moe_plugin.layers.shadow import ShadowExperts, Shadowing
from moe_plugin.layers.token_wire import TokenWire
from moe_plugin.layers.wire import LocalWire


def _unfit(config, parallel: LayerParallelism, mode: str, shadowed: int, traffic: Optional[str]) -> Optional[str]:
    """The config's reason (layout, placement options), else the layer's at run time."""
    return config.exchange_unfit(mode) or exchange_unfit(
        mode, expert=parallel.ep_size, expert_tensor=parallel.etp_size, overlap_chunks=config.overlap_chunks,
        drop_tokens=config.drop_tokens, shadowed=shadowed, traffic=traffic)


def resolve_exchange(config, parallel: LayerParallelism, shadowed: int = 0, traffic: Optional[str] = None) -> str:
    """``counts``, ``padded`` or ``token`` (named only) for a layer of ``config`` on ``parallel`` with
    ``shadowed`` experts and ``traffic`` (what reads the sender x expert traffic); unfit and named: raises."""
    if parallel.ep is None:
        return "counts"
    if config.exchange != "auto":
        why = _unfit(config, parallel, config.exchange, shadowed, traffic)
        if why is not None:
            what = "shadow experts" if shadowed else traffic
            raise ValueError(f"{what}: not with moe.exchange {config.exchange!r} (set 'counts'"
                             f"{' or ' + repr('auto') if config.exchange == 'padded' else ''}): it {why}")
        return config.exchange
    why_not = _unfit(config, parallel, "padded", shadowed, traffic)
    backend = dist.get_backend(parallel.ep)
    if why_not is None and backend != "gloo":
        why_not = f"the EP group's backend is {backend}, not gloo (a small all-to-all is cheap there, padding costs)"
    log_choice("counts" if why_not else "padded", why_not)
    return "counts" if why_not else "padded"


def build_dispatcher(config, parallel: LayerParallelism, shadow: ShadowExperts,
                     traffic: Optional[str] = None) -> tuple[Dispatcher, str]:
    """(the dispatcher, its exchange mode) for a layer of ``config`` on ``parallel``, ``shadow``'s experts shadowed."""
    shadowed = len(shadow.expert_ids)
    if shadowed:
        why = shadow_unfit(parallel.ep_size, parallel.etp_size)
        if why is not None:
            raise ValueError(why)
    if not parallel.expert_parallel:
        return Dispatcher(LocalWire()), "counts"
    mode = resolve_exchange(config, parallel, shadowed, traffic)
    L = config.num_experts // parallel.ep_size
    wire = {"counts": lambda: CountsWire(parallel, L), "token": lambda: TokenWire(parallel, L),
            "padded": lambda: PaddedWire(parallel, L, forced=config.exchange == "padded")}[mode]()
    why = overlap_unfit(config.overlap_chunks, parallel.ep_size, parallel.etp_size, config.num_experts)
    if why is not None:
        raise ValueError(f"overlap_chunks {config.overlap_chunks}: {why}")
    chunks = 1 if shadowed else config.overlap_chunks      # shadowed: one exchange (chunking them not done)
    schedule = Overlapped(parallel, chunks) if chunks > 1 else OneExchange()
    shadowing = Shadowing(shadow) if shadowed else None
    return Dispatcher(wire, schedule, shadowing), mode
