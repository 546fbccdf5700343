"""Megatron-Core's RNG tracker: ``moe_plugin.initialize`` seeds it before the model is built.

* On the CPU accelerator, ``compat/megatron_cpu.py``'s tracker over torch's CPU generator: its
  named states are what a CPU generator seeded alike gives, a fork continues its state's stream and
  leaves the default generator where it was, the model-parallel state differs between
  tensor-parallel ranks (dropout under sequence parallelism: each rank its own mask) and is the
  same across data-parallel replicas.
* On the CUDA accelerator (faked on the CPU: DeepSpeed's accelerator says ``cuda``, Megatron's
  tracker is a recording stand-in over the CPU generator, Megatron's buffers go to the CPU), the
  example's GPU model (Megatron's ``DotProductAttention`` and norms, no CPU swaps,
  ``use_cpu_initialization`` as ``run_gpu_125m.sh`` runs it) is built by ``initialize`` with device
  ``LOCAL_RANK`` made the process's (else every rank starts on device 0) and the
  tracker's three states already seeded as Megatron-LM seeds them (``--seed`` + 100 x pipeline
  rank; + 2718 + tp rank; + 1024 + 100 x ep rank + etp rank); its first forward forks the
  model-parallel state in every attention. Without the seeding that forward fails as it would on a
  GPU ("cuda rng state model-parallel-rng is not added"). The tensor-parallel layers' GPU
  initialisation (``use_cpu_initialization`` off) forks the model-parallel state too (the plugin's
experts are not Megatron's: nothing forks the expert-parallel state).
"""
from __future__ import annotations

import dataclasses
import importlib.util
import json
import os
import sys
from pathlib import Path

import pytest
import torch

from launcher import REPO
from dist import run_distributed
from ds_json import write_ds_config

EXAMPLE = REPO / "examples" / "gpt_moe" / "pretrain_gpt_moe.py"
SEED, VOCAB, SEQ, BATCH = 7, 64, 8, 2
FLAGS = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4", "--ffn-hidden-size", "64",
         "--seq-length", str(SEQ), "--micro-batch-size", str(BATCH), "--seed", str(SEED)]
MOE = {"num_experts": 4, "router": "topk", "top_k": 2, "layer_interval": 1}
NAMES = ("data-parallel-rng", "expert-parallel-rng", "model-parallel-rng")


# --- CPU accelerator: the tracker over the CPU generator ---------------------------------------------
@pytest.fixture
def megatron_globals(monkeypatch):
    """Megatron's tracker and the buffer modules' torch as they were, after the test."""
    from megatron.core.tensor_parallel import random as megatron_random

    from moe_plugin.compat.megatron_cpu import BUFFER_MODULES

    for name in ("_CUDA_RNG_STATE_TRACKER", "_CUDA_RNG_STATE_TRACKER_INITIALIZED"):
        monkeypatch.setattr(megatron_random, name, getattr(megatron_random, name))
    for name in BUFFER_MODULES:
        module = importlib.import_module(name)
        monkeypatch.setattr(module, "torch", module.torch)


def _tracker_draws(groups_ranks: dict) -> dict:
    """Seed the tracker as rank ``groups_ranks`` (tp, pp, ep, etp) would; draws inside forks."""
    from megatron.core.tensor_parallel import get_cuda_rng_tracker

    from moe_plugin.integration.seeding import seed_megatron_rng

    class Ranks:   # the part of ProcessGroups seed_megatron_rng reads
        rank_in = staticmethod(groups_ranks.__getitem__)

    before = torch.get_rng_state()
    given = seed_megatron_rng(SEED, Ranks())
    tracker = get_cuda_rng_tracker()
    with tracker.fork():
        first = torch.rand(4)
    with tracker.fork():
        second = torch.rand(4)
    with tracker.fork("expert-parallel-rng"):
        expert = torch.rand(4)
        with tracker.fork():   # nested, as Megatron nests them
            inner = torch.rand(4)
    return {"given": given, "names": sorted(tracker.get_states()), "first": first, "second": second,
            "expert": expert, "inner": inner, "default_untouched": torch.equal(before, torch.get_rng_state()),
            "seeds": sorted(tracker.seeds_)}


