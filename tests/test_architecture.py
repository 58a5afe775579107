"""The package's layout rules, checked on its source.

Every private torch API (and every torch-version fallback) lives in
``simplefsdp/_torch_compat/`` (``__init__.py`` and ``internals.py``), so a new torch
release is checked in one place. The check parses each module (no regex over text, so
comments and docstrings that name a private API do not count) and flags:

* ``import torch._x`` / ``from torch._x import ...`` / ``from torch.x import _y``:
  any private component in a torch import;
* an attribute chain on a name bound to torch (``torch._C``, ``torch.ops._c10d_functional``,
  ``dist.distributed_c10d._get_default_store``) with a private component;
* private methods and attributes of torch objects reached through our own variables
  (``pg._get_backend``, ``target._schema``, ``prof.profiler.kineto_results``), by name,
  also as a ``getattr`` string;
* the spellings of torch's symbolic-size hints, a version fallback;
* a private member of a torch class overridden in a subclass (``class S(ParallelStyle):
  def _apply``), the base resolved through its import;
* private torch names spelled as strings outside docstrings: a ``torch._`` module path
  (a logger's name), a private op namespace (``_c10d_functional``, ``_dtensor``), a private
  aten op (``"_scaled_dot_product_flash_attention"``).

Our own private names (``self._x``, ``module._sf_compute``) are not torch's and pass;
``nn.Module._parameters`` is the one torch attribute the package still touches directly
(see ``_ALLOWED``).
"""

from __future__ import annotations

import ast
import functools
import re
from pathlib import Path

import pytest

pytestmark = pytest.mark.quick  # unit checks in one process: the whole file is in the quick tier

PACKAGE = Path(__file__).resolve().parent.parent / "simplefsdp"
COMPAT = PACKAGE / "_torch_compat"

# Private torch attributes reached through our own variables (not a torch-rooted chain).
_KNOWN_PRIVATE = frozenset({
    "_get_backend", "_allgather_base", "_destroy", "_schema", "_get_root_mesh",
    "_mesh_resources", "kineto_results", "_current_graph_task_id", "_get_default_store",
    "_get_default_group", "_register_work", "_resolve_process_group", "_StridedShard",
    "_disable_current_modes", "_hint", "optimization_hint", "hint_int", "size_hint",
    "checkpoint_fn", "_checkpoint_wrapped_module",  # torch's checkpoint wrapper's members
})
# torch.ops namespaces that are torch's own (private): spelled only in _torch_compat.
_PRIVATE_OP_NAMESPACES = frozenset({"_c10d_functional", "_dtensor"})
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


def _docstrings(tree: ast.AST) -> set[int]:
    """ids of the docstring constants of ``tree``'s module, classes and functions."""
    return {id(n.body[0].value) for n in ast.walk(tree)
            if isinstance(n, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef)
            and n.body and isinstance(n.body[0], ast.Expr)
            and isinstance(n.body[0].value, ast.Constant)}


def _private_torch_string(text: str, op_name: bool) -> bool:
    """A string naming a private torch thing: a ``torch._`` module path, a private op
    namespace (alone or as ``ns::op``), or, where it is used as an op's name
    (``op_name``: an element of a literal collection, ``getattr``'s name), a private aten
    op."""
    import torch

    if text.startswith("torch._") or text.split("::")[0] in _PRIVATE_OP_NAMESPACES:
        return True
    return op_name and bool(re.fullmatch(r"_[a-z][a-z0-9_]*", text)) \
        and hasattr(torch.ops.aten, text)


def _torch_base(base: ast.expr, imported: dict[str, str]):
    """The torch class a class statement's base names (``ParallelStyle``, ``nn.Module``),
    resolved through the module's own torch imports; None for any other base."""
    import importlib

    root, attrs = _chain(base) if isinstance(base, ast.Attribute) else (
        getattr(base, "id", None), [])
    if root not in imported:
        return None
    try:
        obj = importlib.import_module(imported[root])
    except ImportError:
        module, _, name = imported[root].rpartition(".")
        obj = getattr(importlib.import_module(module), name, None)
    for attr in attrs:
        obj = getattr(obj, attr, None)
    return obj if isinstance(obj, type) else None


