"""Memory model of an FX graph: bytes of a node's output and a liveness-based peak.

Also the small vocabulary the compute model shares with it: which ops only touch
metadata, and concrete ints for possibly symbolic sizes.
"""

from __future__ import annotations

import operator
from collections.abc import Callable
from typing import Any

import torch
import torch.fx

from ..._torch_compat import OpOverload, op_schema, symint_hint, tree_flatten
from ..collectives import KINDS, CollectiveKind, full_node

__all__ = ["IN_FLIGHT_SCRATCH", "alias_bases", "alias_roots", "held_by_caller", "live_bytes",
           "peak_memory_estimate", "scratch_bytes", "sunk_copies", "tensor_bytes"]

# Bytes a collective allocates while in flight (from its start to its wait), per byte of
# its full tensor (an all-gather's output, a reduce-scatter's input), by process-group
# backend. gloo: ``_allgather_base`` gathers into a temporary the size of its output,
# and its reduce-scatter reduces a clone of its input (profiled on 2 gloo ranks:
# tests/test_auto_wrap_memory.py). NCCL writes into the output: nothing extra.
IN_FLIGHT_SCRATCH = {"gloo": {CollectiveKind.ALL_GATHER: 1.0, CollectiveKind.REDUCE_SCATTER: 1.0}}
# Ops that return metadata or a view of their input without a kernel of their own.
METADATA_ONLY = frozenset({
    "aten::_unsafe_view", "aten::sym_size", "aten::sym_stride", "aten::sym_numel",
    "aten::sym_storage_offset", "aten::detach", "aten::alias", "aten::lift_fresh",
    "aten::_local_scalar_dense", "prim::device", "prim::layout",
})


def op_name(target: Any) -> str:
    """``"aten::mm"`` for an op overload; "" for other callables."""
    schema = op_schema(target)
    return schema.name if schema is not None else ""


class Unmeasurable(Exception):
    """A node whose size or time cannot be known here (no metadata, unbacked sizes)."""


def concrete_int(x: Any) -> int:
    """A concrete int for a possibly symbolic size (no guards added where avoidable)."""
    if isinstance(x, torch.SymInt):
        hint = symint_hint(x)
        if hint is None:
            raise Unmeasurable(f"no hint for symbolic size {x}")
        return hint
    return int(x)


def value_bytes(val: Any) -> int:
    """Bytes of every tensor in ``val`` (a tensor or a nest of them): numel x itemsize."""
    leaves, _ = tree_flatten(val)
    total = 0
    for t in leaves:
        if isinstance(t, torch.Tensor):
            numel = 1
            for s in t.shape:
                numel *= concrete_int(s)
            total += numel * t.element_size()
    return total


def tensor_bytes(node: torch.fx.Node) -> int:
    """Bytes of the node's output(s) from ``node.meta["val"]`` (summed over tuples/lists);
    0 when the node carries no tensor metadata. Logical size: numel x element size."""
    val = node.meta.get("val")
    if val is None:
        return 0
    try:
        return value_bytes(val)
    except Unmeasurable:
        return 0


def _tensor_input_nodes(node: torch.fx.Node) -> list[torch.fx.Node]:
    return [n for n in node.all_input_nodes if "val" in n.meta]


# View ops by schema that copy when no view of the input has the asked shape (a
# reshape of a non-contiguous slice: the copy-out of an all-gather bucket).
COPY_IF_NEEDED = frozenset({"aten::reshape"})


def _reshape_copies(node: torch.fx.Node) -> bool:
    """Whether ``node`` (a reshape) allocates: no view of its input's strides has the
    output's shape. Decided on meta tensors of the same sizes and strides."""
    inputs = _tensor_input_nodes(node)
    src, out = (inputs[0].meta.get("val") if inputs else None), node.meta.get("val")
    if not isinstance(src, torch.Tensor) or not isinstance(out, torch.Tensor):
        return False
    try:
        probe = torch.empty_strided([concrete_int(s) for s in src.shape],
                                    [concrete_int(s) for s in src.stride()],
                                    dtype=src.dtype, device="meta")
        probe.view([concrete_int(s) for s in out.shape])
    except Unmeasurable:
        return False
    except (RuntimeError, ValueError):  # eager meta kernels / refs (under a fake mode)
        return True
    return False


