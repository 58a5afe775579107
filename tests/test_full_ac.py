"""Full activation checkpointing under torch.compile (issue 27).

On torch 2.13 CPU, AOTAutograd's min-cut partitioner put the recomputed attention's RNG
state after the saved DeviceMesh (an opaque value), and the runtime then handed the mesh
to ``save_for_backward``; ``compiler/recompute.py`` puts the saved values back in the
runtime's layout. These tests train with it.

Tolerances: aot_eager runs the ops eager runs and bucketing only concatenates and slices;
every reduction is over 2 ranks (a + b == b + a exactly) and full AC recomputes the same
ops on the same inputs, so compiled full AC, eager full AC and no AC are bitwise equal
(losses and full gradients).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from rank_runner import run_ranks
from torch import fx

import simplefsdp as sf

ROOT = Path(__file__).resolve().parents[1]
STEPS, BATCH, SEQ = 2, 2, 16
VARIANTS = ("none:eager", "full:eager", "full:manual", "full:auto", "selective:manual",
            "none:manual")


@dataclass(frozen=True)
class Saved:
    """What a partitioned forward saves for backward, graph inputs (parameters, the
    batch) apart: they live anyway."""

    count: int
    nbytes: int
    names: tuple[str, ...]
    input_count: int  # saved values that are forward inputs (no extra memory)


def saved_summary(fw_graph: fx.Graph, num_fwd_outputs: int) -> Saved:
    """Count and bytes of the tensors ``fw_graph`` outputs for backward, outside its
    inputs (placeholders), with their names."""
    out = next(iter(fw_graph.find_nodes(op="output")))
    saved = [n for n in list(out.args[0])[num_fwd_outputs:]
             if isinstance(n, fx.Node) and isinstance(n.meta.get("val"), torch.Tensor)]
    made = [n for n in saved if n.op != "placeholder"]
    nbytes = sum(n.meta["val"].numel() * n.meta["val"].element_size() for n in made)
    return Saved(len(made), int(nbytes), tuple(n.name for n in made), len(saved) - len(made))


def _model():
    from simplefsdp.models.llama import ModelArgs, Transformer

    torch.manual_seed(0)
    return Transformer(ModelArgs(dim=32, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=64,
                                 multiple_of=16, max_seq_len=SEQ))


def _batch(step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 * step + rank)
    tokens = torch.randint(0, 64, (BATCH, SEQ + 1), generator=g)
    return tokens[:, :-1], tokens[:, 1:]


def _variant(rank: int, name: str, saved: list) -> dict:
    """Train ``name`` (ac:eager or ac:bucketing, aot_eager) for STEPS AdamW steps: its
    losses, every step's full gradients, and its backward graph's collectives."""
    from simplefsdp.mesh import stage_group
    from simplefsdp.parallel.activation_checkpoint import apply_ac

    ac, how = name.split(":")
    torch._dynamo.reset()
    model = _model()
    apply_ac(model, ac)
    mesh = sf.make_mesh(dp_shard=2)
    model = sf.data_parallel(model, mesh)
    runnable, backend = model, None
    if how != "eager":
        group = stage_group(mesh) if how == "auto" else None
        backend = sf.compile_backend("aot_eager", bucketing=how, reordering=True, group=group)
        runnable = torch.compile(model, fullgraph=True, backend=backend)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses, grads = [], []
    saved.clear()
    for step in range(STEPS):
        inputs, targets = _batch(step, rank)
        loss = F.cross_entropy(runnable(inputs).float().flatten(0, 1), targets.flatten())
        loss.backward()
        grads.append([p.grad.full_tensor() for p in model.parameters()])
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    out = {"losses": losses, "grads": grads, "saved": list(saved)}
    if backend is not None:
        backward = [r for r in backend.reports if r.graph == "backward"][-1]
        out["backward_gathers"] = backward.collectives_before.get("all_gather", 0)
        out["backward_buckets"] = sum(b["kind"] == "all_gather" for b in backward.buckets)
    return out


def _variants(rank: int, world: int) -> dict:
    from simplefsdp.compiler import recompute

    saved: list = []
    partition = recompute.partition

    def recording(joint, inputs, *, num_fwd_outputs, **kwargs):  # what the forward saves
        fw, bw = partition(joint, inputs, num_fwd_outputs=num_fwd_outputs, **kwargs)
        saved.append(saved_summary(fw.graph, num_fwd_outputs))
        return fw, bw

    recompute.partition = recording  # the backend looks it up at each compile
    try:
        results = {name: _variant(rank, name, saved) for name in VARIANTS}
    finally:
        recompute.partition = partition
    ref = results["none:eager"]  # compared here: tensors do not travel back
    for name in VARIANTS[1:]:
        got = results[name]
        assert got["losses"] == ref["losses"], (rank, name, got["losses"], ref["losses"])
        for step, (mine, theirs) in enumerate(zip(got["grads"], ref["grads"], strict=True)):
            for i, (a, b) in enumerate(zip(mine, theirs, strict=True)):
                assert torch.equal(a, b), (rank, name, step, i, (a - b).abs().max().item())
    for got in results.values():
        del got["grads"]
    return results


def test_compiled_full_ac_is_bitwise_eager_and_saves_least():
    results = run_ranks(_variants, 2)[0]
    print("losses:", results["none:eager"]["losses"])
    saved = {name: results[name]["saved"][0] for name in VARIANTS if ":eager" not in name}
    print("saved for backward (tensors / bytes):",
          {name: (s.count, s.nbytes) for name, s in saved.items()})
    # Measured (2 blocks, dim 32, batch 2 x 16 tokens): none 33 tensors / 157,312 B,
    # selective 15 / 62,592 B, full 6 / 22,528 B: the 2 block inputs (embedding, add_5),
    # the final norm's rsqrt and the output projection's input (outside the blocks), and
    # 2 CPU RNG states (5,056 B each, one per recomputed attention).
    for bucketing in ("manual", "auto"):
        full = saved[f"full:{bucketing}"]
        assert full.nbytes * 2 < saved["selective:manual"].nbytes, (full, saved)
        assert full.nbytes * 6 < saved["none:manual"].nbytes, (full, saved)
        assert full.count < saved["selective:manual"].count < saved["none:manual"].count
        assert {"embedding", "add_5"} <= set(full.names), full  # the block inputs
        assert not any(n.startswith("mm") for n in full.names), full  # no matmul output
    # Resharding holds: the full-AC backward gathers the parameters again (as without AC:
    # the parametrization's own recompute), and manual bucketing merges those gathers.
    gathers = {name: results[name]["backward_gathers"] for name in saved}
    print("backward all-gathers before bucketing:", gathers)
    assert gathers["full:manual"] == gathers["full:auto"] == gathers["none:manual"] > 0, gathers
    assert 0 < results["full:manual"]["backward_buckets"] < \
        results["full:manual"]["backward_gathers"]


def _trainer(rank: int, world: int, argv: list[str]) -> dict:
    from simplefsdp.train.__main__ import main

    result = main(argv)
    return {"losses": result.losses, "grad_norms": result.grad_norms}


@pytest.mark.parametrize("layout", ["tp", "pp"])
def test_trainer_full_ac_compiled_matches_eager(tmp_path, layout):
    """TP 2 / PP 2 on 2 processes, full AC: compiled (aot_eager, manual buckets) trains
    exactly like eager (bitwise: every printed loss and grad norm equal)."""
    extra = {"tp": ["--parallel.tp", "2"],
             "pp": ["--parallel.pp", "2", "--parallel.pp_microbatches", "2"]}[layout]
    base = ["--config", str(ROOT / "configs/debug.toml"), "--training.steps", "2",
            "--training.batch_size", "2", "--training.seq_len", "16", "--model.dim", "32",
            "--model.n_layers", "2", "--metrics.log_every", "1", "--checkpoint.enable",
            "false", "--activation_checkpoint.mode", "full", *extra]
    runs = {}
    for name, more in (("eager", []), ("compiled", [
            "--compile.enable", "true", "--compile.backend", "aot_eager",
            "--compile.bucketing", "manual"])):
        argv = base + more + ["--metrics.output_dir", str(tmp_path / name)]
        runs[name] = run_ranks(_trainer, 2, argv)[0]
    print(layout, runs)
    assert runs["compiled"] == runs["eager"], runs


def test_inductor_full_ac_refused_where_torch_lacks_the_partitioner_hook(monkeypatch):
    """A torch whose Inductor has no ``custom_partitioner_fn`` (older than the 2.9 cycle;
    2.11-2.13 have it): full AC with Inductor is refused before any work, with the keys
    and the ways out; aot_eager, selective AC and eager are not refused."""
    from simplefsdp import _torch_compat
    from simplefsdp.errors import ConfigError
    from simplefsdp.parallel.activation_checkpoint import check_composition

    assert _torch_compat.custom_partitioner_base() is not None  # 2.13: present
    monkeypatch.setattr(_torch_compat, "missing_inductor_options", lambda names: list(names))
    assert _torch_compat.custom_partitioner_base() is None
    with pytest.raises(ConfigError) as info:
        check_composition("full", True, "inductor")
    message = str(info.value)
    for part in ("activation_checkpoint.mode = 'full'", "compile.backend = 'inductor'",
                 "custom_partitioner_fn", f"torch {torch.__version__}",
                 "compile.backend = 'aot_eager'", "activation_checkpoint.mode = 'selective'",
                 "compile.enable = false"):
        assert part in message, (part, message)
    for allowed in (("full", True, "aot_eager"), ("selective", True, "inductor"),
                    ("full", False, "inductor")):
        check_composition(*allowed)