def private_torch_uses(source: str) -> list[str]:
    """Every private torch use in ``source``, as ``"line: what"``, in line order."""
    tree = ast.parse(source)
    inner = {id(n.value) for n in ast.walk(tree) if isinstance(n, ast.Attribute)}
    torch_names: set[str] = set()  # local names bound to torch modules or objects
    imported: dict[str, str] = {}  # local name -> the torch module or object it names
    found = []

    def flag(node: ast.AST, what: str) -> None:
        found.append((node.lineno, what))

    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                parts = alias.name.split(".")
                if parts[0] in ("torch", "functorch"):
                    torch_names.add(alias.asname or parts[0])
                    imported[alias.asname or parts[0]] = alias.name if alias.asname else parts[0]
                    if any(_private(p) for p in parts):
                        flag(node, f"import {alias.name}")
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            parts = node.module.split(".")
            if parts[0] in ("torch", "functorch"):
                for alias in node.names:
                    torch_names.add(alias.asname or alias.name)
                    imported[alias.asname or alias.name] = f"{node.module}.{alias.name}"
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
    docstrings = _docstrings(tree)
    op_names = {id(e) for n in ast.walk(tree) if isinstance(n, ast.List | ast.Tuple | ast.Set)
                for e in n.elts} | {id(n.args[1]) for n in ast.walk(tree)
                                    if isinstance(n, ast.Call) and len(n.args) > 1
                                    and getattr(n.func, "id", "") in ("getattr", "hasattr")}
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and isinstance(node.value, str) \
                and id(node) not in docstrings \
                and _private_torch_string(node.value, id(node) in op_names):
            flag(node, f"the string {node.value!r}")
        elif isinstance(node, ast.ClassDef):
            bases = [b for b in (_torch_base(b, imported) for b in node.bases) if b]
            for item in node.body:
                if isinstance(item, ast.FunctionDef | ast.AsyncFunctionDef) \
                        and _private(item.name) and any(hasattr(b, item.name) for b in bases):
                    flag(item, f"{node.name}.{item.name} overrides a private torch member")
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
    # attribute access on torch classes, private strings, private overrides (issue 45)
    "def f(block):\n    return block.checkpoint_fn.keywords",
    "def f(block):\n    return getattr(block, '_checkpoint_wrapped_module', None)",
    "import logging\nlogging.getLogger('torch._higher_order_ops.wrap')",
    "import torch\nlib = torch.library.Library('_c10d_functional', 'IMPL')",
    "def f(name):\n    return name.startswith('_c10d_functional::')",
    "NAMESPACES = {'c10d', '_dtensor'}",
    "import torch\nops = [getattr(torch.ops.aten, n) for n in ['_efficient_attention_forward']]",
    "import torch\nop = getattr(torch.ops.aten, '_scaled_dot_product_flash_attention')",
    "from torch.distributed.tensor.parallel import ParallelStyle\n"
    "class S(ParallelStyle):\n    def _apply(self, module, mesh):\n        return module",
    "from torch import nn\nclass M(nn.Module):\n    def _apply(self, fn):\n        return self",
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
    # our own private helpers on a torch subclass, our own strings, docstrings
    "from torch import nn\nclass M(nn.Module):\n    def _sf_gather(self):\n        return 1",
    "KEY = '_sf_compute'\nNAME = 'simplefsdp_data_parallel_groups'",
    "def f():\n    '''calls _c10d_functional::all_gather_into_tensor'''",
    "def f(kind):\n    return kind + '_backward'",  # an aten op's name, but not used as one
])
def test_checker_passes_public_and_own_names(snippet):
    assert private_torch_uses(snippet) == [], snippet


def test_private_torch_apis_only_in_compat():
    offenders = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        if path.is_relative_to(COMPAT):
            continue
        uses = private_torch_uses(path.read_text())
        if uses:
            offenders[str(path.relative_to(PACKAGE.parent))] = uses
    assert not offenders, (
        "private torch APIs outside simplefsdp/_torch_compat/ (add a wrapper there, "
        f"with the torch versions it was checked on): {offenders}")
    for path in sorted(COMPAT.glob("*.py")):
        assert private_torch_uses(path.read_text()), f"the check would not see {path.name}'s"


def test_no_module_over_500_lines():
    long = {str(p.relative_to(PACKAGE.parent)): n for p in PACKAGE.rglob("*.py")
            if (n := len(p.read_text().splitlines())) > 500}
    assert not long, f"split these modules (500 lines at most): {long}"


# ------------------------------------------------------------------ one owner per fact
# Issue 26 (debt 2): each of these is defined once in the package, and second spellings
# (a literal list of collective kinds, 16 or 36 bytes per parameter, a block's parameters
# from the FFN width, a roofline's memory term) stay out of the rest of it.

def _sources() -> dict[str, str]:
    """``{path relative to the repository: source}`` of every module of the package."""
    return {str(p.relative_to(PACKAGE.parent)): p.read_text()
            for p in sorted(PACKAGE.rglob("*.py"))}


@functools.cache
def _parse(source: str) -> ast.Module:
    return ast.parse(source)


def _defs(sources: dict[str, str], kind: type, match) -> list[tuple[str, str]]:
    """``(path, name)`` of every ``kind`` definition (a function or class, at any depth)
    or module-level assignment (``kind=ast.Assign``) whose name satisfies ``match``."""
    found = []
    for path, source in sources.items():
        tree = _parse(source)
        if kind is ast.Assign:  # annotated or not
            names = [t.id for n in tree.body if isinstance(n, ast.Assign | ast.AnnAssign)
                     for t in (n.targets if isinstance(n, ast.Assign) else [n.target])
                     if isinstance(t, ast.Name)]
        else:
            names = [n.name for n in ast.walk(tree) if isinstance(n, kind)
                     or (kind is ast.FunctionDef and isinstance(n, ast.AsyncFunctionDef))]
        found += [(path, name) for name in names if match(name)]
    return sorted(found)


_KIND_NAMES = frozenset({"all_gather", "reduce_scatter", "all_reduce",
                         "all_gather_into_tensor", "reduce_scatter_tensor"})
