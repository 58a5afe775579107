"""Find the data-parallel collectives in an AOTAutograd FX graph and the module each
came from.

A collective is a start node (``all_gather_into_tensor`` / ``reduce_scatter_tensor`` /
``all_reduce``) plus the ``wait_tensor`` that consumes it. Only collectives on a process
group that ``data_parallel`` shards over are ours (its parametrization names those groups
in the nodes' metadata at trace time, ``mesh.DP_GROUPS_META``):
tensor/sequence-parallel collectives (on the TP group), pipeline sends and user
collectives on other groups are never touched. Forward and recomputed (backward)
all-gathers carry ``nn_module_stack``; backward reductions carry ``fwd_nn_module_stack``.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from enum import StrEnum

from torch import fx

from .._torch_compat import FakeTensorMode, c10d_functional, detect_fake_mode
from ..mesh import DP_GROUPS_META
from ..state_dict import unwrapped_name

c10d = c10d_functional
ALL_GATHER = c10d.all_gather_into_tensor.default
REDUCE_SCATTER = c10d.reduce_scatter_tensor.default
ALL_REDUCE = c10d.all_reduce.default
WAIT = c10d.wait_tensor.default
# an exchange no pass touches (Ulysses, expert dispatch); the planner times it
ALL_TO_ALL = c10d.all_to_all_single.default


class CollectiveKind(StrEnum):
    """The collective kinds our passes, cost model and planner know: the one list of them
    (a ``str``, so ``kind == "all_gather"`` and JSON keep working). Every other file that
    names a collective op asks here: :attr:`op`, :data:`KINDS`, :func:`collective_kind`,
    :func:`full_value`."""

    ALL_GATHER = "all_gather"
    REDUCE_SCATTER = "reduce_scatter"
    ALL_REDUCE = "all_reduce"

    def __repr__(self) -> str:  # reports print {'all_gather': 2}, as for a plain str
        return repr(self.value)

    @property
    def short(self) -> str:
        """A two-letter label for tables: AG, RS, AR."""
        return "".join(word[0] for word in self.value.split("_")).upper()

    @property
    def op(self):
        """The functional collective op (``_c10d_functional``) of this kind."""
        return {CollectiveKind.ALL_GATHER: ALL_GATHER, CollectiveKind.REDUCE_SCATTER:
                REDUCE_SCATTER, CollectiveKind.ALL_REDUCE: ALL_REDUCE}[self]


KINDS = {kind.op: kind for kind in CollectiveKind}  # functional op -> its kind
COLLECTIVE_KINDS = tuple(CollectiveKind)


def collective_kind(name: str) -> CollectiveKind | None:
    """The kind of a collective under any of its names, or None for other ops: FX and
    c10d op names (``all_gather_into_tensor``, ``c10d::_allgather_base_``,
    ``_c10d_functional::reduce_scatter_tensor``, ``allreduce_coalesced``) and the kinds
    themselves. The one place such names are normalized."""
    op = name.rsplit("::", 1)[-1].lower().replace("_", "")
    for kind in (CollectiveKind.REDUCE_SCATTER, CollectiveKind.ALL_GATHER,
                 CollectiveKind.ALL_REDUCE):
        if kind.value.replace("_", "") in op:
            return kind
    return None


def full_node(start: fx.Node) -> fx.Node:
    """The node holding the full (unsharded) tensor of a functional collective start: an
    all-gather's output (the start itself), a reduce-scatter's or all-reduce's input. The
    one rule for a collective's full bytes (what ``CommModel.predict`` reads, and the
    process group's in-flight scratch)."""
    return start if KINDS[start.target] == CollectiveKind.ALL_GATHER else start.args[0]


def full_value(start: fx.Node):
    """The fake value of :func:`full_node`."""
    return full_node(start).meta["val"]


@dataclass
class Collective:
    """One collective in a graph: its start node, its wait, and where it came from."""

    start: fx.Node
    wait: fx.Node
    kind: CollectiveKind
    module: str  # FQN of the module that owns the parameter, e.g. "layers.0.attention.wq"

    @property
    def merge_key(self) -> tuple:
        """What must match for two collectives to merge: kind, process group (size and
        name), reduce op, dtype. A key to compare, not a process group."""
        args = self.start.args
        if self.kind == "reduce_scatter":  # (input, reduce_op, group_size, group_name)
            return (self.kind, args[2], args[3], args[1], self.start.meta["val"].dtype)
        # all_gather: (input, group_size, group_name); all_reduce: (input, op, group_name)
        return (self.kind, args[1], args[2], self.start.meta["val"].dtype)

    @property
    def group_name(self) -> str:
        return group_name(self.start)

    @property
    def nbytes(self) -> int:
        """Bytes of the full (unsharded) tensor: the all-gather output / reduce-scatter or
        all-reduce input."""
        full = full_value(self.start)
        if self.kind == "all_reduce":  # HSDP: count the padded shard the reduce-scatter
            source = feeding_reduce_scatter(self.start)  # returned, the same on every
            if source is not None:  # rank (uneven shards differ), so plans agree
                full = source.meta["val"]
        return full.numel() * full.element_size()


