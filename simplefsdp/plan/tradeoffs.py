"""The planner's terms for FSDP2's memory/communication knobs (issue 48), on top of a
prediction made without them. None changes the traced graphs' computation, so each is a
closed-form change to a stage role's device bytes and step seconds, from the role's
parameters, the fabric and the device profile:

* ``training.gradient_sync = "last_microstep"`` (``A = grad_accum_steps`` micro-steps):
  ``fully_shard`` / ``hybrid_shard`` keep a full-size gradient accumulator in the
  reduction dtype (FSDP2's behaviour: ``trainable_full x reduce bytes``; ``replicate``'s
  gradients are full-size already); the gradient reductions run once per optimizer step
  instead of ``A`` times, saving ``(A - 1)`` reductions, no more than the communication a
  micro-step leaves exposed (hidden communication costs no time).
* ``parallel.reshard_after_forward = N`` (``fully_shard``): each rank keeps ``1 / N`` of
  every parameter (``full x param bytes / N``) from forward to backward; backward
  all-gathers on ``N`` neighbouring ranks (NVLink when they share a node) instead of the
  whole shard group; compiled, forward gathers in two steps (outer, inner: the same
  bytes, one more start-up). The exposed time changes by the backward's (and compiled
  forward's) difference, a saving again capped by the exposed communication.
* ``training.cpu_offload``: the model states leave the device (16 B per trainable
  parameter, 4 B per frozen one); each gather first copies its float32 shard in and each
  reduction's result goes back out over PCIe (``GpuProfile.pcie_Bps``), synchronously on
  the compute stream (exposed); the optimizer steps on the host at
  ``GpuProfile.host_optimizer_Bps`` instead of the device's memory bandwidth.
* Frozen parameters (``lora.enable``: everything but the adapters): no gradient and no
  optimizer state (12 B of the 16 per parameter), no reduction (its seconds saved, capped
  by the exposed communication), no optimizer traffic.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field

from ..compiler.collectives import CollectiveKind
from ..compiler.cost.state import model_state_bytes_per_param, optimizer_traffic_bytes_per_param
from ..config.job import DTYPES, JobConfig
from ..config.lora import lora_targets
from ..errors import ConfigError
from ..models.llama import ffn_hidden_dim
from . import timing

F32 = 4  # the trainer's shards, gradients and AdamW moments are float32


@dataclass
class Terms:
    """A role's changes: device bytes at its peak, step seconds, and their parts."""

    bytes: float = 0.0
    seconds: float = 0.0
    detail: dict = field(default_factory=dict)

    def add(self, name: str, nbytes: float = 0.0, seconds: float = 0.0) -> None:
        self.bytes += nbytes
        self.seconds += seconds
        self.detail[name] = {"bytes": nbytes, "seconds": seconds}


def lora_params(args, cfg: JobConfig, blocks: int) -> float:
    """Trainable parameters LoRA adds to ``blocks`` blocks of our Llama: ``rank x (in +
    out)`` per adapted matrix (``lora.target_modules``, by the names of
    ``models/llama.py``)."""
    hd, hidden = args.head_dim, ffn_hidden_dim(args)
    shapes = {"wq": (args.dim, args.n_heads * hd), "wk": (args.dim, args.kv_heads * hd),
              "wv": (args.dim, args.kv_heads * hd), "wo": (args.n_heads * hd, args.dim),
              "w1": (args.dim, hidden), "w3": (args.dim, hidden), "w2": (hidden, args.dim)}
    per_block = 0
    for name in lora_targets(cfg):
        short = name.rsplit(".", 1)[-1]
        if short not in shapes:
            raise ConfigError(f"lora.target_modules: the planner knows our Llama's matrices "
                              f"({', '.join(shapes)}), not {name!r}")
        per_block += cfg.lora.rank * sum(shapes[short])
    return per_block * blocks


@dataclass(frozen=True)
class RoleParams:
    """One rank's parameters of a stage role: ``rank`` (sharded, what it stores),
    ``full`` (gathered for compute, per rank before data-parallel sharding) and their
    trainable parts."""

    rank: float
    full: float
    trainable_rank: float
    trainable_full: float


def role_params(cfg: JobConfig, params_rank: float, blocks: int, shard: int) -> RoleParams:
    """``params_rank`` (``memory.rank_params``) split into trainable and frozen: with
    ``lora.enable`` only the adapters train (sharded like the rest)."""
    full = params_rank * shard
    if not cfg.lora.enable:
        return RoleParams(params_rank, full, params_rank, full)
    adapters = lora_params(cfg.model.model_args(), cfg, blocks)
    return RoleParams(params_rank + adapters / shard, full + adapters, adapters / shard,
                      adapters)


def _reduce_seconds(cfg: JobConfig, fabric: timing.MeshLinks, nbytes: float) -> float:
    """One step's gradient reduction of ``nbytes`` (full size, reduction dtype)."""
    mode, dims = cfg.parallel.dp_mode, cfg.parallel.dims()
    if mode == "replicate":
        return fabric.seconds(CollectiveKind.ALL_REDUCE, "dp_replicate", nbytes)
    seconds = fabric.seconds(CollectiveKind.REDUCE_SCATTER, "dp_shard", nbytes)
    if mode == "hybrid_shard":
        seconds += fabric.seconds(CollectiveKind.ALL_REDUCE, "dp_replicate",
                                  nbytes / dims.dp_shard_cp)
    return seconds