# Issue 45: the choice lists, each a Literal in its owner with the tuple derived from it.
_CHOICES = {frozenset({"fully_shard", "hybrid_shard", "replicate"}): "simplefsdp/data_parallel.py",
            frozenset({"inductor", "aot_eager"}): "simplefsdp/compiler/backend.py",
            frozenset({"none", "manual", "auto", "greedy"}): "simplefsdp/compiler/backend.py",
            frozenset({"none", "selective", "full"}): "simplefsdp/config/job.py"}
_DTYPE_NAMES = frozenset({"float32", "bfloat16", "float16"})


def _small_fact_spellings(path: str, tree: ast.Module) -> list[str]:
    """Issue 45's small facts spelled a second time: a dtype name map (``config.job.DTYPES``
    owns it), an MFU (``hardware.model_flops_utilization``), a DTensor's local shard
    inline (``mesh.local_shard``), a class built with ``type(name, bases, attrs)``
    (``module_swap.derived_class``), a choice list written out (its ``Literal`` and the
    tuple derived from it), the shipped corpus's file name (``corpus.text``), a lambda in
    a model family's entry (the Llama family's named functions)."""
    found = []
    literal_args = {id(n.slice) for n in ast.walk(tree) if isinstance(n, ast.Subscript)
                    and getattr(n.value, "id", "") == "Literal"}
    for n in ast.walk(tree):
        where = f"{path}:{getattr(n, 'lineno', 0)}"
        if isinstance(n, ast.Dict) and not path.endswith("config/job.py") and any(
                {getattr(k, "value", None), getattr(v, "value", None)} & _DTYPE_NAMES
                and {getattr(k, "attr", None), getattr(v, "attr", None)} & _DTYPE_NAMES
                for k, v in zip(n.keys, n.values, strict=True)):
            found.append(f"{where}: a dtype name map")
        if isinstance(n, ast.BinOp) and isinstance(n.op, ast.Div) \
                and "flops_per_token" in _mentioned(n.left) \
                and _mentioned(n.right) & {"peak", "bf16_flops", "peak_flops"} \
                and not path.endswith("simplefsdp/hardware.py"):
            found.append(f"{where}: an MFU")
        if isinstance(n, ast.IfExp) and isinstance(n.body, ast.Call) \
                and getattr(n.body.func, "attr", "") == "to_local" \
                and "DTensor" in _mentioned(n.test) and not path.endswith("simplefsdp/mesh.py"):
            found.append(f"{where}: a local shard inline")
        if isinstance(n, ast.Call) and getattr(n.func, "id", "") == "type" \
                and len(n.args) == 3 and not path.endswith("module_swap.py"):
            found.append(f"{where}: a class built with type()")
        if isinstance(n, ast.Tuple | ast.List | ast.Set) and len(n.elts) > 1:
            values = frozenset(getattr(e, "value", None) for e in n.elts)
            owner = _CHOICES.get(values)
            if owner and not (id(n) in literal_args and path == owner):
                found.append(f"{where}: a choice list {sorted(values)}")
        if isinstance(n, ast.Constant) and n.value == "shakespeare.txt" \
                and not path.endswith("corpus/text.py"):
            found.append(f"{where}: the shipped corpus's file")
        if isinstance(n, ast.Call) and getattr(n.func, "attr", getattr(n.func, "id", "")) \
                == "ModelFamily" and any(isinstance(k.value, ast.Lambda) for k in n.keywords):
            found.append(f"{where}: a lambda in a model family's entry")
    return found


def second_spellings(sources: dict[str, str]) -> list[str]:
    """The old duplicates, as ``"path:line: what"``: a literal collection naming two or
    more collective kinds (``CollectiveKind`` is the list); 16 or 36 times a parameter
    count (``cost.state`` owns the optimizer's bytes and traffic); arithmetic on
    ``ffn_hidden_dim(...)`` outside ``models/llama.py`` (``block_matmul_params``); a
    division by a memory bandwidth outside ``roofline_seconds``'s module."""
    found = []
    for path, source in sources.items():
        found += _small_fact_spellings(path, _parse(source))
        for n in ast.walk(_parse(source)):
            where = f"{path}:{getattr(n, 'lineno', 0)}"
            if isinstance(n, ast.Tuple | ast.List | ast.Set | ast.Dict):
                elts = list(n.keys) + list(n.values) if isinstance(n, ast.Dict) else n.elts
                kinds = {e.value for e in elts if isinstance(e, ast.Constant)} & _KIND_NAMES
                if len(kinds) >= 2:
                    found.append(f"{where}: collective kinds listed {sorted(kinds)}")
            if not isinstance(n, ast.BinOp):
                continue
            for a, b in ((n.left, n.right), (n.right, n.left)):
                names = {x.id for x in ast.walk(b) if isinstance(x, ast.Name)} | {
                    x.attr for x in ast.walk(b) if isinstance(x, ast.Attribute)}
                if isinstance(n.op, ast.Mult) and isinstance(a, ast.Constant) \
                        and a.value in (16, 36) and any("param" in x for x in names):
                    found.append(f"{where}: {a.value} bytes per parameter")
                if isinstance(a, ast.Call) and getattr(a.func, "id", "") == "ffn_hidden_dim" \
                        and not path.endswith("models/llama.py"):
                    found.append(f"{where}: a block's parameters from ffn_hidden_dim")
            right = {x.attr for x in ast.walk(n.right) if isinstance(x, ast.Attribute)} | {
                x.id for x in ast.walk(n.right) if isinstance(x, ast.Name)}
            if isinstance(n.op, ast.Div) and "mem_bandwidth_Bps" in right \
                    and not path.endswith("compiler/cost/compute.py"):
                found.append(f"{where}: a roofline's memory term")
    return sorted(found)


