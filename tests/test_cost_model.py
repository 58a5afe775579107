"""Tests for simplefsdp.compiler.cost: communication calibration and its cache,
compute-time estimates of FX nodes, and the liveness-based memory estimate."""

from __future__ import annotations

import json
import math
import os

import pytest
import torch
from rank_runner import run_ranks
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental.proxy_tensor import make_fx

from simplefsdp import agreement
from simplefsdp.compiler.collectives import collective_kind
from simplefsdp.compiler.cost import comm, compute, fit, memory
from simplefsdp.hardware import gpu_peak_flops, gpu_spec

# ---------------------------------------------------------------------------- comm model

# Sizes the check holds out; neither is one of the calibration sizes (4 KiB * 4**i).
_CHECK_SIZES = (32 * 1024, 2 * 1024 * 1024)
# Gloo over loopback on a 2-core machine shared with other jobs: a rank that gets
# descheduled stalls the collective for a scheduler slice (~ms), and the load changes
# from one second to the next. So the check is a hold-out under the same load: the
# model under test is the one calibrate() returns, and the one timing round it runs
# (measure_collectives) also times the check sizes, interleaved with its own (medians of
# 9), without showing them to it; the model's prediction for each kind must match the
# agreed held-out medians within 3x either way (a wrong beta or alpha is off by 10x+ at
# one of the two sizes; swapped alpha and beta by 1000x+). Before, the check timed its
# sizes in a separate round after calibrating: a burst of load between the two put
# ratios at 0.14-0.28. A retry (decided on agreed numbers, so all ranks retry together)
# calibrates again and still absorbs a burst within one round, and each check keeps its
# best ratio over the rounds: a wrong fit misses in every round, one slow round only some
# checks (the 32 KiB checks read 0.27-1.0 from one round to the next on an idle machine;
# a clean CI run failed when its last round read 0.24 for one). On gloo the three kinds
# take about as long as one another (reduce-scatter runs as an all-reduce), so which
# kind's fit a kind gets is checked exactly, on timings with a known line per kind
# (_calibrate_on_known_lines).
_TOLERANCE = 3.0
_ATTEMPTS = 3
_HELD_OUT_REPEATS = 9


def _off(ratio: float) -> float:
    """How far a predicted/measured ratio is from 1, either way (log scale)."""
    return abs(math.log(max(ratio, 1e-12)))


def _calibrate_holding_out(probes: bool) -> tuple[comm.CommModel, dict[tuple[str, int], float]]:
    """``comm.calibrate()`` as it is, except that its timing round (``measure_collectives``,
    9 repeats) also times ``_CHECK_SIZES`` of each kind, interleaved with its own sizes,
    and keeps their agreed (MAX) medians from it. ``probes=False``: the hidden-fraction,
    copy and slowdown probes are left out (a retry round needs only the fits)."""
    real, held = comm.measure_collectives, {}

    def measure(cases, group, device, dtype, repeats, warmup):
        extra = [(k, n) for k in dict.fromkeys(k for k, _ in cases) for n in _CHECK_SIZES]
        medians = real([*cases, *extra], group, device, dtype, _HELD_OUT_REPEATS, warmup)
        held.update(zip(extra, agreement.agree_across_ranks(medians[len(cases):], group),
                        strict=True))
        return medians[:len(cases)]

    saved = {name: getattr(comm, name) for name in (
        "measure_collectives", "measure_hidden_fraction", "measure_copy",
        "measure_compute_slowdown")}
    comm.measure_collectives = measure
    if not probes:
        comm.measure_hidden_fraction = lambda *a, **k: 0.0
        comm.measure_copy = lambda *a, **k: 0.0
        comm.measure_compute_slowdown = lambda *a, **k: 1.0
    try:
        model = comm.calibrate(repeats=3)
    finally:
        for name, fn in saved.items():
            setattr(comm, name, fn)
    return model, held


