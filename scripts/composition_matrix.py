"""The composition matrix: every data-parallel mode x TP x PP x activation checkpointing x
bucketing x compile backend, trained for a few steps on gloo ranks, compiled and eager.

    python scripts/composition_matrix.py                 # the full matrix (up to 8 processes)
    python scripts/composition_matrix.py --ci            # the pairwise subset CI runs
    python scripts/composition_matrix.py --only hybrid_shard --out matrix.md

Each cell builds a tiny Llama (one block per pipeline stage: ``Cell.layers``) the way
the trainer does (pipeline split, tensor + sequence parallel, activation checkpointing,
``simplefsdp.data_parallel``), trains ``STEPS`` SGD steps in eager mode, then again
compiled with ``simplefsdp.compile_backend`` (reordering on), and reports:

* ``ok``: it ran; ``refused``: the library rejected the combination before any work, with
  the error it gave; ``failed``: anything else (a bug);
* collectives per step before and after bucketing (summed over the compiled graphs and
  their calls), the data-parallel buckets, the collectives the profiler saw in one
  compiled step, the compiled step time;
* parity with eager: max |loss difference| and max |parameter difference| after the
  last step (aot_eager must be bitwise equal; Inductor within ``INDUCTOR_ATOL``).

Every cell uses 2 data-parallel ranks (hybrid_shard: 2 x 2) times its TP and PP sizes.
``run_cells`` is what a group of ranks runs; the test suite imports it.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import statistics
import sys
import time
import traceback
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F

MODES = ("fully_shard", "replicate", "hybrid_shard")
TPS, PPS = (1, 2), (1, 2)
ACS = ("none", "selective", "full")
BUCKETINGS = ("none", "manual", "auto")
BACKENDS = ("aot_eager", "inductor")
AXES = ("mode", "tp", "pp", "ac", "bucketing", "backend")
# Two steps: the first compiles, runs forward and backward and updates the weights; the
# second runs the compiled graphs again on those weights (its loss checks the update;
# the profiler watches it), and the last weights check the second update.
STEPS, BATCH, SEQ, MICROBATCHES, VOCAB = 2, 2, 8, 2, 64
# Inductor fuses and reorders float math (and SGD carries those differences into the
# weights): after STEPS steps, losses and parameters agree with eager within 1e-4 absolute.
INDUCTOR_ATOL = 1e-4
CELL_TIMEOUT_S = 900  # per cell of a launch: 8 ranks compiling on 2 cores take minutes


@dataclass(frozen=True)
class Cell:
    mode: str
    tp: int
    pp: int
    ac: str
    bucketing: str
    backend: str

    @property
    def dp(self) -> tuple[int, int]:
        """(dp_replicate, dp_shard)."""
        return {"fully_shard": (1, 2), "replicate": (2, 1), "hybrid_shard": (2, 2)}[self.mode]

    @property
    def world(self) -> int:
        from simplefsdp.mesh import ParallelDims

        return ParallelDims(pp=self.pp, dp_replicate=self.dp[0], dp_shard=self.dp[1],
                            tp=self.tp).world_size

    @property
    def layers(self) -> int:
        """Transformer blocks: one per pipeline stage. One block still puts three groups
        of parameters in a row (embedding, block, norm + head), so bucketing, prefetching
        and recomputation each cross a module boundary; compiling costs per block."""
        return self.pp

    @property
    def name(self) -> str:
        return f"{self.mode}/tp{self.tp}/pp{self.pp}/ac-{self.ac}/{self.bucketing}/{self.backend}"


@dataclass
class CellResult:
    cell: str
    status: str  # ok | refused | failed
    error: str = ""
    before: dict[str, int] = field(default_factory=dict)  # per step, data-parallel
    after: dict[str, int] = field(default_factory=dict)
    buckets: int = 0  # data-parallel buckets per step
    other: int = 0  # TP/SP collectives per step (left in place)
    profiled: int = -1  # collectives the profiler saw in one compiled step
    step_s: float = 0.0
    eager_step_s: float = 0.0
    loss_diff: float = -1.0
    param_diff: float = -1.0
    wall_s: float = -1.0  # the cell's whole run on this rank: build, eager, compile


def full_matrix() -> list[Cell]:
    return [Cell(*values) for values in itertools.product(MODES, TPS, PPS, ACS, BUCKETINGS,
                                                          BACKENDS)]


# A pairwise-covering subset with at most 4 processes per cell (test_composition checks
# it): every pair of axis values that fits in 4 processes appears in a cell that runs.
CI_CELLS = [  # 10 cells, 3 of them Inductor (the costly backend): the fewest found
    Cell("replicate", 2, 1, "none", "manual", "aot_eager"),
    Cell("replicate", 2, 1, "selective", "auto", "aot_eager"),
    Cell("hybrid_shard", 1, 1, "none", "none", "aot_eager"),
    Cell("hybrid_shard", 1, 1, "full", "auto", "aot_eager"),
    Cell("replicate", 1, 2, "selective", "none", "aot_eager"),
    Cell("fully_shard", 1, 2, "full", "manual", "aot_eager"),
    Cell("fully_shard", 2, 1, "selective", "none", "aot_eager"),
    Cell("fully_shard", 1, 2, "none", "auto", "inductor"),
    Cell("hybrid_shard", 1, 1, "selective", "manual", "inductor"),
    Cell("replicate", 2, 1, "full", "none", "inductor"),
]


def refused(cell: Cell) -> bool:
    """Cells the library refuses up front on this torch
    (parallel.activation_checkpoint.check_composition): full AC under Inductor where
    Inductor has no ``custom_partitioner_fn`` (none on 2.13)."""
    from simplefsdp._torch_compat import custom_partitioner_base

    return cell.ac == "full" and cell.backend == "inductor" and custom_partitioner_base() is None


def uncovered_pairs(cells: list[Cell], max_world: int) -> list[tuple]:
    """Pairs of (axis, value) that some cell of at most ``max_world`` processes could
    hold but none of ``cells`` does. A refused cell covers only the pairs of the value
    it is refused for."""
    feasible = [c for c in full_matrix() if c.world <= max_world]

    def pairs(c: Cell) -> set:
        values = list(zip(AXES, (getattr(c, a) for a in AXES), strict=True))
        found = set(itertools.combinations(values, 2))
        return {p for p in found if ("ac", "full") in p} if refused(c) else found

    want = set().union(*(pairs(c) for c in feasible))
    have = set().union(*(pairs(c) for c in cells)) if cells else set()
    return sorted(want - have, key=str)


# ---------------------------------------------------------------------------------------
# One cell on one rank.
# ---------------------------------------------------------------------------------------
def _model_args(layers: int):
    from simplefsdp.models.llama import ModelArgs

    return ModelArgs(dim=32, n_layers=layers, n_heads=4, n_kv_heads=2, vocab_size=VOCAB,
                     multiple_of=16, max_seq_len=SEQ)


def _batch(step: int, dp_index: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 * step + dp_index)
    tokens = torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=g)
    return tokens[:, :-1], tokens[:, 1:]


def _ce(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())


class _Built:
    """A cell's model on this rank, ready to train; ``comm_model``: see ``run_cells``."""

    def __init__(self, cell: Cell, compiled: bool, comm_model=None):
        import simplefsdp as sf
        from simplefsdp.mesh import ParallelDims, stage_group
        from simplefsdp.models.llama import Transformer
        from simplefsdp.parallel.activation_checkpoint import apply_ac, check_composition
        from simplefsdp.parallel.pipeline import build_schedule, split_stage
        from simplefsdp.parallel.tensor import apply_tp

        check_composition(cell.ac, compiled, cell.backend)
        replicate, shard = cell.dp
        dims = ParallelDims(pp=cell.pp, dp_replicate=replicate, dp_shard=shard, tp=cell.tp)
        self.mesh = dims.build_mesh()
        at = dims.coords(dist.get_rank())
        self.backend = None
        if compiled:  # before the model, so a refused setting costs nothing
            group = stage_group(self.mesh) if cell.bucketing == "auto" else None
            self.backend = sf.compile_backend(cell.backend, bucketing=cell.bucketing,
                                              reordering=True, group=group,
                                              comm_model=comm_model)
        torch.manual_seed(0)  # the same initial weights on every rank and run
        model = Transformer(_model_args(cell.layers))
        stage = at.pp
        split_stage(model, cell.pp, stage)
        if cell.tp > 1:
            apply_tp(model, self.mesh["tp"], SEQ)
        apply_ac(model, cell.ac)
        self.model = sf.data_parallel(model, self.mesh, mode=cell.mode)
        runnable = self.model
        if compiled:
            runnable = torch.compile(self.model, fullgraph=True, backend=self.backend)
        self.runnable = runnable
        self.first, self.last = stage == 0, stage == cell.pp - 1
        self.schedule = None
        if cell.pp > 1:
            def loss_fn(logits, targets):
                return _ce(logits, targets) / MICROBATCHES

            self.schedule, _ = build_schedule(runnable, self.mesh["pp"], torch.device("cpu"),
                                              MICROBATCHES, loss_fn)
        self.dp_index = at.dp
        self.optimizer = torch.optim.SGD(self.model.parameters(), lr=0.1)

    def step(self, step: int) -> float:
        """One training step; returns this rank's loss (0 where it has none)."""
        inputs, targets = _batch(step, self.dp_index)
        if self.schedule is None:
            loss = _ce(self.runnable(inputs), targets)
            loss.backward()
            value = loss.item()
        else:
            losses: list[torch.Tensor] = []
            self.schedule.step(*((inputs,) if self.first else ()),
                               target=targets if self.last else None, losses=losses)
            value = sum(x.item() for x in losses) if self.last else 0.0
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return value

    def params(self) -> list[torch.Tensor]:
        return [p.to_local().detach().clone() for p in self.model.parameters()]


