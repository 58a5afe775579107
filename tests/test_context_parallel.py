"""Context parallelism (issue 29): ring and Ulysses attention, in the trainer.

* The ring's merge and written-out backward, one process simulating every ring rank,
  against ``F.scaled_dot_product_attention`` over the whole sequence (float64: the merge
  is exact up to rounding, bound 1e-12).
* Load balance: the attention FLOPs each ring rank's kernels run (counted on the kernel
  calls themselves), against the causal FLOPs of the whole sequence divided by the ranks.
* The trainer on 4 gloo processes, DP 2 x ring 2 (full AC, 2 blocks), DP 2 x Ulysses 2
  (selective AC), ring 2 x Ulysses 2, hybrid_shard (2 x 1) x Ulysses 2 and TP 2 x ring 2
  (with sequence parallel) on one block, and the MoE family (2 blocks) as DP 2 x ring 2,
  replicate 2 x ring 2 and PP 2 x ring 2 (2 microbatches), each with EP 2 (a covering
  subset: see ``CELLS``),
  each against one process without CP on the same global batch: the losses and gradient
  norms of 2 steps (the second runs on the first's update), and every parameter after
  them (the safetensors export). Float32 results that differ only in summation order
  (blockwise attention merged by log-sum-exp, sums over 4 ranks instead of 1). Measured
  over 3 steps: losses and gradient norms within 1.1e-7 relative, parameters within
  2.6e-6 absolute (AdamW at lr 1e-3: each step moves a weight by up to ~1e-3 whatever
  the gradient's size, so parameters show order noise amplified).
  Bounds: 1e-6 relative for losses and norms (the gradient norm also catches a gradient
  off by a constant factor, which AdamW's update would hide), 1e-5 absolute for the
  parameters (a flipped update would move a weight by ~1e-3).
  The MoE balance loss is a mean over one forward's tokens: with CP its statistics are
  summed over the CP ranks (whole sequences), so DP 2 x ring 2 computes it over each
  data-parallel slice's 2 sequences, and the reference runs 2 microsteps of those 2
  sequences; the step's balance loss (metrics.csv) within 1e-6 relative as the loss.
  The document mask (each newline ends a document) with the ring alone (DP 2 x ring 2,
  on 2 blocks: a mask reaching only the first block's CP attention fails it) and Ulysses
  alone (DP 2 x Ulysses 2), against one process with the mask.
* The ring with K/V passed point to point (``parallel.cp_rotate = "ring"``), in the same
  spawn: on a ring of 4 (float64, GQA) each rank's output and gradients against SDPA
  over the whole sequence (1e-12), causal and with documents; the bytes each rotation
  saves for backward against a count by hand (the ring: its own K/V block; the
  all-gather: the whole ring's, repeated for GQA) and the ring's peak of live bytes
  below the all-gather's; in bf16 (mixed precision), the gradients against float64
  SDPA within u = 2^-8 relative RMS, a bound from counting roundings that the travelling
  dK/dV accumulated in bf16 (one rounding a hop) exceeds. In the trainer: ring 2 x
  Ulysses 2 with the document mask against the masked one-process reference (the
  bounds above).
* Two compiled cells (aot_eager, manual bucketing), each bitwise equal to its eager
  twin (the same ops), the data-parallel collectives bucketed, the CP ones left alone:
  ring 2 x Ulysses 2 (K/V all-gathered), and the same with K/V passed around the ring
  and the document mask (compiled graphs compute the pairs eager skips, weighed
  exactly 0), also within the bounds above of the masked reference.
* Bad input is refused when the config is read, naming the keys.
"""

from __future__ import annotations

import csv
import time
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from rank_runner import run_ranks
from toy import relabel_odd_bytes

from simplefsdp._torch_compat import TorchDispatchMode
from simplefsdp.config.job import load_config
from simplefsdp.corpus.text import ByteTokenizer
from simplefsdp.errors import ConfigError
from simplefsdp.parallel.context import positions
from simplefsdp.parallel.ring import GatheredKVAttention, natural_order

pytestmark = pytest.mark.many_ranks  # more than 2 ranks at once (conftest.py)

