"""The package's layout rules, checked on its source.

Every private torch API (and every torch-version fallback) lives in
``simplefsdp/_torch_compat.py``, so a new torch release is checked in one file. The
check parses each module (no regex over text, so comments and docstrings that name a
private API do not count) and flags:

* ``import torch._x`` / ``from torch._x import ...`` / ``from torch.x import _y``:
  any private component in a torch import;
* an attribute chain on a name bound to torch (``torch._C``, ``torch.ops._c10d_functional``,
  ``dist.distributed_c10d._get_default_store``) with a private component;
* private methods and attributes of torch objects reached through our own variables
  (``pg._get_backend``, ``target._schema``, ``prof.profiler.kineto_results``), by name,
  also as a ``getattr`` string;
* the spellings of torch's symbolic-size hints, a version fallback.

Our own private names (``self._x``, ``module._sf_compute``) are not torch's and pass;
``nn.Module._parameters`` is the one torch attribute the package still touches directly
(see ``_ALLOWED``).
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "simplefsdp"
COMPAT = PACKAGE / "_torch_compat.py"

# Private torch attributes reached through our own variables (not a torch-rooted chain).
_KNOWN_PRIVATE = frozenset({
    "_get_backend", "_allgather_base", "_destroy", "_schema", "_get_root_mesh",
    "_mesh_resources", "kineto_results", "_current_graph_task_id", "_get_default_store",
    "_get_default_group", "_register_work", "_resolve_process_group", "_StridedShard",
    "_disable_current_modes", "_hint", "optimization_hint", "hint_int", "size_hint",
})
# nn.Module's parameter dict: data_parallel swaps parameters in place through it (the
# public setattr would run our gathering property instead).
_ALLOWED = frozenset({"_parameters"})


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def _chain(node: ast.Attribute) -> tuple[str | None, list[str]]:
    """``a.b.c`` -> ("a", ["b", "c"]); the root is None when it is not a plain name."""
    attrs = []
    while isinstance(node, ast.Attribute):
        attrs.append(node.attr)
        node = node.value
    return (node.id if isinstance(node, ast.Name) else None), attrs[::-1]


def private_torch_uses(source: str) -> list[str]:
    """Every private torch use in ``source``, as ``"line: what"``, in line order."""
    tree = ast.parse(source)
    inner = {id(n.value) for n in ast.walk(tree) if isinstance(n, ast.Attribute)}
    torch_names: set[str] = set()  # local names bound to torch modules or objects
    found = []

    def flag(node: ast.AST, what: str) -> None:
        found.append((node.lineno, what))

    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                parts = alias.name.split(".")
                if parts[0] in ("torch", "functorch"):
                    torch_names.add(alias.asname or parts[0])
                    if any(_private(p) for p in parts):
                        flag(node, f"import {alias.name}")
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            parts = node.module.split(".")
            if parts[0] in ("torch", "functorch"):
                for alias in node.names:
                    torch_names.add(alias.asname or alias.name)
                    if any(_private(p) for p in parts) or _private(alias.name):
                        flag(node, f"from {node.module} import {alias.name}")
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and id(node) not in inner:  # whole chains only
            root, attrs = _chain(node)
            private = [a for a in attrs if _private(a) and a not in _ALLOWED]
            if (root in torch_names and private) or set(attrs) & _KNOWN_PRIVATE:
                flag(node, ".".join([root or "<expr>", *attrs]))
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) \
                and node.func.id in ("getattr", "hasattr", "setattr") and len(node.args) >= 2 \
                and isinstance(node.args[1], ast.Constant) \
                and node.args[1].value in _KNOWN_PRIVATE:
            flag(node, f"{node.func.id}(..., {node.args[1].value!r})")
    return [f"{line}: {what}" for line, what in sorted(set(found))]


@pytest.mark.parametrize("snippet", [
    "import torch._dynamo",
    "import torch.utils._pytree as pytree",
    "from torch._guards import detect_fake_mode",
    "from torch.distributed.tensor.placement_types import _StridedShard",
    "from torch.utils import _pytree",
    "from functorch._src import x",
    "import torch\nx = torch._C._current_graph_task_id()",
    "import torch\nc10d = torch.ops._c10d_functional",
    "import torch.distributed as dist\nstore = dist.distributed_c10d._get_default_store()",
    "from torch import distributed as d\nd._x",
    "def f(pg):\n    return pg._get_backend(dev).name()",
    "def f(prof):\n    return prof.profiler.kineto_results.events()",
    "def f(t):\n    return getattr(t, '_schema', None)",
    "from torch.fx.experimental import symbolic_shapes as ss\nss.hint_int(x)",
])
def test_checker_flags_private_uses(snippet):
    assert private_torch_uses(snippet), snippet


@pytest.mark.parametrize("snippet", [
    "import torch\nx = torch.ops.aten.mm.default",
    "import torch.distributed as dist\ndist.get_rank()",
    "from torch.distributed.tensor import DTensor",
    "class A:\n    def f(self):\n        return self._agreement",
    "def f(module, p):\n    module._parameters['w'] = p",
    "def f(module):\n    module._sf_compute = {}",
    "def f():\n    '''torch._C is private'''  # torch._C",
])
def test_checker_passes_public_and_own_names(snippet):
    assert private_torch_uses(snippet) == [], snippet


def test_private_torch_apis_only_in_compat():
    offenders = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        if path == COMPAT:
            continue
        uses = private_torch_uses(path.read_text())
        if uses:
            offenders[str(path.relative_to(PACKAGE.parent))] = uses
    assert not offenders, (
        "private torch APIs outside simplefsdp/_torch_compat.py (add a wrapper there, "
        f"with the torch versions it was checked on): {offenders}")
    assert private_torch_uses(COMPAT.read_text()), "the check would not see the compat uses"


def test_no_module_over_500_lines():
    long = {str(p.relative_to(PACKAGE.parent)): n for p in PACKAGE.rglob("*.py")
            if (n := len(p.read_text().splitlines())) > 500}
    assert not long, f"split these modules (500 lines at most): {long}"