def test_one_definition_each():
    src = _sources()
    fn, cls = ast.FunctionDef, ast.ClassDef
    assert _defs(src, fn, lambda n: "roofline" in n) == [
        ("simplefsdp/compiler/cost/compute.py", "roofline_seconds")]
    # the step simulator: the plan-level and the op-level two-stream model, one module
    assert {p for p, _ in _defs(src, fn, lambda n: n.startswith("simulate"))} == {
        "simplefsdp/compiler/simulate.py"}
    assert _defs(src, cls, lambda n: n == "Fabric") == [("simplefsdp/hardware.py", "Fabric")]
    assert _defs(src, cls, lambda n: "CollectiveKind" in n) == [
        ("simplefsdp/compiler/collectives.py", "CollectiveKind")]
    llama = "simplefsdp/models/llama.py"
    assert _defs(src, fn, lambda n: n in ("block_matmul_params", "attention_flops")) == [
        (llama, "attention_flops"), (llama, "block_matmul_params")]
    # FLOPs per token: Llama's; hf/hooks.py's is the Hugging Face family's registered entry
    assert _defs(src, fn, lambda n: n == "flops_per_token") == [
        ("simplefsdp/hf/hooks.py", "flops_per_token"), (llama, "flops_per_token")]
    state = "simplefsdp/compiler/cost/state.py"
    assert _defs(src, ast.Assign, lambda n: n == "STATE_TENSORS_PER_PARAM") == [
        (state, "STATE_TENSORS_PER_PARAM")]
    assert _defs(src, fn, lambda n: n.endswith("bytes_per_param")) == [
        (state, "model_state_bytes_per_param"), (state, "optimizer_traffic_bytes_per_param")]
    # issue 45: the dtype map, MFU, local shard, class swap, choice lists, corpus path
    job = "simplefsdp/config/job.py"
    assert _defs(src, ast.Assign, lambda n: "DTYPE" in n) == [(job, "DTYPES")]
    assert _defs(src, fn, lambda n: "flops_utilization" in n or n == "mfu") == [
        ("simplefsdp/hardware.py", "model_flops_utilization")]
    assert _defs(src, fn, lambda n: n in ("local_shard", "_local", "_to_local")) == [
        ("simplefsdp/mesh.py", "local_shard")]
    assert _defs(src, fn, lambda n: n in ("derived_class", "_subclass", "_routed_class")) == [
        ("simplefsdp/module_swap.py", "derived_class")]
    assert _defs(src, ast.Assign, lambda n: n in ("MODES", "BACKENDS", "BUCKETING", "AC_MODES")
                 ) == [("simplefsdp/bench/ring_overlap.py", "MODES"),  # its own: what overlaps
                       ("simplefsdp/compiler/backend.py", "BACKENDS"),
                       ("simplefsdp/compiler/backend.py", "BUCKETING"), (job, "AC_MODES"),
                       ("simplefsdp/data_parallel.py", "MODES")]
    assert _defs(src, fn, lambda n: n == "shipped_corpus") == [
        ("simplefsdp/corpus/text.py", "shipped_corpus")]
    assert second_spellings(src) == []


@pytest.mark.parametrize("snippet, what", [
    ("KINDS = ('all_gather', 'reduce_scatter')", "collective kinds listed"),
    ("short = {'all_gather': 'AG', 'all_reduce': 'AR'}", "collective kinds listed"),
    ("def f(params):\n    return 16 * params", "16 bytes per parameter"),
    ("def f(n_params):\n    return n_params * 36 / 1e9", "36 bytes per parameter"),
    ("def f(a):\n    return 3 * a.dim * ffn_hidden_dim(a)", "from ffn_hidden_dim"),
    ("def f(b, dev):\n    return b / (dev.spec.mem_bandwidth_Bps * 0.7)", "memory term"),
    ("D = {'bfloat16': torch.bfloat16, 'float32': torch.float32}", "dtype name map"),
    ("NAMES = {torch.float16: 'float16'}", "dtype name map"),
    ("def f(args, tps, dev):\n    return flops_per_token(args) * tps / dev.spec.bf16_flops",
     "an MFU"),
    ("def f(s, tps):\n    return s.flops_per_token * tps / (s.peak * s.world)", "an MFU"),
    ("def f(t):\n    return t.to_local() if isinstance(t, DTensor) else t", "local shard"),
    ("def f(cls, mixin):\n    return type(f'X{cls.__name__}', (mixin, cls), {})",
     "class built with type()"),
    ("MODES = ('fully_shard', 'replicate', 'hybrid_shard')", "a choice list"),
    ("def f(x: Literal['inductor', 'aot_eager']):\n    pass", "a choice list"),
    ("AC = ['none', 'selective', 'full']", "a choice list"),
    ("P = resources.files('simplefsdp') / 'data' / 'shakespeare.txt'", "corpus's file"),
    ("F = registry.ModelFamily(name='x', fingerprint=lambda cfg: {})", "a lambda in a model"),
])
def test_second_spellings_are_flagged(snippet, what):
    found = second_spellings({"simplefsdp/plan/x.py": snippet})
    assert len(found) == 1 and what in found[0], found