def sunk_copies(node: torch.fx.Node) -> list[torch.fx.Node] | None:
    """``alias_bases`` for a compiler that sinks copies into their consumers (Inductor
    fuses a bucket's copy-out reshape into each parameter's first use, so the gathered
    buffer lives until the bucket's last use instead of the copies living after it):
    every reshape aliases its input."""
    if node.op == "call_function" and op_name(node.target) in COPY_IF_NEEDED:
        return _tensor_input_nodes(node)[:1] or None
    return alias_bases(node)


def alias_bases(node: torch.fx.Node) -> list[torch.fx.Node] | None:
    """The input nodes whose memory ``node``'s output shares, or None for fresh memory.

    getitem, waits, views and ops whose schema marks every return as aliasing an input
    (in-place ``foo_``, ``out=`` variants) produce no new memory; they keep their bases
    alive instead. So does the graph's output node: it returns tensors made earlier
    (Inductor's graphs give it a ``meta["val"]`` of all of them, which is no
    allocation). A reshape that cannot be a view copies (fresh memory).
    """
    if node.op == "output":
        return _tensor_input_nodes(node) or None
    if node.op != "call_function":
        return None
    target = node.target
    if target is operator.getitem:
        base = node.args[0]
        return [base] if isinstance(base, torch.fx.Node) else None
    if not isinstance(target, OpOverload):
        return None
    if op_name(target) in COPY_IF_NEEDED and _reshape_copies(node):
        return None
    if op_name(target).endswith("wait_tensor") or getattr(target, "is_view", False) \
            or op_name(target) in METADATA_ONLY:
        return _tensor_input_nodes(node)[:1] or None
    schema = op_schema(target)
    if schema.returns and all(r.alias_info is not None for r in schema.returns):
        sets = {a for r in schema.returns for a in r.alias_info.before_set}
        bases = []
        for i, arg in enumerate(schema.arguments):
            if arg.alias_info is None or not (set(arg.alias_info.before_set) & sets):
                continue
            value = node.args[i] if i < len(node.args) else node.kwargs.get(arg.name)
            if isinstance(value, torch.fx.Node):
                bases.append(value)
        return bases or None
    return None


def _collective_wait(node: torch.fx.Node) -> torch.fx.Node | None:
    """The wait of a functional collective ``node`` (None for other nodes): its input
    stays allocated until then (the process group reads it while the collective runs;
    Inductor frees it after the wait)."""
    if node.op != "call_function" or node.target not in KINDS:
        return None
    waits = [u for u in node.users if op_name(u.target).endswith("wait_tensor")]
    return waits[0] if waits else None


def held_by_caller(graph: torch.fx.Graph) -> Callable[[torch.fx.Node], bool]:
    """Which of ``graph``'s inputs stay allocated for the whole graph because the caller
    holds them: every input of a forward graph (parameters, the batch), and the
    ``primals_*`` and ``tangents_*`` inputs of an AOTAutograd backward (the same
    parameters; the incoming gradients, which ``CompiledFunction.backward(ctx,
    *flat_args)`` keeps referenced until the compiled backward returns). Its saved
    activations are handed over (AOTAutograd clears them, Inductor deletes each after
    its last use)."""
    backward = any(n.op == "placeholder" and n.name.startswith("tangents")
                   for n in graph.nodes)
    return lambda n: n.op == "placeholder" and (
        not backward or n.name.startswith(("primals", "tangents")))


def alias_roots(graph: torch.fx.Graph, alias_of: Callable = alias_bases
                ) -> dict[torch.fx.Node, list[torch.fx.Node]]:
    """For each node, the fresh-memory nodes its output is (itself if it allocates)."""
    roots: dict[torch.fx.Node, list[torch.fx.Node]] = {}
    for n in graph.nodes:
        bases = alias_of(n)
        roots[n] = [n] if bases is None else list(
            dict.fromkeys(r for b in bases for r in roots.get(b, [b])))
    return roots


