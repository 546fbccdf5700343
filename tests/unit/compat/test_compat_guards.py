"""Version guards: what each ``moe_plugin/compat/`` module relies on in DeepSpeed and Megatron-Core
is still there. A failure names the upstream change and the compat file that must follow it.
No process group is created."""
from __future__ import annotations

import importlib
import inspect
import os
import re
from importlib.metadata import version

import pytest
import torch

from launcher import REPO

DS = f"deepspeed {version('deepspeed')}"
MCORE = f"megatron-core {version('megatron-core')}"


def _must(condition: bool, what: str, upstream: str, compat: str) -> None:
    assert condition, f"{what} ({upstream}): moe_plugin/compat/{compat}.py must follow it"


def test_megatron_parallel_state_globals():
    from megatron.core import parallel_state as ps

    from moe_plugin.compat.megatron_parallel_state import GLOO_GROUPS, RANK_LISTS_KEPT, parallel_state_values

    kinds = ("tp", "pp", "mp", "embedding", "pos_embedding", "dp", "cp", "tp_dp", "ep", "etp", "etp_ep",
             "etp_ep_pp", "edp")
    values = parallel_state_values({k: object() for k in kinds}, {k: [0] for k in kinds}, 0, gloo=True)
    source = inspect.getsource(ps)
    for name in sorted(set(values) | set(GLOO_GROUPS) | set(RANK_LISTS_KEPT) | {"_GLOBAL_MEMORY_BUFFER"}):
        _must(hasattr(ps, name), f"megatron.core.parallel_state no longer has {name}", MCORE,
              "megatron_parallel_state")
        _must(re.search(rf"global [^\n]*\b{name}\b", source) is not None,
              f"no function of megatron.core.parallel_state sets {name} any more", MCORE, "megatron_parallel_state")
    for name in ("_set_global_memory_buffer", "destroy_model_parallel", "initialize_model_parallel"):
        _must(callable(getattr(ps, name, None)), f"megatron.core.parallel_state no longer has {name}()", MCORE,
              "megatron_parallel_state")
    destroy = inspect.getsource(ps.destroy_model_parallel)
    for name in GLOO_GROUPS:
        _must(name in destroy, f"destroy_model_parallel() no longer destroys {name}", MCORE, "megatron_parallel_state")


def test_megatron_layer_construction():
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.core.transformer import transformer_layer
    from megatron.core.transformer.spec_utils import build_module

    from moe_plugin.compat.megatron_layer import TRANSFORMER_LAYER_ARGS, BuildSpec

    params = list(inspect.signature(transformer_layer.TransformerLayer.__init__).parameters)[1:]
    _must(tuple(params[:len(TRANSFORMER_LAYER_ARGS)]) == TRANSFORMER_LAYER_ARGS,
          f"TransformerLayer.__init__ takes {params}, not {list(TRANSFORMER_LAYER_ARGS)} first", MCORE, "megatron_layer")
    offset = list(inspect.signature(transformer_layer.get_transformer_layer_offset).parameters)
    _must(offset[:3] == ["config", "vp_stage", "pp_rank"],
          f"get_transformer_layer_offset takes {offset}", MCORE, "megatron_layer")
    _must("self.layer_number = layer_number + get_transformer_layer_offset(" in inspect.getsource(transformer_layer),
          "TransformerLayer numbers its layer in another way", MCORE, "megatron_layer")
    _must(callable(getattr(ProcessGroupCollection, "use_mpu_process_groups", None)),
          "ProcessGroupCollection.use_mpu_process_groups is gone", MCORE, "megatron_layer")

    class Built:
        def __init__(self, **kwargs):
            self.kwargs = kwargs

    built = build_module(BuildSpec(Built, {"a": 1}, submodules="s"), config="c")
    _must(isinstance(built, Built) and built.kwargs == {"a": 1, "submodules": "s", "config": "c"},
          "build_module no longer builds module(**params, submodules=..., config=...) from a non-ModuleSpec",
          MCORE, "megatron_layer")


