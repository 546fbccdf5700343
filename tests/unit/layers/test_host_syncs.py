"""At most one host synchronisation per MoE layer forward, none in backward; no host-to-device copy.

On a GPU every read of a tensor's values into Python, and every op whose output size depends
on the data, stalls the stream until the device catches up. On CPU nothing stalls, so the test
counts what would: Python-level reads (``tolist``, ``numpy``, ``cpu``, patched here only) and,
in a ``TorchDispatchMode``, the aten ops that read values on the host (``_local_scalar_dense``:
``item``, ``bool``, ``int``, ``float``) or size their output by the data (``nonzero``,
``masked_select``, ``unique``, boolean-mask indexing, ``repeat_interleave`` without
``output_size``, ``bincount``, which reads the largest index on CUDA). A read inside a counted
Python-level call is not counted again. Each sync is recorded with the innermost
``moe_plugin`` line that caused it, for the failure message.

The one sync a forward needs: the per-expert counts (and, with expert parallelism, the
exchanged counts that size the uneven all-to-all) reach the host in one transfer.

Host-to-device copies are counted in the same mode (``uploads``): every tensor made from Python
data (``torch.tensor``, ``as_tensor``, ``new_tensor``, indexing with a Python list: the aten op
``lift_fresh``; on an accelerator that data is copied from the host, and from pageable memory the
copy blocks the host until the stream gets to it) and every copy from the CPU to another device
(none on a CPU run; on a GPU ``torch.tensor(data).to(device)`` counts twice). A Python number
written into a tensor (``t[i] = 0``) is not counted: on an accelerator it is filled in place
there. The steady state (a second step: the first one also probes the expert backend, once per
device type and dtype) needs no copy: the experts cut their chunks' row offsets from the counts
on the device (``ffn_autograd.RowCounts``), not from the host's list.
"""
from __future__ import annotations

import traceback

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from dist import attempts, case_results, run_distributed
from moe_plugin.configs import MoEConfig
from moe_plugin.groups.layout import RankLayout
from moe_plugin.layers import MoELayer
from tests.unit.layers.test_layers_single import capacity_if_dropping

H, F, E = 16, 16, 8
SYNC_OPS = {"_local_scalar_dense", "nonzero", "masked_select", "_unique", "_unique2", "unique_dim",
            "unique_consecutive", "unique_dim_consecutive", "bincount", "histc", "equal"}
PY_READS = ("tolist", "numpy", "cpu")
LIFTS = ("lift_fresh", "lift_fresh_copy")


def _where() -> str:
    """The innermost ``moe_plugin`` line on the stack (outside the test's own frames)."""
    for frame in reversed(traceback.extract_stack()):
        if "/moe_plugin/" in frame.filename:
            return f"{frame.filename.split('/moe_plugin/')[-1]}:{frame.lineno}"
    return "?"


def _is_sync(func, args, kwargs) -> bool:
    name = func._overloadpacket.__name__
    if name in SYNC_OPS:
        return True
    if func is torch.ops.aten.repeat_interleave.Tensor:     # the others decompose into this one
        return kwargs.get("output_size") is None
    if name in ("index", "index_put", "index_put_", "_index_put_impl_"):
        return any(i is not None and i.dtype in (torch.bool, torch.uint8) for i in args[1])
    if name in ("_to_copy", "copy_"):   # device -> host copies (none on a CPU run)
        src, dst = _copy_ends(name, args, kwargs)
        return src.type != "cpu" and dst.type == "cpu"
    return False


def _copy_ends(name: str, args, kwargs) -> tuple[torch.device, torch.device]:
    """(source, destination) device of a ``_to_copy`` or ``copy_``."""
    src = args[1] if name == "copy_" else args[0]
    dst = args[0].device if name == "copy_" else kwargs.get("device") or src.device
    return src.device, torch.device(dst)


def _is_upload(func, args, kwargs) -> bool:
    """Python data made a tensor, or a copy from the CPU to another device (module docstring)."""
    name = func._overloadpacket.__name__
    if name in LIFTS:
        return True
    if name in ("_to_copy", "copy_"):
        src, dst = _copy_ends(name, args, kwargs)
        return src.type == "cpu" and dst.type != "cpu"
    return False