def _calibrate_and_check(rank: int, world_size: int) -> dict:
    model = None  # the first round's: the real thing, probes and all
    attempts = 0
    best: dict[str, float] = {}  # per check, the ratio nearest 1 over the attempts
    for _ in range(_ATTEMPTS):
        attempts += 1
        calibrated, held = _calibrate_holding_out(probes=model is None)
        model = model or calibrated
        for (kind, n), measured in held.items():
            r = calibrated.predict(kind, n) / measured
            name = f"{kind}@{n}"
            if name not in best or _off(r) < _off(best[name]):
                best[name] = r
        if all(1 / _TOLERANCE <= r <= _TOLERANCE for r in best.values()):
            break
    # agree_across_ranks: MAX, identical everywhere; lengths must match. Compiler passes
    # run inside the compiler's FakeTensorMode: the collective must still be real.
    with FakeTensorMode():
        agreed = agreement.agree_across_ranks([float(rank), 10.0 - rank])
    try:
        agreement.agree_across_ranks([1.0] * (rank + 1))
        mismatch = "no error"
    except ValueError as e:
        mismatch = str(e)
    return {"model": model.to_dict(), "params": {k: model.params(k) for k in comm.COLLECTIVE_KINDS},
            "ratios": best, "attempts": attempts, "agreed": agreed, "mismatch": mismatch}


# A line per kind (alpha s, beta s/B), all six figures distinct; calibrate() is fed these
# times (rank 1: the lines, rank 0: half of them) and must return each kind's own line
# (the MAX over ranks), alpha as alpha, beta as beta.
_KNOWN_LINES = {"all_gather": (1e-4, 2e-9), "reduce_scatter": (3e-4, 5e-9),
                "all_reduce": (7e-4, 1.1e-8)}
_KNOWN_SIZES = (4096, 65536, 1048576)


def _calibrate_on_known_lines(rank: int) -> dict:
    def measure(cases, *args, **kwargs):
        scale = 1.0 if rank == 1 else 0.5
        return [scale * (_KNOWN_LINES[k][0] + _KNOWN_LINES[k][1] * n) for k, n in cases]

    saved = {name: getattr(comm, name) for name in (
        "measure_collectives", "measure_hidden_fraction", "measure_copy",
        "measure_compute_slowdown")}
    comm.measure_collectives = measure
    comm.measure_hidden_fraction = lambda *a, **k: (0.4, 0.6)[rank]  # MIN: rank 0's
    comm.measure_copy = lambda *a, **k: (3e-10, 2e-10)[rank]  # MAX: rank 0's
    comm.measure_compute_slowdown = lambda *a, **k: 1.25  # agreed by the probe itself
    try:
        return comm.calibrate(sizes=_KNOWN_SIZES, repeats=1).to_dict()
    finally:
        for name, fn in saved.items():
            setattr(comm, name, fn)


# A fake clock for measure_compute_slowdown (3 repeats): the times each rank's calls
# read, in call order (rank 0 alternates alone / together; rank 1 runs only together).
_SLOW_CLOCK = {
    "slower together": ([0.010, 0.012, 0.030, 0.050, 0.009, 0.011], [0.013, 0.004, 0.014]),
    "faster together": ([0.020, 0.010, 0.020, 0.010, 0.020, 0.010], [0.010, 0.010, 0.010]),
}


def _slowdown_on_fake_clock(rank: int) -> dict:
    from simplefsdp.compiler.cost import probes

    real = probes.time_callable
    out = {}
    try:
        for case, clocks in _SLOW_CLOCK.items():
            reads = iter(clocks[rank])

            def fake(fn, repeats, warmup, device, _reads=reads):
                # warmup 2: _model_mix sizing its work (1 ms a call), not the rounds
                return 1e-3 if warmup == 2 else next(_reads)

            probes.time_callable = fake
            out[case] = probes.measure_compute_slowdown(repeats=3)
            out[case + " left"] = len(list(reads))
    finally:
        probes.time_callable = real
    return out


def _cache_roundtrip(rank: int, world_size: int, dirs: list[str]) -> dict:
    os.environ["SIMPLEFSDP_CACHE_DIR"] = dirs[rank]  # rank 1's folder stays empty
    key = comm.cache_key()
    no_cache = comm.get_comm_model(calibrate_on_miss=False, cache=False)
    first = comm.get_comm_model(sizes=[4096, 65536], repeats=2)

    def no_timing(*args, **kwargs):
        raise AssertionError("a cached run must not time collectives")

    # what calibrate() times with: replaced, so a calibration now would fail the test
    measure, comm.measure_collectives = comm.measure_collectives, no_timing
    # the start-up probe still runs, its verdict pinned to "holds": on a host loaded by
    # other jobs its real reading may legitimately refuse the cache (tested with scripted
    # readings in test_calibration_probe.py)
    verdict, comm.drift.disagreements = comm.drift.disagreements, lambda *a, **k: []
    try:
        second = comm.get_comm_model(sizes=[4096, 65536], repeats=2)
        with FakeTensorMode():  # as inside a torch.compile backend
            # a cache hit beats the defaults
            third = comm.get_comm_model(calibrate_on_miss=False)
        try:  # the guard is live: a calibration does reach the replaced function
            comm.calibrate(sizes=[4096], repeats=1)
            guarded = False
        except AssertionError:
            guarded = True
    finally:
        comm.measure_collectives = measure
        comm.drift.disagreements = verdict
    return {"key": key, "first": first, "second": second, "third": third, "guarded": guarded,
            "second_source": second.source, "no_cache": no_cache,
            "files": sorted(os.listdir(dirs[rank]))}


