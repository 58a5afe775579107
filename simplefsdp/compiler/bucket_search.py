"""The optimal bucketing plan: dynamic programming over contiguous bucket boundaries.

Buckets are contiguous runs of steps in issue order. The simulated step time
(:mod:`.simulate`) is a sum of terms that each read at most three consecutive buckets
(a bucket's collective, the compute of the bucket before it, the reduce-scatter of the
one before that), and the memory of a bucket reads its neighbours. So the best plan
ending in buckets ``(prev, last)`` extends the best plan ending in ``prev``: a dynamic
program over states ``(prev, last)``, exact for that model, O(n^4 / 24) for n
candidate boundaries.

Candidates: with at most ``max_groups`` steps a boundary may fall anywhere. Beyond that
only between steps of different blocks (a block is the module name up to its layer
index, ``layers.3`` for ``layers.3.attn.wq``), and when that still leaves more than
``max_groups`` groups, neighbouring groups are merged evenly: exact over the boundaries
it keeps.

Trust region: no bucket grows past ``CommModel.max_bytes`` (the largest collective the
comm model was measured on) unless a single candidate group is that large already.

Stability: a plan whose step time is within ``tolerance`` of the best is as good; the
search prefers fewer buckets by charging each bucket ``tolerance * reference / n``
(so the chosen plan is at most ``tolerance`` of the reference slower than the optimum,
and run-to-run noise in the measurements does not flip between near-equal plans).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import NamedTuple

from .cost import CommModel
from .simulate import (
    CollectiveCost,
    bucket_peak,
    comm_seconds,
    copy_seconds,
    reduction_seconds,
    simulate,
    window,
)

DEFAULT_TOLERANCE = 0.02
DEFAULT_MAX_GROUPS = 40


def block_of(name: str) -> str:
    """``layers.3.attn.wq`` -> ``layers.3``; ``tok_embeddings`` -> ``tok_embeddings``."""
    parts = name.split(".")
    for i, p in enumerate(parts):
        if p.isdigit():
            return ".".join(parts[:i + 1])
    return parts[0]


def candidate_groups(steps: Sequence[CollectiveCost], max_groups: int = DEFAULT_MAX_GROUPS
                     ) -> list[list[int]]:
    """Runs of step indices that the search keeps together (see module doc)."""
    if len(steps) <= max_groups:
        return [[i] for i in range(len(steps))]
    groups: list[list[int]] = []
    for i, s in enumerate(steps):
        if groups and block_of(steps[groups[-1][-1]].name) == block_of(s.name):
            groups[-1].append(i)
        else:
            groups.append([i])
    if len(groups) > max_groups:
        per = math.ceil(len(groups) / max_groups)
        groups = [[i for g in groups[k:k + per] for i in g]
                  for k in range(0, len(groups), per)]
    return groups


class BucketTerms(NamedTuple):
    """What the search reads about one candidate bucket (a run of groups)."""

    compute_s: float  # its compute, slowed by ``CommModel.compute_slowdown``
    comm_s: float  # its collective
    reduce_s: float  # its backward reductions (reduce-scatter, HSDP all-reduce)
    nbytes: int  # the collective's full bytes
    scatter_bytes: int  # the reduce-scatters' bytes
    count: int  # steps in it
    base_bytes: int  # the largest ``base_bytes`` of its steps
    copy_s: float  # its copy-in/copy-out


_EMPTY = BucketTerms(0.0, 0.0, 0.0, 0, 0, 0, 0, 0.0)


def _prefix(values: list[float]) -> list[float]:
    out = [0.0]
    for v in values:
        out.append(out[-1] + v)
    return out


class _Buckets:
    """:class:`BucketTerms` of ``groups[i:j]`` from prefix sums over the groups, memoised."""

    def __init__(self, steps: Sequence[CollectiveCost], groups: list[list[int]],
                 comm: CommModel, kind: str, scatter_kind: str):
        def over_groups(field: str, factor: float = 1) -> list[float]:
            return _prefix([factor * sum(getattr(steps[s], field) for s in g) for g in groups])

        self.comp = over_groups("compute_s", comm.compute_slowdown)
        self.size = over_groups("nbytes")
        self.rs_size = over_groups("scatter_bytes")
        self.ar_size = over_groups("all_reduce_bytes")
        self.count = _prefix([len(g) for g in groups])
        self.base_of = [max(steps[s].base_bytes for s in g) for g in groups]
        self.comm, self.kind, self.scatter_kind = comm, kind, scatter_kind
        self.cache: dict[tuple[int, int], BucketTerms] = {}

    def __call__(self, i: int, j: int) -> BucketTerms:
        got = self.cache.get((i, j))
        if got is None:
            comm = self.comm
            nb, rb = int(self.size[j] - self.size[i]), int(self.rs_size[j] - self.rs_size[i])
            c, ab = int(self.count[j] - self.count[i]), int(self.ar_size[j] - self.ar_size[i])
            got = BucketTerms(self.comp[j] - self.comp[i], comm_seconds(comm, self.kind, nb),
                              reduction_seconds(comm, self.scatter_kind, rb, ab), nb, rb, c,
                              max(self.base_of[i:j]), copy_seconds(comm, self.kind, c, nb, rb))
            self.cache[(i, j)] = got
        return got


def optimal_buckets(steps: Sequence[CollectiveCost], comm: CommModel,
                    memory_limit_bytes: float | None = None, kind: str = "all_gather",
                    scatter_kind: str = "reduce_scatter",
                    tolerance: float = DEFAULT_TOLERANCE,
                    max_groups: int = DEFAULT_MAX_GROUPS) -> list[list[int]]:
    """The plan of least simulated step time whose predicted peak stays under
    ``memory_limit_bytes`` (see module doc). When no plan fits, every step is its own
    bucket (the smallest peak the model knows); the caller reports the overshoot."""
    if memory_limit_bytes is not None and memory_limit_bytes <= 0:
        raise ValueError(f"memory_limit_bytes must be positive, got {memory_limit_bytes}")
    if tolerance < 0:
        raise ValueError(f"tolerance must be >= 0, got {tolerance}")
    if not steps:
        return []
    groups = candidate_groups(steps, max_groups)
    n = len(groups)
    limit = math.inf if memory_limit_bytes is None else memory_limit_bytes
    cap = math.inf if comm.max_bytes is None else comm.max_bytes
    f = comm.hidden_fraction
    bucket = _Buckets(steps, groups, comm, kind, scatter_kind)
    reference = simulate(steps, [[s] for s in range(len(steps))], comm, kind,
                         scatter_kind).step_s
    penalty = tolerance * reference / max(len(steps), 1)

    # best[(h, i, j)]: least cost of buckets covering groups[:j] ending in
    # groups[h:i], groups[i:j] (h == i: no bucket before), with the terms of every
    # bucket before groups[i:j] and its own collective; back[...] the previous state.
    best: dict[tuple[int, int, int], float] = {}
    back: dict[tuple[int, int, int], tuple[int, int, int] | None] = {}

    def too_big(i: int, j: int) -> bool:
        return j - i > 1 and bucket.size[j] - bucket.size[i] > cap

    for j in range(1, n + 1):
        if too_big(0, j):
            break
        best[(0, 0, j)] = window(0.0, bucket(0, j).comm_s, f) + bucket(0, j).copy_s + penalty
        back[(0, 0, j)] = None
    for j in range(1, n + 1):  # states in order of their end: all predecessors are done
        for (h, i, jj), cost in [(k, v) for k, v in best.items() if k[2] == j]:
            prev = bucket(h, i) if h < i else _EMPTY
            cur = bucket(i, jj)
            for nxt_end in range(j + 1, n + 1):
                if too_big(j, nxt_end):
                    break
                nxt = bucket(j, nxt_end)
                if bucket_peak(cur.base_bytes, cur.count, cur.nbytes, nxt.nbytes,
                               prev.scatter_bytes) > limit:
                    continue
                total = cost + window(cur.compute_s, nxt.comm_s + prev.reduce_s, f) \
                    + nxt.copy_s + penalty
                key = (i, j, nxt_end)
                if total < best.get(key, math.inf):
                    best[key], back[key] = total, (h, i, jj)
    return _best_plan(best, back, bucket, groups, n, limit, f) or \
        [[s] for s in range(len(steps))]


def _best_plan(best: dict, back: dict, bucket: _Buckets, groups: list[list[int]], n: int,
               limit: float, f: float) -> list[list[int]] | None:
    """The cheapest complete plan among the search's final states (its last bucket's
    compute and reductions added, its peak under ``limit``); None when none fits."""
    finals = []
    for (h, i, j), cost in best.items():
        if j != n:
            continue
        prev = bucket(h, i) if h < i else _EMPTY
        cur = bucket(i, j)
        if bucket_peak(cur.base_bytes, cur.count, cur.nbytes, 0, prev.scatter_bytes) > limit:
            continue
        finals.append((cost + window(cur.compute_s, prev.reduce_s, f) + cur.reduce_s,
                       (h, i, j)))
    if not finals:
        return None
    _, state = min(finals)
    bounds = []
    while state is not None:
        bounds.append(state[1:])
        state = back[state]
    return [[s for g in groups[i:j] for s in g] for i, j in reversed(bounds)]