class SyncCounter(TorchDispatchMode):
    """Records ``(what, where)`` of every host sync inside ``with counter:`` (module docstring),
    and of every host-to-device copy in ``uploads``; ``take()`` returns the syncs and starts over,
    ``take_uploads()`` the copies."""

    def __init__(self):
        super().__init__()
        self.syncs: list[tuple[str, str]] = []
        self.uploads: list[tuple[str, str]] = []
        self._inside = 0
        self._number_written = False
        self._saved: dict = {}

    def __enter__(self):
        for name in PY_READS + ("__setitem__",):
            self._saved[name] = torch.Tensor.__dict__.get(name)     # None: inherited from TensorBase
        for name in PY_READS:
            setattr(torch.Tensor, name, self._counting(name, getattr(torch.Tensor, name)))
        torch.Tensor.__setitem__ = self._writing(torch.Tensor.__setitem__)
        return super().__enter__()

    def __exit__(self, *exc):
        for name, method in self._saved.items():
            if method is None:
                delattr(torch.Tensor, name)
            else:
                setattr(torch.Tensor, name, method)
        return super().__exit__(*exc)

    def _counting(self, name, method):
        def read(tensor, *args, **kwargs):
            if self._inside == 0:
                self.syncs.append((name, _where()))
            self._inside += 1
            try:
                return method(tensor, *args, **kwargs)
            finally:
                self._inside -= 1
        return read

    def _writing(self, method):
        """``__setitem__`` that marks a Python number as the value: its 0-dim lift is no copy."""
        def write(tensor, index, value):
            self._number_written = isinstance(value, (bool, int, float))
            try:
                return method(tensor, index, value)
            finally:
                self._number_written = False
        return write

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if self._inside == 0 and _is_sync(func, args, kwargs):
            self.syncs.append((func._overloadpacket.__name__, _where()))
        if _is_upload(func, args, kwargs) and not (self._number_written and args[0].dim() == 0):
            self.uploads.append((func._overloadpacket.__name__, _where()))
        return func(*args, **kwargs)

    def take(self) -> list[tuple[str, str]]:
        syncs, self.syncs = self.syncs, []
        return syncs

    def take_uploads(self) -> list[tuple[str, str]]:
        uploads, self.uploads = self.uploads, []
        return uploads


def count_syncs(layer: MoELayer, x_SBH: torch.Tensor, steps: int = 2) -> list[tuple[list, list, list, list]]:
    """Per training step of ``layer`` on ``x_SBH`` (forward, then backward): the host syncs of
    the forward, of the backward, and the host-to-device copies of each."""
    grad_SBH = torch.randn(x_SBH.shape, generator=torch.Generator().manual_seed(7))
    counter, counted = SyncCounter(), []
    for _ in range(steps):
        x = x_SBH.clone().requires_grad_(True)
        with counter:
            out_SBH, _ = layer(x)
        forward, up_forward = counter.take(), counter.take_uploads()
        with counter:
            out_SBH.backward(grad_SBH)
        counted.append((forward, counter.take(), up_forward, counter.take_uploads()))
    return counted


ROUTERS = {
    "top1": dict(router="switch"),
    "top2": dict(router="topk", top_k=2, aux_loss_coeff=0.1, z_loss_coeff=1e-2),
    "gshard": dict(router="gshard", jitter_eps=0.1, aux_loss_coeff=0.1),   # random routing of the 2nd choice
    "sigmoid": dict(router="topk", top_k=2, score_function="sigmoid", gate_scale=2.5, aux_loss_coeff=0.1),
    "probability": dict(router="topk", top_k=2, drop_policy="probability", capacity_factor=0.5),
    "sequence": dict(router="topk", top_k=2, aux_loss_coeff=0.1, aux_loss_scope="sequence"),
    "global": dict(router="switch", aux_loss_coeff=0.1, aux_loss_scope="global"),
    "grouped": dict(router="topk", top_k=3, score_function="sigmoid", router_groups=4, group_topk=2),
}


def _layer(router: str, drop: bool, parallel=None, groups=None, placement=None, **moe) -> MoELayer:
    block = {"num_experts": E, "capacity_factor": 1.0, "min_capacity": 1, "drop_tokens": drop,
             **ROUTERS[router], **moe}
    if parallel is not None:
        block["parallel"] = parallel
    config = MoEConfig.from_dict(capacity_if_dropping(block))
    return MoELayer(config, H, F, groups, seed=3, init_std=0.3, placement=placement).train()


def _x(S=8, B=2, seed=11) -> torch.Tensor:
    return torch.randn(S, B, H, generator=torch.Generator().manual_seed(seed))


def _check(steps: list, uploads: tuple[int, int] = (0, 0)) -> None:
    """Each step: at most one sync in forward, none in backward; in the steady state (the last
    step), ``uploads`` host-to-device copies in forward and in backward."""
    for forward, backward, _, _ in steps:
        assert len(forward) <= 1, f"{len(forward)} host syncs in one forward: {forward}"
        assert not backward, f"{len(backward)} host syncs in backward: {backward}"
    *_, up_forward, up_backward = steps[-1]
    assert (len(up_forward), len(up_backward)) == uploads, \
        f"host-to-device copies {len(up_forward)} in forward {up_forward}, {len(up_backward)} in backward " \
        f"{up_backward}; expected {uploads}"