def _ranks_main(rank: int, world_size: int, dirs: list[str]) -> dict:
    # One group of processes for both multi-rank checks: spawning ranks (each imports
    # torch) costs far more than the checks themselves.
    return {"calibration": _calibrate_and_check(rank, world_size),
            "known_lines": _calibrate_on_known_lines(rank),
            "slowdown": _slowdown_on_fake_clock(rank),
            "cache": _cache_roundtrip(rank, world_size, dirs)}


@pytest.fixture(scope="module")
def rank_results(tmp_path_factory):
    root = tmp_path_factory.mktemp("comm_cache")
    dirs = [str(root / "rank0"), str(root / "rank1")]
    for d in dirs:
        os.makedirs(d)
    return run_ranks(_ranks_main, 2, dirs), root


def test_calibration_fits_agrees_and_predicts(rank_results):
    r0, r1 = (r["calibration"] for r in rank_results[0])
    # bit-identical on every rank (float == float and the same repr)
    assert r0["params"] == r1["params"]
    assert repr(r0["params"]) == repr(r1["params"])
    assert r0["model"]["source"] == "calibrated" and r0["model"]["world_size"] == 2
    # the measured hidden fraction is agreed (MIN) across ranks too
    assert r0["model"]["hidden_fraction"] == r1["model"]["hidden_fraction"]
    # the copy cost (MAX across ranks) is measured; buckets stay within the sizes timed
    assert r0["model"]["copy_s_per_byte"] == r1["model"]["copy_s_per_byte"] > 0
    assert r0["model"]["max_bytes"] == max(comm.DEFAULT_CPU_SIZES)
    # agreed; its value is checked on a fake clock below (it is clamped to >= 1, so a
    # ">= 1" check here could not fail)
    assert r0["model"]["compute_slowdown"] == r1["model"]["compute_slowdown"]
    assert tuple(r0["model"]["group"]) == (0, 1)
    # the hold-out: calibrate()'s own model against the agreed medians of sizes it did
    # not fit, timed in its round
    assert r0["ratios"] == r1["ratios"]
    assert len(r0["ratios"]) == len(comm.COLLECTIVE_KINDS) * len(_CHECK_SIZES)
    for name, ratio in r0["ratios"].items():
        assert 1 / _TOLERANCE <= ratio <= _TOLERANCE, (name, r0["ratios"], r0["params"])
    assert r0["agreed"] == r1["agreed"] == [1.0, 10.0]
    assert "disagree" in r0["mismatch"] and "disagree" in r1["mismatch"]


def test_calibration_fits_each_kind_its_own_line(rank_results):
    """calibrate() on timings that lie on a known line per kind: each kind gets its own
    (alpha, beta), from the slower rank (MAX); the hidden fraction is the MIN over ranks,
    the copy cost the MAX. rel 1e-9: the fit is exact on points on a line up to float
    rounding (~1e-15 relative)."""
    models = [r["known_lines"] for r in rank_results[0]]
    assert models[0] == models[1]
    model = models[0]
    for kind, (alpha, beta) in _KNOWN_LINES.items():
        assert model[kind] == pytest.approx([alpha, beta], rel=1e-9), (kind, model)
    assert model["hidden_fraction"] == 0.4 and model["copy_s_per_byte"] == 3e-10
    assert model["compute_slowdown"] == 1.25 and model["max_bytes"] == max(_KNOWN_SIZES)


def test_compute_slowdown_on_a_fake_clock(rank_results):
    """measure_compute_slowdown's arithmetic on given times: the slowest rank's median
    together over rank 0's median alone, by hand 0.013 / 0.010 = 1.3 (means: 0.0243 /
    0.0163 = 1.49; the fastest rank: 1.2); faster together is clamped to 1.0 (the
    docstring's >= 1)."""
    for r in rank_results[0]:
        out = r["slowdown"]
        assert out["slower together"] == pytest.approx(1.3, rel=1e-12)
        assert out["faster together"] == 1.0
        assert out["slower together left"] == out["faster together left"] == 0


