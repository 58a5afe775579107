"""The plan as a table, JSON and a PNG (memory against tokens/s, chosen layout marked)."""

from __future__ import annotations

import json
from pathlib import Path

from .predict import Prediction

COLUMNS = ("dp_replicate", "dp_shard", "cp_ring", "cp_ulysses", "cp_rotate", "tp", "pp", "ep",
           "ac",
           "batch_size", "seq_len", "compile", "peak_memory_gib", "reserved_memory_gib",
           "step_time_s", "tokens_per_s_per_gpu", "mfu", "fits", "knobs")


def table(rows: list[Prediction], limit: int | None = None) -> str:
    """Fixed-width text table, one line per configuration."""
    head = ("rep", "shard", "ring", "ulysses", "rotate", "tp", "pp", "ep", "ac", "batch", "seq",
            "compile", "peak GiB", "reserved GiB", "step s", "tok/s/GPU", "MFU", "fits", "knobs")
    lines = ["  ".join(f"{h:>9}" for h in head)]
    for r in rows[:limit]:
        cells = (r.dp_replicate, r.dp_shard, r.cp_ring, r.cp_ulysses, r.cp_rotate, r.tp, r.pp,
                 r.ep, r.ac, r.batch_size, r.seq_len, r.compile, f"{r.peak_memory_gib:.2f}",
                 f"{r.reserved_memory_gib:.2f}", f"{r.step_time_s:.3f}",
                 f"{r.tokens_per_s_per_gpu:.0f}", f"{r.mfu:.1%}",
                 "yes" if r.fits else "NO", r.knobs or "-")
        lines.append("  ".join(f"{c!s:>9}" for c in cells))
    return "\n".join(lines)


def search_note(stats: dict, keep: int, workers: int) -> str:
    """What the search traced and what it skipped untraced (``search``'s ``stats``)."""
    bound = (f"; {stats.get('bound', 0)} could not reach the {keep} best (speed bound: "
             f"the first {keep} rows are exact, later rows are those traced)" if keep else "")
    return (f"search: {stats.get('predicted', 0)} layouts predicted ({stats.get('traces', 0)}"
            f" traces, {stats.get('eager_replays', 0)} eager replays, {workers} "
            f"process{'es' if workers > 1 else ''}); skipped untraced: "
            f"{stats.get('memory', 0)} cannot fit, {stats.get('activations', 0)} cannot "
            f"hold the activations of a smaller traced layout, "
            f"{stats.get('fits_with_less_ac', 0)} fit "
            f"with less recomputation, {stats.get('invalid', 0)} invalid{bound}"
            + (f"; {stats['knob_rows']} rows with a knob turned (--tradeoffs)"
               if stats.get("knob_rows") else ""))


def write_json(rows: list[Prediction], path: str | Path) -> None:
    Path(path).write_text(json.dumps([r.to_dict() for r in rows], indent=1))


def write_png(rows: list[Prediction], path: str | Path, memory_gib: float) -> str:
    """Scatter of reserved memory vs tokens/s; returns a note (matplotlib may be absent)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "matplotlib is not installed: no PNG written (pip install matplotlib)"
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for fits, color in ((True, "tab:blue"), (False, "tab:gray")):
        pts = [r for r in rows if r.fits == fits]
        ax.scatter([r.reserved_memory_gib for r in pts],
                   [r.tokens_per_s_per_gpu for r in pts], c=color, s=14,
                   label="fits" if fits else "does not fit")
    best = next((r for r in rows if r.fits), None)
    if best is not None:
        ax.scatter([best.reserved_memory_gib], [best.tokens_per_s_per_gpu], marker="*",
                   s=220, c="tab:red", label=f"chosen: dp {best.dp_replicate}x"
                   f"{best.dp_shard} tp {best.tp} pp {best.pp} ac {best.ac} b {best.batch_size}")
    ax.axvline(memory_gib, ls="--", c="k", lw=0.8)
    ax.set_xlabel("predicted reserved memory per GPU (GiB)")
    ax.set_ylabel("predicted tokens/s per GPU")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return f"wrote {path}"
