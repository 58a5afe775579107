"""The parallelisms other than data parallel, one module each, applied to a plain model
from outside and usable without the trainer (a model, a mesh or ``ParallelDims``, plain
options): ``tensor`` (TP + sequence parallel + loss parallel), ``activation_checkpoint``,
``pipeline``, ``context`` and ``ring`` (context parallelism), ``expert`` (MoE expert
parallelism). ``models/parallelize.py`` composes them for a job; see docs/design.md."""
