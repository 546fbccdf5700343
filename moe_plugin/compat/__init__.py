"""Every touch of DeepSpeed's or Megatron-Core's private state, behind a named function with a
version guard; what each module relies on: docs/design/compat_upstream.md.
"""