def test_deepspeed_group_registry():
    import deepspeed
    from deepspeed.utils import groups as ds_groups

    from moe_plugin.compat.deepspeed_groups import expert_groups, forget_expert_groups, set_expert_groups

    for name in ("_EXPERT_PARALLEL_GROUP", "_EXPERT_PARALLEL_GROUP_RANKS", "_EXPERT_DATA_PARALLEL_GROUP",
                 "_EXPERT_DATA_PARALLEL_GROUP_RANKS"):
        _must(isinstance(getattr(ds_groups, name, None), dict), f"deepspeed.utils.groups no longer has the dict {name}",
              DS, "deepspeed_groups")
    for name in ("mpu", "expert_tensor_parallel_world_size"):
        _must(hasattr(ds_groups, name), f"deepspeed.utils.groups no longer has {name}", DS, "deepspeed_groups")
    engine = inspect.getsource(deepspeed.runtime.engine)
    _must("groups.mpu = self.mpu" in engine, "DeepSpeedEngine no longer sets deepspeed.utils.groups.mpu", DS,
          "deepspeed_groups")
    ep, edp, etp = object(), object(), ds_groups.expert_tensor_parallel_world_size
    try:
        set_expert_groups("compat_guard", ep, [0, 1], edp, [0], etp)
        _must(ds_groups._get_expert_parallel_group("compat_guard") is ep
              and ds_groups._get_expert_data_parallel_group("compat_guard") is edp
              and ds_groups._get_expert_parallel_group_ranks("compat_guard") == [0, 1],
              "DeepSpeed's expert-group getters no longer read the registered dicts", DS, "deepspeed_groups")
        assert expert_groups("compat_guard") == (ep, edp)
    finally:
        forget_expert_groups("compat_guard")
    assert expert_groups("compat_guard") == (None, None)


def test_deepspeed_moe_marker():
    import deepspeed
    from deepspeed.moe.layer import MoE
    from deepspeed.runtime.utils import is_model_parallel_parameter

    from moe_plugin.compat.deepspeed_moe import MARKER_READS, DeepSpeedMoEMarker, mark_model_parallel

    engine = inspect.getsource(deepspeed.runtime.engine)
    _must("if isinstance(module, MoE):\n                self.has_moe_layers = True" in engine,
          "DeepSpeedEngine no longer detects MoE layers by isinstance(module, deepspeed.moe.layer.MoE)", DS,
          "deepspeed_moe")
    for name in MARKER_READS:
        _must(f"module.{name}" in engine, f"DeepSpeedEngine no longer reads {name} of an MoE module", DS,
              "deepspeed_moe")
    _must("module.set_deepspeed_parallelism(self._config.use_data_before_expert_parallel_)" in engine,
          "DeepSpeedEngine calls set_deepspeed_parallelism in another way", DS, "deepspeed_moe")
    own = [n for n in inspect.signature(MoE.set_deepspeed_parallelism).parameters if n != "self"]
    _must(own == ["use_data_before_expert_parallel_"], f"MoE.set_deepspeed_parallelism takes {own}", DS,
          "deepspeed_moe")
    marker = DeepSpeedMoEMarker(8, 2, "ep_size_2", object(), object())
    assert isinstance(marker, MoE) and not list(marker.parameters())
    p = torch.nn.Parameter(torch.zeros(2))
    mark_model_parallel([p])
    _must(is_model_parallel_parameter(p), "is_model_parallel_parameter no longer reads model_parallel", DS,
          "deepspeed_moe")


