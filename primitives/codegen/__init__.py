"""Triton code generation: the emit context, kernel templates, the module cache, autotuning."""
