"""Glue to Megatron-Core and DeepSpeed. Import the submodules directly (they import Megatron):

* ``megatron``: GPT layer/block specs with the plugin's MoE MLP (``gpt_moe_spec``, ``moe_layer_spec``,
  ``cpu_friendly_spec``, ``megatron_lm_spec``); ``transformer_config`` (re-exported as
  ``moe_plugin.transformer_config``): Megatron's ``TransformerConfig`` with the block's parallel sizes.
* ``sp_grads``: sequence-parallel gradients summed over TP (``sequence_parallel_grad_hooks``, which
  ``initialize`` installs; ``allreduce_sequence_parallel_grads`` for a loop of one's own).
* ``cpu_modules``: ``SDPAttention`` and ``TorchNorm``, the CPU-capable spec pieces.
* ``megatron_lm_spec``: the module-level ``spec`` for Megatron-LM's ``--spec``.
* ``deepspeed``: ``initialize`` (re-exported as ``moe_plugin.initialize``): config and world size
  checked, groups built and registered, dense/expert param groups, ``deepspeed.initialize``.
* ``summary``: ``RunSummary`` (``initialize``'s ``result.summary``, printed on rank 0): group sizes,
  MoE layers, experts per rank, dense / expert / active parameters, a memory estimate per rank.
* ``memory_estimate``: that estimate, the busiest rank's peak part by part (weights, optimizer,
  gradients, DeepSpeed's buckets, activations, runtime), and the stop at start when it does not fit.
* ``pipeline``: ``gpt_pipeline_module``, a Megatron-Core GPT with MoE layers as a DeepSpeed
  ``PipelineModule`` (Megatron's stage split, per-piece seeds, ``GPTModel`` key names).
* ``pipe_topology``: ``pipeline_topology``, DeepSpeed's ``ProcessTopology`` from the rank layout.
* ``seeding``: layer seeds that make every layout start from the same weights; ``seed_megatron_rng``
  (re-exported as ``moe_plugin.seed_megatron_rng``, ``initialize`` calls it): Megatron's RNG tracker
  seeded as Megatron-LM seeds it, over the CPU generator on the CPU accelerator.
* ``expert_params``: what DeepSpeed's engine needs to treat our expert parameters as MoE ones.
* ``monitor``: ``ExpertMetrics``, expert load per MoE layer over a step (tokens per expert,
  imbalance, dropped fraction, aux and z loss) into DeepSpeed's monitor, and a short log line.
* ``grad_norm``: the global gradient norm over dense, TP-sharded and expert gradients, each once.
* ``step_boundary``: ``StepBoundary`` (``initialize``'s ``result.step_boundary``): once per optimizer
  step, the aux-loss-free bias update (``bias_update_rate``) and the global balance counts reset.
* ``guard``: ``TrainingGuard`` (``initialize``'s ``result.guard``), checked after every optimizer step:
  non-finite gradients (fp32/bf16) or fp16 steps skipped in a row stop the run on every rank with
  one message; slow-step line. ``GradientWatch``: the hooks that name the parameter.
* ``preemption``: ``ExitRequest`` (re-exported as ``moe_plugin.ExitRequest``): SIGTERM / SIGUSR1 caught
  as a flag and a wall-time limit, agreed by every rank at a step boundary (one all-reduce), so that a
  loop saves and exits with ``EXIT_STATUS`` (75) together.

Checkpoints (``save_checkpoint``, ``load_checkpoint``, resharding, export) are the package
``moe_plugin.checkpoint``.
"""
