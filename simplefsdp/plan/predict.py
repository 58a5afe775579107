"""One configuration -> predicted memory and speed per GPU.

The blocks repeat, so each pipeline stage role is traced with 1 and 2 blocks at full
width and extrapolated to the stage's depth ``n`` (embeddings and head are in both
traces). Times and saved activations grow by one block's worth per block:
``X(n) = X(1) + (n - 1) * (X(2) - X(1))``. Peaks do not: a peak is what is saved so far
plus a transient (the gathered bucket in use and the one prefetched behind it, the
block's temporaries), and the transient is the same at any depth of 2 or more, so
``peak(n) = peak(2) + (n - 2) * (saved(2) - saved(1))`` (``peak_extrapolation``).
Without pipeline parallelism the role is the whole model; with it, the first stage
(embeddings, most microbatches in flight under 1F1B) and the last (head and loss).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import NamedTuple

from ..config.job import JobConfig
from ..config.keys import check_etp
from ..errors import ConfigError
from ..hardware import KNOWN_FABRICS, GiB, gpu_profile, model_flops_utilization
from ..models.llama import flops_per_token
from ..parallel.activation_checkpoint import ac_mode_run
from ..parallel.pipeline import stage_layers
from . import disk_cache, memory, moe, ring_pass, timing, tradeoffs
from .eager import eager_memory
from .trace import trace, trace_key

# Caching-allocator reserve over the active peak: fitted, the one constant fitted to the
# published runs (their reserved / our predicted active peak: 1.18 full AC, 1.22 no AC,
# 1.24 and 1.14 selective eager / compiled; see README).
ALLOC_OVERHEAD = 0.20
CONTEXT_BYTES = 1.0 * GiB  # CUDA context + NCCL buffers: outside torch's reserved figure
# Eager memory is replayed at the planned shard count where the ranks it needs stay
# within this many (shard-sized temporaries are then exact), else at the traced count.
EXACT_EAGER_WORLD = 64
# A shard count so large that shard-sized tensors count as nothing: the saved bytes left
# are the activations, which no data-parallel size shrinks (``block_saved_floor``).
SHARDLESS = 1 << 50


@dataclass
class Prediction:
    """One row of the plan: the layout, and per-GPU memory and speed."""

    dp_replicate: int
    dp_shard: int
    tp: int
    pp: int
    ac: str
    batch_size: int
    seq_len: int
    compile: bool
    peak_memory_gib: float  # active (torch.cuda.max_memory_allocated)
    reserved_memory_gib: float  # + allocator overhead (torch's max reserved)
    step_time_s: float
    tokens_per_s_per_gpu: float
    mfu: float
    fits: bool
    gpu: str = ""
    gpus: int = 0
    exposed_comm_s: float = 0.0
    detail: dict = field(default_factory=dict)
    ep: int = 1
    cp_ring: int = 1
    cp_ulysses: int = 1
    cp_rotate: str = "allgather"
    knobs: str = ""  # issue 48's knobs set (tradeoffs.knob_label), "" for none

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


def _extrapolate(one: float, two: float, n: int) -> float:
    return one + (n - 1) * (two - one)


# compiled graphs' peak -> the saved bytes it grows with, block by block. The eager
# replay's peak keeps the linear rule: eager prefetches nothing, and the rule fits
# the eager runs better than the saved slope does (figures: docs/performance.md).
PEAK_GROWS_WITH = {"forward_peak": "saved", "backward_peak": "saved"}


def peak_extrapolation(one: dict, two: dict, n: int) -> dict:
    """Figures of an ``n``-block stage from its 1- and 2-block traces (module docstring).
    Compiled peaks grow with the saved bytes, not linearly: with reordering, the 2-block
    trace holds two gathered blocks at its peak and the 1-block trace one, so a linear
    rule would count one more transient per block."""
    out = {k: _extrapolate(one[k], two[k], n) for k in one}
    if n >= 2:
        for peak, saved in PEAK_GROWS_WITH.items():
            if peak in one:
                out[peak] = two[peak] + (n - 2) * (two[saved] - one[saved])
    return out


def _figures_key(cfg: JobConfig, role: str, dev, fabric, mb: int) -> dict:
    """Everything ``_traced_figures`` reads: the configuration as planned (its parallel
    section resolved), the role and microbatch, the device's speeds and links (not its
    memory: the figures do not depend on it) and the fabric's node size."""
    speeds = dataclasses.asdict(dataclasses.replace(dev, memory_bytes=0.0, note=""))
    links = {name: dataclasses.asdict(KNOWN_FABRICS[name])
             for name in (dev.intra_node, dev.inter_node)}
    return {"config": disk_cache.planned_config(cfg), "role": role, "microbatch": mb,
            "device": speeds, "links": links, "gpus_per_node": fabric.gpn,
            "dims": dataclasses.asdict(fabric.dims)}