def test_cpu_tracker_has_megatron_lm_states_over_the_cpu_generator(megatron_globals):
    from moe_plugin.compat.megatron_cpu import CpuRNGStatesTracker, buffers_on_cpu

    rank0 = _tracker_draws({"tp": 0, "pp": 0, "ep": 0, "etp": 0})
    assert rank0["given"] == SEED and rank0["names"] == list(NAMES) and rank0["default_untouched"]
    assert rank0["seeds"] == [SEED, SEED + 1024, SEED + 2718]
    assert buffers_on_cpu()
    from megatron.core.tensor_parallel import get_cuda_rng_tracker

    assert isinstance(get_cuda_rng_tracker(), CpuRNGStatesTracker)
    stream = torch.Generator().manual_seed(SEED + 2718)
    assert torch.equal(rank0["first"], torch.rand(4, generator=stream))
    assert torch.equal(rank0["second"], torch.rand(4, generator=stream))   # a fork goes on where the last one left
    assert torch.equal(rank0["inner"], torch.rand(4, generator=stream))
    assert torch.equal(rank0["expert"], torch.rand(4, generator=torch.Generator().manual_seed(SEED + 1024)))
    # another data-parallel replica (same tp rank): the same masks; another tp rank: others
    replica = _tracker_draws({"tp": 0, "pp": 0, "ep": 1, "etp": 0})
    assert torch.equal(replica["first"], rank0["first"]) and not torch.equal(replica["expert"], rank0["expert"])
    tp1 = _tracker_draws({"tp": 1, "pp": 0, "ep": 0, "etp": 0})
    assert not torch.equal(tp1["first"], rank0["first"])
    stage1 = _tracker_draws({"tp": 0, "pp": 1, "ep": 0, "etp": 0})
    assert stage1["given"] == SEED + 100 and stage1["seeds"] == [SEED + 100, SEED + 1124, SEED + 2818]


def test_cpu_tracker_refuses_what_megatron_refuses(megatron_globals):
    from moe_plugin.compat.megatron_cpu import CpuRNGStatesTracker

    tracker = CpuRNGStatesTracker()
    with pytest.raises(Exception, match="cuda rng state model-parallel-rng is not added"):
        with tracker.fork():
            pass
    tracker.add("a", 1)
    with pytest.raises(Exception, match="seed 1 already exists"):
        tracker.add("b", 1)
    with pytest.raises(Exception, match="cuda rng state a already exists"):
        tracker.add("a", 2)


# --- CUDA accelerator, faked ------------------------------------------------------------------------
class _Stop(Exception):
    """Raised by the provider once the first forward is done: initialize goes no further."""


def _example():
    spec = importlib.util.spec_from_file_location("pretrain_gpt_moe", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def _fake_cuda(rank: int, world_size: int, ds_path: str, layouts: dict) -> dict:
    from deepspeed.accelerator import set_accelerator
    from deepspeed.accelerator.cpu_accelerator import CPU_Accelerator
    from megatron.core.tensor_parallel import random as megatron_random

    import moe_plugin
    from moe_plugin.compat.megatron_cpu import CpuRNGStatesTracker, buffers_on_cpu, cpu_buffers
    from moe_plugin.integration import deepspeed as plugin_deepspeed

    class FakeCuda(CPU_Accelerator):   # what the plugin asks of the accelerator's kind: "cuda"
        devices = []

        def device_name(self, device_index=None):
            return "cuda"

        def set_device(self, device_index):
            self.devices.append(device_index)

    class RecordingTracker(CpuRNGStatesTracker):   # Megatron's CUDA tracker, over the CPU generator
        def __init__(self):
            super().__init__()
            self.forks = []

        def fork(self, name="model-parallel-rng"):
            self.forks.append(name)
            return super().fork(name)

    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size))   # as the launcher sets
    set_accelerator(FakeCuda())
    example = _example()
    out = {}
    for name, (parallel, cpu_init, seeded) in layouts.items():
        config = json.loads(Path(ds_path).read_text())
        config["moe"]["parallel"] = parallel
        tracker = RecordingTracker()
        megatron_random._CUDA_RNG_STATE_TRACKER, megatron_random._CUDA_RNG_STATE_TRACKER_INITIALIZED = tracker, True
        args = example.parse_args([*FLAGS, "--deepspeed_config", ds_path])
        pipelined = parallel.get("pipeline", 1) > 1
        inner = (example.gpt_pipeline_provider if pipelined else example.gpt_model_provider)(args, VOCAB)
        if not cpu_init:
            real_config = example.transformer_config
            example.transformer_config = lambda a, m: dataclasses.replace(real_config(a, m),
                                                                          use_cpu_initialization=False)
        record = out[name] = {}

        def provider(moe_config, groups):
            record["states"] = sorted(tracker.get_states())
            record["seeds"] = sorted(tracker.seeds_)
            record["ranks"] = {k: groups.rank_in(k) for k in ("tp", "pp", "ep", "etp")}
            record["set_device"] = list(FakeCuda.devices)   # before the tracker was seeded (initialize, step 2)
            FakeCuda.devices.clear()
            record["cpu_stand_ins"] = buffers_on_cpu()   # the plugin's CPU buffers: not on CUDA
            cpu_buffers()   # Megatron allocates on the current CUDA device: here the CPU
            if pipelined:   # (DeepSpeed's PipelineModule moves itself to the accelerator's device: not here)
                raise _Stop
            model = inner(moe_config, groups)
            record["init_forks"] = sorted(set(tracker.forks))
            record["modules"] = sorted({type(m).__name__ for m in model.modules()} & {"DotProductAttention",
                                                                                       "SDPAttention"})
            tracker.forks.clear()
            gen = torch.Generator().manual_seed(1)
            tokens = torch.randint(0, VOCAB, (BATCH, SEQ), generator=gen)
            causal = torch.triu(torch.ones(SEQ, SEQ, dtype=torch.bool), diagonal=1)[None, None]
            try:
                loss = model(tokens, torch.arange(SEQ).expand(BATCH, SEQ), causal, labels=tokens).mean()
                loss.backward()
                record["loss"] = loss.item()
            except Exception as err:   # noqa: BLE001 (what the first forward raises is the result)
                record["error"] = str(err)
            record["forward_forks"] = list(tracker.forks)
            raise _Stop

        real_seed = plugin_deepspeed.seed_megatron_rng
        if not seeded:   # the plugin without the seeding: what the first forward did before
            plugin_deepspeed.seed_megatron_rng = lambda seed, groups: None
        try:
            moe_plugin.initialize(config, provider, seed=args.seed, print_summary=False)
        except _Stop:
            pass
        finally:
            plugin_deepspeed.seed_megatron_rng = real_seed
            if not cpu_init:
                example.transformer_config = real_config
    return out