def test_cache_roundtrip_and_broadcast(rank_results):
    results, root = rank_results
    r0, r1 = (r["cache"] for r in results)
    assert r0["key"]["world_size"] == 2 and r0["key"]["backend"] == "gloo"
    assert r0["key"]["device_type"] == "cpu"
    assert r0["key"]["torch_version"] == torch.__version__
    assert r0["no_cache"] == comm.default_comm_model(2, "gloo_cpu_loopback")
    assert r0["no_cache"].source == "default:gloo_cpu_loopback"
    # only rank 0 wrote, one file, no leftover tmp file
    assert r0["files"] == [comm.cache_path(r0["key"]).name] and r1["files"] == []
    # the second call timed nothing (measure_collectives raised if called; "guarded":
    # calibrate() does call it) and rank 1, whose cache folder is empty, got rank 0's
    # figures
    for r in (r0, r1):
        assert r["guarded"]
        assert r["second"] == r0["first"] and r["third"] == r0["first"]
        assert r["second_source"] == "cache"
    stored = json.loads((root / "rank0" / r0["files"][0]).read_text())
    assert stored["key"] == r0["key"]


def test_cache_is_keyed(tmp_path, monkeypatch):
    monkeypatch.setenv("SIMPLEFSDP_CACHE_DIR", str(tmp_path))
    assert comm.cache_dir() == tmp_path
    key = {"world_size": 2, "local_world_size": 2, "backend": "gloo", "device_type": "cpu",
           "device_name": "x86_64", "torch_version": torch.__version__}
    model = comm.CommModel((1e-4, 1e-9), (2e-4, 2e-9), (3e-4, 3e-9), world_size=2)
    comm._store_cached(key, model)
    assert comm.CommModel.from_dict(comm.load_record(key)["model"]) == model
    for field, other in [("world_size", 4), ("backend", "nccl"), ("device_type", "cuda"),
                         ("device_name", "H100"), ("torch_version", "0.0")]:
        changed = dict(key, **{field: other})
        assert comm.cache_path(changed) != comm.cache_path(key)
        assert comm.load_record(changed) is None
    # a file whose stored key does not match (e.g. a hash collision) is ignored
    comm.cache_path(key).write_text(json.dumps({"key": dict(key, world_size=8),
                                              "model": model.to_dict()}))
    assert comm.load_record(key) is None
    comm.cache_path(key).write_text("{not json")
    assert comm.load_record(key) is None


@pytest.mark.quick
def test_fit_and_defaults():
    sizes = [4096 * 4 ** i for i in range(6)]
    alpha, beta = fit.fit_alpha_beta(sizes, [5e-5 + 2e-10 * n for n in sizes])
    assert alpha == pytest.approx(5e-5, rel=1e-9) and beta == pytest.approx(2e-10, rel=1e-9)
    # clamping: a negative intercept is refitted through the origin, a negative slope flat
    assert fit.fit_alpha_beta([1, 2, 3], [0.5, 2.0, 3.5])[0] == 0.0
    assert fit.fit_alpha_beta([1, 2, 3], [3.0, 2.0, 1.0])[1] == 0.0
    nv = comm.default_comm_model(8, "nvlink_h100")
    # 1 GiB all-gather over 8 H100s: 7/8 GiB at 360 GB/s ~ 2.6 ms
    assert 2e-3 < nv.predict("all_gather_into_tensor", 2 ** 30) < 3.5e-3
    assert nv.predict("all_reduce", 2 ** 30) > 1.9 * nv.predict("reduce_scatter", 2 ** 30)
    ib = comm.default_comm_model(16, "infiniband_ndr")
    assert ib.predict("all_gather", 2 ** 30) > 5 * nv.predict("all_gather", 2 ** 30)
    with pytest.raises(ValueError):
        nv.predict("broadcast", 1)
    assert comm.get_comm_model() == comm.default_comm_model(1)  # no process group here


# ------------------------------------------------------------------------- compute model


@pytest.fixture
def one_thread():
    # Two intra-op threads on a loaded 2-core box stall on each other for a scheduler
    # slice (~15 ms even for a tiny matmul); one thread gives stable kernel timings.
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def _mm_add(a, b, c):
    return torch.mm(a, b) + c


def _nodes(gm) -> dict:
    return {n.name: n for n in gm.graph.nodes}


