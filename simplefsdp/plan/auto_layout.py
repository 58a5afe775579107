"""``parallel.layout = "auto"``: the planner's search for one job, kept to the keys the
user fixed, and its answer as a configuration.

The search (``plan.search.search``, the ranking ``python -m simplefsdp.plan --search``
prints) chooses the layout keys (``LAYOUT_KEYS``: the parallel sizes, ``dp_mode``,
``pp_microbatches``, the AC mode and the local batch) and issue 48's knobs (``KNOB_KEYS``:
its rows with a knob turned, ``plan.tradeoffs.variants``: an int reshard, gradient sync
on the last micro-step, CPU offload where a layout does not fit; the fastest row that
fits wins, whichever it is). A layout key the user set (in the
TOML or on the command line) is a constraint: candidates that differ are dropped, and a
fixed ``training.batch_size`` replaces the search's own batches (1 and 2, or under PP one
sequence per microbatch). ``dp_shard = -1`` ("the rest") constrains nothing.

The answer is cached on disk (``<cache_dir>/layouts/``, keyed by everything the search
reads and by the planner's source files), so a restart or a second job with the same
inputs skips the search. Tracing needs the planner's fake process group: ``choose`` runs
in a fresh process (``choose_isolated``) wherever the caller has a process group of its
own (the trainer).
"""

from __future__ import annotations

import copy
import json
import sys
import time
from pathlib import Path
from typing import Any

from ..config.job import JobConfig
from ..errors import ConfigError
from ..hardware import GB, GiB, gpu_profile
from . import disk_cache
from .predict import CONTEXT_BYTES, Prediction

# Issue 48's knobs, set by the search's knob rows (``plan.tradeoffs.variants``): a
# reshard to a node, gradient sync on the last micro-step, CPU offload.
KNOB_KEYS = ("parallel.reshard_after_forward", "training.gradient_sync", "training.cpu_offload")
# The keys the search sets on each candidate (``plan.search.layouts``) or its knob rows.
LAYOUT_KEYS = ("parallel.dp_replicate", "parallel.dp_shard", "parallel.tp", "parallel.pp",
               "parallel.cp_ring", "parallel.cp_ulysses", "parallel.cp_rotate", "parallel.ep",
               "parallel.dp_mode", "parallel.pp_microbatches", "activation_checkpoint.mode",
               "training.batch_size", *KNOB_KEYS)



def get_key(cfg: JobConfig, dotted: str) -> Any:
    section, _, key = dotted.partition(".")
    return getattr(getattr(cfg, section), key)


def set_key(cfg: JobConfig, dotted: str, value: Any) -> None:
    section, _, key = dotted.partition(".")
    setattr(getattr(cfg, section), key, value)


def fixed_layout_keys(cfg: JobConfig, explicit: set[str]) -> dict[str, Any]:
    """The layout keys the user set (``explicit``: ``section.key`` names) with their
    values: the constraints. ``parallel.dp_shard = -1`` ("the rest") is none."""
    fixed = {k: get_key(cfg, k) for k in LAYOUT_KEYS if k in explicit}
    if fixed.get("parallel.dp_shard") == -1:
        del fixed["parallel.dp_shard"]
    return fixed


def _row_key(c: JobConfig) -> tuple:
    """A candidate's identity as a ``Prediction`` row shows it."""
    p = c.parallel
    return (p.dp_replicate, p.dp_shard, p.tp, p.pp, c.activation_checkpoint.mode,
            c.training.batch_size, p.ep, p.cp_ring, p.cp_ulysses, p.cp_rotate)


def prediction_key(r: Prediction) -> tuple:
    return (r.dp_replicate, r.dp_shard, r.tp, r.pp, r.ac, r.batch_size, r.ep, r.cp_ring,
            r.cp_ulysses, r.cp_rotate)