# ------------------------------------------------------------------ mesh rules
# Issue 26 (debt 1): ParallelDims (simplefsdp/mesh.py) is the one place that computes a
# degree or a rank's coordinate; the package and the scripts ask it.

_DEGREE_NAMES = frozenset({"pp", "dp_replicate", "dp_shard", "cp", "cp_ring", "cp_ulysses",
                           "tp", "ep"})
MESH = "simplefsdp/mesh.py"


def _mentioned(node: ast.AST) -> set[str]:
    return {x.id for x in ast.walk(node) if isinstance(x, ast.Name)} | {
        x.attr for x in ast.walk(node) if isinstance(x, ast.Attribute)}


def mesh_rule_spellings(sources: dict[str, str]) -> list[str]:
    """Mesh rules computed outside ``mesh.py``, as ``"path:line: what"``: arithmetic
    combining two different degrees (``gpus // (tp * pp)``; a ratio of one degree, e.g.
    a traced shard count over the planned one, is a scale, not a rule), and a rank's
    coordinate read off a mesh (``get_local_rank``, ``get_coordinate``)."""
    found = []
    for path, source in sources.items():
        if path == MESH:
            continue
        for n in ast.walk(_parse(source)):
            where = f"{path}:{getattr(n, 'lineno', 0)}"
            if isinstance(n, ast.BinOp) and isinstance(
                    n.op, ast.Mult | ast.FloorDiv | ast.Div | ast.Mod):
                left, right = _mentioned(n.left) & _DEGREE_NAMES, \
                    _mentioned(n.right) & _DEGREE_NAMES
                if left and right and len(left | right) >= 2:
                    found.append(f"{where}: degrees combined {sorted(left | right)}")
            if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute) \
                    and n.func.attr in ("get_local_rank", "get_coordinate"):
                found.append(f"{where}: a rank coordinate from {n.func.attr}")
    return sorted(found)


def test_parallel_dims_is_the_one_owner_of_mesh_rules():
    src = _sources()
    scripts = PACKAGE.parent / "scripts"
    src.update({str(p.relative_to(PACKAGE.parent)): p.read_text()
                for p in sorted(scripts.glob("*.py"))})
    assert _defs(src, ast.ClassDef, lambda n: n in ("ParallelDims", "Coords")) == [
        (MESH, "Coords"), (MESH, "ParallelDims")]
    owned = ("dp_degree", "dp_shard_cp", "coords", "local_rank", "coordinate", "build_mesh",
             "data_parallel_mesh", "expert_mesh", "shard_mesh", "world_size")
    assert {p for p, _ in _defs(src, ast.FunctionDef, lambda n: n in owned)} == {MESH}
    assert mesh_rule_spellings(src) == []


@pytest.mark.parametrize("snippet, what", [
    ("def f(gpus, tp, pp):\n    return gpus // (tp * pp)", "degrees combined"),
    ("def f(p):\n    return p.dp_replicate * p.dp_shard", "degrees combined"),
    ("def f(mesh):\n    return mesh['pp'].get_local_rank()", "get_local_rank"),
    ("def f(mesh):\n    return mesh.get_coordinate()", "get_coordinate"),
])
def test_mesh_rule_spellings_are_flagged(snippet, what):
    found = mesh_rule_spellings({"simplefsdp/plan/x.py": snippet})
    assert len(found) == 1 and what in found[0], found


def test_a_ratio_of_one_degree_is_not_a_mesh_rule():
    assert mesh_rule_spellings({"simplefsdp/plan/x.py":
                                "def f(tr, p):\n    return tr.key.dp_shard / p.dp_shard"}) == []


# ------------------------------------------------------------------ size of functions

MAX_FUNCTION_LINES = 80


def long_functions(sources: dict[str, str]) -> dict[str, int]:
    """``{"path:function": lines}`` of every function longer than the cap, its docstring
    not counted (a docstring says what and why; the cap is on the code)."""
    long = {}
    for path, source in sources.items():
        for n in ast.walk(_parse(source)):
            if not isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef):
                continue
            lines = n.end_lineno - n.lineno + 1
            first = n.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant) \
                    and isinstance(first.value.value, str):
                lines -= first.end_lineno - first.lineno + 1
            if lines > MAX_FUNCTION_LINES:
                long[f"{path}:{n.name}"] = lines
    return long


def test_no_function_over_80_lines():
    long = long_functions(_sources())
    assert not long, f"split these functions ({MAX_FUNCTION_LINES} lines at most): {long}"


def test_long_function_is_flagged_without_its_docstring():
    body = "".join(f"    x{i} = {i}\n" for i in range(79))
    doc = '    """' + "\n".join(["why"] * 30) + '"""\n'
    short = f"def f():\n{doc}{body}"  # 80 lines of code, 30 of docstring
    assert long_functions({"simplefsdp/x.py": short}) == {}
    assert long_functions({"simplefsdp/x.py": short + "    return x0\n"}) == {
        "simplefsdp/x.py:f": 81}