_KINDS = ("all_gather_into_tensor", "reduce_scatter_tensor", "all_reduce")


def _profiled_collectives(prof) -> int:
    """Functional collectives issued in a profiled region (compiled graphs issue these)."""
    return sum(1 for e in prof.events() if e.name.startswith("_c10d_functional::")
               and any(k in e.name for k in _KINDS) and "coalesced" not in e.name)


def _train(built: _Built, compiled: bool) -> tuple[list[float], list[float], int]:
    losses, times, profiled = [], [], -1
    for step in range(STEPS):
        start = time.perf_counter()
        if step == STEPS - 1 and compiled:
            from torch.profiler import ProfilerActivity, profile

            with profile(activities=[ProfilerActivity.CPU]) as prof:
                losses.append(built.step(step))
            profiled = _profiled_collectives(prof)
        else:
            losses.append(built.step(step))
        times.append(time.perf_counter() - start)
    return losses, times, profiled


def _graph_counts(cell: Cell, backend) -> tuple[dict, dict, int, int]:
    """Per-step collectives before/after, buckets and other collectives: the latest
    forward and backward reports, times the graph calls per step (PP: microbatches)."""
    calls = MICROBATCHES if cell.pp > 1 else 1
    before: dict[str, int] = {}
    after: dict[str, int] = {}
    buckets = other = 0
    for graph in ("forward", "backward"):
        report = next((r for r in reversed(backend.reports) if r.graph == graph), None)
        if report is None:
            continue
        for kind, n in report.collectives_before.items():
            before[kind] = before.get(kind, 0) + calls * n
        for kind, n in report.collectives_after.items():
            after[kind] = after.get(kind, 0) + calls * n
            if n != sum(b["kind"] == kind for b in report.buckets):
                raise AssertionError(f"{graph}: {n} {kind} after bucketing but "
                                     f"{report.buckets} buckets")
        buckets += calls * len(report.buckets)
        other += calls * report.other_collectives
    return before, after, buckets, other