ROOT = Path(__file__).resolve().parents[1]


# ---------------------------------------------------------------------------------------
# The ring's math, one process.
# ---------------------------------------------------------------------------------------
def _qkv(seq, heads=3, dim=8, dtype=torch.float64):
    gen = torch.Generator().manual_seed(seq)
    return [torch.randn(2, heads, seq, dim, generator=gen, dtype=dtype, requires_grad=True)
            for _ in range(3)]


def _ring_equals_sdpa(ring: int, seq: int, doc: torch.Tensor | None = None) -> None:
    """Every simulated ring rank's output, and the gradients summed over ranks, equal SDPA
    over the whole sequence: causal, or with ``doc``'s block-diagonal causal mask."""
    q, k, v = _qkv(seq)
    weight = torch.randn(2, 3, seq, 8, dtype=torch.float64)
    if doc is None:
        ref = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    else:
        causal = torch.ones(seq, seq, dtype=torch.bool).tril()
        mask = (doc[:, :, None] == doc[:, None, :]) & causal
        ref = F.scaled_dot_product_attention(q, k, v, attn_mask=mask[:, None])
    (ref * weight).sum().backward()
    want = [x.grad.clone() for x in (q, k, v)]
    for x in (q, k, v):
        x.grad = None
    total = 0
    for r in range(ring):
        index = positions(seq, (r, ring))
        masked = () if doc is None else (doc,)
        out = GatheredKVAttention.apply(q[:, :, index], k, v, r, ring, *masked)
        torch.testing.assert_close(out, ref[:, :, index].detach(), rtol=0, atol=1e-12)
        total = total + (out * weight[:, :, index]).sum()
    total.backward()
    for got, expected in zip((q.grad, k.grad, v.grad), want, strict=True):
        torch.testing.assert_close(got, expected, rtol=0, atol=1e-12)


@pytest.mark.quick
@pytest.mark.parametrize("ring", [2, 3])
def test_gathered_kv_attention_is_exact_attention_forward_and_backward(ring):
    """Causal attention, float64, 1e-12."""
    _ring_equals_sdpa(ring, 2 * ring * 5)


@pytest.mark.parametrize("ring", [2, 3])
def test_gathered_kv_attention_with_documents_is_exact_masked_attention(ring):
    """The document mask (float64, 1e-12). Sequence 0 has documents starting at 3, 10 (a
    chunk start: its queries see nothing of the block before) and 13; sequence 1 one
    starting at 17 (some rows of its chunk see keys of the block before, some none)."""
    seq = 2 * ring * 5
    doc = torch.zeros(2, seq, dtype=torch.long)
    for row, starts in ((0, (3, 10, 13)), (1, (17,))):
        for start in starts:
            doc[row, start:] += 1
    _ring_equals_sdpa(ring, seq, doc)


def test_positions_cover_the_sequence_head_and_tail():
    """Ring 2 x Ulysses 2 on 16 tokens, by hand: chunks of 4; ring rank 0 holds chunks 0
    and 3, rank 1 chunks 1 and 2; Ulysses halves each."""
    got = {(r, u): positions(16, (r, 2), (u, 2)).tolist() for r in range(2) for u in range(2)}
    assert got == {(0, 0): [0, 1, 2, 3], (0, 1): [12, 13, 14, 15],
                   (1, 0): [4, 5, 6, 7], (1, 1): [8, 9, 10, 11]}
    # the all-gather holds rank 0's chunks (0, 3) then rank 1's (1, 2)
    assert natural_order(2, 2).tolist() == [0, 1, 4, 5, 6, 7, 2, 3]


class _AttentionFlops(TorchDispatchMode):
    """FLOPs of the attention kernels called: 4 * batch * heads * queries * keys * dim,
    halved for a causal (diagonal) block."""

    def __init__(self):
        super().__init__()
        self.flops = 0.0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default:
            q, k = args[0], args[1]
            causal = args[4] if len(args) > 4 else (kwargs or {}).get("is_causal", False)
            b, h, lq, d = q.shape
            self.flops += 4 * b * h * lq * k.shape[2] * d / (2 if causal else 1)
        return func(*args, **(kwargs or {}))