def _role_figures(cfg: JobConfig, role: str, p, dev, fabric, mb: int) -> dict:
    """Memory (bytes) and time (s) of one stage role at its real depth, per microbatch:
    from the disk cache (``plan.disk_cache``) when these inputs were planned before,
    else from its traces (and then kept there)."""
    path = disk_cache.entry_path("figures", _figures_key(cfg, role, dev, fabric, mb))
    figures = disk_cache.load(path)
    if figures is None:
        figures = _traced_figures(cfg, role, p, dev, fabric, mb)
        disk_cache.store(path, figures)
    return figures


def _traced_figures(cfg: JobConfig, role: str, p, dev, fabric, mb: int) -> dict:
    """``_role_figures`` from the role's 1- and 2-block traces."""
    args = cfg.model.model_args()
    blocks = list(range(args.n_layers)) if role == "full" else stage_layers(
        args.n_layers, p.pp, 0 if role == "first" else p.pp - 1)
    n = len(blocks)
    dp_shard_t = 2 if p.dp_shard >= 2 else 1
    dp_rep_t = 2 if p.dp_replicate >= 2 else 1
    figures = []
    for k in (1, 2):
        tr = trace(trace_key(cfg, role, k, mb, dp_rep_t, dp_shard_t))
        gm = memory.graph_memory(tr, p.dp_shard)
        scale = tr.key.dp_shard / p.dp_shard
        ffn_tp = moe.ffn_tp_collectives(args)  # the stand-in's FFN: the model's own?
        times = [timing.graph_seconds(g, dev, fabric, tr.groups, tr.key.compile, scale, shard,
                                      ffn_tp)
                 for g, shard in zip((tr.forward, tr.backward), memory.trace_shards(tr),
                                     strict=True)]
        # the graphs run before the forward (float8: the weights' amaxes and their
        # all-reduce, which the forward waits for)
        times += [timing.graph_seconds(g, dev, fabric, tr.groups, tr.key.compile, scale, set())
                  for g in tr.prologue]
        # the ring pass's shifts, hidden behind each step's attention (``plan.ring_pass``)
        ring = sum(ring_pass.ring_pass_seconds(tr, dev, fabric, tr.key.ac == "full"))
        fig = {**vars(gm), "seconds": sum(t for t, _ in times) + ring,
               "exposed": sum(e for _, e in times) + ring, "ring_exposed": ring}
        if cfg.compile.enable:  # the saved bytes that do not shrink with more shards
            fig["saved_floor"] = memory.graph_memory(tr, SHARDLESS).saved
        if not cfg.compile.enable:  # eager memory is what eager autograd keeps
            # at the planned shard size where the fake world holds it (shard-sized
            # temporaries, e.g. the bf16 casts of the shards, are then exact)
            fits = dataclasses.replace(tr.key.dims, dp_shard=p.dp_shard).world_size \
                <= EXACT_EAGER_WORLD
            em = eager_memory(dataclasses.replace(
                tr.key, dp_shard=p.dp_shard if fits else dp_shard_t), fits)
            fig.update(eager_peak=em.peak, eager_saved=em.saved)
        figures.append(fig)
    out = peak_extrapolation(figures[0], figures[1], n)
    out["layers"] = blocks
    if "saved_floor" in out:  # one block's, for the search's memory floor
        del out["saved_floor"]
        out["block_saved_floor"] = max(0, figures[1]["saved_floor"]
                                       - figures[0]["saved_floor"])
    return out