# ------------------------------------------------------------------ the trainer on top
# Issue 45: ``train/`` is the top of the package; nothing below imports it. A command-line
# entry point outside ``train/`` may run the trainer, importing it inside a function only
# (so importing the entry point's package does not load the trainer).
# a command line (python -m ...) that reads the trainer's files inside its functions
ENTRY_POINTS = frozenset({"simplefsdp.bench.long_context", "simplefsdp.generate"})
LOWER = ("simplefsdp.parallel", "simplefsdp.plan", "simplefsdp.bench", "simplefsdp.corpus",
         "simplefsdp.hf", "simplefsdp.models", "simplefsdp.config", "simplefsdp.compiler")


def _module_name(path: str) -> str:
    parts = path.removesuffix(".py").split("/")
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def upward_train_imports(sources: dict[str, str]) -> list[str]:
    """Modules outside ``simplefsdp.train`` that import it, as ``"module -> target"``; an
    entry point (``ENTRY_POINTS``, ``__main__`` modules) only where the import runs when
    the module is imported (at its top level)."""
    graph = import_graph(sources)
    found = []
    for module, targets in sorted(graph.items()):
        if module == "simplefsdp.train" or module.startswith("simplefsdp.train."):
            continue
        up = sorted(t for t in targets
                    if t == "simplefsdp.train" or t.startswith("simplefsdp.train."))
        if not up:
            continue
        if module in ENTRY_POINTS or module.endswith(".__main__"):
            path = next(p for p in sources if _module_name(p) == module)
            top = {"simplefsdp": _parse(sources[path])}  # its top-level statements only
            top_sources = {path: ast.unparse(ast.Module(
                [n for n in top["simplefsdp"].body
                 if not isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef)],
                []))}
            top_sources.update({p: "" for p in sources if p != path})
            up = sorted(t for t in import_graph(top_sources).get(module, ())
                        if t.startswith("simplefsdp.train"))
        found += [f"{module} -> {t}" for t in up]
    return found


def test_train_is_the_top():
    assert upward_train_imports(_sources()) == []


@pytest.mark.parametrize("path, snippet, flagged", [
    ("simplefsdp/plan/x.py", "from ..train.step import train_step", True),
    ("simplefsdp/parallel/x.py", "def f():\n    from simplefsdp.train import trainer", True),
    ("simplefsdp/hf/x.py", "import simplefsdp.train.metrics", True),
    ("simplefsdp/bench/long_context.py", "from ..train.trainer import setup", True),
    ("simplefsdp/bench/long_context.py", "def main():\n    from ..train.trainer import setup",
     False),
    ("simplefsdp/train/x.py", "from .trainer import setup", False),
])
def test_upward_train_imports_are_flagged(path, snippet, flagged):
    sources = {"simplefsdp/__init__.py": "", "simplefsdp/train/__init__.py": "",
               "simplefsdp/train/trainer.py": "def setup():\n    pass",
               "simplefsdp/train/step.py": "def train_step():\n    pass",
               "simplefsdp/train/metrics.py": "", path: snippet}
    assert bool(upward_train_imports(sources)) == flagged, upward_train_imports(sources)


def test_lower_packages_import_no_train():
    """``parallel/``, ``plan/``, ``bench/``, ``corpus/``, ``hf/`` (and ``models/``,
    ``config/``, ``compiler/``) name no ``simplefsdp.train`` module at all, entry points
    apart (their imports of it run inside functions: :func:`test_train_is_the_top`)."""
    graph = import_graph(_sources())
    offenders = {m: sorted(t for t in targets if t.startswith("simplefsdp.train"))
                 for m, targets in graph.items()
                 if m.startswith(LOWER) and m not in ENTRY_POINTS
                 and not m.endswith(".__main__")}
    assert not {m: t for m, t in offenders.items() if t}, offenders


def test_importing_the_lower_layers_leaves_the_trainer_out():
    """In a fresh interpreter (modules other tests imported do not count): importing every
    ``simplefsdp.parallel`` module, ``simplefsdp.plan`` and ``simplefsdp.bench`` (every
    module of those packages, entry points too) loads no ``simplefsdp.train`` module."""
    import subprocess
    import sys

    modules = sorted(_module_name(p) for p in _sources()
                     if _module_name(p).startswith(("simplefsdp.parallel", "simplefsdp.plan",
                                                    "simplefsdp.bench"))
                     and not p.endswith("__main__.py"))
    assert "simplefsdp.parallel.tensor" in modules and "simplefsdp.bench" in modules
    code = (f"import importlib, sys\nfor m in {modules!r}:\n    importlib.import_module(m)\n"
            "print(sorted(m for m in sys.modules if m.startswith('simplefsdp.train')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True).stdout.strip().splitlines()[-1]
    assert out == "[]", f"importing the lower layers imported {out}"


# ------------------------------------------------------------------ import cycles

# Cycles allowed among the package's modules: none (issue 26 removed train <-> hf).
KNOWN_CYCLES: list[frozenset[str]] = []


def import_graph(sources: dict[str, str]) -> dict[str, set[str]]:
    """Module -> the package's modules it imports (at any depth: a lazy import inside a
    function is a dependency too). ``from pkg import name`` points at ``pkg.name`` when
    that is a module, else at ``pkg``. ``sources``: ``{"simplefsdp/x/y.py": source}``."""
    def module(path: str) -> str:
        parts = path.removesuffix(".py").split("/")
        return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)

    modules = {module(p): p for p in sources}

    def known(name: str) -> str:
        while name not in modules and "." in name:
            name = name.rsplit(".", 1)[0]
        return name

    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        package = name if path.endswith("__init__.py") else name.rsplit(".", 1)[0]
        edges = set()
        for n in ast.walk(ast.parse(sources[path])):
            if isinstance(n, ast.Import):
                edges |= {known(a.name) for a in n.names if a.name.startswith("simplefsdp")}
            elif isinstance(n, ast.ImportFrom):
                parts = package.split(".")
                base = (n.module or "") if n.level == 0 else ".".join(
                    parts[:len(parts) - n.level + 1] + ([n.module] if n.module else []))
                if base.split(".")[0] == "simplefsdp":
                    edges |= {f"{base}.{a.name}" if f"{base}.{a.name}" in modules
                              else known(base) for a in n.names}
        graph[name] = edges - {name}
    return graph


