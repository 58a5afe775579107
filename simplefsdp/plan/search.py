"""Enumerate the layouts of N GPUs and predict each one that can fit.

Layouts: ``tp`` (a power-of-two divisor of N, at most one node), ``pp`` (divides what
is left, at most the number of blocks), ``dp_replicate x dp_shard`` for the rest
(``fully_shard`` when ``dp_replicate = 1``, ``hybrid_shard`` with shards of at least one
node otherwise), each AC mode, and local batch sizes 1 and 2 (under PP: as many
microbatches of one sequence as 1x and 2x the stages). Skipped untraced: layouts whose
model states (and the loss's logits) alone exceed the GPU; a batch whose smaller batch
did not fit with the same AC mode; AC modes recomputing more than one that already fits
(never faster); a batch, or a replication (smaller shards), larger than one that did
not fit with the same tp, pp and AC mode; with ``keep``, layouts whose speed bound
(compute FLOPs at the roofline, no communication) cannot reach the ``keep``-th best row
found so far. Layouts are visited fastest bound first, so the bar rises early.

Context parallelism: a second pass over the layouts that split the sharded ranks as
``dp_shard x cp_ring x cp_ulysses`` (where the model family has CP attention and the
sequence and heads split), with the AC modes that recompute less than every fitting
whole-sequence row: all of them when no layout holds whole sequences, none when one fits
without AC. With the same AC mode a CP layout does the same FLOPs per token plus the K/V
(ring) or heads (Ulysses) in transit, so it cannot win; with less recomputation (its
activations split by cp) it can. The second pass starts from the first one's ``keep``
bar, so its layouts must beat the whole-sequence rows' speed to be traced. With a ring
(cp_ring > 1) both of ``parallel.cp_rotate``'s ways of moving K/V are tried
(``ROTATIONS``).
"""

from __future__ import annotations

import copy
from collections.abc import Iterator
from typing import get_args, get_type_hints

from ..config.job import AC_MODES, DTYPES, JobConfig, ParallelConfig
from ..errors import ConfigError
from ..hardware import gpu_profile
from ..mesh import ParallelDims
from ..parallel.pipeline import stage_layers
from . import memory, moe, timing, tradeoffs
from .floors import ActivationFloor, lower_bound
from .predict import CONTEXT_BYTES, Prediction, predict

# parallel.cp_rotate's values: with a ring (cp_ring > 1) the search tries each, since
# neither wins everywhere: the ring pass hides its shifts behind attention and, eager,
# keeps one K/V block for backward instead of the gathered sequence, but sends the blocks
# again in backward with their gradients (``plan.ring_pass``)
ROTATIONS = get_args(get_type_hints(ParallelConfig)["cp_rotate"])


def _cause(e: Exception) -> str:
    """The line of an error that names its cause (dynamo wraps backend errors)."""
    lines = [x for x in str(e).splitlines() if "Error" in x and "TORCHDYNAMO" not in x]
    return (lines[-1] if lines else f"{type(e).__name__}: {e}")[:160]


def expert_degrees(args, ranks: int) -> list[int]:
    """The ``ep`` sizes to try: 1, and for a mixture of experts every divisor of ``ranks``
    (``ParallelDims.expert_ranks``: the EP groups are carved out of them) that also divides
    the experts (each EP rank holds whole experts)."""
    experts = getattr(args, "num_experts", 1)
    return [e for e in range(1, ranks + 1) if ranks % e == 0 and experts % e == 0]


def _cp_valid(cfg: JobConfig, args, dims: ParallelDims) -> bool:
    """Whether a family with context-parallel attention can split ``cfg``'s sequence and
    heads as ``dims`` does (``ParallelDims.check_cp``)."""
    if not cfg.model.family_entry().context_parallel:
        return False
    try:
        dims.check_cp(cfg.training.seq_len, args.n_heads)
    except ValueError:
        return False
    return True


