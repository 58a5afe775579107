"""Parallelisms other than data parallel, each applied to a plain model from outside
(``expert``: MoE expert parallelism)."""