def test_ring_load_balance_equal_attention_flops():
    """Ring 4 on 64 tokens: each rank runs exactly 1/4 of the causal attention FLOPs of
    the whole sequence (2 * b * h * S^2 * d); a contiguous split would give rank 3 seven
    times rank 0's work."""
    ring, seq = 4, 64
    q, k, v = (x.detach() for x in _qkv(seq))
    per_rank = []
    for r in range(ring):
        with _AttentionFlops() as count:
            GatheredKVAttention.apply(q[:, :, positions(seq, (r, ring))], k, v, r, ring)
        per_rank.append(count.flops)
    whole = 2 * 2 * 3 * seq * seq * 8
    assert per_rank == [whole / ring] * ring, per_rank


# ---------------------------------------------------------------------------------------
# The trainer: parity with one process on the same global batch.
# ---------------------------------------------------------------------------------------
BASE = ["--training.steps", "2", "--training.seq_len", "32", "--model.dim", "32",
        "--model.n_layers", "1", "--model.n_heads", "4", "--model.n_kv_heads", "1",
        "--training.warmup_steps", "0", "--metrics.log_every", "1",
        "--checkpoint.export_safetensors", "true", "--training.hang_watchdog_s", "0"]
# One KV head (GQA, 4 query heads each): Ulysses 2 must repeat it to 2 before splitting.
# One block: the CP attention of several blocks in one step (their shared positions, their
# groups) is the MoE cells' (2 blocks, PP cuts them into 2 stages), with the document mask
# DP 2 x ring 2's (2 blocks: the MoE cells have no mask).
# Activation checkpointing rides along (it recomputes the same ops: no new tolerance).
KV2 = ["--model.n_kv_heads", "2"]
# A tiny debug_moe: 2 blocks, 4 experts of width 32, top-2, a shared expert, the balance
# loss with a large coefficient (so that it moves the weights visibly).
MOE = ["--model.name", "debug_moe", "--model.n_layers", "2", "--model.num_experts", "4",
       "--model.moe_hidden_dim", "32", "--model.shared_hidden_dim", "32",
       "--model.aux_loss_coef", "0.1"]
DOC = ["--data.document_mask", "true"]  # with _NewlineEnds as the tokenizer
TWO_BLOCKS = ["--model.n_layers", "2"]


class _NewlineEnds(ByteTokenizer):
    """Bytes, each newline the EOS that ends a document (Shakespeare's lines: about one a
    window of 32)."""

    fingerprint = "byte-newline-eos"
    eos_id = 10