def test_estimate_node_time(one_thread):
    n = 256
    gm = make_fx(_mm_add, tracing_mode="fake")(torch.randn(n, n), torch.randn(n, n),
                                               torch.randn(n, n))
    nodes = _nodes(gm)
    mm, add = nodes["mm"], nodes["add"]
    cache: dict = {}
    t_mm = compute.estimate_node_time(mm, cache=cache)
    t_add = compute.estimate_node_time(add, cache=cache)
    assert t_mm > 0 and t_add > 0
    assert t_mm > t_add  # 33.5 MFLOP vs 65 K additions
    assert len(cache) == 2
    assert compute.estimate_node_time(mm, cache=cache) == t_mm  # cached: not timed again
    assert len(cache) == 2

    # roofline fallback: asked for, or because running fails (inputs over the budget)
    f_mm = compute.estimate_node_time(mm, measure=False)
    f_add = compute.estimate_node_time(add, measure=False)
    assert f_mm > f_add > 0
    assert compute.estimate_node_time(mm, max_input_bytes=0) == f_mm
    spec = compute.ComputeSpec({torch.float32: 1e12}, 1e11)
    expected = 2 * n ** 3 / 1e12 + 3 * n * n * 4 / 1e11  # flops + (2 inputs + output) bytes
    assert compute.estimate_node_time(mm, measure=False, spec=spec) == pytest.approx(expected)

    times = compute.estimate_graph_compute(gm)
    assert len(times) == len(gm.graph.nodes)
    by_name = dict(zip(nodes, times, strict=True))
    assert by_name["a_1"] == by_name["output"] == 0.0
    assert by_name["mm"] > by_name["add"] > 0

    # an active fake mode (as inside the compiler) does not stop the measurement
    with FakeTensorMode():
        assert compute.estimate_node_time(mm) > 0


@pytest.mark.quick
def test_zero_cost_nodes():
    def f(x):
        y = x.view(4, 4).t()
        return y.sum(), y[0]
    gm = make_fx(f, tracing_mode="fake")(torch.randn(16))
    times = dict(zip(_nodes(gm), compute.estimate_graph_compute(gm), strict=True))
    assert times["view"] == times["t"] == times["select"] == times["x_1"] == 0.0
    assert times["sum_1"] > 0


# -------------------------------------------------------------------------- memory model


def _mm_slice_relu(x, w):
    a = x @ w          # [8, 32] fp32 = 1024 B
    s = a[:, :4]       # a view of a: no new memory, keeps a alive until relu
    r = torch.relu(s)  # [8, 4] = 128 B
    return r * 2       # 128 B


@pytest.mark.quick
def test_peak_memory_estimate():
    gm = make_fx(_mm_slice_relu, tracing_mode="fake")(torch.randn(8, 16), torch.randn(16, 32))
    names = [n.name for n in gm.graph.nodes]
    assert names == ["x_1", "w_1", "mm", "slice_1", "relu", "mul", "output"]
    nodes = _nodes(gm)
    assert [memory.tensor_bytes(nodes[k]) for k in names] == [512, 2048, 1024, 128, 128, 128, 0]
    peak, live = memory.peak_memory_estimate(gm)
    # By hand: the inputs (512 + 2048 = 2560 B) are live throughout; mm (1024) from its
    # definition to relu, which reads it through the slice; relu (128) until mul; mul
    # (128) until the output.
    assert live == [2560, 2560, 3584, 3584, 2560 + 1024 + 128, 2560 + 128 + 128, 2560 + 128]
    assert peak == 3712
    assert memory.peak_memory_estimate(gm.graph) == (peak, live)


def test_tensor_bytes_tuple_and_inplace():
    def f(x):
        v, i = torch.max(x, dim=1)  # values fp32 + indices int64
        x.add_(1)                   # in-place: aliases x, no new memory
        return v, i
    gm = make_fx(f, tracing_mode="fake")(torch.randn(4, 8))
    nodes = _nodes(gm)
    assert memory.tensor_bytes(nodes["max_1"]) == 4 * 4 + 4 * 8
    peak, live = memory.peak_memory_estimate(gm)
    assert peak == 4 * 8 * 4 + 4 * 4 + 4 * 8  # x + the (values, indices) tuple


# ------------------------------------------------------------------------ hardware table


