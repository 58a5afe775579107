"""Turn raw measurements into the results: derived columns, table, JSON, report.md, PNG.

Derived columns (per variant):

* ``tokens_per_s``: global tokens per step (world x batch x seq) / median step time. For
  the compute-only reference the same global count over its one-rank step time: the
  throughput ``world`` ranks would reach without any communication.
* ``ratio_vs_fsdp2``: tokens/s over FSDP2-eager's.
* ``exposed_comm_s``: median step time minus the compute-only median of the same
  execution (``compute-only-compiled`` for compiled variants when it ran, else
  ``compute-only``): the time the step spends beyond its computation (exposed
  communication, compute slowed by every rank computing at once, framework overhead).
* ``comm_blocked_s``: time the profiled step spent blocked in collectives and their
  waits (max over ranks; see ``measure.profiled_step``).
* ``estimated_exposed_comm_s``: ``bucketing="auto"`` only: the cost model's simulated
  step beyond its one-rank compute (exposed communication, bucket copies, compute
  slowed by every rank computing at once), summed over the compiled graphs (rank 0);
  ``estimate_ratio``: it over ``exposed_graphs_s``, the same difference for the steps
  without their optimizer step (what the compiled graphs cover; 1.0: the model
  predicts the measurement). ``plan``: buckets per compiled graph (forward/backward).
* ``all_to_alls_per_step``, ``all_to_all_s``: MoE variants: the profiled step's
  all-to-alls and the host time spent in them and in the wait completing each (max over
  ranks; ``measure.profiled_step``): exposed, the dispatch computes only once they end.
* ``compile_s``: first step time minus the median step time (compiled variants).
* ``max_loss_diff``: largest |loss - reference loss| over every step; ``loss_match``
  compares it with the tolerance.
"""

from __future__ import annotations

import json
import math
import os
import platform
from datetime import datetime
from pathlib import Path

import torch

from ..compiler.collectives import collective_kind
from .config import BenchConfig
from .measure import CPU_MEMORY_MEASURE, CUDA_MEMORY_MEASURE
from .variants import BASELINE, COMPUTE_ONLY, LOSS_REFERENCE, VARIANTS

MIB = 2**20


def save_json(name: str, payload: dict) -> Path:
    """``payload`` written to ``bench_results/<name>-<time>.json`` (the standalone
    benches' figures), the path printed and returned."""
    out = Path("bench_results") / f"{name}-{datetime.now().strftime('%Y%m%d-%H%M%S')}.json"
    out.parent.mkdir(exist_ok=True)
    out.write_text(json.dumps(payload, indent=2))
    print(f"results: {out}")
    return out