def import_cycles(graph: dict[str, set[str]]) -> list[frozenset[str]]:
    """The strongly connected components of more than one module (each holds a cycle)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    cycles = []

    def visit(v: str) -> None:  # Tarjan's algorithm
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = set()
            while True:
                w = stack.pop()
                component.add(w)
                if w == v:
                    break
            if len(component) > 1:
                cycles.append(frozenset(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return cycles


def test_import_cycle_finder():
    sources = {"simplefsdp/__init__.py": "from .a import f",
               "simplefsdp/a.py": "from . import b",
               "simplefsdp/b.py": "def g():\n    from .c import h",
               "simplefsdp/c.py": "from simplefsdp.a import f",
               "simplefsdp/d.py": "from .c import h"}
    graph = import_graph(sources)
    assert graph["simplefsdp"] == {"simplefsdp.a"}
    assert graph["simplefsdp.b"] == {"simplefsdp.c"}  # a lazy import counts
    assert import_cycles(graph) == [frozenset({"simplefsdp.a", "simplefsdp.b",
                                               "simplefsdp.c"})]
    sources["simplefsdp/c.py"] = "def h():\n    pass"
    assert import_cycles(import_graph(sources)) == []


def test_no_import_cycles_beyond_the_known_one():
    cycles = import_cycles(import_graph(_sources()))
    unknown = [sorted(c) for c in cycles if not any(c <= known for known in KNOWN_CYCLES)]
    assert not unknown, f"import cycles among the package's modules: {unknown}"


def test_import_train_does_not_import_hf():
    """The trainer reaches model families through ``models.registry`` only: importing it
    (and its config) loads no Hugging Face module. In a fresh interpreter, so modules
    other tests imported do not count."""
    import subprocess
    import sys

    code = ("import sys, simplefsdp.train, simplefsdp.train.trainer, simplefsdp.config;"
            "print(sorted(m for m in sys.modules if m.startswith('simplefsdp.hf')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True).stdout.strip()
    assert out == "[]", f"importing the trainer imported {out}"


def test_model_families_register_themselves():
    """One registry, one entry per family, each registered by its own module (family ->
    registry): the registry imports no family, every family module registers the name the
    table gives it, and nothing else defines a ModelFamily."""
    src = _sources()
    assert _defs(src, ast.ClassDef, lambda n: n == "ModelFamily") == [
        ("simplefsdp/models/registry.py", "ModelFamily")]
    graph = import_graph(src)
    from simplefsdp.models import registry

    for name, module in registry.FAMILIES.items():
        assert module not in graph["simplefsdp.models.registry"]
        assert registry.get(name).name == name
        path = module.replace(".", "/") + ".py"
        assert "registry.register(" in src[path], path


# ------------------------------------------------------------------ no dead code
# Issue 45: a function, class or module-level name of the package that only tests call is
# dead code (the tests then check something the package never runs): every definition is
# named by the package or its scripts. Framework hooks are named by the framework.
_FRAMEWORK_CALLED = frozenset({
    ("simplefsdp/_torch_compat/internals.py", "_apply"),  # ParallelStyle._apply's override
    ("simplefsdp/train/console.py", "emit"),  # logging.Handler.emit's override
})


def _names_used(tree: ast.Module) -> set[str]:
    """Every name ``tree`` reads: names and attributes loaded, imports, and strings that
    are a (dotted) name, such as ``__all__`` entries and a registry's module paths."""
    used = set()
    for n in ast.walk(tree):
        if isinstance(n, ast.Name) and not isinstance(n.ctx, ast.Store):
            used.add(n.id)
        elif isinstance(n, ast.Attribute):
            used.add(n.attr)
        elif isinstance(n, ast.alias):
            used.add(n.name.rsplit(".", 1)[-1])
        elif isinstance(n, ast.Constant) and isinstance(n.value, str) \
                and re.fullmatch(r"[A-Za-z_][\w.]*", n.value):
            used.add(n.value.rsplit(".", 1)[-1])
    return used


