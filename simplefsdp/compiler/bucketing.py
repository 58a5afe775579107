"""Merge the collectives of one bucket into a single collective (paper section 3.2.1).

All-gather bucket:  copy-in (flatten + concat the shards) -> one all-gather -> one wait
-> copy-out (per parameter: its slice of every rank's chunk, reshaped).
Reduce-scatter bucket: copy-in (each gradient viewed as [ranks, chunk], concatenated on
dim 1 so every rank's chunk is contiguous) -> one reduce-scatter -> one wait -> copy-out.
All-reduce bucket (replicate gradients; HSDP reduced shards): copy-in (flatten + concat)
-> one all-reduce -> one wait -> copy-out (slices viewed back to each shape).

Inputs of a gather are shards padded to the same size on every rank (DTensor pads uneven
shards), so every rank builds the same bucket even when its graph differs.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import torch
from torch import fx

from .collectives import ALL_GATHER, ALL_REDUCE, REDUCE_SCATTER, WAIT, Collective, call

aten = torch.ops.aten


@dataclass
class Bucket:
    """One merged collective and the nodes that feed and unpack it."""

    kind: str
    name: str
    members: list[str]  # modules of the merged collectives
    nbytes: int
    start: fx.Node
    wait: fx.Node
    copy_in: list[fx.Node] = field(default_factory=list)
    copy_out: list[fx.Node] = field(default_factory=list)

    def summary(self) -> dict:
        return {"kind": self.kind, "name": self.name, "count": len(self.members),
                "bytes": self.nbytes, "modules": sorted(set(self.members))}


def bucket_of_one(c: Collective, index: int | None = None) -> Bucket:
    """An unmerged collective seen as a bucket of one (``index`` makes its name unique)."""
    name = c.module if index is None else f"{c.module}#{index}"
    return Bucket(c.kind, name, [c.module], c.nbytes, c.start, c.wait)


def merge(graph: fx.Graph, name: str | None, members: list[Collective]) -> Bucket:
    """Replace ``members`` (same kind and group) by one bucketed collective; a bucket of
    one keeps its collective and takes ``name`` (None: the collective's module)."""
    if len(members) == 1:
        return bucket_of_one(members[0]) if name is None else \
            dataclasses.replace(bucket_of_one(members[0]), name=name)
    nbytes = sum(c.nbytes for c in members)  # before the members' nodes are erased
    custom = dict(members[0].start.meta.get("custom", {}))
    if members[0].kind == "all_gather":
        bucket = _merge_all_gathers(graph, name, members, nbytes)
    elif members[0].kind == "all_reduce":
        bucket = _merge_all_reduces(graph, name, members, nbytes)
    else:
        bucket = _merge_reduce_scatters(graph, name, members, nbytes)
    for node in (bucket.start, bucket.wait):  # the members' trace-time metadata (e.g.
        node.meta["custom"] = dict(custom)  # their data-parallel groups) carries over
    return bucket


def _merge_all_gathers(graph: fx.Graph, name: str, members: list[Collective],
                       nbytes: int) -> Bucket:
    first = members[0]
    _, group_size, group_name = first.start.args
    shards = [c.start.args[0] for c in members]
    for shard in shards:  # the shards come from placeholders (+ cast/pad): move them up
        hoist_before(shard, first.start)
    with graph.inserting_before(first.start):
        flat = [call(graph, aten.reshape.default, (s, [-1])) for s in shards]
        buffer = call(graph, aten.cat.default, (flat,))
        start = call(graph, ALL_GATHER, (buffer, group_size, group_name))
    with graph.inserting_before(first.wait):
        wait = call(graph, WAIT, (start,))
        per_rank = call(graph, aten.view.default, (wait, [group_size, -1]))
        outs, offset = [], 0
        for c, shard in zip(members, shards, strict=True):
            numel = shard.meta["val"].numel()
            piece = call(graph, aten.slice.Tensor, (per_rank, 1, offset, offset + numel))
            offset += numel
            out = call(graph, aten.reshape.default, (piece, list(c.wait.meta["val"].shape)))
            outs.append(out)
    _retire(graph, members, outs)
    return Bucket("all_gather", name, [c.module for c in members],
                  nbytes, start, wait, flat + [buffer], outs)


def _merge_reduce_scatters(graph: fx.Graph, name: str, members: list[Collective],
                           nbytes: int) -> Bucket:
    # The merged reduce-scatter reads every member's gradient, and backward produces them
    # one after another: the last member's position is the first one where all of them
    # exist, so the bucket goes there and no computation has to move. (An all-gather
    # bucket goes to its first member instead: its shards are inputs, ready early.)
    last = max(members, key=lambda c: _position(graph, c.start))
    _, reduce_op, group_size, group_name = last.start.args
    with graph.inserting_before(last.start):
        grads = [c.start.args[0] for c in members]
        chunks = [call(graph, aten.reshape.default, (g, [group_size, -1])) for g in grads]
        buffer = call(graph, aten.cat.default, (chunks, 1))
        flat = call(graph, aten.reshape.default, (buffer, [-1]))
        start = call(graph, REDUCE_SCATTER, (flat, reduce_op, group_size, group_name))
        wait = call(graph, WAIT, (start,))
        outs = _unpack_flat(graph, wait, members)
    _retire(graph, members, outs)
    return Bucket("reduce_scatter", name, [c.module for c in members],
                  nbytes, start, wait, chunks + [buffer, flat], outs)


def _merge_all_reduces(graph: fx.Graph, name: str, members: list[Collective],
                       nbytes: int) -> Bucket:
    last = max(members, key=lambda c: _position(graph, c.start))
    _, reduce_op, group_name = last.start.args
    with graph.inserting_before(last.start):
        flat = [call(graph, aten.reshape.default, (c.start.args[0], [-1])) for c in members]
        buffer = call(graph, aten.cat.default, (flat,))
        start = call(graph, ALL_REDUCE, (buffer, reduce_op, group_name))
        wait = call(graph, WAIT, (start,))
        outs = _unpack_flat(graph, wait, members)
    _retire(graph, members, outs)
    return Bucket("all_reduce", name, [c.module for c in members],
                  nbytes, start, wait, flat + [buffer], outs)


def _unpack_flat(graph: fx.Graph, flat: fx.Node, members: list[Collective]) -> list[fx.Node]:
    """Each member's result out of the bucket's flat result, in member order."""
    outs, offset = [], 0
    for c in members:
        numel = c.wait.meta["val"].numel()
        piece = call(graph, aten.slice.Tensor, (flat, 0, offset, offset + numel))
        offset += numel
        outs.append(call(graph, aten.view.default, (piece, list(c.wait.meta["val"].shape))))
    return outs


def _retire(graph: fx.Graph, members: list[Collective], outs: list[fx.Node]) -> None:
    """Point every use of a member's result at its replacement; drop the member."""
    for c, out in zip(members, outs, strict=True):
        c.wait.replace_all_uses_with(out)
        graph.erase_node(c.wait)
        graph.erase_node(c.start)


def _position(graph: fx.Graph, node: fx.Node) -> int:
    for i, n in enumerate(graph.nodes):
        if n is node:
            return i
    raise ValueError(f"{node} is not in the graph")


def hoist_before(node: fx.Node, anchor: fx.Node) -> None:
    """Move ``node`` and whatever it needs that sits after ``anchor`` to before ``anchor``.

    Only pure nodes are moved (casts, views, pads of placeholders); a collective or wait
    in the chain raises, since moving those would change the collective order.
    """
    order = {n: i for i, n in enumerate(anchor.graph.nodes)}
    to_move, stack, seen = [], [node], set()
    while stack:
        n = stack.pop()
        if n in seen or order[n] < order[anchor]:
            continue
        seen.add(n)
        if n.op != "call_function" or n.target in (ALL_GATHER, REDUCE_SCATTER, ALL_REDUCE,
                                                      WAIT):
            raise ValueError(f"cannot move {n} ({n.op} {n.target}) before {anchor}")
        to_move.append(n)
        stack.extend(n.all_input_nodes)
    for n in sorted(to_move, key=order.__getitem__):
        anchor.prepend(n)


def bucket_collectives(graph: fx.Graph, collectives: list[Collective],
                       assignment: dict[fx.Node, str]) -> list[Bucket]:
    """Merge collectives that share a bucket name (from ``assignment``) and a group.

    Buckets come back in graph order of their first member; unassigned collectives stay
    single. Order between buckets of one kind is the order of their first member.
    """
    groups: dict[tuple, list[Collective]] = {}
    for c in collectives:
        key = (assignment.get(c.start, f"#{c.start.name}"),) + c.merge_key
        groups.setdefault(key, []).append(c)
    buckets = [merge(graph, key[0] if members[0].start in assignment else None, members)
               for key, members in groups.items()]
    order = {n: i for i, n in enumerate(graph.nodes)}
    return sorted(buckets, key=lambda b: order[b.start])
