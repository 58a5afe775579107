"""The planner's search and its exact shortcuts: shard rescaling with bf16 compute (the
casts of the shards saved for backward), and the trace counts of a search.

Each trace costs a few seconds of Dynamo + AOTAutograd, so every check runs in one
spawned worker (its own fake process group) and traces as little as it can.
"""

from __future__ import annotations

import multiprocessing

from simplefsdp.train.config import load_config

# The anomaly's own layout: 405B, tp 8 (sequence parallel), bf16 compute, selective AC,
# batch 2 (fake tensors: tracing costs the same at any width).
LLAMA_405B = ("configs/llama3_405b.toml", [
    "--parallel.tp", "8", "--parallel.dp_replicate", "1", "--parallel.dp_mode",
    "fully_shard", "--activation_checkpoint.mode", "selective", "--compile.bucketing",
    "manual", "--training.batch_size", "2"])


def _in_worker(fn, *args):
    with multiprocessing.get_context("spawn").Pool(1) as pool:  # own fake process group
        return pool.apply(fn, args)


def _rescaled_vs_traced(path, overrides):
    from simplefsdp.plan.memory import graph_memory
    from simplefsdp.plan.trace import trace, trace_key

    cfg = load_config(path, overrides)
    two = trace(trace_key(cfg, "full", 1, 2, 1, 2))
    four = trace(trace_key(cfg, "full", 1, 2, 1, 4))
    return vars(graph_memory(two, 4)), vars(graph_memory(four, 4))


def test_bf16_saved_shard_casts_are_rescaled():
    """With bf16 compute, selective AC saves the bf16 casts of the parameter shards for
    backward. They are shard-sized in the backward graph too, and tp 8's sequence-parallel
    reduce-scatters are not: traced at dp_shard 2 and rescaled to 4, every figure equals
    a trace at 4 (exact: the sizes divide evenly).
    Before the fix the backward counted them at the traced size: the 405B search on
    1024 GPUs (tp 8, dp_shard 128) predicted 121.8 GiB for batch 2 against 41.3 GiB for
    batch 1; with it, 72.3 vs 39.3 GiB (activations 66.0 vs 33.0: twice)."""
    rescaled, traced = _in_worker(_rescaled_vs_traced, *LLAMA_405B)
    assert rescaled == traced
