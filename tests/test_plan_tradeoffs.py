"""The planner's terms for gradient sync off, reshard to a group, CPU offload and frozen
parameters (``plan/tradeoffs.py``), checked against figures worked out here by hand from
the formulas' inputs (fabric and device figures, parameter counts), and ``--search``
rows that turn each knob.

Case: 16 H100 SXM GPUs, 8 per node, ``fully_shard`` over all 16 (the shard group spans
two nodes: InfiniBand NDR), 8e6 parameters gathered per rank (5e5 stored), 4 blocks.
"""

from __future__ import annotations

import dataclasses

import pytest

from simplefsdp.config.job import JobConfig
from simplefsdp.hardware import GPU_PROFILES, KNOWN_FABRICS
from simplefsdp.mesh import ParallelDims
from simplefsdp.plan import timing, tradeoffs

GPUS, PER_NODE, BLOCKS = 16, 8, 4
FULL, RANK = 8e6, 8e6 / GPUS
DEV = GPU_PROFILES["h100-sxm"]
IB, NV = KNOWN_FABRICS["infiniband_ndr"], KNOWN_FABRICS["nvlink_h100"]
LOOSE = 10.0  # exposed communication large enough that no saving is capped


def ring(fabric, n: int, nbytes: float) -> float:
    """A ring all-gather / reduce-scatter of ``nbytes`` (full size) over ``n`` ranks, by
    hand: start-up, one step per hop, (n-1)/n of the bytes through each link."""
    return fabric.alpha_s + (n - 1) * fabric.ring_step_s + (n - 1) / n * nbytes \
        / fabric.bus_bandwidth_Bps


def _case(**knobs) -> tuple[JobConfig, timing.MeshLinks]:
    cfg = JobConfig()
    cfg.parallel.dp_shard = GPUS
    for key, value in knobs.items():
        section, name = key.split("__")
        setattr(getattr(cfg, section), name, value)
    return cfg, timing.MeshLinks(DEV, ParallelDims(dp_shard=GPUS), PER_NODE)


def _terms(cfg, fabric, exposed=LOOSE):
    params = tradeoffs.role_params(cfg, RANK, BLOCKS, GPUS)
    return tradeoffs.role_terms(cfg, fabric, DEV, params, exposed, BLOCKS)


@pytest.mark.quick
def test_gradient_sync_off_full_size_accumulator_and_one_reduction():
    cfg, fabric = _case(training__grad_accum_steps=4, training__gradient_sync="last_microstep")
    terms = _terms(cfg, fabric)
    scatter = ring(IB, 16, FULL * 4)  # float32 reduction over 2 nodes
    assert terms.bytes == pytest.approx(FULL * 4)  # a float32 accumulator per parameter
    assert terms.seconds == pytest.approx(-3 * scatter)  # 3 of 4 reductions skipped
    # a saving never exceeds the communication a micro-step leaves exposed
    assert _terms(cfg, fabric, exposed=1e-4).seconds == pytest.approx(-3 * 1e-4)
    # replicate's gradients are full-size already: no accumulator
    cfg.parallel.dp_mode, cfg.parallel.dp_replicate, cfg.parallel.dp_shard = "replicate", 16, 1
    fabric = timing.MeshLinks(DEV, ParallelDims(dp_replicate=16, dp_shard=1), PER_NODE)
    assert _terms(cfg, fabric).bytes == 0


@pytest.mark.parametrize("compiled", [False, True])
def test_reshard_to_a_node(compiled):
    cfg, fabric = _case(parallel__reshard_after_forward=8, compile__enable=compiled)
    terms = _terms(cfg, fabric)
    block = FULL * 4 / BLOCKS  # float32 gathered bytes of one block
    flat, inner = ring(IB, 16, block), ring(NV, 8, block)  # the node's 8 ranks: NVLink
    delta = inner - flat
    if compiled:  # forward: the outer step (2 ranks a node apart), then the inner one
        delta += ring(IB, 2, block / 8) + inner - flat
    assert delta < 0
    assert terms.bytes == pytest.approx(FULL * 4 / 8)  # an eighth of each kept, float32
    assert terms.seconds == pytest.approx(BLOCKS * delta)


