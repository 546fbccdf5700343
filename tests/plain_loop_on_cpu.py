"""Runs examples/simple_loop/train_plain_mcore.py (the loop before the port) on CPU ranks, for
tests/e2e/test_porting.py: the two pieces of it that need CUDA are swapped first, Megatron-Core's
local attention (for the plugin's ``cpu_friendly_spec`` of the same spec) and
``model_parallel_cuda_manual_seed`` (a no-op: with dropout 0 nothing draws from its generators).
Everything else (``initialize_model_parallel``, the mpu shim, ``deepspeed.initialize``, the step,
the engine's checkpoints) runs as written. Usage: ``deepspeed --num_gpus N plain_loop_on_cpu.py ARGS``."""
import importlib.util
import sys
from pathlib import Path

from moe_plugin.compat.process_exit import exit_process
from moe_plugin.integration.megatron import cpu_friendly_spec

SCRIPT = Path(__file__).resolve().parents[1] / "examples" / "simple_loop" / "train_plain_mcore.py"
spec = importlib.util.spec_from_file_location("train_plain_mcore", SCRIPT)
plain = importlib.util.module_from_spec(spec)
spec.loader.exec_module(plain)
local_spec = plain.get_gpt_layer_local_spec
plain.get_gpt_layer_local_spec = lambda *a, **k: cpu_friendly_spec(local_spec(*a, **k))
plain.tensor_parallel.model_parallel_cuda_manual_seed = lambda seed: None
plain.main()
exit_process(0)   # the interpreter's teardown races gloo's threads (moe_plugin/compat/process_exit.py)