def test_deepspeed_engine_loss_scale_and_norm():
    import deepspeed
    from deepspeed.runtime.base_optimizer import ZeROOptimizer
    from deepspeed.runtime.fp16.fused_optimizer import FP16_Optimizer
    from deepspeed.runtime.fp16.unfused_optimizer import FP16_UnfusedOptimizer
    from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer

    from moe_plugin.compat.deepspeed_engine import engine_loss_scale, optimizer_loss_scale

    backward = inspect.getsource(deepspeed.runtime.engine)   # backward is wrapped (nvtx): the module's text
    _must("if isinstance(self.optimizer, ZeROOptimizer):\n                loss = self.optimizer.scale_if_loss(loss)\n"
          "            elif self.torch_autocast_z0_gradscaler:" in backward,
          "engine.backward scales the loss in another way", DS, "deepspeed_engine")
    scale = inspect.getsource(ZeROOptimizer.scale_if_loss)
    for name in ("custom_loss_scaler", "external_loss_scale", "torch_autocast_gradscaler", "loss_scaler"):
        _must(f"self.{name}" in scale, f"ZeROOptimizer.scale_if_loss no longer reads {name}", DS, "deepspeed_engine")
    _must("self._global_grad_norm = self.optimizer._global_grad_norm" in inspect.getsource(deepspeed.runtime.engine),
          "engine.step no longer takes the optimizer's _global_grad_norm", DS, "deepspeed_engine")
    for cls in (FP16_Optimizer, FP16_UnfusedOptimizer, DeepSpeedZeroOptimizer):
        _must(isinstance(inspect.getattr_static(cls, "loss_scale", None), property),
              f"{cls.__name__} has no loss_scale property", DS, "deepspeed_engine")

    class Scaler:
        def get_scale(self):
            return 8.0

    zero = ZeROOptimizer.__new__(ZeROOptimizer)
    zero.custom_loss_scaler, zero.torch_autocast_gradscaler, zero.loss_scaler = False, None, None
    engine = type("Engine", (), {})()
    engine.optimizer = zero
    assert engine_loss_scale(engine) == 1.0 and optimizer_loss_scale(engine) is None
    zero.torch_autocast_gradscaler = Scaler()
    assert engine_loss_scale(engine) == 8.0
    engine.optimizer, engine.torch_autocast_z0_gradscaler = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))]), None
    assert engine_loss_scale(engine) == 1.0


def test_deepspeed_zero_flat_buffers():
    from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer

    from moe_plugin.compat.deepspeed_zero import ZERO_ATTRIBUTES

    source = inspect.getsource(DeepSpeedZeroOptimizer.__init__)
    for name in ZERO_ATTRIBUTES + ("optimizer",):
        _must(re.search(rf"self\.{name}(: [^=]+)? = ", source) is not None,
              f"DeepSpeedZeroOptimizer no longer sets {name}", DS, "deepspeed_zero")
    _must("self.bit16_groups_flat[i]" in source and "_update_model_bit16_weights(i)" in source,
          "DeepSpeedZeroOptimizer no longer makes its parameters views of bit16_groups_flat", DS, "deepspeed_zero")


def test_deepspeed_optimizer_state_linking():
    """``link_inner_state`` / ``fill_inner_state``: both optimizers link their inner state lazily
    behind ``_hp_optimizer_states_linked``, and the linked fragments are what ``safe_*`` reach."""
    from deepspeed.runtime.bf16_optimizer import BF16_Optimizer
    from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer
    tensor_fragment = importlib.import_module("deepspeed.utils.tensor_fragment")

    for cls in (DeepSpeedZeroOptimizer, BF16_Optimizer):
        lazy = inspect.getsource(cls._lazy_init_hp_params_optimizer_state)
        _must("if not self._hp_optimizer_states_linked:" in lazy and "self.optimizer.state" in lazy,
              f"{cls.__name__}._lazy_init_hp_params_optimizer_state no longer links self.optimizer.state behind "
              "_hp_optimizer_states_linked", DS, "deepspeed_zero")
    _must("optim_state_key" in inspect.getsource(tensor_fragment.safe_set_full_optimizer_state)
          and "_hp_mapping" in inspect.getsource(tensor_fragment.safe_get_full_optimizer_state),
          "safe_get/set_full_optimizer_state no longer go through _hp_mapping", DS, "deepspeed_zero")


def test_deepspeed_pipeline_module_partitioning():
    from deepspeed.runtime.pipe import module

    source = inspect.getsource(module.PipelineModule)
    _must("self._partition_layers(method=partition_method)" in source,
          "PipelineModule.__init__ no longer partitions through _partition_layers", DS, "deepspeed_pipe")
    _must("self._set_bounds(start=self.parts[stage_id], stop=self.parts[stage_id + 1])" in source
          and "stage_id = self._topo.get_coord(self.global_rank).pipe" in source,
          "PipelineModule._partition_layers no longer sets its bounds from parts and _topo", DS, "deepspeed_pipe")
    bounds = list(inspect.signature(module.PipelineModule._set_bounds).parameters)
    _must(bounds == ["self", "start", "stop"], f"PipelineModule._set_bounds takes {bounds}", DS, "deepspeed_pipe")


