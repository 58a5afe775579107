"""Cost model of the auto-wrapping pass (SimpleFSDP section 3.3.2, Table 1, Algorithm 1).

* :mod:`.comm`: ``alpha + beta * bytes`` per collective kind, calibrated, cached or
  from fabric defaults;
* :mod:`.compute`: the time of one FX node, measured or by the roofline (the one
  roofline, ``roofline_seconds``, which the planner uses too) and the one "costs
  nothing" rule;
* :mod:`.memory`: bytes of a node's output and a liveness-based peak for a graph;
* :mod:`.state`: the optimizer's state layout: bytes held outside the graphs through a
  step, model-state bytes and the optimizer step's memory traffic per parameter.

Every rank must take the same bucketing decisions, so anything measured is agreed
across ranks before use (see :mod:`simplefsdp.agreement`).
"""

from .comm import CommModel, get_comm_model
from .compute import estimate_graph_compute
from .memory import peak_memory_estimate
from .state import optimizer_state_bytes

__all__ = ["CommModel", "estimate_graph_compute", "get_comm_model", "optimizer_state_bytes",
           "peak_memory_estimate"]