def module_fqn(node: fx.Node) -> str:
    """The innermost module a node was traced in, without dynamo's and wrappers' prefixes."""
    stack = node.meta.get("nn_module_stack") or node.meta.get("fwd_nn_module_stack") or {}
    if not stack:
        return ""
    path = list(stack.values())[-1][0]  # e.g. "L['self'].layers.0.up"
    path = re.sub(r"^L\['[^']*'\]\.?", "", path)
    path = re.sub(r"\[['\"]?([^'\"\]]+)['\"]?\]", r".\1", path).lstrip(".")  # ['0'] -> .0
    return unwrapped_name(path).replace("._modules.", ".")


def group_name(start: fx.Node) -> str:
    """The process group name argument of a collective start node (always the last)."""
    return start.args[-1]


def is_data_parallel(node: fx.Node) -> bool:
    """A collective start that ``data_parallel``'s parametrization issued: its gather (and
    under compile its gradient's reductions) carries ``DP_GROUPS_META`` in the node's
    metadata, and that region issues data-parallel collectives only. The annotation's
    group names are not compared with the node's: torch caches sub-meshes by layout, so
    a second mesh over the same ranks may gather on the first one's groups (same ranks,
    another name)."""
    return node.op == "call_function" and node.target in KINDS and \
        DP_GROUPS_META in node.meta.get("custom", {})


def other_collectives(graph: fx.Graph) -> int:
    """Collectives that are not ours (TP/SP, user): left alone, counted for reports."""
    return sum(1 for n in graph.nodes if n.op == "call_function" and n.target in KINDS
               and not is_data_parallel(n))


def all_to_alls(graph: fx.Graph) -> list[fx.Node]:
    """The graph's all-to-all starts (expert dispatch, Ulysses): left in place by bucketing
    and reordering (which move only data-parallel collectives, each kind in its order, so
    an exchange keeps its place among the others on every rank), counted for reports."""
    return [n for n in graph.nodes if n.op == "call_function" and n.target == ALL_TO_ALL]


def find_collectives(graph: fx.Graph) -> list[Collective]:
    """Every data-parallel collective start node with exactly one wait, in graph order."""
    found = []
    for node in graph.nodes:
        if not is_data_parallel(node):
            continue
        waits = [u for u in node.users if u.target == WAIT]
        if len(waits) != 1 or len(node.users) != 1:
            continue  # not a shape we know how to move; leave it alone
        found.append(Collective(node, waits[0], KINDS[node.target], module_fqn(node)))
    return found


def feeding_reduce_scatter(node: fx.Node, depth: int = 16) -> fx.Node | None:
    """The reduce-scatter start whose result ``node`` (a collective start) reduces, seen
    through casts and views; None if its input does not come from a reduce-scatter."""
    arg = node.args[0]
    for _ in range(depth):
        if not isinstance(arg, fx.Node) or arg.op != "call_function" or not arg.args:
            return None
        if arg.target == WAIT:
            source = arg.args[0]
            return source if source.target == REDUCE_SCATTER else None
        arg = arg.args[0]
    return None


def is_backward(graph: fx.Graph) -> bool:
    """AOTAutograd names the incoming gradients of a backward graph `tangents_*`."""
    return any(n.op == "placeholder" and n.name.startswith("tangents") for n in graph.nodes)


def call(graph: fx.Graph, target, args: tuple, kwargs: dict | None = None) -> fx.Node:
    """Add ``target(*args)`` to ``graph`` with its fake value in ``meta["val"]``, as the
    nodes AOTAutograd and Inductor produce have."""
    node = graph.call_function(target, args, kwargs or {})
    vals = [a.meta["val"] for a in node.all_input_nodes if "val" in a.meta]
    mode = detect_fake_mode(vals) or FakeTensorMode()

    def fake(a):
        return a.meta["val"] if isinstance(a, fx.Node) else a

    with mode:
        node.meta["val"] = target(*fx.node.map_aggregate(args, fake),
                                  **fx.node.map_aggregate(kwargs or {}, fake))
    return node


def stable_topological_sort(graph: fx.Graph) -> None:
    """Reorder as little as possible so every node comes after its inputs: a node whose
    input is still ahead waits until that input has been placed."""
    pending: dict[fx.Node, int] = {}
    waiting_on: dict[fx.Node, list[fx.Node]] = {}
    placed: set[fx.Node] = set()
    cursor = None  # the last placed node
    order = list(graph.nodes)
    for node in order:
        missing = [i for i in node.all_input_nodes if i not in placed]
        if missing:
            pending[node] = len(missing)
            for i in missing:
                waiting_on.setdefault(i, []).append(node)
            continue
        ready = [node]
        while ready:
            n = ready.pop(0)
            if cursor is not None and cursor.next is not n:
                cursor.append(n)
            cursor = n
            placed.add(n)
            for user in waiting_on.pop(n, []):
                pending[user] -= 1
                if pending[user] == 0:
                    del pending[user]
                    ready.append(user)
    if pending:
        raise RuntimeError(f"graph has a cycle through {list(pending)[:3]}")