def machine_info(cfg: BenchConfig, backend: str) -> dict:
    """Machine, software and run settings, for the report header."""
    info = {
        "host": platform.node(),
        "platform": platform.platform(),
        "cpu": platform.processor() or platform.machine(),
        "cpu_count": os.cpu_count(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "device": cfg.job.device,
        "process_group": backend,
    }
    if cfg.job.device == "cuda" and torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name()
        info["gpu_count"] = torch.cuda.device_count()
    return info


def _predicted_peaks(cfg: BenchConfig, names: list[str]) -> dict[str, int | None]:
    """The planner's predicted peak bytes per rank for each simplefsdp variant (the
    "pred. MiB" column); {} where the planner cannot run (it needs torch's fake group)."""
    from ..plan.bench import predicted_peaks

    try:
        return predicted_peaks(names, cfg.model, cfg.training.batch_size,
                               cfg.training.seq_len, cfg.bench.world_size)
    except Exception as e:  # noqa: BLE001 - a prediction must never sink the benchmark
        print(f"bench: no predicted memory column ({type(e).__name__}: {e})")
        return {}


def summarize(cfg: BenchConfig, raw: dict, backend: str) -> dict:
    """The full results document (what ``results.json`` holds)."""
    tokens = cfg.bench.world_size * cfg.training.batch_size * cfg.training.seq_len
    measured = raw["variants"]
    reference_name = LOSS_REFERENCE if LOSS_REFERENCE in measured else next(
        (n for n in measured if VARIANTS[n].communicates), None)
    reference = measured.get(reference_name) if reference_name else None
    rows = []
    predicted = _predicted_peaks(cfg, [n for n in cfg.selected_variants()
                                       if n not in raw["failed"]])
    for name in cfg.selected_variants():
        row: dict = {"name": name, "description": VARIANTS[name].description}
        if name in raw["failed"]:
            row.update(status="failed", error=raw["failed"][name])
        else:
            _measured_row(row, cfg, measured, tokens, reference, predicted.get(name))
        rows.append(row)
    return {"meta": _meta(cfg, raw, backend, tokens, reference_name), "variants": rows}


def _measured_row(row: dict, cfg: BenchConfig, measured: dict, tokens: int,
                  reference: dict | None, predicted: float | None) -> None:
    """Fill ``row`` with one measured variant's figures, against the FSDP2 baseline, the
    compute-only run and the loss reference."""
    name = row["name"]
    spec, m, baseline = VARIANTS[name], measured[name], measured.get(BASELINE)
    median = m["median_step_s"]
    tps = tokens / median
    row.update(status="ok", error=None, median_step_s=median, tokens_per_s=tps,
               min_step_s=min(m["step_times_s"]), max_step_s=max(m["step_times_s"]),
               step_times_s=m["step_times_s"], first_step_s=m["first_step_s"])
    row["ratio_vs_fsdp2"] = tps / (tokens / baseline["median_step_s"]) if baseline else None
    compute = measured.get(COMPUTE_ONLY[spec.compiled]) or \
        measured.get(COMPUTE_ONLY[False])
    row["exposed_comm_s"] = (median - compute["median_step_s"]
                             if compute and spec.communicates else None)
    row["compile_s"] = max(m["first_step_s"] - median, 0.0) if spec.compiled else None
    row["predicted_peak_mib"] = None if predicted is None else predicted / MIB
    row.update(peak_mem_mib=m["peak_bytes"] / MIB, held_mib=m["held_bytes"] / MIB,
               transient_mib=m["transient_bytes"] / MIB,
               collectives_per_step=m["collectives_per_step"],
               collectives_total=sum(m["collectives_per_step"].values()),
               losses=m["losses"], final_loss=m["losses"][-1])
    row["compiles_in_measured_steps"] = m["compiles_in_measured_steps"]
    row["comm_blocked_s"] = m["comm_blocked_s"]
    # the MoE exchange: all-to-alls per step and the host time spent in them (None
    # for a variant without any)
    a2a = m["collectives_per_step"].get("all_to_all", 0)
    row["all_to_alls_per_step"] = a2a or None
    row["all_to_all_s"] = m["all_to_all_s"] if a2a else None
    _estimate_columns(row, m, compute if spec.communicates else None)
    same_data = spec.communicates or cfg.bench.world_size == 1
    if same_data and reference is not None and not cfg.bench.fake_pg:
        diff = max(abs(a - b) for a, b in zip(m["losses"], reference["losses"], strict=True))
        row.update(max_loss_diff=diff, loss_match=diff <= cfg.bench.loss_tolerance)
    else:  # compute-only trains on rank 0's data alone; a fake group returns garbage
        row.update(max_loss_diff=None, loss_match=None)


def _estimate_columns(row: dict, m: dict, compute: dict | None) -> None:
    """The backend's estimate of the exposed communication against the measured one,
    the plan (buckets per graph), the passes' and the calibration's reports."""
    estimates = [p["estimated_exposed_s"] for p in m.get("passes") or []
                 if p.get("estimated_exposed_s") is not None]
    row["estimated_exposed_comm_s"] = sum(estimates) if estimates else None
    # the estimate covers the compiled graphs: compare it with their exposed time,
    # the steps' without the optimizer step (the sharded DTensor AdamW costs more
    # host time than the compute-only model's plain one: not communication)
    measured_exposed = (m["median_graphs_s"] - compute["median_graphs_s"]
                        if compute else None)
    row["exposed_graphs_s"] = measured_exposed
    row["estimate_ratio"] = (row["estimated_exposed_comm_s"] / measured_exposed
                             if estimates and measured_exposed and measured_exposed > 0
                             else None)
    row["plan"] = "/".join(f"{p['graph'][0].upper()}{p['buckets']}"
                           for p in m.get("passes") or []) or None
    if m.get("passes") is not None:
        row["passes"] = m["passes"]
    if m.get("calibration") is not None:
        row["calibration"] = m["calibration"]


def _meta(cfg: BenchConfig, raw: dict, backend: str, tokens: int,
          reference_name: str | None) -> dict:
    """The run's settings and machine, at the head of ``results.json``."""
    real_timing = not cfg.bench.fake_pg
    return {
        "timestamp": datetime.now().isoformat(timespec="seconds"),
        **machine_info(cfg, backend),
        "world_size": cfg.bench.world_size, "fake_pg": cfg.bench.fake_pg,
        "real_figures": ("all" if real_timing else
                         "compile time, memory and collective counts only: timings, "
                         "tokens/s, ratios and losses come from a fake process group"),
        "model": cfg.model.name, "model_args": vars(cfg.model_args()),
        "n_params": raw["n_params"],
        "batch_size_per_rank": cfg.training.batch_size, "seq_len": cfg.training.seq_len,
        "tokens_per_step": tokens, "warmup": cfg.bench.warmup, "steps": cfg.bench.steps,
        "compile_backend": cfg.compile.backend, "compile_cache": cfg.bench.compile_cache,
        "lr": cfg.training.lr, "seed": cfg.training.seed,
        "mixed_precision_param": cfg.training.mixed_precision_param,
        "mixed_precision_reduce": cfg.training.mixed_precision_reduce,
        "threads_per_rank": torch.get_num_threads(),
        "memory_measure": CUDA_MEMORY_MEASURE if cfg.job.device == "cuda"
        else CPU_MEMORY_MEASURE,
        "loss_reference": reference_name, "loss_tolerance": cfg.bench.loss_tolerance,
        "baseline": BASELINE,
    }


# ---------------------------------------------------------------------------------------
# Rendering.
# ---------------------------------------------------------------------------------------
COLUMNS = ("variant", "step ms", "tokens/s", "vs FSDP2", "peak MiB", "pred. MiB", "colls/step",
           "plan", "exposed ms", "w/o opt.", "est. ms", "est/meas", "blocked ms", "a2a/step",
           "a2a ms", "compile s", "final loss", "loss ok")


def _fmt(value, spec: str, empty: str = "-") -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return empty
    return format(value, spec)


def _collectives(c: dict[str, int]) -> str:
    return " ".join(f"{kind.short if (kind := collective_kind(k)) else k}{n}"
                    for k, n in c.items()) or "0"


def table_rows(results: dict) -> list[list[str]]:
    rows = []
    for r in results["variants"]:
        if r["status"] != "ok":
            rows.append([r["name"], f"FAILED: {r['error']}"])
            continue
        ok = {True: "yes", False: "NO", None: "n/a"}[r["loss_match"]]
        if r["max_loss_diff"] is not None:
            ok += f" ({r['max_loss_diff']:.1e})"
        rows.append([r["name"], _fmt(r["median_step_s"] * 1e3, ".1f"),
                     _fmt(r["tokens_per_s"], ".0f"), _fmt(r["ratio_vs_fsdp2"], ".2f"),
                     _fmt(r["peak_mem_mib"], ".1f"), _fmt(r.get("predicted_peak_mib"), ".1f"),
                     _collectives(r["collectives_per_step"]), r.get("plan") or "-",
                     _fmt(None if r["exposed_comm_s"] is None else r["exposed_comm_s"] * 1e3,
                          ".1f"),
                     _fmt(None if r.get("exposed_graphs_s") is None
                          else r["exposed_graphs_s"] * 1e3, ".1f"),
                     _fmt(None if r["estimated_exposed_comm_s"] is None
                          else r["estimated_exposed_comm_s"] * 1e3, ".1f"),
                     _fmt(r.get("estimate_ratio"), ".2f"),
                     _fmt(r["comm_blocked_s"] * 1e3, ".1f"),
                     _fmt(r.get("all_to_alls_per_step"), "d"),
                     _fmt(None if r.get("all_to_all_s") is None else r["all_to_all_s"] * 1e3,
                          ".1f"),
                     _fmt(r["compile_s"], ".1f"), _fmt(r["final_loss"], ".5f"), ok])
    return rows


def header_lines(results: dict) -> list[str]:
    m = results["meta"]
    a = m["model_args"]
    lines = [
        f"machine: {m['host']} ({m['platform']}, {m['cpu_count']} CPUs"
        + (f", {m['gpu_count']}x {m['gpu']}" if "gpu" in m else "") + ")",
        f"torch {m['torch']}, python {m['python']}, device {m['device']}, process group "
        f"{m['process_group']}, world size {m['world_size']}, {m['threads_per_rank']} "
        f"thread(s)/rank",
        f"model: {m['model']} (dim {a['dim']}, {a['n_layers']} layers, {a['n_heads']} heads, "
        f"vocab {a['vocab_size']}, {m['n_params'] / 1e6:.2f}M params), batch "
        f"{m['batch_size_per_rank']}/rank x seq {m['seq_len']} = {m['tokens_per_step']} "
        f"tokens/step, {m['warmup']} warm-up + {m['steps']} measured steps, compile "
        f"backend {m['compile_backend']}",
        f"real figures: {m['real_figures']}",
    ]
    lines += [f"{r['name']}'s calibration: {_calibration(r['calibration'])}"
              for r in results["variants"] if r.get("calibration")]
    return lines


def _calibration(c: dict) -> str:
    age = "-" if c["age_s"] is None else f"{c['age_s'] / 3600:.1f} h old"
    return (f"{c['source']}, {c['file'] or 'no cache file'} ({age}), compute_slowdown "
            f"{c['compute_slowdown']:.3f}")


def format_table(results: dict, markdown: bool = False) -> str:
    rows = table_rows(results)
    if markdown:
        out = ["| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
        for r in rows:
            cells = r if len(r) == len(COLUMNS) else [r[0], r[1]] + [""] * (len(COLUMNS) - 2)
            out.append("| " + " | ".join(c.replace("|", "/") for c in cells) + " |")
        return "\n".join(out)
    widths = [max([len(COLUMNS[i]), *(len(r[i]) for r in rows if len(r) == len(COLUMNS))])
              for i in range(len(COLUMNS))]
    line = lambda cells: "  ".join(c.ljust(w) for c, w in zip(cells, widths, strict=False))
    out = [line(COLUMNS), line(["-" * w for w in widths])]
    for r in rows:
        out.append(line(r) if len(r) == len(COLUMNS) else f"{r[0].ljust(widths[0])}  {r[1]}")
    return "\n".join(out)


def legend(results: dict) -> list[str]:
    m = results["meta"]
    return [
        "step ms: median of the measured steps (slowest rank per step); tokens/s: global "
        "tokens per step / median (compute-only: the same global tokens over its one-rank "
        "step, i.e. the no-communication limit)",
        f"vs FSDP2: tokens/s ratio to {m['baseline']}; exposed ms: step minus compute-only "
        "step, compute-only-compiled's for compiled variants where it ran (communication "
        "not hidden + compute slowed by all ranks at once + framework overhead)",
        "blocked ms: time the profiled step was blocked inside collectives and their waits "
        "(c10d / functional collective ops and wait_tensor, union of spans, max over ranks); "
        "an eager Work.wait() is no profiler event, so for eager c10d variants (FSDP2, DDP) "
        "it is a lower bound; host time only: on CUDA it is launch overhead, not GPU waiting",
        "est. ms: the auto-wrapping cost model's step beyond its one-rank compute "
        "(exposed communication + bucket copies + compute slowed by all ranks computing at "
        "once; sum over graphs; auto/greedy only; excludes the optimizer step); w/o opt.: "
        "exposed ms of the steps without their optimizer step (the sharded DTensor AdamW's "
        "extra host time is no communication); est/meas: est. ms over w/o opt.; plan: "
        "buckets per compiled graph (F forward, B backward)",
        f"peak MiB (per rank, max over ranks): {m['memory_measure']}",
        "pred. MiB: the planner's predicted active peak per rank (python -m simplefsdp.plan;"
        " simplefsdp variants without auto wrapping)",
        "a2a/step, a2a ms: MoE variants: all-to-alls one step issues (profiler) and the "
        "profiled step's host time inside them and the wait_tensor completing each (union of "
        "spans, max over ranks): the dispatch waits for every exchange before computing, so "
        "none of it is hidden behind compute",
        "colls/step: collectives one training step issues (profiler, c10d ops; AG all-gather, "
        "RS reduce-scatter, AR all-reduce)",
        "compile s: first step minus median step (compiled variants); Inductor caches "
        + ("on: may be a warm compile" if m.get("compile_cache") else "off: a cold compile"),
        f"loss ok: max |loss - {m['loss_reference']} loss| over all steps <= "
        f"{m['loss_tolerance']:g} (parameters gathered in "
        f"{m.get('mixed_precision_param', 'float32')}, gradients reduced in "
        f"{m.get('mixed_precision_reduce', 'float32')}; reduction order and compiler "
        "fusions differ); "
        "compute-only trains on rank 0's data alone (n/a unless world size 1); fake process "
        "group: n/a",
    ]


def write_outputs(results: dict, out_root: str | Path) -> Path:
    """``<out_root>/<timestamp>/`` with results.json, report.md and results.png."""
    stamp = datetime.now().strftime("%Y%m%d-%H%M%S")
    out = Path(out_root) / stamp
    suffix = 1
    while out.exists():
        out = Path(out_root) / f"{stamp}-{suffix}"
        suffix += 1
    out.mkdir(parents=True)
    (out / "results.json").write_text(json.dumps(results, indent=2, default=str))
    failed = [r for r in results["variants"] if r["status"] != "ok"]
    md = ["# simplefsdp benchmark", "", *[f"- {line}" for line in header_lines(results)], "",
          format_table(results, markdown=True), "", "## Columns", "",
          *[f"- {line}" for line in legend(results)], ""]
    if failed:
        md += ["## Failed variants", "", *[f"- **{r['name']}**: {r['error']}" for r in failed],
               ""]
    ok = [r for r in results["variants"] if r["status"] == "ok"]
    late = [r for r in ok if r.get("compiles_in_measured_steps")]
    if late:
        md += ["## Warning: compiled during measured steps", "",
               *[f"- {r['name']}: {r['compiles_in_measured_steps']} graph(s); its step times "
                 f"include compilation (raise --warmup)" for r in late], ""]
    md += ["## Step time spread (measured steps, ms)", "",
           *[f"- {r['name']}: min {r['min_step_s'] * 1e3:.1f}, median "
             f"{r['median_step_s'] * 1e3:.1f}, max {r['max_step_s'] * 1e3:.1f}" for r in ok], ""]
    passes = [(r["name"], p) for r in ok for p in r.get("passes") or []]
    if passes:
        md += ["## What our passes did (rank 0, per compiled graph)", "",
               *[f"- {name} {p['graph']}: collectives {p['collectives_before']} -> "
                 f"{p['collectives_after']}, {p['buckets']} buckets, {p['moves']} moves, "
                 f"{p['pass_s'] * 1e3:.0f} ms" + _auto_details(p) + "; merged buckets: "
                 + (", ".join(p["bucket_names"]) or "none") for name, p in passes], ""]
    md += ["## Variants", "", *[f"- `{r['name']}`: {r['description']}"
                                for r in results["variants"]], ""]
    if plot(results, out / "results.png"):
        md += ["![tokens/s and memory](results.png)", ""]
    (out / "report.md").write_text("\n".join(md))
    return out


def _auto_details(p: dict) -> str:
    if p.get("estimated_exposed_s") is None:
        return ""
    return (f", {p['decisions']} decisions, estimated exposed "
            f"{p['estimated_exposed_s'] * 1e3:.2f} ms")


def plot(results: dict, path: Path) -> bool:
    """Two bar charts side by side: tokens/s and peak memory per variant. Returns False
    (and says so) when matplotlib is missing: the table and JSON matter more."""
    try:
        import matplotlib
    except ImportError:
        print("[bench] matplotlib is not installed: no results.png (pip install matplotlib)")
        return False

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = results["variants"]
    names = [r["name"] if r["status"] == "ok" else f"{r['name']} (failed)" for r in rows]
    fig, axes = plt.subplots(1, 2, figsize=(12, 0.45 * max(len(names), 3) + 1.6))
    for ax, key, label in ((axes[0], "tokens_per_s", "tokens/s (global)"),
                           (axes[1], "peak_mem_mib", "peak memory per rank (MiB)")):
        values = [r[key] if r["status"] == "ok" else 0.0 for r in rows]
        ax.barh(names, values, color=[_color(r["name"]) for r in rows])
        ax.invert_yaxis()
        ax.set_xlabel(label)
        ax.grid(axis="x", alpha=0.3)
    axes[1].set_yticklabels([])
    m = results["meta"]
    title = (f"{m['model']} model, world size {m['world_size']}, {m['device']} "
             f"({m['process_group']}), torch {m['torch']}")
    if m["fake_pg"]:
        title += " - FAKE process group: tokens/s not real"
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return True


def _color(name: str) -> str:
    """Ours blue, torch's upstream passes green, FSDP2 / torch DDP orange, compute-only
    gray."""
    if name.startswith("compute-only"):
        return "tab:gray"
    if name.startswith(("fsdp2", "torch-")):
        return "tab:orange"
    if name.startswith("upstream"):
        return "tab:green"
    return "tab:blue"