def test_deepspeed_checkpoint_engine_writes_every_file_in_save():
    from deepspeed.runtime.checkpoint_engine.torch_checkpoint_engine import TorchCheckpointEngine
    from deepspeed.runtime.engine import DeepSpeedEngine
    from deepspeed.runtime.pipe.module import PipelineModule

    from moe_plugin.compat.deepspeed_checkpoint_engine import RecordingCheckpointEngine

    _must(list(inspect.signature(TorchCheckpointEngine.save).parameters) == ["self", "state_dict", "path"]
          and not TorchCheckpointEngine().is_decoupled(),
          "TorchCheckpointEngine.save(state_dict, path) changed", DS, "deepspeed_checkpoint_engine")
    _must("self.checkpoint_engine = create_checkpoint_engine(" in inspect.getsource(DeepSpeedEngine),
          "DeepSpeedEngine no longer keeps its checkpoint engine in checkpoint_engine", DS,
          "deepspeed_checkpoint_engine")
    writers = {name: inspect.getsource(getattr(DeepSpeedEngine, name))
               for name in ("_save_checkpoint", "_save_moe_checkpoint", "_save_zero_checkpoint")}
    writers["PipelineModule.save_state_dict"] = inspect.getsource(PipelineModule.save_state_dict)
    for name, source in writers.items():
        _must("checkpoint_engine.save(" in source and "torch.save(" not in source,
              f"{name} no longer writes its files through the checkpoint engine's save", DS,
              "deepspeed_checkpoint_engine")
    copies = inspect.getsource(DeepSpeedEngine._save_zero_checkpoint)
    _must(list(inspect.signature(DeepSpeedEngine._copy_recovery_script).parameters) == ["self", "save_path"]
          and "self._copy_recovery_script(save_path)" in copies,
          "DeepSpeedEngine no longer copies its recovery scripts with _copy_recovery_script(save_path) in "
          "_save_zero_checkpoint", DS, "deepspeed_checkpoint_engine")
    recorded = []
    wrapper = RecordingCheckpointEngine(TorchCheckpointEngine(), lambda obj, path: recorded.append(path))
    wrapper.save({"x": 1}, "/nowhere/file.pt")
    assert recorded == ["/nowhere/file.pt"] and wrapper.preserves_storage_sharing() in (True, False)


@pytest.mark.parametrize("module", sorted(p.stem for p in (REPO / "moe_plugin" / "compat")
                                           .glob("*.py") if p.stem != "__init__"))
def test_compat_module_names_its_pinned_versions(module):
    import importlib

    doc = importlib.import_module(f"moe_plugin.compat.{module}").__doc__ or ""
    assert re.search(r"(deepspeed|megatron-core|DeepSpeed|torch)\s+\d+\.\d+", doc), f"compat/{module}.py: no pinned version"


def test_megatron_cpu_rng_tracker_and_buffers():
    from megatron.core.tensor_parallel import random as megatron_random

    from moe_plugin.compat import megatron_cpu

    for name in ("_CUDA_RNG_STATE_TRACKER", "_CUDA_RNG_STATE_TRACKER_INITIALIZED", "_MODEL_PARALLEL_RNG_TRACKER_NAME"):
        _must(hasattr(megatron_random, name), f"megatron.core.tensor_parallel.random no longer has {name}", MCORE,
              "megatron_cpu")
    init = inspect.getsource(megatron_random.initialize_rng_tracker)
    _must("if _CUDA_RNG_STATE_TRACKER_INITIALIZED:\n        return" in init,
          "initialize_rng_tracker() no longer keeps an initialised tracker", MCORE, "megatron_cpu")
    seed = inspect.signature(megatron_random.model_parallel_cuda_manual_seed).parameters
    _must(list(seed)[0] == "seed" and {"tp_rank", "ep_rank", "etp_rank"} <= set(seed),
          f"model_parallel_cuda_manual_seed takes {list(seed)}", MCORE, "megatron_cpu")
    seeding = inspect.getsource(megatron_random.model_parallel_cuda_manual_seed)
    _must("_CUDA_RNG_STATE_TRACKER.reset()" in seeding and seeding.count("_CUDA_RNG_STATE_TRACKER.add(") == 3,
          "model_parallel_cuda_manual_seed no longer resets the tracker and adds its three states", MCORE,
          "megatron_cpu")
    tracker = megatron_random.CudaRNGStatesTracker
    for name in ("reset", "get_states", "set_states", "add", "fork", "is_initialized"):
        _must(callable(getattr(tracker, name, None)), f"CudaRNGStatesTracker.{name} is gone", MCORE, "megatron_cpu")
    fields = set(vars(tracker()))
    _must({"states_", "seeds_", "_is_initialized", "_current_state_name"} <= fields,
          f"CudaRNGStatesTracker keeps {sorted(fields)}", MCORE, "megatron_cpu")
    fork = inspect.getsource(tracker.fork)
    _must('"default-rng"' in fork, "CudaRNGStatesTracker.fork no longer nests by state name", MCORE, "megatron_cpu")
    for name in megatron_cpu.BUFFER_MODULES:
        module = importlib.import_module(name)
        _must(isinstance(module.torch, (type(torch), megatron_cpu._TorchOnCpu)) and module.torch.__name__ == "torch",
              f"{name} no longer imports torch as torch", MCORE, "megatron_cpu")
        _must("torch.cuda.current_device()" in inspect.getsource(module),
              f"{name} no longer allocates on torch.cuda.current_device()", MCORE, "megatron_cpu")