def _row_config(candidates: dict[tuple, JobConfig], r: Prediction,
                gpus_per_node: int) -> JobConfig:
    """The configuration of row ``r``: its candidate layout, with the knob its label
    names turned as the search turned it (``tradeoffs.variants``)."""
    from . import tradeoffs

    base = candidates[prediction_key(r)]
    if r.knobs == tradeoffs.knob_label(base):  # the layout's own row (knobs the config set)
        return base
    return next(v for v in tradeoffs.variants(base, False, gpus_per_node)
                if tradeoffs.knob_label(v) == r.knobs)


def _keeps_fixed(c: JobConfig, fixed: dict[str, Any]) -> bool:
    """Whether a knob row's configuration keeps the knob keys the user set."""
    return all(get_key(c, k) == v for k, v in fixed.items() if k in KNOB_KEYS)


class Constraint:
    """``search``'s ``constrain``: each candidate with the fixed keys kept, or None. Keeps
    the candidates it let through, by their ``Prediction`` row (``candidates``)."""

    def __init__(self, fixed: dict[str, Any]):
        self.fixed = fixed
        self.candidates: dict[tuple, JobConfig] = {}

    def __call__(self, c: JobConfig) -> JobConfig | None:
        fixed, p = self.fixed, c.parallel
        if "training.batch_size" in fixed:
            c.training.batch_size = fixed["training.batch_size"]
            # under PP the search's microbatches (pp or 2 pp) must divide the fixed batch
            if p.pp > 1 and c.training.batch_size % p.pp_microbatches:
                return None
        for key, value in fixed.items():
            if key == "parallel.pp_microbatches" and p.pp == 1:
                continue  # means nothing without PP (ParallelConfig.microbatches)
            if get_key(c, key) != value:
                return None
        row = _row_key(c)
        if row in self.candidates:  # a fixed batch makes the search's batches one
            return None
        self.candidates[row] = c
        return c


def _progress(started: float):
    def show(r: Prediction) -> None:
        print(f"[simplefsdp] layout search {time.perf_counter() - started:6.1f} s: "
              f"{describe(r)}: {r.reserved_memory_gib:.2f} GiB, "
              f"{r.tokens_per_s_per_gpu:.0f} tok/s per rank", file=sys.stderr, flush=True)
    return show


def describe(r: Prediction) -> str:
    """A row's layout in the config's words."""
    cp = f" cp_ring={r.cp_ring} cp_ulysses={r.cp_ulysses} ({r.cp_rotate})" \
        if (r.cp_ring, r.cp_ulysses) != (1, 1) else ""
    return (f"dp_replicate={r.dp_replicate} dp_shard={r.dp_shard} tp={r.tp} pp={r.pp}"
            f"{f' ep={r.ep}' if r.ep > 1 else ''}{cp} ac={r.ac} batch_size={r.batch_size}"
            f"{f' knobs={r.knobs}' if r.knobs else ''}")


def _nothing_fits(rows: list[Prediction], candidates: list[JobConfig], gpus: int, gpu: str,
                  fixed: dict[str, Any], failures: list[str]) -> ConfigError:
    """The error when no layout fits: the smallest need predicted, and the knobs; when
    none could be predicted, why (the traces that failed: ``search``'s ``failures``)."""
    limit = gpu_profile(gpu).memory_bytes
    where = f"{gpus} ranks of {gpu} ({limit / GB:.4f} GB usable a rank)"
    if rows:
        best = min(rows, key=lambda r: r.reserved_memory_gib)
        need = best.reserved_memory_gib * GiB + CONTEXT_BYTES
        found = (f"the smallest predicted peak is {need / GB:.4f} GB ({describe(best)}: "
                 f"{best.reserved_memory_gib * GiB / GB:.4f} GB reserved by torch + "
                 f"{CONTEXT_BYTES / GB:.2f} GB of device context), over "
                 f"{len(rows)} layout(s) predicted")
    else:  # none predicted: each one's floor (model states and the loss's logits) is
        from .floors import lower_bound  # over the limit, or their traces failed

        floor = min((lower_bound(c) for c in candidates), default=0.0) + CONTEXT_BYTES
        if floor <= limit and failures:
            fixed_keys = ", ".join(f"{k} = {v!r}" for k, v in fixed.items()) or "none"
            return ConfigError(
                f"parallel.layout = 'auto': no layout of {where} could be planned: the "
                f"planner failed on {'; '.join(failures)}. Keys you set (kept by the "
                f"search): {fixed_keys}; leave some of them out (parallel.dp_shard = -1: "
                f"the rest) and the search can choose others")
        found = (f"the smallest predicted peak is over {floor / GB:.3f} GB: every layout's "
                 f"model states (16 B a parameter) and loss logits alone, with "
                 f"{CONTEXT_BYTES / GB:.2f} GB of device context, exceed it")
    knobs = ["more GPUs (the model states shard over more ranks)",
             "activation_checkpoint.mode = 'full'", "a smaller training.batch_size",
             "a larger parallel.memory_limit_gb (up to the device's memory)"]
    held = [f"{k} = {v!r}" for k, v in fixed.items()
            if k in ("activation_checkpoint.mode", "training.batch_size")]
    held_note = f" (fixed by your config now: {', '.join(held)}; leave them out and the " \
        f"search chooses them)" if held else ""
    return ConfigError(f"parallel.layout = 'auto': no layout fits {where}: {found}. To fit: "
                       f"{'; '.join(knobs)}{held_note}")