@pytest.mark.parametrize("drop", [True, False], ids=["capacity", "dropless"])
@pytest.mark.parametrize("router", list(ROUTERS))
def test_one_host_sync_per_forward(router, drop):
    _check(count_syncs(_layer(router, drop), _x()))


def test_one_host_sync_with_shared_expert_and_placement():
    layer = _layer("top2", False, activation="swiglu", shared_expert_ffn_hidden_size=8, shared_expert_gate=True,
                   placement=[5, 2, 7, 0, 3, 6, 1, 4])
    _check(count_syncs(layer, _x()))


def test_the_counter_sees_syncs():
    """Each kind of read the module docstring names is counted once."""
    x = torch.arange(6.0)
    counter = SyncCounter()
    with counter:
        x.tolist(), x[0].item(), bool(x[1]), int(x[2]), x[x > 2], x.nonzero(), torch.bincount(x.long())
        torch.repeat_interleave(x, x.long()), torch.repeat_interleave(x, x.long(), output_size=15)
        torch.unique(x), x.cpu(), x.numpy()
    assert [what for what, _ in counter.take()] == ["tolist", "_local_scalar_dense", "_local_scalar_dense",
                                                    "_local_scalar_dense", "index", "nonzero", "bincount",
                                                    "repeat_interleave", "_unique2", "cpu", "numpy"]
    assert "tolist" not in torch.Tensor.__dict__ and "__setitem__" not in torch.Tensor.__dict__     # restored


def test_the_counter_sees_host_to_device_copies():
    """Python data made a tensor is counted, each time; a Python number written in place is not,
    nor are ops on tensors already there."""
    x = torch.arange(6.0)
    counter = SyncCounter()
    with counter:
        torch.tensor([1, 2]), torch.as_tensor([3]), x.new_tensor([4.0]), torch.tensor(5.0), x[[0, 2]]
        x[1:3] = 0.0
        x[x > 4] = 1
        x[torch.tensor([0])] = 2.0
        x + 1, torch.arange(3), torch.zeros(2), torch.where(x > 1, x, 0.0)
    assert len(counter.take_uploads()) == 6
    assert x.tolist() == [2.0, 0.0, 0.0, 3.0, 4.0, 1.0]


def test_expert_chunks_copy_no_offsets_to_the_device():
    """The experts' chunks (here 3 of them) take their row offsets from the counts on the device
    (``RowCounts``, what every dispatcher gives): no host-to-device copy, forward or backward; from a
    plain list, one copy in all. Outputs and gradients are the same, bit for bit."""
    from moe_plugin.layers.ffn_autograd import RowCounts, expert_ffn

    gen = torch.Generator().manual_seed(5)
    counts_L = torch.tensor([3, 0, 5, 4, 2, 6])
    x_RH = torch.randn(int(counts_L.sum()), H, generator=gen)
    w1_LHF, w2_LFH = torch.randn(6, H, F, generator=gen), torch.randn(6, F, H, generator=gen)
    results = []
    for counts in (counts_L.tolist(), RowCounts(counts_L.tolist(), counts_L)):
        for backend in ("grouped_mm", "bmm", "loop"):
            x, w1 = x_RH.clone().requires_grad_(True), w1_LHF.clone().requires_grad_(True)
            counter = SyncCounter()
            with counter:
                y = expert_ffn(x, w1, w2_LFH, counts, torch.relu, backend, chunk_bytes=5 * F * 4)
                forward = counter.take_uploads()
                y.sum().backward()
            assert len(forward) == (0 if isinstance(counts, RowCounts) else 1), forward
            assert not counter.take_uploads() and not counter.take()
            results.append((y, x.grad, w1.grad))
    for from_list, from_device in zip(results[:3], results[3:]):     # per backend
        assert all(torch.equal(a, b) for a, b in zip(from_list, from_device))


def test_row_ends_from_a_list_leave_pinned_memory_without_blocking(monkeypatch):
    """The one copy a plain list costs: on an accelerator (here the meta device, ``pin_memory``
    faked, as this machine has no accelerator to pin for) from pinned memory, not blocking; on the
    CPU none; from device counts no copy at all."""
    from moe_plugin.layers.ffn_autograd import row_ends

    pinned, copies, to = [], [], torch.Tensor.to
    monkeypatch.setattr(torch.Tensor, "pin_memory", lambda self: pinned.append(self.tolist()) or self)
    monkeypatch.setattr(torch.Tensor, "to",
                        lambda self, *a, **k: copies.append(k.get("non_blocking")) or to(self, *a, **k))
    ends_L = row_ends([3, 0, 2], torch.device("meta"))
    assert (ends_L.device.type, ends_L.dtype, pinned, copies) == ("meta", torch.int32, [[3, 3, 5]], [True])
    assert row_ends([3, 0, 2], torch.device("cpu")).tolist() == [3, 3, 5] and len(pinned) == 1
    counts_L = torch.tensor([3, 0, 2], device="meta")
    assert row_ends([3, 0, 2], torch.device("meta"), counts_L).device.type == "meta" and len(pinned) == 1