def test_torch_save_files_read_lazily_and_without_running_code(tmp_path):
    """torch's zip format as ``compat/torch_files.py`` reads it: every kind of tensor a checkpoint holds
    comes back bit-exact; an object whose unpickling would run code refuses the file, naming the file and
    its class, and stays an ``Opaque`` when reading is trusted; so does each of DeepSpeed's classes."""
    from moe_plugin.checkpoint.trust import trusting
    from moe_plugin.compat.torch_files import DEEPSPEED_GLOBALS, LazyTensor, Opaque, Refused, TorchFile, safe_load

    marker = tmp_path / "ran"
    base = torch.randn(6, 4)
    tensors = {"f32": torch.randn(3, 5), "bf16": torch.randn(7).bfloat16(), "i64": torch.arange(9),
               "bool": torch.tensor([True, False]), "view": base[2:5], "transposed": base.t(),
               "param": torch.nn.Parameter(torch.ones(2, 2)), "scalar": torch.tensor(3.5), "empty": torch.zeros(0, 3)}
    torch.save({"module": tensors, "shared": [base, base[1]], "planted": _Planted(str(marker)),
                "size": torch.Size([2, 3]), "names": {"a", "b"}}, tmp_path / "f.pt")
    for read in (TorchFile, safe_load):
        with pytest.raises(Refused, match=f"^{tmp_path / 'f.pt'}: holds posix.system, which no file of a checkpoint"):
            read(str(tmp_path / "f.pt"))
    with trusting(), TorchFile(tmp_path / "f.pt") as f:
        module = f.content["module"]
        for name, value in tensors.items():
            _must(isinstance(module[name], LazyTensor) and torch.equal(module[name].read(), value.detach()),
                  f"a {name} tensor no longer reads back from torch.save's zip records", f"torch {torch.__version__}",
                  "torch_files")
        _must(torch.equal(f.content["shared"][1].read(), base[1]), "a view of a shared storage reads otherwise",
              f"torch {torch.__version__}", "torch_files")
        assert isinstance(f.content["planted"], Opaque) and f.content["size"] == torch.Size([2, 3])
    assert not marker.exists()
    from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler
    from deepspeed.runtime.zero.config import ZeroStageEnum

    scaler = DynamicLossScaler(init_scale=8, scale_window=1000, min_scale=1, delayed_shift=1,
                               consecutive_hysteresis=False)
    torch.save({"stage": ZeroStageEnum(1), "scaler": scaler}, tmp_path / "g.pt")
    loaded = safe_load(str(tmp_path / "g.pt"))
    assert loaded["stage"] is ZeroStageEnum(1) and loaded["scaler"].cur_scale == 8
    with TorchFile(tmp_path / "g.pt") as f:
        assert {v.qualname for v in f.content.values()} <= set(DEEPSPEED_GLOBALS)


class _Planted:
    def __init__(self, path: str):
        self.path = path

    def __reduce__(self):
        import os

        return (os.system, (f"touch {self.path}",))