def choose(cfg: JobConfig, gpus: int, gpu: str, gpus_per_node: int,
           fixed: dict[str, Any], progress: bool = True) -> dict[str, Any]:
    """The fastest layout of ``cfg`` on ``gpus`` ranks of the profile ``gpu`` (a
    ``hardware.gpu_profile`` name, ``KEY@<N>GB`` for a memory limit) that fits and keeps
    ``fixed``: ``{"layout": {key: value}, "prediction": Prediction.to_dict(), "search_s",
    "cached"}``. Raises a ConfigError when no candidate keeps ``fixed`` or none fits.
    Must run under the planner's fake process group (no process group of the caller's)."""
    from .search import search

    cache = _cache_path(cfg, gpus, gpu, gpus_per_node, fixed)
    outcome = disk_cache.load(cache)
    if outcome is not None:
        if "error" in outcome:
            raise ConfigError(outcome["error"])
        return {**outcome, "cached": True}
    started = time.perf_counter()
    constraint, stats, failures = Constraint(fixed), {}, []
    rows = search(cfg, gpus, gpu, gpus_per_node, keep=1, stats=stats, constrain=constraint,
                  progress=_progress(started) if progress else None, tradeoffs_rows=True,
                  failures=failures)
    configs = [_row_config(constraint.candidates, r, gpus_per_node) for r in rows]
    rows, configs = [r for r, c in zip(rows, configs, strict=True) if _keeps_fixed(c, fixed)], \
        [c for c in configs if _keeps_fixed(c, fixed)]
    if not constraint.candidates:
        raise ConfigError(f"parallel.layout = 'auto': no layout of {gpus} ranks keeps the "
                          f"keys you set ({', '.join(f'{k} = {v!r}' for k, v in fixed.items())})"
                          f"; leave some of them out of the config and the command line")
    if not rows or not rows[0].fits:
        error = _nothing_fits(rows, list(constraint.candidates.values()), gpus, gpu, fixed,
                              failures)
        disk_cache.store(cache, {"error": str(error)})
        raise error
    best = configs[0]
    outcome = {"layout": {k: get_key(best, k) for k in LAYOUT_KEYS},
               "prediction": rows[0].to_dict(), "search_s": time.perf_counter() - started,
               "stats": stats}
    disk_cache.store(cache, outcome)
    return {**outcome, "cached": False}


