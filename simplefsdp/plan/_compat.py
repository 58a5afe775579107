"""The private torch names the planner needs, in one place (to move into
``simplefsdp._torch_compat`` once that module exists)."""

from torch._dynamo import reset as dynamo_reset
from torch._dynamo.backends.common import aot_autograd
from torch._functorch import config as functorch_config
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.testing._internal.distributed.fake_pg import FakeStore

__all__ = ["FakeStore", "FakeTensorMode", "aot_autograd", "dynamo_reset", "eager_backward"]


def eager_backward():
    """Context: AOTAutograd compiles the backward graph with the forward, not lazily at
    the first backward, so capturing needs no run of the forward."""
    return functorch_config.patch(force_non_lazy_backward_lowering=True)