def _is_refusal(error: BaseException) -> bool:
    from simplefsdp.errors import ConfigError

    return isinstance(error, ValueError | ConfigError | NotImplementedError)


# Eager results do not depend on the bucketing or the compile backend: the cells that
# differ only in those share one eager run (per process, keyed by the other axes).
_EAGER: dict[tuple, tuple[list[float], list[float], list[torch.Tensor]]] = {}


def _eager_reference(cell: Cell) -> tuple[list[float], list[float], list[torch.Tensor]]:
    key = (cell.mode, cell.tp, cell.pp, cell.ac)
    if key not in _EAGER:
        eager = _Built(cell, compiled=False)
        losses, times, _ = _train(eager, compiled=False)
        _EAGER[key] = losses, times, eager.params()
    return _EAGER[key]


def run_cell(cell: Cell, comm_model=None) -> CellResult:
    """Eager then compiled, on every rank of the group (its size must be ``cell.world``);
    ``comm_model``: see ``run_cells``."""
    result = CellResult(cell.name, "ok")
    try:
        torch._dynamo.reset()
        try:  # refused settings raise here, before any work
            compiled = _Built(cell, compiled=True, comm_model=comm_model)
        except Exception as e:  # noqa: BLE001 - classified below
            if not _is_refusal(e):
                raise
            result.status, result.error = "refused", f"{type(e).__name__}: {e}"
            return result
        eager_losses, eager_times, eager_params = _eager_reference(cell)
        losses, times, result.profiled = _train(compiled, compiled=True)
        result.before, result.after, result.buckets, result.other = \
            _graph_counts(cell, compiled.backend)
        result.step_s = statistics.median(times[1:])
        result.eager_step_s = statistics.median(eager_times[1:])
        diffs = [abs(a - b) for a, b in zip(losses, eager_losses, strict=True)]
        result.loss_diff = max(diffs)
        result.param_diff = max((a - b).abs().max().item() if a.numel() else 0.0
                                for a, b in zip(compiled.params(), eager_params, strict=True))
    except Exception as e:  # noqa: BLE001 - a failed cell is a row of the table
        result.status = "failed"
        result.error = f"{type(e).__name__}: {e}"[:1000] + "\n" + traceback.format_exc()[-3000:]
    return result