def layouts(cfg: JobConfig, gpus: int, gpus_per_node: int, cp: bool = False,
            ac_modes: tuple[str, ...] = AC_MODES) -> Iterator[JobConfig]:
    """Every candidate configuration (``cfg`` with parallel sizes, AC and batch set), with
    the AC modes ``ac_modes``; ``cp``: only those that split the sequence (cp_ring x
    cp_ulysses > 1, where the family and the shapes allow it), else only those that do
    not."""
    args = cfg.model.model_args()
    for dims in ParallelDims.layouts(gpus, cp=cp):
        tp, pp, rep, shard = dims.tp, dims.pp, dims.dp_replicate, dims.dp_shard
        if tp > gpus_per_node or tp & (tp - 1) or pp > args.n_layers:
            continue
        if rep > 1 and dims.dp_shard_cp < min(gpus_per_node, rep * dims.dp_shard_cp):
            continue
        if cp and (dims.cp == 1 or not _cp_valid(cfg, args, dims)):
            continue
        rotations = ROTATIONS if dims.cp_ring > 1 else ("allgather",)
        for ep, batch, ac, rotate in ((e, b, a, r)
                                      for e in expert_degrees(args, dims.expert_ranks)
                                      for b in ([1, 2] if pp == 1 else [pp, 2 * pp])
                                      for a in ac_modes for r in rotations):
            c = copy.deepcopy(cfg)
            c.parallel.cp_rotate = rotate
            c.parallel.tp, c.parallel.pp, c.parallel.ep = tp, pp, ep
            c.parallel.dp_replicate, c.parallel.dp_shard = rep, shard
            c.parallel.cp_ring, c.parallel.cp_ulysses = dims.cp_ring, dims.cp_ulysses
            c.parallel.dp_mode = "fully_shard" if rep == 1 else "hybrid_shard"
            c.parallel.pp_microbatches = batch if pp > 1 else 1
            c.training.batch_size = batch
            c.activation_checkpoint.mode = ac
            yield c


def speed_bound(c: JobConfig, gpus: int, dev, gpus_per_node: int | None = None) -> float:
    """Tokens/s per GPU that ``predict`` cannot exceed for ``c``: its step time with each
    stage's simulated forward + backward replaced by the FLOP floors of its blocks and
    output projection and its exposed tensor-parallel communication
    (``timing.compute_floor_seconds``, ``head_floor_seconds``, ``tp_comm_floor_seconds``;
    the loss, optimizer and pipeline schedule terms are predict's own), or by its
    data-parallel communication floor where that is longer (``gpus_per_node`` given and
    ``_dp_floor_applies``: with many ranks over InfiniBand the gathers, not the FLOPs,
    bound a step)."""
    args, t = c.model.model_args(), c.training
    p = c.parallel.resolve(gpus)
    dims = p.dims()  # the layout's one view
    micro = p.microbatches
    mb = t.batch_size // micro
    elem = memory.activation_elem_bytes(t)
    # the tp group is the mesh's innermost dim and at most a node (``layouts``): NVLink
    fabric = timing.MeshLinks(dev, dims, p.tp)
    # a rank's tokens: under context parallelism its part of each sequence (whose queries
    # still meet the whole sequence's keys: seq_len stays the attention's length)
    tokens = memory.rank_tokens(mb, t.seq_len, dims)
    seconds = 0.0
    for role in ["full"] if p.pp == 1 else ["first", "last"]:
        blocks = list(range(args.n_layers)) if role == "full" else stage_layers(
            args.n_layers, p.pp, 0 if role == "first" else p.pp - 1)
        n = len(blocks)
        step = timing.compute_floor_seconds(args, tokens, t.seq_len, p.tp, n,
                                            c.activation_checkpoint.mode == "full", dev) \
            + timing.tp_comm_floor_seconds(args, tokens, n, role != "first"
                                           and not p.vocab_sharded_loss, elem, fabric)
        if role != "first":
            step += timing.head_floor_seconds(args, tokens, p.tp, dev)
        # the padded dispatch's experts compute more rows than the stand-in (fewer under
        # a capacity factor below 1): as ``predict`` adds them
        step += moe.padded_seconds(args, blocks, moe.routed_tokens(tokens, dims),
                                   c.activation_checkpoint.mode, dev, moe.Dispatch.of(p))
        if gpus_per_node is not None and _dp_floor_applies(c, args):
            step = max(step, timing.dp_comm_floor_seconds(
                args, blocks, role, p.tp, DTYPES[t.mixed_precision_param].itemsize,
                DTYPES[t.mixed_precision_reduce].itemsize, p.reshard is True,
                timing.MeshLinks(dev, dims, gpus_per_node)))
        if role != "first":  # the eager loss runs outside the graphs: after either floor
            step += timing.loss_seconds(tokens, memory.loss_vocab(args, p), dev)
        stage = step * t.grad_accum_steps if p.pp == 1 else timing.pp_step_seconds(
            step, p.pp, micro * t.grad_accum_steps)
        params = memory.rank_params(args, role, blocks, dims, p.dp_mode, p.etp)
        stage += timing.optimizer_seconds(params, dev)
        seconds = max(seconds, stage)
    return t.batch_size * t.seq_len * t.grad_accum_steps * dims.dp / seconds / gpus


