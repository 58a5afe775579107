"""Compiler-side pieces of simplefsdp: FX passes over graphs that hold computation and
communication, their cost model, and the ``torch.compile`` backend that chains them."""