def unused_definitions(sources: dict[str, str]) -> list[str]:
    """``"path: name"`` of each function or class (any depth) and module-level assignment
    of the package (``simplefsdp/``) whose name no module of ``sources`` (the package and
    its scripts) reads (:func:`_names_used`)."""
    used = set().union(*(_names_used(_parse(s)) for s in sources.values()))
    found = []
    for path, source in sources.items():
        if not path.startswith("simplefsdp/"):
            continue
        tree = _parse(source)
        names = [n.name for n in ast.walk(tree) if isinstance(
            n, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef)]
        names += [t.id for n in tree.body if isinstance(n, ast.Assign | ast.AnnAssign)
                  for t in (n.targets if isinstance(n, ast.Assign) else [n.target])
                  if isinstance(t, ast.Name)]
        found += [f"{path}: {name}" for name in names if name not in used
                  and not (name.startswith("__") and name.endswith("__"))
                  and (path, name) not in _FRAMEWORK_CALLED]
    return sorted(found)


def test_no_definition_only_tests_call():
    src = _sources()
    scripts = PACKAGE.parent / "scripts"
    src.update({str(p.relative_to(PACKAGE.parent)): p.read_text()
                for p in sorted(scripts.glob("*.py"))})
    assert unused_definitions(src) == []


@pytest.mark.parametrize("snippet, flagged", [
    ("def helper():\n    return 1", ["simplefsdp/x.py: helper"]),
    ("class Helper:\n    pass", ["simplefsdp/x.py: Helper"]),
    ("ROLES = ('full', 'first')", ["simplefsdp/x.py: ROLES"]),
    ("def helper():\n    return 1\n\n\ndef main():\n    return helper()",
     ["simplefsdp/x.py: main"]),  # helper is called; main stands for an unused entry
    ("from .y import *\n__all__ = ['helper']\n\n\ndef helper():\n    return 1", []),
])
def test_unused_definitions_are_flagged(snippet, flagged):
    assert unused_definitions({"simplefsdp/x.py": snippet}) == flagged


# ------------------------------------------------------------------ one view of the layout
# Issue 45: a model family reads the run's ParallelDims it is given (the trainer's
# Setup.dims, the config's while validating) and never rebuilds one from the config's
# sizes; the ep rule (which ranks ep divides) is ParallelDims.check_ep's, the experts'
# count parallel.expert.check_expert_split's.
FAMILY_PACKAGES = ("simplefsdp/models/", "simplefsdp/hf/", "simplefsdp/parallel/")
EP_RULE_OWNERS = ("simplefsdp/mesh.py", "simplefsdp/parallel/expert.py")


def layout_rebuilt_or_ep_rule(sources: dict[str, str]) -> list[str]:
    """``"path:line: what"``: ``.dims()`` called in a model family or a parallelism (the
    config's sizes turned into a second ParallelDims), and a remainder by ``ep`` (the ep
    rule spelled again) outside its owners."""
    found = []
    for path, source in sources.items():
        for n in ast.walk(_parse(source)):
            where = f"{path}:{getattr(n, 'lineno', 0)}"
            if path.startswith(FAMILY_PACKAGES) and isinstance(n, ast.Call) \
                    and getattr(n.func, "attr", "") == "dims" and not n.args:
                found.append(f"{where}: ParallelDims rebuilt from the config")
            if isinstance(n, ast.BinOp) and isinstance(n.op, ast.Mod) \
                    and "ep" in _mentioned(n.right) and path not in EP_RULE_OWNERS:
                found.append(f"{where}: the ep rule spelled again")
    return sorted(found)


def test_families_read_the_runs_layout_and_the_ep_rule_has_owners():
    src = _sources()
    assert layout_rebuilt_or_ep_rule(src) == []
    fn = ast.FunctionDef
    assert _defs(src, fn, lambda n: n in ("check_ep", "check_expert_split")) == [
        ("simplefsdp/mesh.py", "check_ep"),
        ("simplefsdp/parallel/expert.py", "check_expert_split")]
    # one activation-checkpointing entry for every family (no per-family wrapper)
    assert _defs(src, fn, lambda n: n == "apply_ac") == [
        ("simplefsdp/parallel/activation_checkpoint.py", "apply_ac")]
    # the ring's two ways to bring K/V to the queries, named for what they do
    ring = "simplefsdp/parallel/ring.py"
    assert _defs({ring: src[ring]}, ast.ClassDef, lambda n: True) == [
        (ring, "GatheredKVAttention"), (ring, "RingPass")]


@pytest.mark.parametrize("path, snippet, what", [
    ("simplefsdp/models/x.py", "def f(cfg):\n    return cfg.parallel.dims().cp", "rebuilt"),
    ("simplefsdp/hf/x.py", "def f(p):\n    return p.dims()", "rebuilt"),
    ("simplefsdp/bench/x.py", "def f(world, ep):\n    return world % ep", "ep rule"),
    ("simplefsdp/hf/x.py", "def f(n, cfg):\n    return n % cfg.parallel.ep", "ep rule"),
])
def test_layout_rebuilt_or_ep_rule_is_flagged(path, snippet, what):
    found = layout_rebuilt_or_ep_rule({path: snippet})
    assert len(found) == 1 and what in found[0], found