def _dp_floor_applies(c: JobConfig, args) -> bool:
    """Whether ``timing.dp_comm_floor_seconds`` bounds ``c``'s graphs: sharded data
    parallelism of a dense model whose parameters all train, gathered in the mixed
    precision dtype (no float8 all-gather) and with none of issue 48's knobs (their terms
    can take time off the graphs': ``tradeoffs.role_terms``)."""
    return (c.parallel.dp_mode in ("fully_shard", "hybrid_shard")
            and not any(args.routed_params(i) for i in range(args.n_layers))
            and not c.float8.enable and not tradeoffs.knob_label(c))


def _groups(cfg: JobConfig, gpus: int, gpus_per_node: int, dev, cp: bool = False,
            ac_modes: tuple[str, ...] = AC_MODES, constrain=None,
            tradeoffs_rows: bool = False) -> list[list[JobConfig]]:
    """``layouts`` grouped by parallel layout (each group in its batch, AC order), the
    groups fastest bound first (``_prune_bound``: with ``tradeoffs_rows``, their knob
    rows' too), so the layouts likely to win are traced first and set the bar the others'
    bounds must reach. ``constrain(c)``: each layout as the caller allows it (None:
    dropped; see ``search``)."""
    groups: dict[tuple, list[JobConfig]] = {}
    for c in layouts(cfg, gpus, gpus_per_node, cp, ac_modes):
        if constrain is not None and (c := constrain(c)) is None:
            continue
        p = c.parallel
        groups.setdefault(_layout(p), []).append(c)

    def best(group: list[JobConfig]) -> float:
        try:
            return max(_prune_bound(c, gpus, dev, gpus_per_node, tradeoffs_rows)
                       for c in group)
        except ConfigError:
            return 0.0
    return sorted(groups.values(), key=best, reverse=True)


def _layout(p) -> tuple:
    """A configuration's parallel layout: (tp, pp, dp_replicate, dp_shard, ep, cp_ring,
    cp_ulysses, cp_rotate)."""
    return (p.tp, p.pp, p.dp_replicate, p.dp_shard, p.ep, p.cp_ring, p.cp_ulysses,
            p.cp_rotate)