# name: (flags, its reference's name); a global batch of 4 sequences each, on 4 processes.
# A covering subset, not every combination: each CP kind (ring with K/V all-gathered, ring
# with K/V passed, Ulysses, ring x Ulysses) meets each data-parallel mode, the document
# mask, TP, PP, MoE and compile at least once where the combination exists (the dense
# replicate 2 x ring 2 and PP 2 x ring 2 are the MoE cells' dense layers; the ring x
# Ulysses document mask is the ring pass cell's).
CELLS = {
    # the document mask (every newline ends a document) with the ring alone, under full AC,
    # on 2 blocks: each block's CP attention gets the mask (the MoE cells' 2 blocks have
    # none, the other mask cells 1 block)
    "dp2_ring2_doc": (["--training.batch_size", "2", "--parallel.cp_ring", "2",
                       "--activation_checkpoint.mode", "full", *DOC, *TWO_BLOCKS],
                      "reference_doc_2blocks"),
    # ... and with Ulysses alone, under selective AC
    "dp2_ulysses2_doc": (["--training.batch_size", "2", "--parallel.cp_ulysses", "2",
                          "--activation_checkpoint.mode", "selective", *DOC],
                         "reference_doc"),
    "ring2_ulysses2": (["--training.batch_size", "4", "--parallel.cp_ring", "2",
                        "--parallel.cp_ulysses", "2"], "reference"),
    # hybrid_shard 2 x 1: sharded over dp_shard 1 x Ulysses 2 (the CP ranks alone),
    # replicated over dp_replicate 2
    "hybrid2x1_ulysses2": (["--training.batch_size", "2", "--parallel.dp_mode", "hybrid_shard",
                            "--parallel.dp_replicate", "2", "--parallel.dp_shard", "1",
                            "--parallel.cp_ulysses", "2"], "reference"),
    # TP 2 x ring 2 (sequence parallel inside each CP rank's part): KV heads over TP, 2.
    "tp2_ring2": (["--training.batch_size", "4", "--parallel.cp_ring", "2",
                   "--parallel.tp", "2", *KV2], "reference_kv2"),
    # MoE: FSDP 2 x ring 2 with EP 2 (experts split over dp_shard, the ring ranks hold the
    # same experts); the balance loss's statistics over the ring (whole sequences)
    "moe_ep2_dp2_ring2": ([*MOE, "--training.batch_size", "2", "--parallel.cp_ring", "2",
                           "--parallel.ep", "2"], "reference_moe"),
    # MoE with replicate: DDP over dp_replicate 2 x ring 2 (weights and gradients
    # all-reduced over the 4 ranks), the experts' EP 2 groups cut out of the ring ranks
    # (dp_shard 1), replicated over dp_replicate
    "moe_ep2_replicate2_ring2": ([*MOE, "--training.batch_size", "2", "--parallel.dp_mode",
                                  "replicate", "--parallel.dp_replicate", "2",
                                  "--parallel.dp_shard", "1", "--parallel.cp_ring", "2",
                                  "--parallel.ep", "2"], "reference_moe"),
    # MoE with pipeline stages, each with ring attention (stage-to-stage: each rank's
    # part): PP 2 x ring 2 x EP 2 (the ring ranks), 2 microbatches of 2 sequences: each
    # microbatch a forward, so the balance loss's 2 sequences as above
    "moe_ep2_pp2_ring2": ([*MOE, "--training.batch_size", "4", "--parallel.cp_ring", "2",
                           "--parallel.pp", "2", "--parallel.pp_microbatches", "2",
                           "--parallel.ep", "2"], "reference_moe"),
    # K/V passed point to point around the ring (parallel.cp_rotate), with Ulysses and the
    # document mask; also compiled (COMPILED below)
    "ring2_ulysses2_doc_pass": (["--training.batch_size", "4", "--parallel.cp_ring", "2",
                                 "--parallel.cp_ulysses", "2", "--parallel.cp_rotate", "ring",
                                 *DOC], "reference_doc"),
}
COMPILED = ["--compile.enable", "true", "--compile.backend", "aot_eager",
            "--compile.bucketing", "manual"]
REFERENCES = {  # one process, the same global batch of 4 sequences
    "reference": ["--training.batch_size", "4"],
    "reference_kv2": ["--training.batch_size", "4", *KV2],
    # The balance loss is a mean over one forward's tokens: under DP 2 x ring 2, over each
    # data-parallel slice's 2 whole sequences. Here too: 2 microsteps of 2 sequences (the
    # loader serves microstep i the sequences data-parallel rank i reads).
    "reference_moe": [*MOE, "--training.batch_size", "2", "--training.grad_accum_steps", "2"],
    "reference_doc": ["--training.batch_size", "4", *DOC],
    "reference_doc_2blocks": ["--training.batch_size", "4", *DOC, *TWO_BLOCKS],
}