def scratch_bytes(factors: dict[str, float] | None) -> Callable[[torch.fx.Node], int]:
    """``node -> bytes`` it allocates while in flight, from ``factors`` (kind -> bytes per
    byte of the full tensor; an ``IN_FLIGHT_SCRATCH`` entry; None: nothing)."""
    if not factors:
        return lambda n: 0

    def of(node: torch.fx.Node) -> int:
        kind = KINDS.get(node.target) if node.op == "call_function" else None
        if kind is None or not factors.get(kind):
            return 0
        full = full_node(node)
        return int(factors[kind] * tensor_bytes(full)) if isinstance(full, torch.fx.Node) \
            else 0
    return of


def live_bytes(graph: torch.fx.Graph, size_of: Callable[[torch.fx.Node], int],
               pinned: Callable[[torch.fx.Node], bool] = lambda n: False,
               alias_of: Callable | None = None,
               scratch: Callable[[torch.fx.Node], int] = lambda n: 0,
               inputs_until_wait: bool = False) -> list[int]:
    """Live bytes during each node of ``graph``, in graph order: the one liveness pass.

    A fresh-memory node's output (``size_of(node)`` bytes; 0: not counted) is live from
    its definition to its last user, both inclusive, so during a node both its inputs
    and its output count; ``pinned`` nodes are live for the whole graph. Aliasing
    outputs (``alias_of``: views, getitem, waits, in-place ops) cost nothing and extend
    their bases' lifetimes to their own last use instead (``alias_of`` None:
    ``sunk_copies``). With ``inputs_until_wait`` a collective's input stays live until
    its wait, and ``scratch(node)`` bytes (the process group's temporaries, see
    ``scratch_bytes``) are live from the collective to its wait. (The planner,
    ``plan.memory``, keeps the defaults: with both rules its bench_medium prediction
    rose from 328.6 to 377.2 MiB against 273.5 measured; open.)
    """
    alias_of = sunk_copies if alias_of is None else alias_of
    nodes = list(graph.nodes)
    index = {n: i for i, n in enumerate(nodes)}
    roots = alias_roots(graph, alias_of)
    end = dict(index)
    for n in nodes:
        for user in n.users:
            for r in roots[n]:
                end[r] = max(end[r], index[user])
    delta = [0] * (len(nodes) + 1)
    for n in nodes:
        until = _collective_wait(n) if inputs_until_wait else None
        if until is None:
            continue
        for a in _tensor_input_nodes(n):  # the collective reads its input until its wait
            for r in roots[a]:
                end[r] = max(end[r], index[until])
        extra = scratch(n)
        delta[index[n]] += extra
        delta[index[until] + 1] -= extra
    for n in nodes:
        if roots[n] != [n]:
            continue  # aliases own no memory
        size = size_of(n)
        if size:
            start, stop = (0, len(nodes) - 1) if pinned(n) else (index[n], end[n])
            delta[start] += size
            delta[stop + 1] -= size
    live, running = [], 0
    for d in delta[:-1]:
        running += d
        live.append(running)
    return live


def peak_memory_estimate(graph: torch.fx.Graph | torch.fx.GraphModule,
                         scratch: dict[str, float] | None = None,
                         alias_of: Callable = alias_bases) -> tuple[int, list[int]]:
    """``(peak_bytes, live_bytes_per_node)``: ``live_bytes`` with every node's output at
    ``tensor_bytes`` and the inputs the caller holds (``held_by_caller``) live
    throughout the graph; a backward's saved activations die after their last use.
    ``scratch``: the collectives' in-flight temporaries (an ``IN_FLIGHT_SCRATCH`` entry);
    ``alias_of``: ``sunk_copies`` for Inductor's placement of copies. A backward also
    counts, throughout, the forward's outputs its incoming gradients (``tangents_*``)
    belong to: the caller holds them while backward runs (the logits a loss was
    computed on), and they have their gradients' sizes."""
    if isinstance(graph, torch.fx.GraphModule):
        graph = graph.graph
    outputs_held = sum(tensor_bytes(n) for n in graph.nodes
                       if n.op == "placeholder" and n.name.startswith("tangents"))
    live = [b + outputs_held for b in live_bytes(
        graph, tensor_bytes, held_by_caller(graph), alias_of, scratch_bytes(scratch),
        inputs_until_wait=True)]
    return max(live, default=0), live