# -- expert parallelism on 2 gloo ranks: one spawn for every case ----------------------------------
# name -> (RankLayout.build sizes, router, drop, shadowed experts[, overlap_chunks[, exchange]])
DIST_CASES = {
    "dp2-ep2/top1-capacity": (dict(ep=2), "top1", True, []),
    "dp2-ep2/top2-dropless": (dict(ep=2), "top2", False, []),
    "dp2-ep2/gshard-capacity": (dict(ep=2), "gshard", True, []),
    "etp2-dp2/top2-capacity": (dict(etp=2), "top2", True, []),
    "tp2-ep2/top2-dropless": (dict(tp=2, ep=2, etp=1), "top2", False, []),
    "tp2/gshard-capacity": (dict(tp=2, etp=1), "gshard", True, []),          # no EP: the finite flags over TP
    "dp2-ep2/sigmoid-capacity": (dict(ep=2), "sigmoid", True, []),
    "tp2-ep2/probability-capacity": (dict(tp=2, ep=2, etp=1), "probability", True, []),
    "tp2-ep2/sequence-dropless": (dict(tp=2, ep=2, etp=1), "sequence", False, []),   # from the gathered logits
    "tp2/global-capacity": (dict(tp=2, etp=1), "global", True, []),                   # counts over DP (dp 1)
    "dp2-ep2/grouped-dropless": (dict(ep=2), "grouped", False, []),
    "dp2-ep2/shadow-top2-capacity": (dict(ep=2), "top2", True, [0, 5]),
    "dp2-ep2/shadow-top1-dropless": (dict(ep=2), "top1", False, [3]),
    "dp2-ep2/overlap2-top2-dropless": (dict(ep=2), "top2", False, [], 2),          # the exchange in chunks
    "dp2-ep2/overlap4-top1-capacity": (dict(ep=2), "top1", True, [], 4),
    "dp2-ep2/overlap2-shadow-top2-capacity": (dict(ep=2), "top2", True, [1], 2),
    "dp2-ep2/padded-top2-capacity": (dict(ep=2), "top2", True, [], 1, "padded"),     # no counts round
    "dp2-ep2/padded-gshard-capacity": (dict(ep=2), "gshard", True, [], 1, "padded"),
    "dp2-ep2/counts-top1-capacity": (dict(ep=2), "top1", True, [], 1, "counts"),
    "dp2-ep2/token-top2-capacity": (dict(ep=2), "top2", True, [], 1, "token"),     # the unique rows ride along
    "tp2-ep2/token-grouped-dropless": (dict(tp=2, ep=2, etp=1), "grouped", False, [], 1, "token"),
}


def _dist_case(rank: int, layout: RankLayout, groups, router: str, drop: bool, shadow, chunks: int,
               exchange: str) -> dict:
    s = layout.sizes
    parallel = {"tensor": s.tp, "expert": s.ep, "expert_tensor": s.etp, "order": s.order}
    layer = _layer(router, drop, parallel, groups, overlap_chunks=chunks, exchange=exchange)
    assert exchange == "auto" or layer.exchange == exchange
    if shadow:
        layer.set_shadow(shadow)
    return count_syncs(layer, _x(seed=11 + layout.coords(rank)["dp"]))


def _dist_child(rank: int, world_size: int, cases: dict) -> dict:
    from moe_plugin.groups.builder import build_process_groups, destroy_process_groups

    results = {}
    attempt = attempts(results, rank)
    for name, (sizes, router, drop, shadow, *more) in cases.items():
        chunks, exchange = (more + [1, "auto"][len(more):])[:2]
        layout = RankLayout.build(world_size, **sizes)
        groups = build_process_groups(layout)
        try:
            attempt(name, _dist_case, rank, layout, groups, router, drop, shadow, chunks, exchange)
        finally:
            destroy_process_groups(groups)
    return results


@pytest.fixture(scope="module")
def dist_counts(tmp_path_factory):
    return run_distributed(_dist_child, 2, tmp_path_factory.mktemp("syncs"), DIST_CASES)


@pytest.mark.slow
@pytest.mark.parametrize("name", list(DIST_CASES))
def test_one_host_sync_per_forward_expert_parallel(dist_counts, name):
    for result in case_results(dist_counts, name):
        _check(result)