def _ring_pass_checks(rank, world):
    """The ring with K/V passed point to point (``RingPass``) on a ring of all ``world``
    ranks, float64, GQA (4 query heads, 2 KV heads), checked in the rank (a failure stops
    the spawn before the trainer cells): this rank's output and its q/k/v gradients
    (summed over the ranks by the ring's own backward) against SDPA over the whole
    sequence, causal and with documents (1e-12 as the one-process ring above). Then,
    without documents, both rotations' bytes saved for backward, by hand (batch 2, 12
    tokens a rank, head_dim 8, 8-byte floats; a K/V block: 2 KV heads, 2 * 2 * 12 * 8 * 8
    bytes): the ring keeps its own K and V (2 blocks), the all-gather the whole ring's
    repeated to the 4 query heads (4 ranks x 2 repeats, each of K and V); both keep q and
    the output (2 * 4 * 12 * 8 * 8 bytes each) and the log-sum-exp (2 * 4 * 12 * 8), the
    all-gather also its two index_select indices (48 tokens x 8 bytes). The peak of live
    bytes (storages ops return, forward and backward): the ring's below the all-gather's.
    Returns the peaks (allgather, ring)."""
    import torch.distributed as dist

    from simplefsdp.parallel.ring import ring_attention
    from simplefsdp.plan.eager import _Tracker, peak_of

    seq, gen = 4 * world * 3, torch.Generator().manual_seed(7)
    q, k, v = (torch.randn(2, seq, heads, 8, generator=gen, dtype=torch.float64)
               for heads in (4, 2, 2))
    weight = torch.randn(2, seq, 4, 8, generator=gen, dtype=torch.float64)
    doc = torch.zeros(2, seq, dtype=torch.long)
    doc[0, 5:] += 1  # documents: a start inside a chunk, one at a chunk start (row 0),
    doc[0, 18:] += 1  # one whose queries see only part of the block before (row 1)
    doc[1, 23:] += 1
    index = positions(seq, (rank, world))
    block, query, lse, ids = 2 * 2 * 12 * 8 * 8, 2 * 4 * 12 * 8 * 8, 2 * 4 * 12 * 8, 48 * 8
    saved_by_hand = {"ring": [lse, block, block, query, query],
                     "allgather": [ids, ids, lse, query, query, 4 * 2 * block, 4 * 2 * block]}
    peaks = {}
    for masked in (False, True):
        mask = torch.ones(seq, seq, dtype=torch.bool).tril()
        if masked:
            mask = ((doc[:, :, None] == doc[:, None, :]) & mask)[:, None]
        whole = [x.clone().requires_grad_() for x in (q, k, v)]
        ref = F.scaled_dot_product_attention(*(x.transpose(1, 2) for x in whole),
                                             attn_mask=mask, enable_gqa=True).transpose(1, 2)
        (ref * weight).sum().backward()
        for rotate in ("allgather", "ring"):
            mine = [x[:, index].clone().requires_grad_() for x in (q, k, v)]
            saved = []

            def pack(t, saved=saved):
                saved.append(t.untyped_storage().nbytes())
                return t

            with _Tracker(set(), set()) as tracker:
                with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
                    out = ring_attention(*mine, dist.group.WORLD, rank, world,
                                         doc if masked else None, rotate)
                (out * weight[:, index]).sum().backward()
            torch.testing.assert_close(out, ref[:, index], rtol=0, atol=1e-12)
            for x, w in zip(mine, whole, strict=True):
                torch.testing.assert_close(x.grad, w.grad[:, index], rtol=0, atol=1e-12)
            if not masked:
                assert sorted(saved) == sorted(saved_by_hand[rotate]), (rotate, saved)
                peaks[rotate] = peak_of(tracker.events, set())[0]
    assert peaks["ring"] < peaks["allgather"], peaks
    return peaks["allgather"], peaks["ring"]


BF16_UNIT_ROUNDOFF = 2.0 ** -8  # u: half the spacing of bf16's 8 significant bits


