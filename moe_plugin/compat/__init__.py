"""Every touch of DeepSpeed's or Megatron-Core's private state, behind a named function, one file
per upstream concern, each with a version-guard test:

* ``shm_buffers``: the shared-memory all-reduce buffers DeepSpeed's CPU accelerator creates in
  ``/dev/shm`` (their names; ``remove_shm_buffers`` for a job's own).
* ``deepspeed_checkpoint``: DeepSpeed's checkpoint file names and the loader behaviour checkpoints rely on.
* ``megatron_cpu``: Megatron-Core's RNG tracker over the CPU generator and its sequence-parallel
  buffers on the CPU, for the CPU accelerator (``integration.seeding.seed_megatron_rng`` applies them).
* ``megatron_mla``: Megatron-Core's multi-latent attention built and trained right on any device.
* ``megatron_parallel_state``, ``megatron_layer``, ``deepspeed_groups``, ``deepspeed_moe``,
  ``deepspeed_engine``, ``deepspeed_zero``, ``deepspeed_pipe``: see each module's docstring.
"""