class _Bar:
    """The ``keep`` best fitting tokens/s found so far, in this process or shared by the
    search's worker processes (an ``mp.Array`` and its lock)."""

    def __init__(self, keep: int, shared=None, lock=None, seed: tuple[float, ...] = ()):
        self.keep, self.values, self.lock = keep, shared, lock
        if shared is None:
            self.values = [0.0] * keep
        for x in seed:  # rows found before (the whole-sequence pass's, for the CP pass)
            self._insert(x)

    def beaten(self, bound: float) -> bool:
        """Whether a layout with this speed bound cannot make the ``keep`` best."""
        return self.keep > 0 and bound < self.values[self.keep - 1]

    def add(self, tokens_per_s: float) -> None:
        if not self.keep:
            return
        if self.lock is not None:
            with self.lock:
                self._insert(tokens_per_s)
        else:
            self._insert(tokens_per_s)

    def _insert(self, x: float) -> None:
        top = sorted([*self.values, x], reverse=True)[:self.keep]
        for i, v in enumerate(top):
            self.values[i] = v


STATS = ("predicted", "bound", "memory", "activations", "fits_with_less_ac", "invalid",
         "broken_tp")


def _search_groups(groups: list[list[JobConfig]], gpus: int, gpu: str, gpus_per_node: int,
                   bar: _Bar, progress=None, tradeoffs_rows: bool = False,
                   floor: ActivationFloor | None = None
                   ) -> tuple[list[Prediction], list[str], dict]:
    """The search over ``groups`` (layouts, see ``_groups``): (rows, failures, stats);
    ``tradeoffs_rows``: each predicted layout's rows with a knob turned too (``_knob_rows``);
    ``floor``: the activation floors known so far (added to)."""
    dev = gpu_profile(gpu)
    stats = dict.fromkeys(STATS, 0)
    failures: list[str] = []
    results: list[Prediction] = []
    # (tp, pp, ac, cp_rotate, batch, dp_shard x cp, cp) that did not fit
    too_big: list[tuple] = []
    fitted: set[tuple] = set()  # (layout, batch): fits with less recompute already
    broken_tp: set[int] = set()  # tensor-parallel sizes whose trace failed
    floor = ActivationFloor() if floor is None else floor
    for c in (c for group in groups for c in group):
        p = c.parallel
        layout = _layout(p)
        ac, batch = c.activation_checkpoint.mode, c.training.batch_size
        if p.tp in broken_tp:
            stats["broken_tp"] += 1
            continue
        # a larger batch, or smaller shards (more replication), than a layout that did
        # not fit with the same tp, pp and AC holds more: it does not fit either
        # (and with the sequence split no more ways, its K/V moved the same way: the ring
        # pass and the all-gather keep different blocks)
        if any(k[:4] == (p.tp, p.pp, ac, p.cp_rotate) and batch >= k[4]
               and p.dims().dp_shard_cp <= k[5] and p.dims().cp <= k[6] for k in too_big):
            stats["memory"] += 1
            continue
        if layout + (batch,) in fitted:
            stats["fits_with_less_ac"] += 1
            continue
        try:
            c.validate()
        except ConfigError:
            stats["invalid"] += 1
            continue  # e.g. tp does not divide the heads
        if lower_bound(c) + CONTEXT_BYTES > dev.memory_bytes:
            stats["memory"] += 1
            continue
        if floor.exceeds(c, dev.memory_bytes, bool(tradeoffs.knob_label(c)) or (
                tradeoffs_rows and c.job.device == "cuda")):
            stats["activations"] += 1
            continue
        if bar.beaten(_prune_bound(c, gpus, dev, gpus_per_node, tradeoffs_rows)):
            stats["bound"] += 1
            continue
        try:
            r = predict(c, gpus, gpu, gpus_per_node)
        except Exception as e:  # noqa: BLE001 - a layout the library cannot compile
            failures.append(f"tp={p.tp} pp={p.pp} ac={ac}: {_cause(e)}")
            broken_tp.add(p.tp)  # the failures seen are TP-wide: skip its other layouts
            continue
        results.append(r)
        floor.record(c, r)
        stats["predicted"] += 1
        if progress is not None:
            progress(r)
        if tradeoffs_rows:  # candidates too: a fitting one raises the bar as a layout does
            knob_rows = _knob_rows(c, r, gpus, gpu, gpus_per_node, stats, progress)
            results += knob_rows
            for row in (row for row in knob_rows if row.fits):
                bar.add(row.tokens_per_s_per_gpu)
        if not r.fits:
            too_big.append((p.tp, p.pp, ac, p.cp_rotate, batch, p.dims().dp_shard_cp,
                            p.dims().cp))
        else:  # more recomputation only costs time: never faster, not worth tracing
            fitted.add(layout + (batch,))
            bar.add(r.tokens_per_s_per_gpu)
    return results, failures, stats