def _role_memory(cfg: JobConfig, role: str, f: dict, mb: int, micro: int,
                 routed: int) -> tuple[list[float], list[float], float]:
    """(peaks before any gradient exists, peaks with them, bytes saved for backward per
    microbatch of ``mb`` sequences, ``micro`` of them a step under PP) of one stage role
    on top of its model states less the gradients:
    compiled, the graphs' liveness + the eager loss on the logits (the vocabulary-sharded
    ones under loss parallel); eager, the replayed step's own allocations, loss included;
    a mixture of experts' routed copies (``routed`` bytes, ``moe.saved_bytes``) on top of
    either.

    The trainer sets the gradients to None after each step, and the first gradient of a
    step appears in its first microbatch's compiled backward: the forward and the eager
    loss (forward and backward, before the model's) of a step's only microbatch run
    without them. Every other peak counts them whole: the compiled backward's (they
    appear during it), the eager replay's (one figure for the whole step), and any
    microbatch after the first (the earlier ones' are accumulated)."""
    t, args = cfg.training, cfg.model.model_args()
    tokens = memory.rank_tokens(mb, t.seq_len, cfg.parallel.dims())
    elem = memory.activation_elem_bytes(t)
    if cfg.compile.enable:
        before, after, saved = [f["forward_peak"]], [f["backward_peak"]], f["saved"]
        if role in ("full", "last"):
            loss = memory.loss_peaks(tokens, memory.loss_vocab(args, cfg.parallel), elem,
                                     cfg.parallel.vocab_sharded_loss)
            before += [saved + extra for extra in loss]
        if micro * t.grad_accum_steps > 1:
            before, after = [], before + after
    else:
        before, after, saved = [], [f["eager_peak"]], f["eager_saved"]
    return ([peak + routed for peak in before], [peak + routed for peak in after],
            saved + routed)


def _as_run(cfg: JobConfig) -> JobConfig:
    """``cfg`` with the activation checkpointing its blocks get (a compiled mixture of
    experts recomputes whole blocks under ``selective``:
    ``parallel.activation_checkpoint.ac_mode_run``)."""
    mode = ac_mode_run(cfg.activation_checkpoint.mode, cfg.compile.enable,
                       fullgraph=cfg.model.family_entry().fullgraph)
    return dataclasses.replace(cfg, activation_checkpoint=dataclasses.replace(
        cfg.activation_checkpoint, mode=mode))


class RoutedTerms(NamedTuple):
    """A role's MoE terms per microstep (``plan.moe``)."""

    all_to_all_s: float  # EP's and ETP's exchanges, exposed whole
    permute_s: float
    kept_bytes: float  # kept for a recomputation
    host_s: float  # eager: the host's time per step the device waits for
    # the routed experts' data-parallel gathers per read: (returned, received) bytes;
    # their time is the traced stand-in's gathers'
    expert_gather_bytes: tuple


def _routed_terms(cfg: JobConfig, f: dict, tokens: int, moe_ac: str, dev,
                  fabric) -> tuple[float, RoutedTerms]:
    """A role's step with its MoE terms, and those terms. Eager, the device waits for the
    host at each routed block (``moe.host_seconds``). ``f``: the role's figures;
    ``tokens``: a rank's."""
    p, args, layers = cfg.parallel, cfg.model.model_args(), f["layers"]
    routed, elem = moe.routed_tokens(tokens, p.dims()), \
        memory.activation_elem_bytes(cfg.training)
    dispatch = moe.Dispatch.of(p)
    a2a = moe.exchange_seconds(args, layers, routed, elem, moe_ac, fabric, dispatch) \
        + moe.etp_exchange_seconds(args, layers, routed, elem, moe_ac, fabric, p.etp)
    permute = moe.permute_seconds(args, layers, routed, elem, moe_ac, dev,
                                  cfg.compile.enable, p.ep, dispatch, p.etp)
    step = f["seconds"] + a2a + permute \
        + moe.padded_seconds(args, layers, routed, moe_ac, dev, dispatch)
    kept = moe.saved_bytes(args, layers, routed, elem, moe_ac, p.ep, dispatch, p.etp)
    host = 0.0 if cfg.compile.enable else moe.host_seconds(args, layers, moe_ac, p.ep, dev)
    gathers = memory.expert_gather_bytes(args, layers, p.dims(), p.dp_mode, elem, p.etp)
    return max(step, host), RoutedTerms(a2a, permute, kept, host, gathers)


def _check_gpus(cfg: JobConfig, gpus: int, gpus_per_node: int) -> None:
    if gpus < 1 or gpus_per_node < 1:
        raise ConfigError(f"--gpus ({gpus}) and --gpus-per-node ({gpus_per_node}) must be >= 1")
    if cfg.parallel.tp > gpus_per_node:
        raise ConfigError(f"parallel.tp = {cfg.parallel.tp} spans more than one node of "
                          f"{gpus_per_node} GPUs; keep tp <= --gpus-per-node")