def choose_isolated(cfg: JobConfig, gpus: int, gpu: str, gpus_per_node: int,
                    fixed: dict[str, Any]) -> dict[str, Any]:
    """``choose`` in a fresh interpreter (the planner's fake process group must not meet
    the caller's; a subprocess, since a daemonic process, as a test's rank is, may not
    start multiprocessing children), its progress on this process's stderr; a
    ConfigError is raised here."""
    import pickle
    import subprocess
    import tempfile

    with tempfile.TemporaryDirectory(prefix="simplefsdp_layout_") as folder:
        inputs, answer = Path(folder) / "inputs.pkl", Path(folder) / "answer.json"
        inputs.write_bytes(pickle.dumps((cfg, gpus, gpu, gpus_per_node, fixed)))
        done = subprocess.run([sys.executable, "-m", __name__, str(inputs), str(answer)],
                              stdout=sys.stderr, check=False)
        if done.returncode != 0 or not answer.is_file():
            raise RuntimeError(f"the layout search exited with status {done.returncode} "
                               f"(its traceback is above)")
        outcome = json.loads(answer.read_text())
    if "error" in outcome:
        raise ConfigError(outcome["error"])
    return outcome


def _main(inputs: str, answer: str) -> None:
    """``python -m simplefsdp.plan.auto_layout INPUTS ANSWER``: ``choose`` on the pickled
    arguments, its answer (or ``{"error": ...}``) written as JSON (``choose_isolated``)."""
    import pickle

    from ..parallel.activation_checkpoint import quiet_our_checkpoint_warning

    quiet_our_checkpoint_warning()
    args = pickle.loads(Path(inputs).read_bytes())
    try:
        outcome = choose(*args)
    except ConfigError as e:
        outcome = {"error": str(e)}
    Path(answer).write_text(json.dumps(outcome, default=str))


def apply_layout(cfg: JobConfig, layout: dict[str, Any]) -> JobConfig:
    """A copy of ``cfg`` with the chosen layout keys set and ``parallel.layout`` manual:
    the configuration the run trains (and ``layout.toml`` holds)."""
    out = copy.deepcopy(cfg)
    for key, value in layout.items():
        set_key(out, key, value)
    out.parallel.layout = "manual"
    return out


# ---------------------------------------------------------------------------------------
# The answer cache and the configuration as TOML.
# ---------------------------------------------------------------------------------------
def _cache_path(cfg: JobConfig, gpus: int, gpu: str, gpus_per_node: int,
                fixed: dict[str, Any]) -> Path | None:
    """Where the answer for these inputs is kept (None: the cache is off)."""
    inputs = {"config": disk_cache.planned_config(cfg),
              "device": cfg.job.device,  # CPU offload validates for a CUDA job only
              "fixed": sorted(fixed.items()), "gpus": gpus, "gpu": gpu,
              "gpus_per_node": gpus_per_node}
    return disk_cache.entry_path("layouts", inputs)


def _toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int | float):
        return repr(value)
    if isinstance(value, str):
        return json.dumps(value)  # a TOML basic string: JSON's escapes are TOML's
    if isinstance(value, list):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    raise TypeError(f"no TOML form for {value!r}")


def config_toml(cfg: JobConfig, header: str = "") -> str:
    """``cfg`` as a TOML file that ``load_config`` reads back equal: every key of every
    section (a key whose value is None is left out: None is its default)."""
    lines = [f"# {line}" for line in header.splitlines()]
    for section, table in cfg.to_dict().items():
        lines += ["", f"[{section}]"]
        lines += [f"{key} = {_toml_value(value)}" for key, value in table.items()
                  if value is not None]
    return "\n".join(lines) + "\n"


def choice_line(outcome: dict[str, Any], gpus: int, gpu: str) -> str:
    """The one line a run starts with: the layout and its prediction."""
    r = Prediction(**outcome["prediction"])
    source = "cached answer" if outcome.get("cached") else \
        f"searched in {outcome['search_s']:.1f} s"
    return (f"[simplefsdp] layout auto on {gpus} x {gpu}: {describe(r)}; predicted step "
            f"{r.step_time_s:.3g} s, {r.tokens_per_s_per_gpu * gpus:.0f} tokens/s "
            f"({r.tokens_per_s_per_gpu:.0f} per rank), peak {r.peak_memory_gib:.2f} GiB "
            f"active / {r.reserved_memory_gib:.2f} GiB reserved per rank ({source})")


__all__ = ["LAYOUT_KEYS", "apply_layout", "choice_line", "choose", "choose_isolated",
           "config_toml", "fixed_layout_keys"]


if __name__ == "__main__":
    _main(*sys.argv[1:3])