def _ring_pass_bf16_checks(rank, world):
    """The ring pass's gradients under mixed precision: bf16 q/k/v (GQA: 4 query heads, 2
    KV heads, head_dim 16, 32 tokens a rank) on a ring of all ``world`` ranks, against
    float64 SDPA over the whole sequence on the same (bf16-exact) values. Measure: the
    relative RMS error over the whole ring, ``||got - want|| / ||want||`` (squared sums
    all-reduced), of dq, of dq on the tail chunks alone (rank r's chunk ``2R - 1 - r``
    sums ``2R - r >= R + 1`` partial gradients, one per key chunk), of dK and of dV.
    Bound: u = 2^-8 for each, derived by counting roundings: one round-to-nearest of a
    value of random mantissa errs by ~0.42u relative RMS (uniform within half an ulp,
    averaged over the mantissa), and independent roundings add in quadrature. With
    float32 accumulators an element sees the kernel's roundings (its bf16 operands
    inside, its bf16 output: up to 3) and the one cast at home, up to 4: <= 0.85u.
    Accumulated in bf16, each partial added rounds the running sum again: dK/dV at each
    of the ring's 3 hops and in the GQA repeats' sum, a tail chunk's dq at each of its
    4 or more additions: 8 or more in all, ~1.2u. Measured: dq, tail dq, dK, dV 0.82u,
    0.84u, 0.76u, 0.73u with float32 accumulators; dK and dV 1.15u and 1.13u with bf16
    ones (``grad_accumulator_dtype`` returning K's dtype), tail dq 1.08u with a bf16 dq
    alone (the whole dq 0.92u: the head chunks add few partials). Returns the errors."""
    import torch.distributed as dist

    from simplefsdp.parallel.ring import ring_attention

    seq, gen = 8 * world * 4, torch.Generator().manual_seed(128)
    q, k, v = (torch.randn(2, seq, heads, 16, generator=gen).to(torch.bfloat16)
               for heads in (4, 2, 2))
    weight = torch.randn(2, seq, 4, 16, generator=gen).to(torch.bfloat16)
    whole = [x.double().requires_grad_() for x in (q, k, v)]
    ref = F.scaled_dot_product_attention(*(x.transpose(1, 2) for x in whole), is_causal=True,
                                         enable_gqa=True).transpose(1, 2)
    (ref * weight.double()).sum().backward()
    index = positions(seq, (rank, world))
    mine = [x[:, index].clone().requires_grad_() for x in (q, k, v)]
    out = ring_attention(*mine, dist.group.WORLD, rank, world, None, "ring")
    (out * weight[:, index]).sum().backward()
    assert all(x.grad.dtype == torch.bfloat16 for x in mine)
    tail = slice(index.numel() // 2, None)
    pairs = [(x.grad.double(), w.grad[:, index]) for x, w in zip(mine, whole, strict=True)]
    pairs.insert(1, (pairs[0][0][:, tail], pairs[0][1][:, tail]))
    sums = torch.tensor([[(got - want).square().sum(), want.square().sum()]
                         for got, want in pairs], dtype=torch.float64)
    dist.all_reduce(sums)
    errors = (sums[:, 0] / sums[:, 1]).sqrt() / BF16_UNIT_ROUNDOFF
    assert (errors <= 1).all(), f"dq, tail dq, dK, dV relative RMS errors in u: {errors}"
    return errors.tolist()


def _spawned(rank, world, cells, out):
    """The ring-pass checks, then the trainer cells, in one spawn."""
    return ((_ring_pass_checks(rank, world), _ring_pass_bf16_checks(rank, world)),
            _runs(rank, world, cells, out))


def _runs(rank, world, cells, out):
    from simplefsdp.train.__main__ import main
    from simplefsdp.train.console import CompileReports

    results = {}
    for name, argv in cells.items():
        start = time.perf_counter()
        with CompileReports() as reports:
            # relabelled text (odd bytes + 128, the newline EOS kept): the TP cell's
            # output projection sees targets on both vocabulary halves
            run = main(BASE + argv + ["--metrics.output_dir", str(Path(out) / name)],
                       tokenizer=_NewlineEnds() if DOC[0] in argv else None,
                       batch_transform=relabel_odd_bytes)
        graphs = [(r.graph, dict(r.collectives_before), r.other_collectives, len(r.buckets))
                  for r in reports.reports]
        results[name] = ((run.losses, run.grad_norms), graphs)
        print(f"rank {rank} {name}: {time.perf_counter() - start:.1f} s", flush=True)
    return results


def _params(path):
    from safetensors.torch import load_file

    return load_file(str(path / "model.safetensors"))


def _column(path, name):
    with open(path / "metrics.csv", newline="") as f:
        return [float(row[name]) for row in csv.DictReader(f)]


def test_trainer_cp_matches_one_process(tmp_path):
    pass_compiled = "ring2_ulysses2_doc_pass_compiled"
    reference_of = dict({name: ref for name, (_, ref) in CELLS.items()},
                        ring2_ulysses2_compiled="reference", **{pass_compiled: "reference_doc"})
    cells = dict({name: flags for name, (flags, _) in CELLS.items()},
                 ring2_ulysses2_compiled=CELLS["ring2_ulysses2"][0] + COMPILED,
                 **{pass_compiled: CELLS["ring2_ulysses2_doc_pass"][0] + COMPILED})
    checks, got = zip(*run_ranks(_spawned, 4, cells, str(tmp_path)), strict=True)
    print("ring pass, peak live bytes per rank (allgather, ring):", [c[0] for c in checks])
    print("ring pass in bf16, dq/tail dq/dK/dV relative RMS errors in u:", checks[0][1])
    got = got[0]
    refs = run_ranks(_runs, 1, REFERENCES, str(tmp_path))[0]
    for name, ref_name in reference_of.items():
        reference, want = _params(tmp_path / ref_name), refs[ref_name][0]
        for got_list, want_list in zip(got[name][0], want, strict=True):  # losses, norms
            torch.testing.assert_close(torch.tensor(got_list), torch.tensor(want_list),
                                       rtol=1e-6, atol=0, msg=name)
        params = _params(tmp_path / name)
        assert params.keys() == reference.keys()
        for key, value in params.items():
            torch.testing.assert_close(value, reference[key], rtol=0, atol=1e-5,
                                       msg=f"{name}: {key}")
    assert refs["reference_doc"][0][0] != refs["reference"][0][0]  # the mask masks
    # the step's balance loss (metrics.csv; coefficient applied, summed over layers)
    aux_want = _column(tmp_path / "reference_moe", "aux_loss")
    assert len(aux_want) == 2 and min(aux_want) > 0.1  # top_k 2 x 2 layers x 0.1 balanced
    for name in ("moe_ep2_dp2_ring2", "moe_ep2_replicate2_ring2", "moe_ep2_pp2_ring2"):
        torch.testing.assert_close(torch.tensor(_column(tmp_path / name, "aux_loss")),
                                   torch.tensor(aux_want), rtol=1e-6, atol=0, msg=name)
    # compiled: the eager ops, so bitwise; the parameters likewise
    assert got["ring2_ulysses2_compiled"][0] == got["ring2_ulysses2"][0]
    compiled_params = _params(tmp_path / "ring2_ulysses2_compiled")
    eager_params = _params(tmp_path / "ring2_ulysses2")
    assert all(torch.equal(compiled_params[k], eager_params[k]) for k in eager_params)
    graphs = {graph: (before, other, buckets)
              for graph, before, other, buckets in got["ring2_ulysses2_compiled"][1]}
    # The ring's collectives, left alone: per block the all-gathers of k and v (forward)
    # and their reduce-scatters (backward), 1 block. (Ulysses' all-to-alls are no kind
    # our passes know.) The data-parallel ones: 12 parameters (9 in the block, embeddings,
    # norm, output), gathered in forward as 3 buckets (the block, the embeddings, the
    # norm with the output); in backward 11 re-gathered (not the embeddings) as 2 buckets
    # and 12 reduce-scattered as 3.
    assert graphs["forward"] == ({"all_gather": 12}, 2, 3), graphs
    assert graphs["backward"] == ({"all_gather": 11, "reduce_scatter": 12}, 2, 5), graphs
    # the ring pass with the document mask, compiled: pairs that eager skips (no query
    # sees a key) are computed there, masked, and the merge weighs them exp(-inf) = 0, an
    # exact 0: measured bitwise equal to its eager twin, so asserted so (beyond the bounds
    # against the masked one-process reference above)
    twin = "ring2_ulysses2_doc_pass"
    assert got[pass_compiled][0] == got[twin][0]
    compiled_params, eager_params = _params(tmp_path / pass_compiled), _params(tmp_path / twin)
    assert all(torch.equal(compiled_params[k], eager_params[k]) for k in eager_params)
    # the ring's shifts and Ulysses' exchanges are all-to-alls (no kind our passes know);
    # the one other collective: the token ids' all-gather for the document mask (forward)
    graphs = {graph: (before, other, buckets)
              for graph, before, other, buckets in got[pass_compiled][1]}
    assert graphs["forward"] == ({"all_gather": 12}, 1, 3), graphs
    assert graphs["backward"] == ({"all_gather": 11, "reduce_scatter": 12}, 0, 5), graphs


# ---------------------------------------------------------------------------------------
# Bad input.
# ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("flags, message", [
    (["--parallel.cp_ring", "2", "--training.seq_len", "34"],
     "training.seq_len = 34 is not divisible by 2 * parallel.cp_ring * parallel.cp_ulysses = 4"),
    (["--parallel.cp_ulysses", "8", "--training.seq_len", "64"],
     "model.n_heads = 4 is not divisible by parallel.cp_ulysses = 8"),
    (["--parallel.cp_ring", "2", "--parallel.tp", "4", "--model.n_kv_heads", "4",
      "--training.seq_len", "12"],
     "training.seq_len = 12 over parallel.cp_ring * parallel.cp_ulysses = 2 ranks leaves 6 "
     "tokens, not divisible by parallel.tp = 4"),
    (["--parallel.cp_ulysses", "0"],
     "parallel.cp_ulysses = 0 is out of range: it must be a positive integer"),
    (["--parallel.cp_ulysses", "2", "--parallel.cp_rotate", "ring"],
     "parallel.cp_rotate = 'ring' passes K/V around a ring, but parallel.cp_ring = 1 has "
     "none: set parallel.cp_ring > 1 or parallel.cp_rotate = 'allgather'"),
    (["--parallel.cp_ring", "2"], None),  # world 2: dp_shard = 1
])
def test_bad_cp_input_is_refused_at_load(flags, message):
    if message is None:
        cfg = load_config(None, flags, world_size=2)
        assert cfg.parallel.resolve(2).dp_shard == 1
        return
    with pytest.raises(ConfigError) as info:
        load_config(None, flags, world_size=None)
    assert message in str(info.value), str(info.value)


