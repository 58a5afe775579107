"""One prepared run on a lent GPU (issues 28 and 29): what the CPU machines cannot show.

    PYTHONUNBUFFERED=1 python scripts/device_check.py --out DIR [--tiny] [--device cpu]

Sections, each timed and written to ``DIR/results.json`` as it finishes (a run cut
short still returns what it measured):

1. ``env``: torch, GPU, whether ``torch._grouped_mm`` runs for bf16 here.
2. ``ring_single``: ring attention's CUDA kernels (flash with log-sum-exp, its backward,
   the exact merge) on one process: each ring rank's ``GatheredKVAttention`` over the
   whole K/V against SDPA on the whole sequence in float32; causal and with documents.
3. ``ring_threads``: the point-to-point rotation (``RingPass``) with 4 ring ranks as
   threads of one process on the GPU, the shift between them in memory (NCCL refuses two
   ranks on one device; gloo with CUDA tensors crashed a rank with SIGSEGV on torch 2.11).
   ``mla_model``: a one-block MLA model, our cuDNN core against SDPA's pick and compiled.
4. ``attention``: per-layer forward / backward seconds of one CP rank's attention at the
   published long-context shapes (Llama 3 8B heads, 16,384-token chunks, ring 2/4/8),
   and the raw flash kernel's rates, for the planner's attention terms.
5. ``experts``: the routed experts' grouped matmul at DeepSeek-V3 16B's per-rank shapes
   (EP 8: 8 local experts, 4 x 4096 tokens x top-6 rows), forward and backward rates.
6. ``mla``: MLA's attention shapes (16 heads, q/k 192, v 128, 4 x 4096, causal) on the
   kernels SDPA has for them.
7. ``step``: rank 0's whole training step (eager) under a fake process group of 8:
   DeepSeek-V3 16B FSDP 8, then Llama 3 8B CP 8 at 262,144 tokens (full AC). The MoE
   sections (``MOE``): DeepSeek-V3 16B per EP and AC mode, eager and compiled, the
   compiled padded dispatch, and ETP 1 / 2 (Qwen3-30B-A3B at TP 2: ``_etp_section``).
8. ``float8``: ``torch._scaled_mm`` against a bf16 matmul at a Llama 3 8B projection's
   shape (the planner's float8 rate), then rank 0's Llama 3 8B FSDP 8 step in bf16 and
   with ``[float8]`` (tensorwise, float8 all-gather), eager, under the fake process group
   (its gathered bytes are unwritten memory: timing and memory only, not the loss).
   ``float8_compiled``: the same comparison compiled (Inductor, one bucket per block) at
   Llama 3 8B's widths and 4 blocks, where Inductor fuses the casts.
9. ``cpu_offload`` (issue 48): a stack of 4096-wide MLP blocks (~0.4 B parameters)
   under ``data_parallel`` on a one-rank NCCL group, with and without
   ``CPUOffloadPolicy(pin_memory=True)``: step seconds (forward, backward, AdamW on the
   host or the device), peak device memory, and the host<->device copies and bytes of
   one step, against the planner's PCIe figure; then with ``pin_memory=False`` (pageable
   host copies) on the same step.
10. ``train_tools``: the trainer's validation and profiling on the device: a debug run
    (``python -m simplefsdp.train``, one process, 8 steps, validation every 4, step 3
    profiled with the allocator's memory snapshot), then its exit status, the finite
    validation losses in ``metrics.csv`` (copied to ``DIR/train_metrics.csv``), the Chrome
    trace (gzip JSON, its CUDA kernel events) and the snapshot pickle (``segments``,
    ``device_traces``; CUDA only: skipped and said so on CPU).
11. ``overlap_8b``: ``python -m simplefsdp.bench`` under a fake process group of 8 on a
    compiled Llama 3 8B-shaped step (4 blocks): Inductor's overlap scheduler beside our
    auto wrapping and the compiled compute-only limit (median step, the estimated against
    the measured exposed time, the plan, errors), then torch's FX bucketing and our manual
    reordering if the budget leaves room. Each bench run has a timeout.
12. ``pytest_cuda``: the quick tier and tests/test_reliability.py on this machine's
    torch (pytest-xdist, 8 workers, with a timeout): the counts line, the failures' and
    skips' short reasons, the output's tail.

``--only a,b`` runs those sections in that order; ``--budget-train``, ``--budget-overlap``
and ``--budget-pytest`` bound the subprocess sections (seconds); ``--budget-float8`` and
``--budget-offload`` run those two in a child process with that timeout; ``--deadline-s``
cuts every bound to what is left of the whole run. ``--tiny --device cpu``
is the CPU dry run of every section (the debug models; the bench on aot_eager, where the
overlap scheduler reports itself unavailable without triton; one reliability test).
``scripts/device_run.sh`` is the one device command.
"""

# ruff: noqa: B023  (each closure in a loop is timed within its own iteration)
from __future__ import annotations

import argparse
import functools
import json
import os
import subprocess
import sys
import threading
import time
import traceback
from contextlib import nullcontext

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

RESULTS: dict = {}
ARGS = None


def save():
    with open(os.path.join(ARGS.out, "results.json"), "w") as f:
        json.dump(RESULTS, f, indent=1, default=str)


def section(name):
    def wrap(fn):
        @functools.wraps(fn)
        def run():
            start = time.time()
            print(f"== {name}", flush=True)
            try:
                RESULTS[name] = fn()
            except Exception as e:  # record and go on: later sections still run
                RESULTS[name] = {"error": f"{type(e).__name__}: {e}",
                                 "trace": traceback.format_exc()[-3000:]}
            RESULTS[name + "_wall_s"] = round(time.time() - start, 1)
            print(json.dumps({name: RESULTS[name]}, default=str)[:4000], flush=True)
            save()
        return run
    return wrap


def sync():
    if ARGS.device == "cuda":
        torch.cuda.synchronize()