def run_cells(rank: int, world: int, cells: list[Cell], log: str | None = None,
              comm_model=None) -> list[dict]:
    """Every cell in turn on this group of ranks; each rank's results (as dicts). The
    status of a cell is agreed across ranks (failed if any rank failed). With ``log``,
    rank 0 appends each agreed row to that JSON-lines file as soon as the cell ends, so
    a long run can be resumed and a crash names the cell it happened in.
    ``comm_model`` (a ``simplefsdp.compiler.cost.CommModel``): what the auto-bucketing
    cells plan with; None: calibrated on the process group as the trainer does (cached
    on disk, checked by the drift probe, see ``cost.get_comm_model``)."""
    out = []
    for cell in cells:
        started = time.perf_counter()
        result = run_cell(cell, comm_model)
        result.wall_s = time.perf_counter() - started
        everyone = [None] * world
        dist.all_gather_object(everyone, (result.status, result.error, result.loss_diff,
                                          result.param_diff))
        worst = max(everyone, key=lambda s: ("ok", "refused", "failed").index(s[0]))
        result.status, result.error = worst[0], worst[1]
        result.loss_diff = max(s[2] for s in everyone)
        result.param_diff = max(s[3] for s in everyone)
        out.append(asdict(result))
        if log is not None and rank == 0:
            with open(log, "a") as f:
                f.write(json.dumps(out[-1]) + "\n")
    return out


# ---------------------------------------------------------------------------------------
# The table.
# ---------------------------------------------------------------------------------------
def table(results: list[dict]) -> str:
    head = ("| cell | status | collectives before | after (buckets) | TP/SP | profiled | "
            "step s (eager) | loss / param diff |")
    lines = [head, "|" + "---|" * 8]
    for r in results:
        counts = (lambda d: " ".join(f"{k.split('_')[0][:2]}{k.split('_')[1][:1]}:{v}"
                                     for k, v in sorted(d.items())) or "-")
        if r["status"] == "ok":
            lines.append(f"| {r['cell']} | ok | {counts(r['before'])} | {counts(r['after'])} "
                         f"({r['buckets']}) | {r['other']} | {r['profiled']} | "
                         f"{r['step_s']:.3f} ({r['eager_step_s']:.3f}) | "
                         f"{r['loss_diff']:.1e} / {r['param_diff']:.1e} |")
        else:
            error = r["error"].splitlines()[0][:160].replace("|", "/")
            lines.append(f"| {r['cell']} | {r['status']} | {error} | | | | | |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ci", action="store_true", help="only the pairwise CI subset")
    parser.add_argument("--only", default="", help="keep cells whose name contains this")
    parser.add_argument("--max-world", type=int, default=8)
    parser.add_argument("--out", default="composition_matrix.md")
    parser.add_argument("--fresh", action="store_true",
                        help="forget the rows of an earlier run (OUT.jsonl) instead of "
                             "resuming after them")
    args = parser.parse_args(argv)
    # Up to 8 ranks compile at once on a few cores: Inductor's per-rank pool of compile
    # workers would put hundreds of threads on them (load average 200-700 measured).
    os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
    from rank_runner import RankFailure, run_ranks

    cells = CI_CELLS if args.ci else full_matrix()
    cells = [c for c in cells if args.only in c.name and c.world <= args.max_world]
    log = Path(args.out).with_suffix(".jsonl")
    if args.fresh:
        log.unlink(missing_ok=True)

    def done() -> dict[str, dict]:
        rows = [json.loads(line) for line in log.read_text().splitlines()] \
            if log.exists() else []
        return {r["cell"]: r for r in rows}

    # One launch per world size runs all of its cells (spawning ranks costs more than a
    # small cell). A crash or hang takes the launch down: the cell it happened in is
    # recorded as failed and the launch restarts after it.
    for world in sorted({c.world for c in cells}):
        while pending := [c for c in cells if c.world == world and c.name not in done()]:
            started = time.perf_counter()
            try:
                run_ranks(run_cells, world, pending, str(log),
                          timeout_s=CELL_TIMEOUT_S * len(pending))
            except RankFailure as e:
                culprit = next(c for c in pending if c.name not in done())
                with open(log, "a") as f:
                    f.write(json.dumps(asdict(CellResult(
                        culprit.name, "failed", str(e).splitlines()[-1][:2000]))) + "\n")
            print(f"world {world}: {len(pending)} cells in "
                  f"{time.perf_counter() - started:.0f} s", flush=True)
    rows = done()
    results = [rows[c.name] for c in cells]
    for r in results:
        print(f"{r['status']:8s} {r['cell']}", flush=True)
    text = table(results)
    Path(args.out).write_text(text + "\n")
    print(text)
    return 0 if all(r["status"] != "failed" for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