def test_cpu_offload_states_copies_and_host_optimizer():
    cfg, fabric = _case(training__cpu_offload=True, training__grad_accum_steps=2)
    terms = _terms(cfg, fabric)
    # per micro-step: each float32 shard copied in for forward and again for backward,
    # each gradient shard out; 2 micro-steps
    copies = (2 * 2 * RANK + 2 * RANK) * 4 / 50e9
    host = 36 * RANK / 10e9  # AdamW + clipping traffic, 36 B a parameter, on the host
    device = 36 * RANK / (DEV.spec.mem_bandwidth_Bps * DEV.efficiency.memory)
    assert terms.bytes == pytest.approx(-16 * RANK)
    assert terms.seconds == pytest.approx(copies + host - device)


def test_frozen_lora_base_no_gradient_state_or_reduction():
    cfg, fabric = _case(lora__enable=True)
    args = cfg.model.model_args()  # debug: dim 128, 4 heads of 32, 2 KV heads
    adapters = BLOCKS * 8 * ((128 + 4 * 32) + (128 + 2 * 32))  # wq and wv, rank 8
    trainable = adapters / GPUS
    assert tradeoffs.lora_params(args, cfg, BLOCKS) == adapters
    terms = _terms(cfg, fabric)
    reduce = ring(IB, 16, FULL * 4)  # the frozen base's reduction, no longer run
    optimizer = 36 * (RANK - trainable) / (DEV.spec.mem_bandwidth_Bps * DEV.efficiency.memory)
    assert terms.bytes == pytest.approx(16 * trainable - 12 * RANK)
    assert terms.seconds == pytest.approx(-reduce - optimizer)


def _search_rows_with_knobs() -> tuple[dict, list, dict]:
    """In the planner's process (it keeps its fake process group there): one layout
    through the search's loop with ``--tradeoffs`` on a device profile just too small
    for it; rows as dicts by knob."""
    from simplefsdp.config.job import load_config
    from simplefsdp.plan.floors import lower_bound
    from simplefsdp.plan.predict import CONTEXT_BYTES, predict
    from simplefsdp.plan.search import _Bar, _search_groups

    cfg = load_config("configs/debug.toml", ["--job.device", "cuda", "--training.batch_size",
                                             "1", "--training.grad_accum_steps", "2",
                                             "--parallel.dp_shard", "16"], world_size=GPUS)
    base = predict(cfg, GPUS, "h100-sxm", PER_NODE)
    # between the search's untraced lower bound and the layout's reserved memory
    lower = lower_bound(cfg) + CONTEXT_BYTES
    GPU_PROFILES["tight"] = dataclasses.replace(
        DEV, memory_bytes=(lower + base.reserved_memory_gib * 2**30 + CONTEXT_BYTES) / 2)
    try:
        rows, failures, stats = _search_groups([[cfg]], GPUS, "tight", PER_NODE, _Bar(0),
                                               tradeoffs_rows=True)  # --search --tradeoffs
    finally:
        del GPU_PROFILES["tight"]
    return {r.knobs: r.to_dict() for r in rows}, failures, stats


def test_search_rows_turn_each_knob(planner):
    """One layout through the search's loop with ``--tradeoffs``: its row, then one row
    per knob; CPU offload only where the layout does not fit (a device profile just too
    small for it). Without the flag the search is unchanged (tests/test_plan_search.py).
    In the session's planner process: a trace here would leave the planner's fake
    process group initialized in pytest's own process (later tests would meet it)."""
    by_knob, failures, stats = planner(_search_rows_with_knobs)
    assert not failures
    assert set(by_knob) == {"", "reshard=8", "sync=last", "offload"}, list(by_knob)
    assert not by_knob[""]["fits"] and stats["knob_rows"] == 3
    offload = by_knob["offload"]
    assert offload["reserved_memory_gib"] < by_knob[""]["reserved_memory_gib"]
    assert by_knob["reshard=8"]["peak_memory_gib"] > by_knob[""]["peak_memory_gib"]
    assert by_knob["sync=last"]["step_time_s"] < by_knob[""]["step_time_s"]
    print("\n".join(f"{k or 'none':>10}: {r['reserved_memory_gib']:.4f} GiB, "
                    f"{r['step_time_s'] * 1e3:.3f} ms, fits {r['fits']}"
                    for k, r in by_knob.items()))