def timed(fn, reps=3, warm=1):
    """Median seconds of ``fn`` (synchronised)."""
    for _ in range(warm):
        fn()
    sync()
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - start)
    return sorted(times)[len(times) // 2]


class PowerLog:
    """nvidia-smi's power draw and SM clock every 0.2 s while a section runs."""

    def __init__(self):
        self.rows, self.stop = [], threading.Event()

    def __enter__(self):
        def poll():
            while not self.stop.is_set():
                try:
                    out = subprocess.run(
                        ["nvidia-smi", "--query-gpu=power.draw,clocks.sm,power.limit",
                         "--format=csv,noheader,nounits"], capture_output=True, text=True,
                        timeout=5).stdout.strip()
                    self.rows.append([float(x) for x in out.split(",")])
                except Exception:
                    return
                time.sleep(0.2)
        if ARGS.device == "cuda":
            self.thread = threading.Thread(target=poll, daemon=True)
            self.thread.start()
        return self

    def __exit__(self, *exc):
        self.stop.set()

    def summary(self):
        if not self.rows:
            return None
        power = sorted(r[0] for r in self.rows)
        clocks = sorted(r[1] for r in self.rows)
        return {"samples": len(self.rows), "power_w_median": power[len(power) // 2],
                "power_w_max": power[-1], "sm_mhz_median": clocks[len(clocks) // 2],
                "sm_mhz_min": clocks[0], "power_limit_w": self.rows[0][2]}


# --------------------------------------------------------------------------------------
@section("env")
def env():
    from simplefsdp._torch_compat import grouped_mm
    out = {"torch": torch.__version__, "python": sys.version.split()[0]}
    if ARGS.device == "cuda":
        out["gpu"] = torch.cuda.get_device_name()
        out["sms"] = torch.cuda.get_device_properties(0).multi_processor_count
        out["smi"] = subprocess.run(["nvidia-smi", "--query-gpu=name,power.limit,clocks.max.sm",
                                     "--format=csv"], capture_output=True, text=True).stdout
    dev = torch.device(ARGS.device)
    out["grouped_mm_bf16"] = grouped_mm(dev, torch.bfloat16) is not None
    out["grouped_mm_fp32"] = grouped_mm(dev, torch.float32) is not None
    return out


def _reference(q, k, v, doc=None):
    """Whole-sequence attention in float32, (b, h, s, d); GQA by repeating K/V heads."""
    rep = q.shape[1] // k.shape[1]
    q, k, v = q.float(), k.float().repeat_interleave(rep, 1), v.float().repeat_interleave(rep, 1)
    s = q.shape[2]
    mask = torch.ones(s, s, dtype=torch.bool, device=q.device).tril()
    if doc is not None:
        mask = mask & (doc[:, None, :, None] == doc[:, None, None, :])
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)


def _rel(a, b):
    a, b = a.detach().float(), b.detach().float()
    return float((a - b).abs().max() / b.abs().max())


def _inputs(size, length, heads=8, kv_heads=2, dim=128, seed=0, docs=False):
    g = torch.Generator(device="cpu").manual_seed(seed)
    s = 2 * size * length
    dev, dt = ARGS.device, torch.bfloat16
    q, k, v, go = (torch.randn(1, h, s, dim, generator=g).to(dev, dt)
                   for h in (heads, kv_heads, kv_heads, heads))
    doc = None
    if docs:  # documents of uneven lengths, boundaries not on chunk edges
        cuts = torch.tensor([0, s // 5, s // 2 + 3, (4 * s) // 5 + 1])
        doc = (torch.arange(s)[:, None] >= cuts[None, :]).sum(1).sub(1)[None].to(dev)
    return q, k, v, go, doc


@section("ring_single")
def ring_single():
    from simplefsdp.parallel.ring import (  # noqa: F401
        GatheredKVAttention,
        natural_order,
        ring_chunks,
    )
    size, length = 4, 256
    out = {}
    for docs in (False, True):
        q, k, v, go, doc = _inputs(size, length, docs=docs)
        qr, kr, vr = (x.clone().float().requires_grad_() for x in (q, k, v))
        ref = _reference(qr, kr, vr, doc)
        ref.backward(go.float())
        # what one process's bf16 flash kernel gives on the whole sequence (no documents)
        rep = q.shape[1] // k.shape[1]
        kk, vv = (x.repeat_interleave(rep, 1).detach().requires_grad_() for x in (k, v))
        worst = {"out": 0.0, "dq": 0.0, "dk": 0.0, "dv": 0.0}
        dk = torch.zeros_like(kk, dtype=torch.float32)
        dv = torch.zeros_like(vv, dtype=torch.float32)
        for rank in range(size):
            rows = torch.cat([torch.arange(c * length, (c + 1) * length)
                              for c in ring_chunks(rank, size)]).to(q.device)
            qi = q[:, :, rows].detach().requires_grad_()
            ki, vi = kk.detach().requires_grad_(), vv.detach().requires_grad_()
            o = GatheredKVAttention.apply(qi, ki, vi, rank, size, doc)
            o.backward(go[:, :, rows])
            worst["out"] = max(worst["out"], _rel(o, ref[:, :, rows]))
            worst["dq"] = max(worst["dq"], _rel(qi.grad, qr.grad[:, :, rows]))
            dk += ki.grad.float()
            dv += vi.grad.float()
        dk = dk.unflatten(1, (-1, rep)).sum(2)
        dv = dv.unflatten(1, (-1, rep)).sum(2)
        worst["dk"], worst["dv"] = _rel(dk, kr.grad), _rel(dv, vr.grad)
        if not docs:  # the plain kernel on the whole sequence, for scale
            qf = q.detach().requires_grad_()
            kf, vf = (x.detach().requires_grad_() for x in (k, v))
            of = F.scaled_dot_product_attention(qf, kf.repeat_interleave(rep, 1),
                                                vf.repeat_interleave(rep, 1), is_causal=True)
            of.backward(go)
            worst["whole_kernel"] = {"out": _rel(of, ref), "dq": _rel(qf.grad, qr.grad),
                                     "dk": _rel(kf.grad, kr.grad), "dv": _rel(vf.grad, vr.grad)}
        out["docs" if docs else "causal"] = worst
    return out


class _ThreadRing:
    """Stands in for the ring's point-to-point shift when ring ranks are threads of one
    process sharing one GPU: each rank puts its block in the next rank's box, then takes
    its own."""

    def __init__(self, size):
        self.box, self.barrier = [None] * size, threading.Barrier(size, timeout=120)

    def shift(self, x, group, rank, size):
        self.box[(rank + 1) % size] = x.clone()
        self.barrier.wait()
        got = self.box[rank]
        self.barrier.wait()
        return got


@section("ring_threads")
def ring_threads():
    """RingPass (``cp_rotate = "ring"``) on the device: 4 ring ranks as threads, its
    forward and backward called directly (the autograd engine runs every CUDA backward on
    one device thread, where the ranks' shifts would wait for each other forever)."""
    import types

    import simplefsdp.parallel.ring as ring
    size, length = 4, 256
    out = {}
    saved = ring._shift
    try:
        for docs in (False, True):
            q, k, v, go, doc = _inputs(size, length, docs=docs)
            qr, kr, vr = (x.clone().float().requires_grad_() for x in (q, k, v))
            ref = _reference(qr, kr, vr, doc)
            ref.backward(go.float())
            ring._shift = _ThreadRing(size).shift
            res = [None] * size

            def rank_fn(rank):
                try:
                    rows = torch.cat([torch.arange(c * length, (c + 1) * length)
                                      for c in ring.ring_chunks(rank, size)]).to(q.device)
                    ctx = types.SimpleNamespace()
                    ctx.save_for_backward = lambda *t: setattr(ctx, "saved_tensors", t)
                    qi, ki, vi = (x[:, :, rows].contiguous() for x in (q, k, v))
                    o = ring.RingPass.forward(ctx, qi, ki, vi, "t", rank, size, doc)
                    dq, dk, dv = ring.RingPass.backward(ctx, go[:, :, rows])[:3]
                    res[rank] = {"out": _rel(o, ref[:, :, rows]),
                                 "dq": _rel(dq, qr.grad[:, :, rows]),
                                 "dk": _rel(dk, kr.grad[:, :, rows]),
                                 "dv": _rel(dv, vr.grad[:, :, rows])}
                except Exception as e:
                    res[rank] = f"{type(e).__name__}: {e} {traceback.format_exc()[-800:]}"
            threads = [threading.Thread(target=rank_fn, args=(r,)) for r in range(size)]
            for th in threads:
                th.start()
            for th in threads:
                th.join()
            out["docs" if docs else "causal"] = res
    finally:
        ring._shift = saved
    return out


@section("mla_model")
def mla_model():
    """A one-block DeepSeek-V3 16B-shaped model (MLA, dense FFN) in bf16 on the device:
    our MLA core (cuDNN by name where it runs) against SDPA's own pick, eager, and ours
    compiled (Inductor): logits and every gradient."""
    import dataclasses

    from simplefsdp._torch_compat import cudnn_attention_runs
    from simplefsdp.models.llama import causal_attention
    from simplefsdp.models.mla import MultiHeadLatentAttention, mla_attention
    from simplefsdp.models.moe import MOE_PRESETS, MoETransformer
    dev = torch.device(ARGS.device)
    args = dataclasses.replace(MOE_PRESETS["deepseek_v3_16b"], n_layers=1, n_dense_layers=1,
                               vocab_size=4096)
    torch.manual_seed(0)
    with torch.device(dev):
        model = MoETransformer(args)
        model.init_weights()
    model = model.to(torch.bfloat16)
    tokens = torch.randint(0, 4096, (1, 64) if ARGS.tiny else (2, 2048), device=dev)
    out = {"cudnn_runs": cudnn_attention_runs(dev, torch.bfloat16, 192, 128)}

    def set_core(core):
        for m in model.modules():
            if isinstance(m, MultiHeadLatentAttention):
                m.core = core

    def run(fn):
        model.zero_grad(set_to_none=True)
        logits = fn(tokens)
        logits.float().square().mean().backward()
        return logits.detach(), {n: p.grad.detach().clone() for n, p in model.named_parameters()}

    ours = run(model)
    set_core(causal_attention)
    sdpa = run(model)
    set_core(mla_attention)
    compiled = run(torch.compile(model, backend="aot_eager" if ARGS.tiny else "inductor"))

    def compare(a, b):
        return {"logits": _rel(a[0], b[0]),
                "worst_grad": max(_rel(a[1][n], b[1][n]) for n in a[1])}
    out["ours_vs_sdpa"] = compare(ours, sdpa)
    out["compiled_vs_eager"] = compare(compiled, ours)
    return out


def _pairs(rank, size, length):
    """(query, key) pairs rank ``rank`` of a ring of ``size`` attends (head-tail chunks)."""
    a, b = rank, 2 * size - 1 - rank
    return (a + b) * length * length + length * (length + 1)


@section("attention")
def attention():
    """One CP rank's attention per layer at Llama 3 8B's heads, bf16."""
    from simplefsdp.parallel.ring import GatheredKVAttention
    heads, dim = 32, 128
    length = 1024 if ARGS.tiny else 16384
    out = {"length": length}
    dev, dt = ARGS.device, torch.bfloat16
    with PowerLog() as power:
        for size in ((2,) if ARGS.tiny else (2, 4, 8)):
            s = 2 * size * length
            q = torch.randn(1, heads, 2 * length, dim, device=dev, dtype=dt, requires_grad=True)
            k = torch.randn(1, heads, s, dim, device=dev, dtype=dt, requires_grad=True)
            v = torch.randn(1, heads, s, dim, device=dev, dtype=dt, requires_grad=True)
            go = torch.randn_like(q)
            for rank in ((0,) if size < 8 else (0, size - 1)):
                def fwd():
                    with torch.no_grad():
                        GatheredKVAttention.apply(q, k, v, rank, size, None)

                def fwd_bwd():
                    GatheredKVAttention.apply(q, k, v, rank, size, None).backward(go)
                tf, tfb = timed(fwd), timed(fwd_bwd)
                flops = 4 * dim * heads * _pairs(rank, size, length)
                out[f"ring{size}_rank{rank}"] = {
                    "seq": s, "fwd_s": tf, "bwd_s": tfb - tf, "fwd_tflops": flops / tf / 1e12,
                    "bwd_tflops_2.5x": 2.5 * flops / (tfb - tf) / 1e12}
        # the raw kernel, square blocks
        from simplefsdp._torch_compat import attention_with_lse, attention_with_lse_backward
        for causal in (True, False):
            q, k, v = (torch.randn(1, heads, length, dim, device=dev, dtype=dt) for _ in "qkv")
            o, lse = attention_with_lse(q, k, v, causal)
            g = torch.randn_like(o)
            tf = timed(lambda: attention_with_lse(q, k, v, causal))
            tb = timed(lambda: attention_with_lse_backward(g, q, k, v, o, lse, causal))
            pairs = length * (length + 1) // 2 if causal else length * length
            flops = 4 * dim * heads * pairs
            out[f"kernel_{'causal' if causal else 'full'}_{length}"] = {
                "fwd_s": tf, "bwd_s": tb, "fwd_tflops": flops / tf / 1e12,
                "bwd_tflops_2.5x": 2.5 * flops / tb / 1e12}
    out["power"] = power.summary()
    return out


@section("experts")
def experts():
    from simplefsdp.models.moe import expert_ffn
    dim, hidden, local = 2048, 1408, 8
    # routed rows reaching one EP 8 rank when balanced: its 8 experts of 64 get 8 / 64 of
    # the 8 ranks' 4 x 4096 x top-6 slots (12,288 each; the first run used 12,288 in all)
    rows = 4 * 4096 * 6 // (1 if not ARGS.tiny else 64)
    dev, dt = ARGS.device, torch.bfloat16
    x = torch.randn(rows, dim, device=dev, dtype=dt, requires_grad=True)
    gate_up = (torch.randn(local, 2 * hidden, dim, device=dev, dtype=dt) * 0.02).requires_grad_()
    down = (torch.randn(local, dim, hidden, device=dev, dtype=dt) * 0.02).requires_grad_()
    grad = torch.randn(rows, dim, device=dev, dtype=dt)
    flops = 2 * rows * (dim * 2 * hidden + hidden * dim)
    out = {"rows": rows}
    for name, counts in [("balanced", [rows // local] * local),
                         ("skewed", [rows * w // 36 for w in (1, 2, 3, 4, 5, 6, 7, 8)])]:
        counts[-1] += rows - sum(counts)

        def fwd():
            with torch.no_grad():
                expert_ffn(x, counts, gate_up, down)

        def fwd_bwd():
            expert_ffn(x, counts, gate_up, down).backward(grad)
        tf, tfb = timed(fwd), timed(fwd_bwd)
        out[name] = {"fwd_s": tf, "fwd_bwd_s": tfb, "fwd_tflops": flops / tf / 1e12,
                     "fwd_bwd_tflops": 3 * flops / tfb / 1e12}
    w1 = torch.randn(2 * hidden, dim, device=dev, dtype=dt)
    t = timed(lambda: x.detach() @ w1.t())
    out["dense_same_rows"] = {"s": t, "tflops": 2 * rows * dim * 2 * hidden / t / 1e12}
    return out


@section("mla")
def mla():
    from torch.nn.attention import SDPBackend, sdpa_kernel
    b, h, s = (1, 16, 1024) if ARGS.tiny else (4, 16, 4096)
    dev, dt = ARGS.device, torch.bfloat16
    q = torch.randn(b, h, s, 192, device=dev, dtype=dt, requires_grad=True)
    k = torch.randn(b, h, s, 192, device=dev, dtype=dt, requires_grad=True)
    v = torch.randn(b, h, s, 128, device=dev, dtype=dt, requires_grad=True)
    go = torch.randn(b, h, s, 128, device=dev, dtype=dt)
    flops = 2 * b * h * s * (s + 1) // 2 * (192 + 128)
    out = {}
    backends = {"efficient": SDPBackend.EFFICIENT_ATTENTION, "flash": SDPBackend.FLASH_ATTENTION,
                "cudnn": SDPBackend.CUDNN_ATTENTION, "math": SDPBackend.MATH}
    for name, backend in backends.items():
        try:
            with sdpa_kernel([backend]):
                def fwd():
                    with torch.no_grad():
                        F.scaled_dot_product_attention(q, k, v, is_causal=True)

                def fwd_bwd():
                    F.scaled_dot_product_attention(q, k, v, is_causal=True).backward(go)
                tf, tfb = timed(fwd), timed(fwd_bwd)
            out[name] = {"fwd_s": tf, "bwd_s": tfb - tf, "fwd_tflops": flops / tf / 1e12,
                         "bwd_tflops_2.5x": 2.5 * flops / (tfb - tf) / 1e12}
        except Exception as e:
            out[name] = f"{type(e).__name__}: {str(e)[:300]}"
    if ARGS.device == "cuda" and not ARGS.tiny:
        try:
            from torch.nn.attention.flex_attention import create_block_mask, flex_attention
            mask = create_block_mask(lambda b_, h_, qi, ki: qi >= ki, None, None, s, s)
            flex = torch.compile(flex_attention)

            def ffwd():
                with torch.no_grad():
                    flex(q, k, v, block_mask=mask)

            def ffwd_bwd():
                flex(q, k, v, block_mask=mask).backward(go)
            start = time.time()
            ffwd_bwd()
            compile_s = time.time() - start
            tf, tfb = timed(ffwd), timed(ffwd_bwd)
            out["flex"] = {"fwd_s": tf, "bwd_s": tfb - tf, "fwd_tflops": flops / tf / 1e12,
                           "bwd_tflops_2.5x": 2.5 * flops / (tfb - tf) / 1e12,
                           "compile_s": compile_s}
        except Exception as e:
            out["flex"] = f"{type(e).__name__}: {str(e)[:300]}"
    out["flops_fwd"] = flops
    out["accuracy"] = _mla_accuracy(backends)
    return out


def _mla_accuracy(backends):
    """Each kernel's output and gradients against float32 math on the same bf16 inputs."""
    from torch.nn.attention import sdpa_kernel
    dev, dt = ARGS.device, torch.bfloat16
    g = torch.Generator(device="cpu").manual_seed(1)
    q, k, v, go = (torch.randn(1, 16, 1024, d, generator=g).to(dev, dt)
                   for d in (192, 192, 128, 128))
    leaves = [x.float().requires_grad_() for x in (q, k, v)]
    ref = F.scaled_dot_product_attention(*leaves, is_causal=True)
    ref.backward(go.float())
    out = {}
    for name in ("efficient", "cudnn"):
        try:
            xs = [x.detach().requires_grad_() for x in (q, k, v)]
            with sdpa_kernel([backends[name]]):
                o = F.scaled_dot_product_attention(*xs, is_causal=True)
            o.backward(go)
            grads = {f"d{n}": _rel(x.grad, r.grad)
                     for n, x, r in zip("qkv", xs, leaves, strict=True)}
            out[name] = {"out": _rel(o, ref), **grads}
        except Exception as e:
            out[name] = f"{type(e).__name__}: {str(e)[:300]}"
    return out


def _identity_all_to_all(dist):
    """Under the fake process group the exchanges leave their outputs unwritten, so the
    expert dispatch's exchanged counts would be garbage: here each rank receives what it
    sends (every one of its routed slots lands on its own local experts: an EP rank's
    balanced share of rows, so the grouped matmuls and permutations have their real
    sizes; the exchange itself costs nothing). The dispatch's functional collectives
    (``parallel.expert``'s, traced into compiled graphs) are replaced by a copy, and
    expert tensor parallelism's count gather (``parallel.expert_tensor``) by this rank's
    counts repeated: every TP peer routed as many rows per expert as this rank, so the
    exchanges around the width slices are identities of the right sizes too. Returns
    the function that puts the originals back."""
    from simplefsdp.parallel import expert, expert_tensor

    def identity(output, input, *args, **kwargs):
        if output.shape == input.shape:
            output.copy_(input)
        return None

    patches = [(dist, "all_to_all_single", identity),
               (expert, "all_to_all_single", lambda x, group: x.clone()),
               (expert, "all_to_all_single_autograd",
                lambda x, output_splits, input_splits, group, wait=False: x.clone()),
               (expert_tensor, "all_gather_autograd",
                lambda x, group: x.repeat(dist.get_world_size(group)))]
    originals = [(module, name, getattr(module, name)) for module, name, _ in patches]
    for module, name, fn in patches:
        setattr(module, name, fn)

    def restore():
        for module, name, fn in originals:
            setattr(module, name, fn)
    return restore


def _profile(step):
    """One step under torch.profiler: GPU time by aten op (self device time) and the GPU's
    busy time (kernels run on one stream, so their sum), against the step's wall time."""
    from torch.profiler import ProfilerActivity, profile
    sync()
    start = time.perf_counter()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        step()
        sync()
    wall = time.perf_counter() - start
    ops, kernels = [], []
    for evt in prof.key_averages():
        on_device = str(getattr(evt, "device_type", "")).endswith("CUDA")
        ms = (getattr(evt, "self_device_time_total", 0) if ARGS.device == "cuda"
              else evt.self_cpu_time_total) / 1e3
        if ms > 0:
            (kernels if on_device else ops).append((evt.key[:120], evt.count, round(ms, 3)))
    ops.sort(key=lambda r: -r[2])
    kernels.sort(key=lambda r: -r[2])
    return {"profiled_wall_ms": round(wall * 1e3, 1),
            "kernel_ms": round(sum(r[2] for r in kernels), 1),
            "ops_ms": ops[:70], "kernels_ms": kernels[:40]}


def _step(config, overrides, gpus, steps, profiled=False):
    """Rank 0's training step under a fake process group of ``gpus`` (eager)."""
    import dataclasses

    import torch.distributed as dist

    from simplefsdp._torch_compat import fake_store
    from simplefsdp.config.job import load_config
    from simplefsdp.optim import build_optimizer
    from simplefsdp.parallel.context import cp_batches
    from simplefsdp.parallel.tensor import loss_context, token_loss_sum
    cfg = load_config(config, overrides)
    dev = torch.device(ARGS.device, 0) if ARGS.device == "cuda" else torch.device("cpu")
    if ARGS.device == "cuda":
        torch.cuda.set_device(0)
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    torch._dynamo.reset()  # an earlier section's compiles count against the limits
    dist.init_process_group("fake", store=fake_store(), rank=0, world_size=gpus)
    restore_exchanges = _identity_all_to_all(dist)
    try:
        p = cfg.parallel.resolve(gpus)
        cfg = dataclasses.replace(cfg, parallel=p)
        dims = p.dims()
        mesh = dims.build_mesh(ARGS.device)
        start = time.time()
        runnable, model = cfg.model.family_entry().build(cfg, mesh, dims, dev)
        build_s = time.time() - start
        optimizer, _ = build_optimizer(model, cfg)
        t = cfg.training
        x = torch.randint(0, cfg.model.model_args().vocab_size, (t.batch_size, t.seq_len),
                          device=dev)
        (inputs, targets), = cp_batches([(x, x)], mesh, t.seq_len) if dims.cp > 1 \
            else [(x, x)]

        def step():
            with loss_context(p.vocab_sharded_loss):
                loss = token_loss_sum(runnable(inputs), targets) / targets.numel()
                loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)

        start = time.time()
        step()
        sync()
        first_s = time.time() - start
        if cfg.compile.enable:  # step 2 recompiles some frames (module hooks' guards)
            for _ in range(2):
                step()
        if ARGS.device == "cuda":
            torch.cuda.reset_peak_memory_stats()
        with PowerLog() as power:
            step_s = timed(step, reps=steps, warm=0)
        out = {"build_s": build_s, "first_step_s": first_s, "step_s": step_s,
               "tokens_per_rank": inputs.numel(), "tok_per_s": inputs.numel() / step_s,
               "power": power.summary()}
        if ARGS.device == "cuda":
            out["max_allocated_gib"] = torch.cuda.max_memory_allocated() / 2**30
            out["max_reserved_gib"] = torch.cuda.max_memory_reserved() / 2**30
        if profiled:
            out["profile"] = _profile(step)
        from simplefsdp.models import moe
        loads = [m.tokens_per_expert for m in moe.moe_layers(model)]
        if loads:  # slots per expert, all blocks and steps; under EP the local groups
            total = torch.stack(loads).sum(0)
            local = total.view(p.ep, -1).sum(0) if p.ep > 1 else total
            out["rows_per_local_expert_max_mean"] = float(local.max() / local.mean())
        return out
    finally:
        restore_exchanges()
        dist.destroy_process_group()


@section("step_deepseek")
def step_deepseek():
    if ARGS.tiny:
        return _step("configs/debug_moe.toml", ["--parallel.dp_shard", "-1"], 8, 1)
    return _step("configs/deepseek_v3_16b.toml",
                 ["--parallel.ep", "1", "--training.batch_size", "4"], 8, 2)


def _moe_case(ep, ac, compiled=False, layers=None, extra=()):
    depth = ["--model.n_layers", str(layers)] if layers else []
    flags = ["--parallel.ep", str(ep), "--activation_checkpoint.mode", ac,
             "--compile.enable", str(compiled).lower(), *depth, *extra]
    if ARGS.tiny:
        return _step("configs/debug_moe.toml", ["--parallel.dp_shard", "-1", *flags], 8, 1,
                     profiled=True)
    return _step("configs/deepseek_v3_16b.toml", ["--training.batch_size", "4", *flags], 8,
                 2, profiled=True)


def _moe_section(name, ep, ac, compiled=False, layers=None, extra=()):
    """A section running :func:`_moe_case`; ``layers = 6``: DeepSeek-V3 16B's widths at 6
    blocks (1 dense + 5 routed), compiled (Inductor) against eager, for the planner;
    ``extra``: more trainer flags (the padded dispatch)."""
    @section(name)
    def run():
        return _moe_case(ep, ac, compiled, layers, extra)
    run.__name__ = name
    return run


def _etp_section(etp):
    """Expert tensor parallelism (``parallel.etp``) against ETP 1 on the same layout: rank
    0's eager step of Qwen3-30B-A3B (its config: full AC, 1 x 4096 tokens; DeepSeek-V3
    16B's MLA has no TP) as FSDP 4 x TP 2 x EP 4 under the fake process group of 8. TP 2
    is expressible there: the mesh has a tp dim of 2, the dense TP collectives keep their
    sizes, and :func:`_identity_all_to_all` makes ETP's count gather and row exchanges
    identities of the sizes a balanced TP group gives (rank 0 computes twice its rows at
    half the width). Its step seconds and peak memory go with the planner's ETP terms
    (``plan.moe.etp_exchange_seconds``, whose exchanges cost nothing here)."""
    name = f"moe_etp{etp}"

    @section(name)
    def run():
        flags = ["--parallel.tp", "2", "--parallel.ep", "4", "--parallel.etp", str(etp)]
        if ARGS.tiny:
            return _step("configs/debug_moe.toml", ["--parallel.dp_shard", "-1", *flags], 8,
                         1, profiled=True)
        return _step("configs/qwen3_30b_a3b.toml", flags, 8, 2, profiled=True)
    run.__name__ = name
    return run


PADDED = ["--parallel.expert_dispatch", "padded"]
# moe_ep8_selective_compiled runs the compiled blocks' op-level selective AC
# (``activation_checkpoint.compile_checkpointed_blocks``); the padded sections run the same
# case with the static-shape dispatch (capacity factor 1.25), under both AC modes.
MOE = [_moe_section("moe_ep1_selective", 1, "selective"),
       *[_moe_section(f"moe_ep8_{ac}", 8, ac) for ac in ("selective", "full", "none")],
       *[_moe_section(f"moe_ep8_{ac}_compiled", 8, ac, compiled=True)
         for ac in ("selective", "full")],
       *[_moe_section(f"moe_ep8_{ac}_padded_compiled", 8, ac, compiled=True, extra=PADDED)
         for ac in ("selective", "full")],
       *[_moe_section(f"moe6_{ac}_{'compiled' if c else 'eager'}", 8, ac, c, layers=6)
         for ac in ("selective", "full") for c in (False, True)],
       *[_etp_section(etp) for etp in (1, 2)]]


@section("step_262k")
def step_262k():
    if ARGS.tiny:
        return _step("configs/debug.toml",
                     ["--parallel.cp_ring", "2", "--parallel.dp_shard", "1",
                      "--training.seq_len", "1024", "--model.max_seq_len", "1024",
                      "--activation_checkpoint.mode", "full"], 2, 1)
    return _step("configs/llama3_8b.toml",
                 ["--parallel.cp_ring", "8", "--parallel.dp_shard", "1",
                  "--training.seq_len", "262144", "--model.max_seq_len", "262144",
                  "--training.batch_size", "1", "--activation_checkpoint.mode", "full",
                  "--compile.enable", "false"], 8, 1)


def _matmul_rates(m, k, n):
    """TFLOP/s of ``(m x k) @ (k x n)`` in bf16 and as a tensorwise float8 matmul."""
    dev = ARGS.device
    a, b = torch.randn(m, k, device=dev), torch.randn(n, k, device=dev)
    a16, b16 = a.bfloat16(), b.bfloat16().t()
    a8, b8 = a.to(torch.float8_e4m3fn), b.to(torch.float8_e4m3fn).t()
    one = torch.ones((), device=dev)
    flops = 2 * m * k * n
    bf16_s = timed(lambda: a16 @ b16, reps=10)
    fp8_s = timed(lambda: torch._scaled_mm(a8, b8, scale_a=one, scale_b=one,
                                           out_dtype=torch.bfloat16), reps=10)
    return {"shape": [m, k, n], "bf16_tflops": flops / bf16_s / 1e12,
            "float8_tflops": flops / fp8_s / 1e12}


@section("float8")
def float8():
    from simplefsdp.float8 import check_scaled_mm

    why = check_scaled_mm(ARGS.device)
    if why is not None:
        return {"skipped": why}
    out = {"matmul": _matmul_rates(*((256, 256, 256) if ARGS.tiny else (16384, 4096, 14336)))}
    config, gpus, flags = ("configs/debug.toml", 2, []) if ARGS.tiny else \
        ("configs/llama3_8b.toml", 8, ["--training.batch_size", "1"])
    common = [*flags, "--training.mixed_precision_param", "bfloat16",
              "--compile.enable", "false"]
    for name, on in (("bf16", "false"), ("float8", "true")):
        out[name] = _step(config, [*common, "--float8.enable", on], gpus, 2)
    return out


@section("float8_compiled")
def float8_compiled():
    """Rank 0's compiled step (Inductor, one bucket per block) in bf16 and with
    ``[float8]``, Llama 3 8B's widths at 4 blocks (a whole 32-block compile would take the
    section's budget), fake process group of 8: where Inductor fuses the casts."""
    from simplefsdp.float8 import check_scaled_mm

    why = check_scaled_mm(ARGS.device)
    if why is not None:
        return {"skipped": why}
    config, gpus, shape, backend = ("configs/debug.toml", 2, [], "aot_eager") if ARGS.tiny \
        else ("configs/llama3_8b.toml", 8, ["--model.n_layers", "4"], "inductor")
    common = [*shape, "--training.batch_size", "1", "--training.mixed_precision_param",
              "bfloat16", "--compile.enable", "true", "--compile.backend", backend,
              "--compile.bucketing", "manual"]
    return {name: _step(config, [*common, "--float8.enable", on], gpus, 3)
            for name, on in (("bf16", "false"), ("float8", "true"))}


def _offload_step(policy, blocks, width, steps):
    """(median step seconds, peak device bytes, copies, bytes copied) of one run;
    ``policy``: a ``CPUOffloadPolicy`` or None (everything on the device)."""
    import gc

    import simplefsdp as sf
    from simplefsdp import offload

    gc.collect()  # the previous run's model and optimizer (reference cycles through hooks)
    if ARGS.device == "cuda":
        torch.cuda.empty_cache()
    held_before = torch.cuda.memory_allocated() if ARGS.device == "cuda" else None
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Sequential(
        torch.nn.Linear(width, 4 * width), torch.nn.GELU(), torch.nn.Linear(4 * width, width))
        for _ in range(blocks)]).to(ARGS.device)
    model = sf.data_parallel(model, sf.make_mesh(dp_shard=1, device_type=ARGS.device),
                             offload_policy=policy)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    x = torch.randn(8, 512, width, device=ARGS.device)

    def step():
        model(x).float().pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
    if ARGS.device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    seconds = timed(step, reps=steps)
    peak = torch.cuda.max_memory_allocated() if ARGS.device == "cuda" else None
    host = offload.offloads(model)
    copies = (dict(host[0].copies), dict(host[0].bytes)) if host else None
    if host:
        host[0].reset_counts()
        step()
        copies = (dict(host[0].copies), dict(host[0].bytes))
    return {"step_s": seconds, "peak_device_bytes": peak, "allocated_before": held_before,
            "copies_one_step": copies,
            "pinned": host[0].pin_memory if host else None,
            "params": sum(p.numel() for p in model.parameters())}


@section("cpu_offload")
def cpu_offload():
    import torch.distributed as dist

    from simplefsdp import offload
    from simplefsdp.hardware import GPU_PROFILES

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29533")
    backend = "nccl" if ARGS.device == "cuda" else "gloo"
    if not dist.is_initialized():
        dist.init_process_group(backend, rank=0, world_size=1)
    blocks, width, steps = (2, 64, 2) if ARGS.tiny else (6, 4096, 3)
    out = {"blocks": blocks, "width": width}
    runs = (("device", None), ("offload", offload.CPUOffloadPolicy(pin_memory=True)),
            ("offload_unpinned", offload.CPUOffloadPolicy(pin_memory=False)))
    with offload.cpu_stands_in_for_device() if ARGS.device == "cpu" else nullcontext():
        for name, policy in runs:
            out[name] = _offload_step(policy, blocks, width, steps)
            if ARGS.device == "cuda":  # the next run's peak is its own
                torch.cuda.empty_cache()
    gpu = torch.cuda.get_device_name().lower() if ARGS.device == "cuda" else "h200"
    name = next((n for n in GPU_PROFILES if n.split("-")[0] in gpu), "h200")
    out["planner_profile"] = name
    out["planner_pcie_Bps"] = GPU_PROFILES[name].pcie_Bps
    out["planner_host_optimizer_Bps"] = GPU_PROFILES[name].host_optimizer_Bps
    return out


REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
START = time.time()


def _budget(own):
    """A subprocess section's seconds: its own budget, cut to what ``--deadline-s``
    leaves of the whole run (less a margin for writing the results)."""
    left = ARGS.deadline_s - (time.time() - START) - 10
    if left < 30:
        raise TimeoutError(f"skipped: {left + 10:.0f} s left of --deadline-s {ARGS.deadline_s}")
    return min(own, left)


def _run(cmd, timeout_s, extra_env=None, tail=4000):
    """Run ``cmd`` from the repository root in a session of its own (a timeout kills the
    whole group: torchrun's or pytest-xdist's workers too); stdout and stderr together.
    Returns ``{"rc", "wall_s", "timed_out", "tail"}`` (rc None after a timeout)."""
    import signal

    # cpu_offload's rendezvous variables stay in this process: a child must not take
    # them for torchrun's (its store's port is taken)
    rendezvous = ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK")
    env = {k: v for k, v in os.environ.items() if k not in rendezvous}
    env.update(PYTHONPATH=REPO, PYTHONUNBUFFERED="1", **(extra_env or {}))
    start = time.time()
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        text, timed_out = proc.communicate(timeout=timeout_s)[0], False
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        text, timed_out = proc.communicate()[0], True
    return {"rc": None if timed_out else proc.returncode, "wall_s": round(time.time() - start, 1),
            "timed_out": timed_out, "tail": text[-tail:], "text": text}


def _trace_facts(path):
    """What a Chrome trace holds: events by category, CUDA kernels among them."""
    import collections
    import gzip

    with gzip.open(path, "rt") as f:
        trace = json.load(f)
    events = trace.get("traceEvents", [])
    cats = collections.Counter(str(e.get("cat")) for e in events)
    kernels = [e for e in events if e.get("cat") == "kernel"]
    return {"file_bytes": os.path.getsize(path), "events": len(events),
            "by_category": dict(cats.most_common(12)), "cuda_kernel_events": len(kernels),
            "nccl_or_gloo_events": sum(1 for e in events
                                       if str(e.get("name", "")).startswith(("nccl", "gloo")))}


def _snapshot_facts(path):
    """What the allocator's memory snapshot holds (pytorch.org/memory_viz reads it)."""
    import pickle

    with open(path, "rb") as f:
        snap = pickle.load(f)
    traces = snap.get("device_traces", [])
    return {"file_bytes": os.path.getsize(path), "keys": sorted(snap),
            "segments": len(snap.get("segments", [])),
            "device_trace_entries": sum(len(t) for t in traces),
            "has_segments_and_device_traces": "segments" in snap and "device_traces" in snap}


def _validation_rows(metrics_csv):
    """The metrics rows carrying a validation loss: (step, val_loss, finite)."""
    import csv
    import math

    with open(metrics_csv) as f:
        rows = [r for r in csv.DictReader(f) if r.get("val_loss")]
    return [(int(r["step"]), float(r["val_loss"]), math.isfinite(float(r["val_loss"])))
            for r in rows]


@section("train_tools")
def train_tools():
    """The trainer's validation and profiling on the device: a short debug run (one
    process), then its files: validation rows in metrics.csv, the Chrome trace (CUDA
    kernels), and on CUDA the allocator's memory snapshot."""
    import shutil
    import tempfile

    work = tempfile.mkdtemp(prefix="dc_train_")
    cuda = ARGS.device == "cuda"
    cmd = [sys.executable, "-m", "simplefsdp.train", "--config", "configs/debug.toml",
           "--training.steps", "8", "--validation.enable", "true", "--validation.every", "4",
           "--validation.steps", "2", "--profiling.enable", "true",
           "--profiling.start_step", "3", "--profiling.steps", "1",
           "--profiling.memory_snapshot", str(cuda).lower(), "--job.device", ARGS.device,
           "--metrics.log_every", "1", "--metrics.output_dir", work]
    run = _run(cmd, _budget(ARGS.budget_train))
    out = {"command": " ".join(cmd[1:]), "rc": run["rc"], "wall_s": run["wall_s"],
           "timed_out": run["timed_out"], "tail": run["tail"][-2500:]}
    metrics = os.path.join(work, "metrics.csv")
    if os.path.exists(metrics):
        shutil.copy(metrics, os.path.join(ARGS.out, "train_metrics.csv"))
        out["validation_rows"] = _validation_rows(metrics)
    folder = os.path.join(work, "profile", "step-3")
    trace, snapshot = (os.path.join(folder, n) for n in ("rank0.json.gz", "rank0_memory.pickle"))
    out["trace"] = _trace_facts(trace) if os.path.exists(trace) else "missing"
    if not cuda:
        out["memory_snapshot"] = "skipped: CUDA only (the trainer refuses it on CPU)"
    else:
        out["memory_snapshot"] = _snapshot_facts(snapshot) if os.path.exists(snapshot) \
            else "missing"
    vals = out.get("validation_rows") or []
    out["ok"] = {"exit_0": run["rc"] == 0, "val_rows_finite": bool(vals) and all(
        v[2] for v in vals), "trace_opens": isinstance(out["trace"], dict),
        "cuda_kernels": (out["trace"].get("cuda_kernel_events", 0) > 0
                         if isinstance(out["trace"], dict) else False) if cuda else None,
        "snapshot_opens": isinstance(out["memory_snapshot"], dict) if cuda else None}
    shutil.rmtree(work, ignore_errors=True)
    return out


OVERLAP_CORE = ["compute-only-compiled", "simplefsdp-auto", "upstream-overlap-scheduler"]
OVERLAP_MORE = ["upstream-fx-bucketing", "simplefsdp-reordering"]
BENCH_FIELDS = ("status", "error", "median_step_s", "first_step_s", "compile_s",
                "estimated_exposed_comm_s", "exposed_graphs_s", "exposed_comm_s",
                "estimate_ratio", "plan", "peak_mem_mib", "collectives_per_step",
                "compiles_in_measured_steps", "final_loss")


def _bench_once(variants, timeout_s):
    """One ``simplefsdp.bench`` run of ``variants`` under the fake process group of 8
    (Llama 3 8B's widths at 4 blocks, bf16, 1 x 8192 tokens per rank; ``--tiny``: the
    debug bench model on the CPU, aot_eager): its rows, or the console's tail."""
    import glob
    import shutil
    import tempfile

    work = tempfile.mkdtemp(prefix="dc_bench_")
    if ARGS.tiny:
        shape = ["--config", "configs/bench_debug.toml", "--model.n_layers", "2",
                 "--compile.backend", "aot_eager", "--job.device", "cpu"]
    else:
        shape = ["--model.name", "llama3_8b", "--model.n_layers", "4",
                 "--training.batch_size", "1", "--training.seq_len", "8192",
                 "--training.mixed_precision_param", "bfloat16", "--job.device", "cuda",
                 "--bench.compile_cache", "true"]
    cmd = [sys.executable, "-m", "simplefsdp.bench", *shape, "--bench.world_size", "8",
           "--bench.fake_pg", "true", "--bench.warmup", "3", "--bench.steps", "2",
           "--bench.variants", ",".join(variants), "--bench.output_dir", work]
    run = _run(cmd, timeout_s)
    out = {"command": " ".join(cmd[1:]), "rc": run["rc"], "wall_s": run["wall_s"],
           "timed_out": run["timed_out"],
           "unavailable": [line for line in run["text"].splitlines()
                           if "unavailable" in line][:8]}
    found = sorted(glob.glob(os.path.join(work, "*", "results.json")))
    if found:
        with open(found[-1]) as f:
            doc = json.load(f)
        out["rows"] = {r["name"]: {k: r.get(k) for k in BENCH_FIELDS}
                       for r in doc["variants"]}
        out["meta"] = {k: doc["meta"].get(k) for k in ("n_params", "world_size", "fake_pg",
                                                      "tokens_per_step", "compile_backend")}
    else:
        out["tail"] = run["tail"][-3000:]
    shutil.rmtree(work, ignore_errors=True)
    return out


@section("overlap_8b")
def overlap_8b():
    """Inductor's overlap scheduler (``upstream-overlap-scheduler``) beside our auto
    wrapping (``simplefsdp-auto``) and the compiled compute-only limit, on a compiled
    Llama 3 8B-shaped step under a fake process group of 8 (compile time, memory, the
    estimated exposed communication and collective counts are real; the collectives
    return at once, so step times are compute only); then torch's FX bucketing and our
    manual reordering in a second run, if the section's time budget leaves room."""
    start, budget = time.time(), _budget(ARGS.budget_overlap)
    out = {"core": _bench_once(OVERLAP_CORE, budget * 0.75)}
    left = budget - (time.time() - start)
    more = OVERLAP_MORE[1:] if ARGS.tiny else OVERLAP_MORE  # no CPU Inductor build here
    if left > 45:
        out["more"] = _bench_once(more, left)
    else:
        out["more"] = f"skipped: {left:.0f} s of the section's budget left"
    return out


def _pytest_summary(text):
    """pytest's closing counts line and its short-summary lines (failures, errors and
    skips with their reasons)."""
    import re

    lines = text.splitlines()
    counts = [ln for ln in lines if re.search(r"\d+ (passed|failed|error|skipped)", ln)
              and " in " in ln]
    short = [ln[:300] for ln in lines if ln.startswith(("FAILED", "ERROR", "SKIPPED"))]
    return {"summary": counts[-1].strip("= ") if counts else None, "short": short[:60]}


@section("pytest_cuda")
def pytest_cuda():
    """The suite's quick tier plus every test of tests/test_reliability.py on this
    machine's torch (CI=true, as CI runs it): ``-k "quick or test_reliability"`` selects
    both (a test's markers are keywords, the module's name too). ``--tiny``: one cheap
    test of tests/test_reliability.py, on one pytest process."""
    select = ["tests/test_reliability.py", "-k", "non_finite_floats"] if ARGS.tiny else \
        ["tests", "-k", "quick or test_reliability", "-n", "8", "--dist", "loadfile"]
    cmd = [sys.executable, "-m", "pytest", *select, "-q", "-p", "no:cacheprovider",
           "-rfEs", "--durations=15"]
    run = _run(cmd, _budget(ARGS.budget_pytest), {"CI": "true", "OMP_NUM_THREADS": "1"})
    return {"command": " ".join(cmd[1:]), "rc": run["rc"], "wall_s": run["wall_s"],
            "timed_out": run["timed_out"], **_pytest_summary(run["text"]),
            "tail": run["tail"]}


def _in_child(name, budget_s):
    """Section ``name`` run by a child ``device_check.py --only name`` with a timeout (an
    in-process section has none: a hang or a slow first run would take the rest of the
    run with it); its result, with the child's exit status and, without a result, the
    tail of its console."""
    import shutil
    import tempfile

    @section(name)
    def run():
        work = tempfile.mkdtemp(prefix=f"dc_{name}_")
        cmd = [sys.executable, os.path.abspath(__file__), "--out", work, "--only", name,
               "--device", ARGS.device, *(["--tiny"] if ARGS.tiny else [])]
        child = _run(cmd, _budget(budget_s))
        if child["rc"] != 0:  # its console, for the log (its result is printed below)
            print(child["tail"][-1500:], flush=True)
        found = os.path.join(work, "results.json")
        if os.path.exists(found):
            with open(found) as f:
                got = json.load(f).get(name)
        else:
            got = None
        shutil.rmtree(work, ignore_errors=True)
        out = got if isinstance(got, dict) else {
            "error": "no result: the child timed out or crashed", "tail": child["tail"]}
        out["child"] = {k: child[k] for k in ("rc", "wall_s", "timed_out")}
        return out
    run.__name__ = name
    return run


def main():
    global ARGS
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--tiny", action="store_true")
    parser.add_argument("--only", default="",
                        help="comma-separated sections, run in this order (default: all)")
    parser.add_argument("--budget-train", type=float, default=120,
                        help="train_tools: seconds before its run is killed")
    parser.add_argument("--budget-overlap", type=float, default=240,
                        help="overlap_8b: seconds for its bench runs together")
    parser.add_argument("--budget-pytest", type=float, default=200,
                        help="pytest_cuda: seconds before pytest is killed")
    parser.add_argument("--budget-float8", type=float, default=0,
                        help="float8 (and float8_compiled) in a child process killed "
                             "after this many seconds "
                             "(0: in this process, unbounded)")
    parser.add_argument("--budget-offload", type=float, default=0,
                        help="cpu_offload likewise")
    parser.add_argument("--deadline-s", type=float, default=float("inf"),
                        help="the whole run's seconds: subprocess sections fit inside")
    ARGS = parser.parse_args()
    os.makedirs(ARGS.out, exist_ok=True)
    sections = [env, ring_single, ring_threads, mla_model, attention, experts, mla,
                step_deepseek, step_262k, *MOE, float8, float8_compiled, cpu_offload, train_tools,
                overlap_8b, pytest_cuda]
    by_name = {fn.__name__: fn for fn in sections}
    for name, budget in (("float8", ARGS.budget_float8), ("float8_compiled", ARGS.budget_float8),
                         ("cpu_offload", ARGS.budget_offload)):
        if budget > 0:
            by_name[name] = _in_child(name, budget)
    chosen = [n for n in ARGS.only.split(",") if n] or list(by_name)
    unknown = [n for n in chosen if n not in by_name]
    if unknown:
        parser.error(f"--only: unknown section(s) {unknown}; choose from {list(by_name)}")
    for name in chosen:
        by_name[name]()


if __name__ == "__main__":
    main()