def _deepspeed_files_child(rank: int, world_size: int, out: str, fp16: bool) -> dict:
    """DeepSpeed's own save of a small module at fp32, bf16 and (``fp16``) fp16, ZeRO 0-2: the globals of
    every file."""
    import zipfile

    import deepspeed

    from moe_plugin.compat.torch_files import TorchFile, _Unpickler

    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size))
    seen: dict[str, list[str]] = {}

    class Recording(_Unpickler):
        def find_class(self, module, name):
            seen.setdefault(f"{module}.{name}", []).append(self.file)
            return super().find_class(module, name)

    cases = {"fp32-z0": {}, "fp32-z2": {"zero_optimization": {"stage": 2}}, "bf16-z0": {"bf16": {"enabled": True}},
             "bf16-z1": {"bf16": {"enabled": True}, "zero_optimization": {"stage": 1}},
             "fp16-z0": {"fp16": {"enabled": True}},
             "fp16-z1": {"fp16": {"enabled": True}, "zero_optimization": {"stage": 1}},
             "fp16-z2": {"fp16": {"enabled": True}, "zero_optimization": {"stage": 2}}}
    if not fp16:
        cases = {name: extra for name, extra in cases.items() if not name.startswith("fp16")}
    for name, extra in cases.items():
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.LayerNorm(8))
        config = {"train_batch_size": 1, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
                  "scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 5}}, **extra}
        engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
        dtype = torch.half if name.startswith("fp16") else torch.bfloat16 if name.startswith("bf16") else torch.float32
        loss = engine(torch.randn(1, 8, dtype=dtype)).float().pow(2).mean()
        engine.backward(loss)
        engine.step()
        engine.save_checkpoint(out, tag=name, client_state={"step": 1})
        for file in sorted(os.listdir(os.path.join(out, name))):
            path = os.path.join(out, name, file)
            with zipfile.ZipFile(path) as z:
                record = next(n for n in z.namelist() if n.endswith("/data.pkl"))
                source = TorchFile.__new__(TorchFile)
                source.path, source.strict, source._zip, source._prefix = path, False, z, record[:-len("data.pkl")]
                reader = Recording(source, z.read(record))
                reader.file = f"{name}/{file}"
                reader.load()
    # DeepSpeed's own load through reading_safely: the last tag as saved (fp16 ZeRO-2, else bf16 ZeRO-1),
    # then with an object planted into its optimizer file (the marker must not be written)
    from moe_plugin.checkpoint.errors import CheckpointError
    from moe_plugin.compat.deepspeed_checkpoint_engine import reading_safely

    out_loads = {}
    with reading_safely(engine):   # the last engine: load its own tag
        out_loads["clean"] = engine.load_checkpoint(out, tag=name)[0] is not None
    optim = os.path.join(out, name, next(f for f in sorted(os.listdir(os.path.join(out, name)))
                                         if f.endswith("optim_states.pt")))
    content = torch.load(optim, weights_only=False)
    content["planted"] = _Planted(os.path.join(out, "marker"))
    torch.save(content, optim)
    try:
        with reading_safely(engine):
            engine.load_checkpoint(out, tag=name)
        out_loads["planted"] = "loaded"
    except CheckpointError as err:
        out_loads["planted"] = str(err)
    out_loads["marker"] = os.path.exists(os.path.join(out, "marker"))
    return {"globals": seen, "loads": out_loads, "optim": optim}


@pytest.mark.slow
def test_deepspeed_writes_only_the_admitted_classes(tmp_path):
    """The classes DeepSpeed pickles into its checkpoint files (module, ZeRO and bf16 optimizer files of
    fp32, bf16 and fp16 runs at ZeRO 0-2) are tensors, OrderedDict, torch.Size, dtypes and
    ``DEEPSPEED_GLOBALS``, which a load admits (and nothing else); DeepSpeed's own load reads such a
    tag through ``reading_safely``, and refuses one whose optimizer file holds a planted object. Where
    DeepSpeed's accelerator has no fp16 (many CPUs), the fp16 runs are left out and so is the dynamic loss
    scaler, which only their files hold."""
    from dist import fp16_answer, run_distributed
    from moe_plugin.compat.torch_files import DEEPSPEED_GLOBALS

    fp16 = not fp16_answer()
    result = run_distributed(_deepspeed_files_child, 1, tmp_path, str(tmp_path / "ckpt"), fp16)[0]
    seen, loads = result["globals"], result["loads"]
    assert loads["clean"] and not loads["marker"], loads
    assert loads["planted"].startswith(f"{result['optim']}: holds posix.system, which no file"), loads
    plain = {"collections.OrderedDict", "torch.Size", "torch._utils._rebuild_tensor_v2"}
    others = {g: files[:2] for g, files in seen.items() if g not in plain and g not in DEEPSPEED_GLOBALS
              and not (g.startswith("torch.") and (g.endswith("Storage") or g.split(".")[1] in ("float16", "bfloat16",
                                                                                                "float32")))}
    _must(not others, f"DeepSpeed writes {sorted(others)} into its checkpoint files, which a load refuses",
          f"deepspeed {version('deepspeed')}", "torch_files.DEEPSPEED_GLOBALS")
    expected = {g for g in DEEPSPEED_GLOBALS if fp16 or not g.endswith(".DynamicLossScaler")}
    assert {g for g in seen if g.startswith("deepspeed.")} == expected, sorted(seen)


def test_megatron_attention_takes_the_yarn_factor_from_the_config():
    """``compat/megatron_yarn.py``: Megatron's attention multiplies RoPE's cos and sin by
    ``_yarn_get_concentration_factor_from_config(config)``, which ``set_attention_factor`` sets."""
    import megatron.core.transformer.attention as attention
    from megatron.core.transformer.transformer_config import TransformerConfig

    from moe_plugin.compat.megatron_yarn import attention_factor, set_attention_factor

    source = inspect.getsource(attention.SelfAttention) + inspect.getsource(attention.Attention)
    _must("mscale=_yarn_get_concentration_factor_from_config(self.config)" in source,
          "the attention no longer takes RoPE's factor from the config", f"megatron-core {version('megatron-core')}",
          "megatron_yarn")
    config = TransformerConfig(num_layers=1, hidden_size=8, num_attention_heads=2)
    assert attention_factor(config) == 1.0
    set_attention_factor(config, 1.1386)
    assert abs(attention_factor(config) - 1.1386) < 1e-12


def test_megatron_mla_names_the_plugin_swaps():
    """``compat/megatron_mla.py``: Megatron's MLA module builds its rotary embedding through the module's
    names ``RotaryEmbedding`` / ``YarnRotaryEmbedding`` (swapped at construction), reads ``HAVE_TE`` and
    ``TELinear`` there, gathers the key/value down projection with ``gather_from_tensor_model_parallel_region``
    (swapped for its one call), and de-interleaves the rotated dimensions itself (so the hub's weights fit)."""
    import megatron.core.transformer.multi_latent_attention as mla
    from megatron.core.models.common.embeddings import rope_utils

    where = f"megatron-core {version('megatron-core')}"
    for name in ("RotaryEmbedding", "YarnRotaryEmbedding", "HAVE_TE", "TELinear",
                 "gather_from_tensor_model_parallel_region"):
        _must(hasattr(mla, name), f"multi_latent_attention has no {name}", where, "megatron_mla")
    built = inspect.getsource(mla.MultiLatentAttention.__init__)
    _must("self.rotary_pos_emb = RotaryEmbedding(" in built and "self.rotary_pos_emb = YarnRotaryEmbedding(" in built
          and "isinstance(self.linear_proj, TELinear)" in built, "MLA builds its rotary embedding otherwise", where,
          "megatron_mla")
    gathered = inspect.getsource(mla.MLASelfAttention.get_query_key_value_tensors)
    _must("kv_combined = gather_from_tensor_model_parallel_region(kv_combined)" in gathered
          and "rotary_pos_emb, mscale = self.rotary_pos_emb(" in gathered, "MLA gathers or rotates otherwise", where,
          "megatron_mla")
    applied = inspect.getsource(rope_utils._apply_rotary_pos_emb_bshd)
    _must("if multi_latent_attention:" in applied and "t[..., 0::2]" in applied,
          "MLA's RoPE no longer de-interleaves the rotated dimensions", where, "megatron_mla")