@pytest.mark.slow
def test_initialize_seeds_megatron_tracker_before_the_gpu_model_is_built(tmp_path):
    ds = tmp_path / "ds.json"
    write_ds_config(ds, batch=BATCH, micro=BATCH, gas=1, optimizer={"type": "AdamW", "params": {"lr": 1e-3}},
                    zero=None, clip=None, moe=MOE)
    layouts = {   # name -> moe.parallel, use_cpu_initialization, the plugin seeds the tracker
        "tp2-ep2": ({"tensor": 2, "expert": 2, "expert_tensor": 1}, True, True),
        "tp2-ep2 unseeded": ({"tensor": 2, "expert": 2, "expert_tensor": 1}, True, False),
        "tp2 gpu init": ({"tensor": 2}, False, True),
        "tp2sp-ep2": ({"tensor": 2, "expert": 2, "expert_tensor": 1, "sequence_parallel": True}, True, True),
        "pp2": ({"pipeline": 2}, True, True),
    }
    results = run_distributed(_fake_cuda, 2, tmp_path, str(ds), layouts, timeout=300)
    for rank, out in enumerate(results):
        for name, record in out.items():
            r = record["ranks"]
            if name.endswith("unseeded"):
                assert record["states"] == [] and record["forward_forks"] == ["model-parallel-rng"], record
                assert record["error"] == "cuda rng state model-parallel-rng is not added", record
                continue
            base = SEED + 100 * r["pp"]
            assert record["set_device"] == [rank], record   # device LOCAL_RANK, before any work on it
            assert record["states"] == list(NAMES), (name, record)
            assert record["seeds"] == sorted([base, base + 2718 + r["tp"], base + 1024 + 100 * r["ep"] + r["etp"]])
            if name == "pp2":
                assert r["pp"] == rank
                continue
            assert record["modules"] == ["DotProductAttention"], (name, record)   # Megatron's, not the CPU swap
            assert "error" not in record and record["loss"] > 0, (name, record)
            # without SP each layer's attention forks; under SP the embedding's dropout and the block do
            assert record["forward_forks"] == ["model-parallel-rng"] * 2, record
            assert record["init_forks"] == (["model-parallel-rng"] if name == "tp2 gpu init" else []), (name, record)
        assert out["tp2-ep2"]["ranks"] == {"tp": rank, "pp": 0, "ep": rank, "etp": 0}
        assert out["tp2-ep2"]["cpu_stand_ins"] is False   # the first layout: nothing had applied them


def test_checkpoint_keeps_the_tracker_states(megatron_globals):
    """``checkpoint/rng.py``: a resumed run's dropout inside a fork goes on where the saved one was."""
    from megatron.core.tensor_parallel import get_cuda_rng_tracker

    from moe_plugin.checkpoint.rng import rng_state, set_rng_state
    from moe_plugin.integration.seeding import seed_megatron_rng

    model = torch.nn.Linear(2, 2)
    seed_megatron_rng(SEED, None)
    with get_cuda_rng_tracker().fork():
        torch.rand(3)
    saved = rng_state(model)
    with get_cuda_rng_tracker().fork():
        expected = torch.rand(3)
    seed_megatron_rng(SEED + 1, None)   # another run's tracker
    set_rng_state(model, saved)
    with get_cuda_rng_tracker().fork():
        assert torch.equal(torch.rand(3), expected)


@pytest.mark.parametrize("seed", [-1, 1.5, True, "7"])
def test_initialize_refuses_a_bad_seed_before_any_group(seed, monkeypatch):
    import torch.distributed as dist

    import moe_plugin
    from moe_plugin.configs import ConfigError

    monkeypatch.delenv("WORLD_SIZE", raising=False)
    with pytest.raises(ConfigError, match=rf"^seed: got {seed!r}; expected an integer >= 0"):
        moe_plugin.initialize({"train_batch_size": 1, "moe": {"num_experts": 2}}, None, seed=seed)
    assert not dist.is_initialized()
