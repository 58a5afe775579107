"""Compiler-side pieces of simplefsdp: FX passes over graphs that hold computation and
communication, the ``torch.compile`` backend that chains them, and the collective
kernels those graphs need on CPU/gloo."""
