"""``memory_limit_gb`` is the step's peak: the optimizer state held outside the compiled
graphs shrinks the graphs' budget.
"""

from __future__ import annotations

import pytest
import torch

import simplefsdp as sf
from simplefsdp.compiler import auto_wrap as aw
from simplefsdp.compiler.cost import CommModel, optimizer_state_bytes


def test_outside_bytes_shrink_the_budget():
    params = [torch.nn.Parameter(torch.zeros(10, 10)), torch.nn.Parameter(torch.zeros(5))]
    frozen = torch.nn.Parameter(torch.zeros(100), requires_grad=False)
    assert optimizer_state_bytes("adamw", params + [frozen, params[0]]) == 2 * 105 * 4
    assert optimizer_state_bytes(torch.optim.Adam, params, amsgrad=True) == 3 * 105 * 4
    assert optimizer_state_bytes(torch.optim.SGD(params, lr=1, momentum=0.9), params) == 420
    assert optimizer_state_bytes("sgd", params) == 0
    with pytest.raises(ValueError, match="state_bytes_outside_graphs=..."):
        optimizer_state_bytes("lion", params)
    be = sf.compile_backend(bucketing="auto", memory_limit_gb=1.0,
                            state_bytes_outside_graphs=300_000_000,
                            comm_model=CommModel((0, 0), (0, 0), (0, 0)))
    assert be.graph_budget_bytes == 700_000_000  # the planner gets the rest
    with pytest.raises(ValueError, match="leaves nothing for the compiled graphs"):
        sf.compile_backend(bucketing="auto", memory_limit_gb=0.1,
                           state_bytes_outside_graphs=100_000_000)
    with pytest.raises(ValueError, match="must be a non-negative int"):
        aw.check_outside_bytes(-1, None)