def predict(cfg: JobConfig, gpus: int, gpu: str = "h100-sxm",
            gpus_per_node: int = 8) -> Prediction:
    """Predicted per-GPU memory and speed of ``cfg`` on ``gpus`` GPUs of kind ``gpu``."""
    dev = gpu_profile(gpu)
    _check_gpus(cfg, gpus, gpus_per_node)
    p = cfg.parallel.resolve(gpus)
    # the MoE terms follow the mode asked for (a compiled MoE's selective keeps its
    # exchanges while its graphs recompute whole: ``_as_run``)
    moe_ac = cfg.activation_checkpoint.mode
    cfg = dataclasses.replace(_as_run(cfg), parallel=p)
    dims = p.dims()  # the layout's one view
    # expert tensor parallelism's ep rule needs the world's dp_shard (``check_etp``)
    check_etp(cfg, cfg.model.family_entry().name, dims)
    t, args = cfg.training, cfg.model.model_args()
    micro = p.microbatches
    mb = t.batch_size // micro
    fabric = timing.MeshLinks(dev, dims, gpus_per_node, p.etp)
    roles = ["full"] if p.pp == 1 else ["first", "last"]
    active, seconds, exposed, detail = 0.0, 0.0, 0.0, {}
    for role in roles:
        f = _role_figures(cfg, role, p, dev, fabric, mb)
        params = memory.rank_params(args, role, f["layers"], dims, p.dp_mode, p.etp)
        states = memory.states_bytes(params)
        tokens = memory.rank_tokens(mb, t.seq_len, dims)
        step, routed = _routed_terms(cfg, f, tokens, moe_ac, dev, fabric)
        if role in ("full", "last"):
            step += timing.loss_seconds(tokens, memory.loss_vocab(args, p), dev)
        before, after, saved = _role_memory(cfg, role, f, mb, micro, routed.kept_bytes)
        gradless = states - memory.gradient_bytes(params)
        # 1F1B: stage 0 holds min(microbatches, pp) forwards before its first backward
        in_flight = min(micro, p.pp) if role == "first" else 1
        # (total, activations) at the peak: the gradients held or not
        total, acts = max([(gradless + peak, peak) for peak in before]
                          + [(states + peak, peak) for peak in after])
        role_active = total + (in_flight - 1) * saved
        if p.pp == 1:
            stage_s = step * t.grad_accum_steps
        else:
            stage_s = timing.pp_step_seconds(step, p.pp, micro * t.grad_accum_steps)
        stage_s += timing.optimizer_seconds(params, dev)
        # gradient sync off, reshard to a group, CPU offload, frozen parameters
        knobs = tradeoffs.role_terms(
            cfg, fabric, dev, tradeoffs.role_params(cfg, params, len(f["layers"]),
                                                    dims.dp_shard_cp),
            f["exposed"], len(f["layers"]))
        role_active, stage_s = role_active + knobs.bytes, stage_s + knobs.seconds
        active = max(active, role_active)
        seconds = max(seconds, stage_s)
        runs = micro * t.grad_accum_steps
        exposed = max(exposed, (f["exposed"] + routed.all_to_all_s) * runs)
        detail[role] = {"layers": len(f["layers"]), "states_gib": states / GiB,
                        "activations_gib": (acts + (in_flight - 1) * saved) / GiB,
                        "gradients_at_peak": total > gradless + acts,
                        "saved_per_microbatch_gib": saved / GiB, "step_s": stage_s,
                        "all_to_all_s": routed.all_to_all_s * runs,
                        "host_s": routed.host_s * runs, "permute_s": routed.permute_s * runs,
                        "routed_saved_gib": routed.kept_bytes / GiB,
                        "expert_gather_bytes": routed.expert_gather_bytes,
                        "ring_pass_exposed_s": f["ring_exposed"] * runs,
                        # compiled: one block's saved bytes less its shard-sized ones
                        # (``plan.search``'s memory floor for layouts not yet traced)
                        "block_saved_floor_bytes": f.get("block_saved_floor"),
                        "tradeoffs": knobs.detail}
    reserved = active * (1 + ALLOC_OVERHEAD)
    tokens = t.batch_size * t.seq_len * t.grad_accum_steps * dims.dp
    tps = tokens / seconds / gpus
    return Prediction(
        p.dp_replicate, p.dp_shard, p.tp, p.pp, cfg.activation_checkpoint.mode,
        t.batch_size, t.seq_len, cfg.compile.enable, active / GiB, reserved / GiB, seconds,
        tps, model_flops_utilization(flops_per_token(args, t.seq_len), tps, dev.spec.bf16_flops),
        reserved + CONTEXT_BYTES <= dev.memory_bytes, gpu, gpus, exposed, detail, p.ep,
        p.cp_ring, p.cp_ulysses, p.cp_rotate, tradeoffs.knob_label(cfg))