def _prune_bound(c: JobConfig, gpus: int, dev, gpus_per_node: int,
                 tradeoffs_rows: bool) -> float:
    """The speed bound ``keep`` prunes ``c`` by: with its knob rows coming too, without
    the data-parallel communication floor where a variant can take time off it (a
    reshard to a node, gradient sync on the last micro-step: ``tradeoffs.role_terms``)."""
    faster_variants = tradeoffs_rows and any(
        not v.training.cpu_offload for v in tradeoffs.variants(c, True, gpus_per_node))
    return speed_bound(c, gpus, dev, None if faster_variants else gpus_per_node)


def _knob_rows(c: JobConfig, r: Prediction, gpus: int, gpu: str, gpus_per_node: int,
               stats: dict, progress) -> list[Prediction]:
    """Rows for ``c`` with one of issue 48's knobs turned (``tradeoffs.variants``: from the
    traces ``c`` just made, no new one). They compete with the layouts' own rows, and a
    fitting one raises the ``keep`` bar (``_prune_bound`` bounds a layout's knob rows
    too), but not the too-big/fitted bookkeeping, which speaks of layouts."""
    rows = []
    for v in tradeoffs.variants(c, r.fits, gpus_per_node):
        try:
            v.validate()
        except ConfigError:  # e.g. CPU offload of a job on the CPU
            stats["invalid"] += 1
            continue
        row = predict(v, gpus, gpu, gpus_per_node)
        rows.append(row)
        stats["knob_rows"] = stats.get("knob_rows", 0) + 1
        if progress is not None:
            progress(row)
    return rows


def _cache_counts() -> dict:
    from .eager import eager_memory
    from .trace import trace

    return {"traces": trace.cache_info().misses, "eager_replays": eager_memory.cache_info().misses}


_SHARED: tuple = ()  # a worker's (shared array, lock), set by ``_init_worker``


def _init_worker(shared, lock) -> None:
    global _SHARED
    _SHARED = (shared, lock)
    import torch

    torch.set_num_threads(1)  # one core per worker: tracing is single-threaded Python


def _worker(args) -> tuple[list[Prediction], list[str], dict]:
    groups, gpus, gpu, gpus_per_node, keep, tradeoffs_rows = args
    before = _cache_counts()
    rows, failures, stats = _search_groups(groups, gpus, gpu, gpus_per_node,
                                           _Bar(keep, *_SHARED), None, tradeoffs_rows)
    after = _cache_counts()
    stats.update({k: after[k] - before[k] for k in after})
    return rows, failures, stats


