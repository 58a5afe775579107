"""Move collectives so communication hides behind computation (paper section 3.2.2).

Forward: bucket i+1's all-gather is issued before bucket i's wait, so it overlaps bucket
i's copy-out and compute (the placement the paper's Table 6 found fastest).
Backward: bucket i+1's all-gather is issued right after bucket i's wait (overlapping
bucket i's compute), and each reduce-scatter's wait is deferred to just before the next
reduce-scatter, so the reduction overlaps the following compute while at most two
reduce-scatter buffers live. All-reduce waits (replicate gradients, HSDP shards) go to
the end of the graph, as DDP waits for its buckets only when backward is done: each
bucket's all-reduce starts as soon as its last gradient exists and runs under all the
backward that follows, and the next bucket is issued without waiting for it (the
buffers add up to the gradients' size, which the results occupy anyway).

A gather in two steps (``reshard_after_forward=<int>`` under compile: the outer group's
gather, then the inner group's, which reads it) is prefetched by its outer step only;
its inner step is issued after the outer one's wait.

Only all-gather starts move earlier and waits move later; each kind of collective keeps
its order, and every decision depends only on the bucket sequence, so
every rank issues the same collectives in the same order.
"""

from __future__ import annotations

from torch import fx

from .bucketing import Bucket, hoist_before
from .collectives import CollectiveKind, stable_topological_sort


def reorder(graph: fx.Graph, buckets: list[Bucket], backward: bool) -> list[str]:
    """Reorder in place; returns a line per move made."""
    gathers = [b for b in buckets if b.kind == "all_gather"]
    moves: list[str] = []
    for prev, nxt in zip(gathers, gathers[1:], strict=False):
        # Forward: before prev's wait. Backward: right after prev's wait.
        anchor = prev.wait if not backward else prev.wait.next
        if _before(nxt.start, anchor):
            continue  # already early enough
        if _reads(nxt.start, prev.wait):
            # a gather in two steps (``reshard_after_forward=<int>``, compiled): the inner
            # step reads the outer one's result, so it cannot start before it is waited on
            moves.append(f"all_gather {nxt.name} reads {prev.name}: issued after its wait")
            continue
        _move_gather_before(nxt, anchor)
        where = "before" if not backward else "after"
        moves.append(f"all_gather {nxt.name} issued {where} wait of {prev.name}")
    if backward:
        moves += _defer_waits(graph, [b for b in buckets if b.kind == "reduce_scatter"])
        stable_topological_sort(graph)  # users of a deferred wait follow it
        moves += _waits_to_end(graph, [b for b in buckets if b.kind == "all_reduce"])
    _check_collective_order_kept(graph, buckets)
    return moves


def _defer_waits(graph: fx.Graph, reductions: list[Bucket]) -> list[str]:
    """Each wait (and its copy-out) goes right before the next reduction's copy-in."""
    moves = []
    for prev, nxt in zip(reductions, reductions[1:], strict=False):
        anchor = nxt.copy_in[0] if nxt.copy_in else nxt.start
        if _before(anchor, prev.wait):
            continue
        if _before(anchor, prev.start):  # the next one already starts first: keep as is
            continue
        for node in [prev.wait, *prev.copy_out]:
            anchor.prepend(node)
        moves.append(f"wait of {prev.kind} {prev.name} deferred to before "
                     f"{nxt.kind} {nxt.name}")
    return moves


def _waits_to_end(graph: fx.Graph, reductions: list[Bucket]) -> list[str]:
    """Each wait (and its copy-out, and whatever reads them) goes to the end of the
    graph, just before its output, in issue order."""
    output = next(n for n in reversed(graph.nodes) if n.op == "output")
    moves = []
    for b in reductions:
        if b.wait.next is output or not _has_compute_between(b.wait, output):
            continue
        for node in [b.wait, *b.copy_out]:
            output.prepend(node)
        moves.append(f"wait of {b.kind} {b.name} deferred to the end of backward")
    stable_topological_sort(graph)  # users of a moved wait follow it
    return moves


def _has_compute_between(a: fx.Node, b: fx.Node) -> bool:
    node = a.next
    while node is not b:
        if node.op == "call_function":
            return True
        node = node.next
    return False


def _move_gather_before(bucket: Bucket, anchor: fx.Node) -> None:
    for node in bucket.start.all_input_nodes:
        hoist_before(node, anchor)
    anchor.prepend(bucket.start)


def _reads(node: fx.Node, source: fx.Node) -> bool:
    """Whether ``node`` depends on ``source`` (which precedes it in the graph)."""
    order = {n: i for i, n in enumerate(node.graph.nodes)}
    stack, seen = [node], set()
    while stack:
        n = stack.pop()
        if n is source:
            return True
        if n in seen or order[n] < order[source]:
            continue
        seen.add(n)
        stack.extend(n.all_input_nodes)
    return False


def _before(a: fx.Node, b: fx.Node) -> bool:
    node = a
    while node is not None and node.op != "root":
        if node is b:
            return True
        node = node.next
    return False


def _check_collective_order_kept(graph: fx.Graph, buckets: list[Bucket]) -> None:
    """All-gathers keep their order among themselves, and so do reduce-scatters.

    (An all-gather may move ahead of a reduce-scatter: that is the backward prefetch,
    and it is the same on every rank because it depends only on the bucket sequence.)
    """
    for kind in CollectiveKind:
        starts = [b.start for b in buckets if b.kind == kind]
        seen = [n for n in graph.nodes if n in set(starts)]
        if seen != starts:
            raise RuntimeError(f"reordering changed the order of {kind}s, which would "
                               f"deadlock ranks: {[n.name for n in seen]}")
