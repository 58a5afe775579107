"""simplefsdp: PyTorch-native, compiler-friendly Fully Sharded Data Parallel."""

from .compiler.backend import compile_backend
from .data_parallel import MixedPrecisionPolicy, data_parallel, disable_active_parametrization
from .float8 import convert_to_float8
from .mesh import make_mesh
from .offload import CPUOffloadPolicy
from .state_dict import full_state_dict, load_checkpoint, save_checkpoint

__all__ = [
    "CPUOffloadPolicy",
    "MixedPrecisionPolicy",
    "compile_backend",
    "convert_to_float8",
    "data_parallel",
    "disable_active_parametrization",
    "full_state_dict",
    "load_checkpoint",
    "make_mesh",
    "save_checkpoint",
]