def role_terms(cfg: JobConfig, fabric: timing.MeshLinks, dev, params: RoleParams,
               exposed_per_micro: float, blocks: int) -> Terms:
    """The knobs' changes to one stage role (see the module docstring): ``params`` its
    parameters, ``exposed_per_micro`` the communication a micro-step leaves exposed
    (forward + backward, from the traced graphs), ``blocks`` its depth."""
    t, p = cfg.training, cfg.parallel
    terms = Terms()
    reduce_elem = DTYPES[t.mixed_precision_reduce].itemsize
    param_elem = DTYPES[t.mixed_precision_param].itemsize
    micro = p.microbatches * t.grad_accum_steps
    exposed = exposed_per_micro
    frozen_rank = params.rank - params.trainable_rank
    if frozen_rank > 0:  # frozen: no gradient, no optimizer state, no reduction
        state = model_state_bytes_per_param("adamw") - F32
        saved = min(exposed, _reduce_seconds(cfg, fabric, (params.full - params.trainable_full)
                                             * reduce_elem))
        exposed -= saved
        # the prediction counted every parameter as trained and none of the adapters
        adapters = model_state_bytes_per_param("adamw") * params.trainable_rank
        terms.add("frozen", adapters - state * frozen_rank, -saved * micro
                  - timing.optimizer_seconds(frozen_rank - params.trainable_rank, dev))
    if t.gradient_sync == "last_microstep" and micro > 1:
        full_sink = 0.0 if p.dp_mode == "replicate" else params.trainable_full * reduce_elem
        saved = min(exposed, _reduce_seconds(cfg, fabric, params.trainable_full * reduce_elem))
        terms.add("gradient_sync_off", full_sink, -saved * (micro - 1))
    if not isinstance(p.reshard, bool):
        terms.add("reshard_to_group", params.full * param_elem / p.reshard,
                  _reshard_seconds(cfg, fabric, params.full * param_elem, blocks, exposed)
                  * micro)
    if t.cpu_offload:
        terms.add(*_offload_terms(cfg, dev, params, micro))
    return terms


def _reshard_seconds(cfg: JobConfig, fabric: timing.MeshLinks, gathered: float,
                     blocks: int, exposed: float) -> float:
    """A micro-step's change in exposed time with ``reshard_after_forward = N``: one
    gather per block of ``gathered / blocks`` bytes, in backward on ``N`` ranks instead
    of all of them (compiled: forward also splits it into an outer and an inner step)."""
    n, ag = cfg.parallel.reshard, CollectiveKind.ALL_GATHER
    shard = fabric.size("dp_shard")
    per_block = gathered / max(blocks, 1)
    flat = fabric.seconds(ag, "dp_shard", per_block)
    inner = fabric.subgroup_seconds(ag, "dp_shard", n, per_block)
    delta = inner - flat
    if cfg.compile.enable:
        outer = fabric.subgroup_seconds(ag, "dp_shard", shard // n, per_block / n, apart=n)
        delta += outer + inner - flat
    delta *= blocks
    return delta if delta > 0 else -min(-delta, exposed)


def _offload_terms(cfg: JobConfig, dev, params: RoleParams, micro: int):
    """("cpu_offload", device bytes, seconds): the states leave the device; each micro-step
    copies every float32 shard in once per gather (twice when backward gathers again)
    and every trainable gradient shard out; the optimizer steps on the host."""
    states = model_state_bytes_per_param("adamw") * params.trainable_rank \
        + F32 * (params.rank - params.trainable_rank)
    gathers = 2 if cfg.parallel.reshard is not False else 1
    reductions = 1 if cfg.training.gradient_sync == "last_microstep" else micro
    copies = (gathers * micro * params.rank + reductions * params.trainable_rank) * F32
    host_step = optimizer_traffic_bytes_per_param("adamw") * params.trainable_rank \
        / dev.host_optimizer_Bps
    device_step = timing.optimizer_seconds(params.trainable_rank, dev)
    return "cpu_offload", -states, copies / dev.pcie_Bps + host_step - device_step


def knob_label(cfg: JobConfig) -> str:
    """The knobs ``cfg`` sets, for the plan's table: ``reshard=N``, ``sync=last``,
    ``offload``, ``lora`` (frozen base), comma-separated; "" for none."""
    t, p = cfg.training, cfg.parallel
    labels = [f"reshard={p.reshard}"] if not isinstance(p.reshard, bool) else []
    labels += ["sync=last"] if t.gradient_sync == "last_microstep" else []
    labels += ["offload"] if t.cpu_offload else []
    labels += ["lora"] if cfg.lora.enable else []
    return ",".join(labels)


def variants(c: JobConfig, fits: bool, gpus_per_node: int) -> list[JobConfig]:
    """The search's knob variants of a predicted layout ``c``, one knob each (their terms
    need no new trace, so each costs one cached prediction): resharding to a node where
    the shard group spans several (``fully_shard`` without TP, PP or CP: what it is built
    for; from ``True`` it is faster and holds more, from ``False`` it holds less);
    gradient sync on the last micro-step with gradient accumulation (no PP); CPU offload
    only when ``c`` does not fit (it trades speed for memory, never faster)."""
    p, t = c.parallel, c.training
    out = []
    dims = p.dims()
    if (p.dp_mode == "fully_shard" and p.tp == p.pp == dims.cp == 1
            and isinstance(p.reshard, bool)
            and p.dp_shard > gpus_per_node and p.dp_shard % gpus_per_node == 0):
        v = copy.deepcopy(c)
        v.parallel.reshard_after_forward = gpus_per_node
        out.append(v)
    if t.grad_accum_steps > 1 and p.pp == 1 and t.gradient_sync == "every_microstep":
        v = copy.deepcopy(c)
        v.training.gradient_sync = "last_microstep"
        out.append(v)
    if not fits and not t.cpu_offload:
        v = copy.deepcopy(c)
        v.training.cpu_offload = True
        out.append(v)
    return out