def test_cp_refused_for_a_family_without_cp_attention(monkeypatch):
    """Every family has CP attention today (Hugging Face models through hf.context_parallel): a
    family without it stands in for the next one added."""
    import dataclasses

    from simplefsdp.models import registry

    plain = dataclasses.replace(registry.get("llama"), context_parallel=False)
    monkeypatch.setitem(registry._REGISTERED, "llama", plain)
    with pytest.raises(ConfigError, match=r"model.family = 'llama' has none"):
        load_config(None, ["--parallel.cp_ulysses", "2"])


def test_parallel_dims_with_cp():
    """8 ranks as dp_shard 2 x ring 2 x Ulysses 2, row-major over (pp, dp_replicate,
    dp_shard, cp_ring, cp_ulysses, tp), by hand: rank 5 = 1*4 + 0*2 + 1 is data-parallel
    slice 1, ring rank 0, Ulysses rank 1; parameters are sharded over all 8."""
    from simplefsdp.mesh import ParallelDims

    dims = ParallelDims(cp_ring=2, cp_ulysses=2).resolve(8)
    assert (dims.dp_shard, dims.cp, dims.dp, dims.dp_shard_cp) == (2, 4, 2, 8)
    at = dims.coords(5)
    assert (at.dp, at.cp_ring, at.cp_ulysses) == (1, 0, 1)
    # every rank counts its own tokens and loss; each data-parallel slice has 4 ranks
    assert all(dims.coords(r).counts_tokens and dims.coords(r).counts_loss for r in range(8))
    assert [dims.coords(r).dp for r in range(8)] == [0, 0, 0, 0, 1, 1, 1, 1]
    with pytest.raises(ValueError, match=r"world size 6 is not divisible by pp \* "
                       r"dp_replicate \* cp_ring \* cp_ulysses \* tp = 1 \* 1 \* 2 \* 2 \* 1 = 4"):
        ParallelDims(cp_ring=2, cp_ulysses=2).resolve(6)