def search(cfg: JobConfig, gpus: int, gpu: str, gpus_per_node: int = 8,
           progress=None, failures: list[str] | None = None, keep: int = 0,
           stats: dict | None = None, workers: int = 1,
           tradeoffs_rows: bool = False, constrain=None) -> list[Prediction]:
    """Predictions for every layout that was worth tracing, best tokens/s first among
    those that fit. A layout that fails to trace (the library cannot compile it) is
    described in ``failures``, and the other layouts with its ``tp`` are skipped.

    ``keep`` > 0: a layout whose ``speed_bound`` is below the ``keep``-th best fitting
    tokens/s found so far is skipped untraced; the first ``keep`` rows are then exactly
    those of the exhaustive search (``keep = 0``). ``workers`` > 1: that many processes
    (spawned, each with its own fake process group) take one tensor-parallel size, with
    or without pipeline parallelism, at a time (no trace is shared across these), sharing
    the ``keep`` best. ``stats`` gets
    the counts of layouts predicted and skipped by reason, and of traces and eager
    replays run. ``tradeoffs_rows`` (``--tradeoffs``): rows with issue 48's knobs turned
    on each predicted layout (``tradeoffs.variants``), from the same traces.
    ``constrain(c)`` -> a configuration or None: each candidate layout as the caller
    allows it (dropped on None), e.g. with keys the user fixed kept (``plan.auto_layout``)."""
    failures = [] if failures is None else failures
    stats = {} if stats is None else stats
    dev = gpu_profile(gpu)
    floor = ActivationFloor()  # shared by both passes (in this process)
    results = _run(_groups(cfg, gpus, gpus_per_node, dev, constrain=constrain,
                           tradeoffs_rows=tradeoffs_rows), gpus, gpu,
                   gpus_per_node, progress, failures, keep, stats, workers, (), tradeoffs_rows,
                   floor)
    # Context parallelism with less recomputation than any whole-sequence row that fits
    # (module doc), behind the bar those rows set
    fitting = [r for r in results if r.fits and not r.knobs]  # the layouts' own rows
    modes = AC_MODES[:min((AC_MODES.index(r.ac) for r in fitting), default=len(AC_MODES))]
    if modes:
        seed = tuple(r.tokens_per_s_per_gpu for r in fitting)
        results += _run(_groups(cfg, gpus, gpus_per_node, dev, True, modes, constrain,
                                tradeoffs_rows), gpus,
                        gpu, gpus_per_node, progress, failures, keep, stats, workers, seed,
                        tradeoffs_rows, floor)
    return sorted(results, key=lambda r: (not r.fits, -r.tokens_per_s_per_gpu))


def _run(groups: list[list[JobConfig]], gpus: int, gpu: str, gpus_per_node: int, progress,
         failures: list[str], keep: int, stats: dict, workers: int,
         seed: tuple[float, ...] = (), tradeoffs_rows: bool = False,
         floor: ActivationFloor | None = None) -> list[Prediction]:
    """``search``'s predictions of ``groups`` (``failures`` and ``stats`` added to), the
    ``keep`` bar starting from the tokens/s of ``seed``; ``floor``: see ``_search_groups``
    (one process only: workers keep their own)."""
    # a worker's task: the layouts of one tp, with or without PP (they trace disjoint
    # roles: "full" vs "first"/"last"), so no graph is traced by two workers
    by_task: dict[tuple, list[list[JobConfig]]] = {}
    for g in groups:
        by_task.setdefault((g[0].parallel.tp, g[0].parallel.pp > 1), []).append(g)
    if workers <= 1 or len(by_task) <= 1:
        before = _cache_counts()
        results, fails, st = _search_groups(groups, gpus, gpu, gpus_per_node,
                                            _Bar(keep, seed=seed), progress, tradeoffs_rows,
                                            floor)
        after = _cache_counts()
        parts = [(results, fails, {**st, **{k: after[k] - before[k] for k in after}})]
    else:
        import multiprocessing

        ctx = multiprocessing.get_context("spawn")
        shared, lock = ctx.Array("d", max(keep, 1), lock=False), ctx.Lock()
        _Bar(keep, shared, seed=seed)  # the seed's best into the shared array
        tasks = [(g, gpus, gpu, gpus_per_node, keep, tradeoffs_rows) for g in by_task.values()]
        parts = []
        with ctx.Pool(min(workers, len(tasks)), _init_worker, (shared, lock)) as pool:
            for part in pool.imap_unordered(_worker, tasks):
                parts.append(part)
                for r in part[0] if progress is not None else []:
                    progress(r)
    results = []
    for rows, fails, st in parts:
        results += rows
        failures += fails
        for k, v in st.items():
            stats[k] = stats.get(k, 0) + v
    return results