def test_gpu_table_and_collective_names():
    # the more specific names win: an H20 is not an H100 (148 vs 989 TFLOP/s bf16), an
    # H200 is not an H20, the H100 PCIe card is slower than the SXM one
    assert gpu_peak_flops("NVIDIA H20") == 148e12
    assert gpu_peak_flops("NVIDIA H200") == 989e12
    assert gpu_peak_flops("NVIDIA H100 PCIe") == 756e12
    assert gpu_peak_flops("NVIDIA H100 80GB HBM3") == 989e12
    assert gpu_peak_flops("NVIDIA A100-SXM4-80GB") == 312e12
    assert gpu_peak_flops("Tesla T4") is None
    assert gpu_spec("NVIDIA H20").mem_bandwidth_Bps == 4.0e12
    # one normalization for graph, c10d and profiler names
    for name, kind in [("all_gather_into_tensor", "all_gather"),
                       ("c10d::_allgather_base_", "all_gather"),
                       ("_c10d_functional::reduce_scatter_tensor", "reduce_scatter"),
                       ("c10d::_reduce_scatter_base_", "reduce_scatter"),
                       ("allreduce_coalesced", "all_reduce"), ("all_reduce", "all_reduce"),
                       ("_c10d_functional::wait_tensor", None), ("aten::mm", None)]:
        assert collective_kind(name) == kind, name


def test_liveness_output_backward_inputs_and_copying_reshape():
    def f(a, b):
        return (a * b).relu()  # [64] fp32 = 256 B each
    gm = make_fx(f, tracing_mode="fake")(torch.randn(64), torch.randn(64))
    out = next(n for n in gm.graph.nodes if n.op == "output")
    ph = [n for n in gm.graph.nodes if n.op == "placeholder"]
    # Inductor's graphs give the output node a val of every output: no allocation
    out.meta["val"] = (next(n for n in gm.graph.nodes if n.name == "relu").meta["val"],)
    peak, live = memory.peak_memory_estimate(gm)
    # inputs held (512) + mul, then mul + relu, then relu until the output
    assert live == [512, 512, 768, 1024, 768] and peak == 1024
    # as an AOTAutograd backward: saved activations die after their last use; the tangent
    # (256 B, referenced by CompiledFunction.backward's arguments) and the forward output
    # it belongs to (256 B, the caller's) are held throughout
    ph[0].name, ph[1].name = "getitem", "tangents_1"
    peak, live = memory.peak_memory_estimate(gm)
    assert live == [512 + 256, 512 + 256, 512 + 512, 512 + 512, 512 + 256]

    # a reshape that cannot be a view copies (a bucket's copy-out); one that can is free
    from simplefsdp._torch_compat import FakeTensorMode
    from simplefsdp.compiler.collectives import call

    graph = torch.fx.Graph()
    x = graph.placeholder("x")
    with FakeTensorMode() as mode:
        x.meta["val"] = mode.from_tensor(torch.empty(4, 8))
    aten = torch.ops.aten
    copied = call(graph, aten.reshape.default, (call(graph, aten.t.default, (x,)), [-1]))
    viewed = call(graph, aten.reshape.default, (x, [-1]))
    graph.output((copied, viewed))
    assert memory.peak_memory_estimate(graph)[0] == 2 * 128  # x (held) + the copy
    # sunk copies (Inductor fuses them into their users): every reshape aliases its input
    assert memory.peak_memory_estimate(graph, alias_of=memory.sunk_copies)[0] == 128


# what each round of the hidden-fraction probe reads, scripted (see below)
HIDDEN_ROUNDS = (0.6, 0.0, 0.2, 0.5, 0.1)


def _scripted_hidden_fraction(rank: int, world_size: int) -> float:
    """``probes.measure_hidden_fraction`` with its timings scripted by what is timed: the
    all-gather and the compute 1 s each, both together ``2 - f`` (a round then reads
    exactly ``f``, the next of ``HIDDEN_ROUNDS``), the sizing matmuls 1 ms."""
    from simplefsdp.compiler.cost import probes

    rounds = iter(HIDDEN_ROUNDS)

    def timed(fn, repeats, warmup, device):
        if fn.__name__ == "both":
            return 2.0 - next(rounds)
        return 1.0 if fn.__name__ in ("comm", "compute") else 1e-3
    real = probes.time_callable
    probes.time_callable = timed
    try:
        return probes.measure_hidden_fraction(rounds=len(HIDDEN_ROUNDS))
    finally:
        probes.time_callable = real


def test_hidden_fraction_is_the_least_round():
    """The calibration keeps the least hiding any round read: what every round achieved
    (a round reads high when its separately timed all-gather or compute ran slow). The
    median of these rounds would be 0.2."""
    assert run_ranks(_scripted_hidden_fraction, 2) == [0.0, 0.0]
