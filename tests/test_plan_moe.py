"""The planner's mixture-of-experts terms (issue 28): activated FLOPs, expert memory, the
expert-parallel all-to-alls, each against an independent count (by hand, or the real
model's own parameters)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from simplefsdp.hardware import gpu_profile
from simplefsdp.mesh import ParallelDims
from simplefsdp.models.llama import ffn_hidden_dim, flops_per_token, num_params
from simplefsdp.models.moe import MOE_PRESETS, MoETransformer
from simplefsdp.plan import memory, moe, timing


def test_activated_flops_per_token_by_hand():
    """debug_moe (dim 128, 4 blocks, 4 heads of 32, 2 KV heads, vocabulary 256, 8
    experts of width 128, top-2, no shared expert), by hand: per block attention
    128 x 32 x (2 x 4 + 2 x 2) = 49,152, router 8 x 128 = 1,024, two experts
    2 x 3 x 128 x 128 = 98,304, norms 256: 148,736; 4 blocks + final norm 128 + output
    128 x 256 = 32,768: N = 627,840 activated parameters (of 1.84M). Attention: 3 x 4
    blocks x 4 heads x 4 x 32 x seq = 6,144 x seq."""
    args, seq = MOE_PRESETS["debug_moe"], 64
    assert flops_per_token(args, seq) == 6 * 627_840 + 6_144 * seq


@pytest.mark.parametrize("name", ["debug_moe", "deepseek_v3_16b", "qwen3_30b_a3b"])
def test_rank_params_count_the_real_models_parameters(name):
    """The planner's parameter count of the whole model on one rank equals the parameters
    of the model itself, built on meta: every expert, the router, the shared expert and
    DeepSeek's dense first block."""
    args = MOE_PRESETS[name]
    with torch.device("meta"):
        model = MoETransformer(args)
    one = ParallelDims(dp_shard=1)
    assert memory.rank_params(args, "full", list(range(args.n_layers)), one, "fully_shard") \
        == num_params(model)


def test_rank_params_split_experts_over_the_experts_mesh_under_tp():
    """debug_moe on 4 GPUs as tp 2 x dp_shard 2 with ep 2 (the trainer's layout since
    c5772e1: experts split by ep, sharded over dp_shard x tp / ep), by hand. Per block:
    attention 128 x 32 x (2 x 4 + 2 x 2) = 49,152 split by TP (24,576), router 8 x 128 =
    1,024 and norms 256 whole per TP rank; embedding and output 256 x 128 = 32,768 each,
    final norm 128: 4 x 25,856 + 65,664 = 169,088 per TP rank, sharded over dp_shard 2:
    84,544. Experts 4 blocks x 8 x 3 x 128 x 128 = 1,572,864: 4 experts per EP rank, each
    shared by 4 / 2 = 2 ranks: / 4 = 393,216. Total 477,760 per rank (before, the experts
    were whole on each TP rank: 786,432 of them). ``replicate`` as dp_replicate 2 x tp 2
    with ep 2: the non-expert 169,088 whole, the experts split by ep only (786,432):
    955,520; hybrid_shard on the same degrees the same (the experts' dp_shard is
    1 x 2 / 2 = 1). hybrid_shard 2 x 2 without TP, ep 2: non-expert 4 x 50,432 + 65,664 =
    267,392 / 2 = 133,696, experts split by ep alone (dp_shard 2 / ep 2 = 1): 786,432;
    920,128. ``replicate`` 2 x tp 2 without EP: the TP ranks replicate the experts too
    (they are the experts' replicas there), every expert on every rank: 169,088 +
    1,572,864 = 1,741,952."""
    args, layers = MOE_PRESETS["debug_moe"], list(range(4))
    # the router's count, said directly (the one owner: no routed - expert difference)
    assert [args.router_params(i) for i in layers] == [8 * 128] * 4
    assert MOE_PRESETS["deepseek_v3_16b"].router_params(0) == 0  # its dense first block
    tp = ParallelDims(dp_shard=2, tp=2, ep=2)
    assert memory.rank_params(args, "full", layers, tp, "fully_shard") == 477_760
    rep = ParallelDims(dp_replicate=2, dp_shard=1, tp=2, ep=2)
    assert memory.rank_params(args, "full", layers, rep, "replicate") == 955_520
    assert memory.rank_params(args, "full", layers, rep, "hybrid_shard") == 955_520
    rep1 = ParallelDims(dp_replicate=2, dp_shard=1, tp=2)
    assert memory.rank_params(args, "full", layers, rep1, "replicate") == 1_741_952
    hsdp = ParallelDims(dp_replicate=2, dp_shard=2, ep=2)
    assert memory.rank_params(args, "full", layers, hsdp, "hybrid_shard") == 920_128


def test_dense_stand_in_has_the_activated_width():
    """The traced stand-in's SwiGLU is exactly top_k x width + shared: 6 x 1408 + 2816 =
    11,264 for deepseek_v3_16b, 8 x 768 = 6,144 for qwen3_30b_a3b; its FLOPs are the
    routed model's minus the routers' (6 x experts x dim per routed block: the only
    matmul the stand-in lacks)."""
    for name, width in [("deepseek_v3_16b", 11_264), ("qwen3_30b_a3b", 6_144)]:
        args = MOE_PRESETS[name]
        dense = moe.stand_in(args)
        assert ffn_hidden_dim(dense) == width
    args = dataclasses.replace(MOE_PRESETS["debug_moe"])
    routers = 6 * args.num_experts * args.dim * args.n_layers
    assert flops_per_token(moe.stand_in(args), 64) == flops_per_token(args, 64) - routers


def test_all_to_all_seconds_by_hand():
    """DeepSeek-V3 16B's exchange on 8 H100 (FSDP 8, EP 8, one node): 16,384 tokens x
    top-6 x dim 2048 x 2 B = 402,653,184 B per all-to-all, over NVLink 4
    (hardware.KNOWN_FABRICS: 15 us + 7 steps x 1 us + 7/8 of the bytes at 360 GB/s =
    1.0006 ms), 4 per routed block (dispatch and combine, forward and backward; the same
    under selective AC, whose policy keeps the exchanges' outputs; 6 under full AC, which
    exchanges again in its recomputation), 26 routed blocks; across two
    nodes (ep 16 on 8 GPUs per node) the InfiniBand figures (50 us + 15 x 4 us + 15/16
    at 40 GB/s). Each forward run also exchanges the counts (64 x 8 B)."""
    args = MOE_PRESETS["deepseek_v3_16b"]
    layers = list(range(args.n_layers))
    nbytes = 16_384 * 6 * 2048 * 2
    one = 15e-6 + 7e-6 + 7 / 8 * nbytes / 360e9
    cross = 50e-6 + 15 * 4e-6 + 15 / 16 * nbytes / 40e9
    dev = gpu_profile("h100-96gb")

    def links(ep, shard, gpn):
        return timing.MeshLinks(dev, ParallelDims(dp_shard=shard, ep=ep), gpn)

    # the exact dispatch first exchanges the 64 experts' int64 counts (512 B) in each
    # forward run (twice under AC: a recomputation exchanges them again)
    counts = 15e-6 + 7e-6 + 7 / 8 * 512 / 360e9
    for ac, n, c in [("none", 4, 1), ("selective", 4, 2), ("full", 6, 2)]:
        got = moe.exchange_seconds(args, layers, 16_384, 2, ac, links(8, 8, 8))
        assert got == pytest.approx(26 * (n * one + c * counts), rel=1e-12)
    counts_cross = 50e-6 + 15 * 4e-6 + 15 / 16 * 512 / 40e9
    assert moe.exchange_seconds(args, layers, 16_384, 2, "none", links(16, 16, 8)) \
        == pytest.approx(26 * (4 * cross + counts_cross), rel=1e-12)
    assert moe.exchange_seconds(args, layers, 16_384, 2, "none", links(1, 8, 8)) == 0


def _tp_ep_links(ep: int) -> timing.MeshLinks:
    """4 H100 SXM, 2 per node, as tp 2 x dp_shard 2 with ``ep``."""
    return timing.MeshLinks(gpu_profile("h100-sxm"), ParallelDims(dp_shard=2, tp=2, ep=ep), 2)


def test_ep_under_tp_routes_each_rank_s_tokens_on_tp_s_links():
    """debug_moe as tp 2 x dp_shard 2 with ep 2 on 2 nodes of 2 GPUs (batch 2 x seq 64,
    float32 activations), by hand: the EP groups are the TP pairs (the experts' mesh puts
    ep innermost), so they ride NVLink while the dp_shard group spans both nodes (ranks
    0 and 2); ep 4 spans the nodes too. Each TP rank routes its own 128 / 2 = 64 tokens:
    64 x top-2 x dim 128 x 4 B = 65,536 B per all-to-all, 15 us + 1 step x 1 us + 1/2 of
    the bytes at 360 GB/s each, 4 per routed block without AC, 4 blocks (and once a block
    the 8 experts' counts, 64 B, before the tokens); saved for
    backward without AC 4 blocks x 2 x 65,536 = 524,288 B (the gathered tokens and the
    expert outputs), the same under selective (the two exchanges' outputs), none without
    EP under selective (it recomputes the routed experts) nor under full AC."""
    args, layers = MOE_PRESETS["debug_moe"], list(range(4))
    links = _tp_ep_links(2)
    assert (links.size("ep"), links.link("ep"), links.link("dp_shard")) == (2, "nvlink", "ib")
    assert _tp_ep_links(4).link("ep") == "ib"
    tokens = moe.routed_tokens(memory.rank_tokens(2, 64, links.dims), links.dims)
    assert tokens == 64
    one = 15e-6 + 1e-6 + 65_536 / 2 / 360e9
    counts = 15e-6 + 1e-6 + 8 * 8 / 2 / 360e9  # the 8 experts' int64 counts, once a block
    assert moe.exchange_seconds(args, layers, tokens, 4, "none", links) \
        == pytest.approx(16 * one + 4 * counts, rel=1e-12)
    assert moe.saved_bytes(args, layers, tokens, 4, "none", 2) == 524_288
    assert moe.saved_bytes(args, layers, tokens, 4, "selective", 2) == 524_288
    assert moe.saved_bytes(args, layers, tokens, 4, "selective", 1) == 0
    assert moe.saved_bytes(args, layers, tokens, 4, "full", 2) == 0


# debug_moe as tp 2, batch 2 x seq 64, no AC, eager (the cheaper to plan), on H100 SXM
# of 2 a node: 4 GPUs with ep 2 (fully_shard, dp_shard 2), without and with etp 2, and
# DDP x TP 2 with etp 2 on 2 GPUs.
TP2_MOE = ["--parallel.tp", "2", "--training.batch_size", "2", "--training.seq_len", "64",
           "--activation_checkpoint.mode", "none"]


def _tp2_moe_predictions() -> dict:
    """``TP2_MOE``'s three predictions in one planner call: the two 4-GPU layouts share
    their traces and eager replays (the planner traces the dense stand-in, which holds no
    expert layout: ep and etp are not in a trace's key)."""
    from simplefsdp.config.job import load_config
    from simplefsdp.plan import predict

    def cfg(*extra):
        return load_config("configs/debug_moe.toml", [*TP2_MOE, *extra])
    return {"ep": predict(cfg("--parallel.ep", "2"), 4, "h100-sxm", 2),
            "etp": predict(cfg("--parallel.ep", "2", "--parallel.etp", "2"), 4,
                           "h100-sxm", 2),
            "ddp_etp": predict(cfg("--parallel.etp", "2", "--parallel.dp_mode", "replicate"),
                               2, "h100-sxm", 2)}


@pytest.fixture(scope="module")
def tp2_moe(planner) -> dict:
    return planner(_tp2_moe_predictions)


def test_prediction_holds_the_tp_ep_layout(tp2_moe):
    """The whole prediction (eager, the cheaper to plan) of the layout above carries
    those figures: model states 16 B x 477,760 parameters per rank
    (test_rank_params_split_experts_over_the_experts_mesh_under_tp) and the all-to-alls
    16 x 16.091 us (+ 4 counts exchanges of 16.0 us) and the routed copies kept for
    backward, 4 x 2 x 65,536 B
    (test_ep_under_tp_routes_each_rank_s_tokens_on_tp_s_links: without AC as with
    selective AC)."""
    from simplefsdp.hardware import GiB

    row = tp2_moe["ep"].detail["full"]
    assert row["states_gib"] * GiB == pytest.approx(16 * 477_760, rel=1e-12)
    assert row["all_to_all_s"] == pytest.approx(16 * (16e-6 + 65_536 / 2 / 360e9)
                                                + 4 * (16e-6 + 64 / 2 / 360e9), rel=1e-12)
    assert row["routed_saved_gib"] * GiB == 524_288


# test_etp's TINY debug_moe (2 blocks, 4 experts of width 32, dim 32): 2 x (4 x 64 x 32 +
# 4 x 32 x 32) = 24,576 routed-expert parameters (test_etp.EXPERT_ELEMENTS).
TINY_EXPERTS = 24_576


def _tiny_moe_args():
    from simplefsdp.config.job import load_config

    return load_config(None, [
        "--model.name", "debug_moe", "--model.dim", "32", "--model.n_layers", "2",
        "--model.n_heads", "4", "--model.n_kv_heads", "2", "--model.num_experts", "4",
        "--model.moe_hidden_dim", "32", "--model.shared_hidden_dim", "32"]).model.model_args()


def test_etp_expert_states_and_gathers_by_hand():
    """Expert tensor parallelism's placements (``parallel/expert_tensor.py``) on test_etp's
    TINY model, whose trainer runs count the same figures (float32, 4 B an element): FSDP
    2 x TP 2 x EP 2 stores 24,576 / 4 = 6,144 expert parameters a rank with ETP 1 (/ ep 2,
    sharded over dp_shard x tp / ep = 2) and with ETP 2 (/ etp 2 / ep 2, the experts'
    dp_shard x cp / ep = 1); a read returns 24,576 / 2 x 4 B = 49,152 B, half of which
    arrives from the other shard (ETP 1), or 24,576 / 4 x 4 = 24,576 B, none of it moved
    (ETP 2: nothing sharded). DDP 1 x TP 2: ETP 1 stores all 24,576, ETP 2 half; reads
    98,304 and 49,152 B, nothing moved. FSDP 4 x TP 2 without EP: 24,576 / 8 = 3,072 a
    rank either way; reads 98,304 B (7/8 arriving: 86,016) and 49,152 B (sharded over 4:
    3/4, 36,864)."""
    args, layers = _tiny_moe_args(), [0, 1]
    assert sum(args.expert_params(i) for i in layers) == TINY_EXPERTS
    fsdp = ParallelDims(dp_shard=2, tp=2, ep=2)
    ddp = ParallelDims(dp_replicate=1, dp_shard=1, tp=2)
    wide = ParallelDims(dp_shard=4, tp=2)
    for dims, mode, etp, stored, read, moved in [
            (fsdp, "fully_shard", 1, 6_144, 49_152, 24_576),
            (fsdp, "fully_shard", 2, 6_144, 24_576, 0),
            (ddp, "replicate", 1, 24_576, 98_304, 0),
            (ddp, "replicate", 2, 12_288, 49_152, 0),
            (wide, "fully_shard", 1, 3_072, 98_304, 86_016),
            (wide, "fully_shard", 2, 3_072, 49_152, 36_864)]:
        case = (dims, mode, etp)
        assert memory.rank_expert_params(args, layers, dims, mode, etp) == stored, case
        assert memory.expert_gather_bytes(args, layers, dims, mode, 4, etp) \
            == (read, moved), case
    # the whole rank's parameters carry the experts' share (DDP: 12,288 fewer with ETP 2)
    assert memory.rank_params(args, "full", layers, ddp, "replicate", 1) \
        - memory.rank_params(args, "full", layers, ddp, "replicate", 2) == 12_288


@pytest.mark.quick
def test_etp_exchanges_by_hand():
    """debug_moe as tp 2 x dp_shard 2 with ep 2 and etp 2 on 2 nodes of 2 H100 SXM (batch
    2 x seq 64, float32), by hand (``expert_tensor.width_split_ffn``): each rank routes 64
    tokens, 64 x top-2 = 128 slots of dim 128 x 4 B: D = 65,536 B. A block's experts send
    those rows to both TP ranks (an all-to-all of 2 copies, 131,072 B, half leaving) and
    the partial outputs back (the same), the converse pair in backward: 4 exchanges a
    block, on the TP pair's NVLink: 15 us + 1 x 1 us + 131,072 / 2 / 360 GB/s each; 6
    under full AC, 4 under selective (it keeps their outputs). Each forward run first
    all-gathers the 4 local experts' int64 counts (2 x 32 B): 15 + 1 us + 32 B / 360
    GB/s, twice a block under AC. 4 blocks. The EP groups are no longer the TP pairs
    (ETP keeps tp as the experts' own dim): ranks 2 apart, across the 2 nodes, on IB.
    Kept for backward: without AC the experts' 2 D gathered input and the D outputs,
    (2 + 1) x D a block; selective the EP exchanges' 2 D and the ETP ones' 2 x 2 D (4 D
    without EP); none under full AC."""
    args, layers = MOE_PRESETS["debug_moe"], list(range(4))
    dims, dev = ParallelDims(dp_shard=2, tp=2, ep=2), gpu_profile("h100-sxm")
    links = timing.MeshLinks(dev, dims, 2, etp=2)
    assert (links.link("tp"), links.link("ep")) == ("nvlink", "ib")
    assert timing.MeshLinks(dev, dims, 2).link("ep") == "nvlink"  # etp 1: the TP pairs
    d = 64 * 2 * 128 * 4
    one = 15e-6 + 1e-6 + 2 * d / 2 / 360e9
    counts = 15e-6 + 1e-6 + 2 * 4 * 8 / 2 / 360e9
    for ac, n, c in [("none", 4, 1), ("selective", 4, 2), ("full", 6, 2)]:
        got = moe.etp_exchange_seconds(args, layers, 64, 4, ac, links, 2)
        assert got == pytest.approx(4 * (n * one + c * counts), rel=1e-12), ac
    assert moe.etp_exchange_seconds(args, layers, 64, 4, "none", links, 1) == 0
    assert moe.saved_bytes(args, layers, 64, 4, "none", 2, etp=2) == 4 * 3 * d
    assert moe.saved_bytes(args, layers, 64, 4, "selective", 2, etp=2) == 4 * 6 * d
    assert moe.saved_bytes(args, layers, 64, 4, "selective", 1, etp=2) == 4 * 4 * d
    assert moe.saved_bytes(args, layers, 64, 4, "full", 2, etp=2) == 0


def test_etp_permutations_by_hand():
    """ETP's copies around the width slices (plan/moe.py's ``ETP_PASSES``, counted from
    ``expert_tensor.width_split_ffn``) in the layout above (D = 65,536 B, T = 2 D the TP
    pair's rows): forward 6 T + 2 D, backward 8 T + 2 D, the forward's twice under AC.
    Compiled selective with EP 2: the exact dispatch's 2 x 5 + 7 graph passes and 2 x 4 +
    6 regroupings, 31 D, plus ETP's 2 x (12 + 2) + 16 + 2 = 46 D: 77 D a block; eager
    without AC or EP: 12 D + ETP's 14 + 18 = 32 D, 44 D. 4 blocks at 26% (compiled) and
    40% (eager) of the H100 SXM's 3.35 TB/s."""
    args, layers, dev = MOE_PRESETS["debug_moe"], list(range(4)), gpu_profile("h100-sxm")
    d = 65_536
    for ac, compiled, ep, passes, rate in [("selective", True, 2, 77, 0.26),
                                           ("none", False, 1, 44, 0.40)]:
        got = moe.permute_seconds(args, layers, 64, 4, ac, dev, compiled, ep, etp=2)
        assert got == pytest.approx(4 * passes * d / (3.35e12 * rate), rel=1e-12), ac
    assert moe.permute_seconds(args, layers, 64, 4, "none", dev, False, 1) \
        == pytest.approx(4 * 12 * d / (3.35e12 * 0.40), rel=1e-12)


def test_prediction_holds_the_etp_layout(tp2_moe):
    """The whole prediction (eager) of the layout above with etp 2 (the planner takes an
    ETP config and traces its dense stand-in): model states 16 B x 477,760 parameters per
    rank, ETP 1's (test_rank_params_split_experts_over_the_experts_mesh_under_tp: the
    experts' share is the same under FSDP); the all-to-alls: the EP exchange's 16 x (50 us
    + 4 us + 65,536 / 2 / 40 GB/s) and its 4 counts exchanges (64 B) on IB, plus the ETP
    exchanges of test_etp_exchanges_by_hand; the routed copies (2 + 1) x 65,536 B a
    block; the experts' gathers per read 1,572,864 / (2 x 2) x 4 B returned, none moved
    (the experts' data-parallel dim is 1); the permutations with ETP's copies. DDP x TP
    2 with etp 2 stores half the experts. Refused before any trace: ep 4 with etp 2 on
    these 4 GPUs (the EP groups must come out of dp_shard 2), naming the key."""
    from simplefsdp.config.job import load_config
    from simplefsdp.errors import ConfigError
    from simplefsdp.hardware import GiB
    from simplefsdp.plan import predict

    row = tp2_moe["etp"].detail["full"]
    assert row["states_gib"] * GiB == pytest.approx(16 * 477_760, rel=1e-12)
    ep_ib = 16 * (54e-6 + 65_536 / 2 / 40e9) + 4 * (54e-6 + 64 / 2 / 40e9)
    etp = 4 * (4 * (16e-6 + 131_072 / 2 / 360e9) + (16e-6 + 64 / 2 / 360e9))
    assert row["all_to_all_s"] == pytest.approx(ep_ib + etp, rel=1e-12)
    assert row["routed_saved_gib"] * GiB == 4 * 3 * 65_536
    assert tuple(row["expert_gather_bytes"]) == (1_572_864, 0)
    # eager, no AC, EP 2: the graph's 12 D, the exact dispatch's 4 + 6 D and ETP's 32 D
    # (test_etp_permutations_by_hand) a block, at 40% of 3.35 TB/s
    assert row["permute_s"] == pytest.approx(4 * 54 * 65_536 / (3.35e12 * 0.40), rel=1e-12)
    # DDP x TP 2 on 2 GPUs stores half the experts with ETP 2: 169,088 non-expert
    # parameters per TP rank (test_rank_params_split_experts_over_the_experts_mesh_under_tp)
    # + 1,572,864 / 2, where ETP 1 holds all 1,572,864
    row = tp2_moe["ddp_etp"].detail["full"]
    assert row["states_gib"] * GiB == pytest.approx(16 * (169_088 + 786_432), rel=1e-12)
    bad = load_config("configs/debug_moe.toml", [*TP2_MOE, "--parallel.etp", "2",
                                                 "--parallel.ep", "4"])
    with pytest.raises(ConfigError, match=r"parallel\.etp = 2"):
        predict(bad, 4, "h100-sxm", 2)


def test_search_memory_bound_holds_etp_states():
    """The search's memory bound (``floors.lower_bound``: model states and the loss's
    logits, no trace) takes ETP's expert states: DDP x TP 2 of debug_moe on 2 GPUs stores
    1,572,864 / 2 = 786,432 fewer expert parameters a rank with etp 2, 16 B each
    (test_etp_expert_states_and_gathers_by_hand's rule on debug_moe's 4 x 8 experts)."""
    import dataclasses

    from simplefsdp.config.job import load_config
    from simplefsdp.plan import floors

    bounds = []
    for etp in ("1", "2"):
        cfg = load_config("configs/debug_moe.toml", [
            "--parallel.tp", "2", "--parallel.etp", etp, "--parallel.dp_mode", "replicate"])
        bounds.append(floors.lower_bound(dataclasses.replace(
            cfg, parallel=cfg.parallel.resolve(2))))
    assert bounds[0] - bounds[1] == 16 * 786_432


def _attention_node(qk_dim: int, v_dim: int,
                    op=torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default):
    """An attention node (by default SDPA's, the CPU trace's op) on bf16 (1, 16, 4096,
    qk / v) fake tensors."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    graph = torch.fx.Graph()
    with FakeTensorMode():
        values = {"q": torch.empty(1, 16, 4096, qk_dim, dtype=torch.bfloat16),
                  "k": torch.empty(1, 16, 4096, qk_dim, dtype=torch.bfloat16),
                  "v": torch.empty(1, 16, 4096, v_dim, dtype=torch.bfloat16)}
    inputs = []
    for name, value in values.items():
        inputs.append(graph.placeholder(name))
        inputs[-1].meta["val"] = value
    if "backward" in str(op):  # (grad_out, query, key, value, ...): grad_out as the output
        grad = graph.placeholder("grad_out")
        grad.meta["val"] = values["v"]
        inputs.insert(0, grad)
    return graph.call_function(op, tuple(inputs), {"is_causal": True})


def test_mla_attention_costs_the_kernel_a_gpu_runs():
    """DeepSeek-V3 16B's MLA attention (16 heads, 4096 tokens, query/key heads 192, value
    heads 128) cannot run SDPA's flash kernel (one head size only). Forward FLOPs by hand:
    2 x 16 x 4096^2 x (192 + 128) / 2 (causal) = 85,899,345,920. Called through SDPA it
    runs the memory-efficient kernel, at its measured H200 forward rate (140 TFLOP/s);
    called by name as our MLA does (``models.mla.mla_attention``), cuDNN's kernel at its
    measured 505 TFLOP/s forward and 390 backward (2.5x the forward's FLOPs); the same
    shapes with value heads of 192 run flash, 2 x 16 x 4096^2 x 384 / 2 FLOPs, at
    FlashAttention-2's published causal forward rate on H100, 335 TFLOP/s. Each plus the
    compiled kernel floor (3 us). All FLOP-bound: ~84 / ~100 MB of q/k/v/out at 70% of
    2.4 TB/s take ~0.05 ms."""
    dev = gpu_profile("h100-96gb")
    aten = torch.ops.aten
    mla, flash = _attention_node(192, 128), _attention_node(192, 192)
    fused = _attention_node(192, 128, aten._scaled_dot_product_cudnn_attention.default)
    fused_backward = _attention_node(
        192, 128, aten._scaled_dot_product_cudnn_attention_backward.default)
    forward = 85_899_345_920
    assert timing._flops(mla) == ("efficient_attention", forward)
    assert timing._flops(fused) == ("cudnn_attention", forward)
    assert timing._flops(fused_backward) == ("cudnn_attention_backward", 2.5 * forward)
    assert timing._flops(flash) == ("attention", 103_079_215_104)
    for node, seconds in [(mla, forward / 140e12), (fused, forward / 505e12),
                          (fused_backward, 2.5 * forward / 390e12),
                          (flash, 103_079_215_104 / 335e12)]:
        assert timing.node_seconds(node, dev, compiled=True) \
            == pytest.approx(seconds + 3e-6, rel=1e-12), node


def _mla_forward_attention():
    from simplefsdp.config.job import load_config
    from simplefsdp.plan.trace import trace, trace_key

    cfg = load_config(None, [
        "--model.name", "debug_moe", "--model.attention", "mla", "--model.n_kv_heads", "4",
        "--model.kv_lora_rank", "16", "--model.qk_nope_head_dim", "8",
        "--model.qk_rope_head_dim", "4", "--model.v_head_dim", "8", "--training.seq_len", "64",
        "--training.batch_size", "2", "--compile.enable", "true",
        "--activation_checkpoint.mode", "none"])
    tr = trace(trace_key(cfg, "full", 1, 2, 1, 2))
    nodes = [n for n in tr.forward.graph.nodes if n.op == "call_function"]
    kinds: dict[str, float] = {}
    for node in nodes:
        kind, flops = timing._flops(node)
        kinds[kind] = kinds.get(kind, 0) + flops
    return kinds, sorted({str(n.target) for n in nodes if "softmax" in str(n.target)})


def test_mla_trace_runs_the_gpus_attention_kernel(planner):
    """The planner's trace of an MLA model (debug_moe with MLA: 4 heads, query/key heads
    8 + 4, value heads 8; batch 2 x seq 64, one block) holds cuDNN's fused kernel, which
    our MLA runs on a GPU (``models.mla.mla_attention``), not the math path SDPA takes on
    CPU tensors (scores materialized, a softmax
    node): forward attention by hand 2 x (2 x 4) x 64 x 64 x (12 + 8) / 2 = 655,360
    FLOPs, all of them costed as that kernel. Traced in the session's planner process
    (its own fake process group)."""
    kinds, softmax = planner(_mla_forward_attention)
    assert kinds.get("cudnn_attention") == 655_360, kinds
    assert "attention" not in kinds and softmax == [], (kinds, softmax)


def test_permute_seconds_by_hand():
    """DeepSeek-V3 16B's token permutations on one H100 96 GB (26 routed blocks, 16,384
    tokens x top-6 x dim 2048 x 2 B = 402,653,184 B = D per pass, 2.4 TB/s), passes
    counted from the code (plan/moe.py): with EP, the graph's 5 + 7 plus the dispatch's
    eager 4 + 6, the forwards twice under AC (selective too: the experts are recomputed):
    31 D, at the measured 26% of the bandwidth compiled (``permute_memory_compiled``);
    eager without EP and AC: 12 D at 40%."""
    args = MOE_PRESETS["deepseek_v3_16b"]
    layers, dev = list(range(args.n_layers)), gpu_profile("h100-96gb")
    one = 402_653_184 / 2.4e12
    for ac, compiled, ep, passes, rate in [("selective", True, 8, 31, 0.26),
                                           ("full", True, 8, 31, 0.26),
                                           ("none", False, 1, 12, 0.40)]:
        got = moe.permute_seconds(args, layers, 16_384, 2, ac, dev, compiled, ep)
        assert got == pytest.approx(26 * passes * one / rate, rel=1e-12), (ac, compiled, ep)


# DeepSeek-V3 16B at EP 8 on 8 H100 96 GB, one rank's 16,384 tokens: 98,304 slots (top-6)
# over 64 experts; padded at capacity factor 1.25, ceil(1.25 x 98,304 / 64) = 1,920 rows
# per expert and rank: 64 x 1,920 = 122,880 rows each way.
SLOTS, PADDED_ROWS = 98_304, 122_880
PADDED = moe.Dispatch(padded=True, capacity_factor=1.25)


def test_padded_dispatch_moves_and_computes_capacity_sized_slots():
    """By hand: the padded exchange moves 122,880 rows x 2048 x 2 B = 503,316,480 B (the
    exact one 98,304 rows), with no counts exchange; nothing is kept for a recomputation,
    so selective AC exchanges again as full AC does (6 a block). Its experts compute
    24,576 rows beyond the stand-in's slots, 6 x 2048 x 1408 FLOPs a row per forward run,
    in 2 forward runs under AC (1 without) and 2 backward matmuls, at 60% of 989 TFLOP/s;
    26 routed blocks. Kept for backward without AC: the padded rows the experts multiply
    and the slots the routing weights multiply (P + D a block); nothing under AC."""
    args = MOE_PRESETS["deepseek_v3_16b"]
    layers, dev = list(range(args.n_layers)), gpu_profile("h100-96gb")
    assert PADDED.rows(args, 16_384) == PADDED_ROWS and moe.EXACT.rows(args, 16_384) == SLOTS
    p_bytes, d_bytes = PADDED_ROWS * 2048 * 2, SLOTS * 2048 * 2
    assert moe.dispatch_bytes(args, 16_384, 2, PADDED) == p_bytes == 503_316_480
    links = timing.MeshLinks(dev, ParallelDims(dp_shard=8, ep=8), 8)
    one = 15e-6 + 7e-6 + 7 / 8 * p_bytes / 360e9
    for ac, n in [("none", 4), ("selective", 6), ("full", 6)]:
        got = moe.exchange_seconds(args, layers, 16_384, 2, ac, links, PADDED)
        assert got == pytest.approx(26 * n * one, rel=1e-12), ac
    row = 6 * 2048 * 1408
    for ac, runs in [("none", 3), ("selective", 4), ("full", 4)]:
        got = moe.padded_seconds(args, layers, 16_384, ac, dev, PADDED)
        assert got == pytest.approx(26 * 24_576 * row * runs / (989e12 * 0.6), rel=1e-12)
    assert moe.padded_seconds(args, layers, 16_384, "none", dev, moe.EXACT) == 0
    # a capacity factor under 1 computes fewer rows than the slots: 0.5 -> 768 a expert
    half = moe.Dispatch(padded=True, capacity_factor=0.5)
    assert moe.padded_seconds(args, layers, 16_384, "none", dev, half) == pytest.approx(
        26 * (64 * 768 - SLOTS) * row * 3 / (989e12 * 0.6), rel=1e-12)
    assert moe.saved_bytes(args, layers, 16_384, 2, "none", 8, PADDED) == 26 * (p_bytes + d_bytes)
    assert moe.saved_bytes(args, layers, 16_384, 2, "selective", 8, PADDED) == 0
    assert moe.saved_bytes(args, layers, 16_384, 2, "selective", 8) == 26 * 2 * d_bytes


def test_padded_permutations_by_hand():
    """The padded dispatch's copies (plan/moe.py's count from ``models.moe.padded_experts``)
    on top of the graph's 5 + 7 passes over the slots D: forward 5 P + 3 D and backward
    4 P + 3 D, and with EP 8 (8 local experts) the two regroupings, 4 P each way; the
    forward's twice under AC. Compiled, selective: D passes 2 x 5 + 7 + 2 x 3 + 3 = 26,
    P passes 2 x (5 + 4) + 4 + 4 = 26, at 26% of 2.4 TB/s. Without EP (every expert
    local) no regrouping: none AC, D 5 + 7 + 3 + 3 = 18, P 5 + 4 = 9, eager at 40%."""
    args = MOE_PRESETS["deepseek_v3_16b"]
    layers, dev = list(range(args.n_layers)), gpu_profile("h100-96gb")
    p_bytes, d_bytes = PADDED_ROWS * 2048 * 2, SLOTS * 2048 * 2
    got = moe.permute_seconds(args, layers, 16_384, 2, "selective", dev, True, 8, PADDED)
    assert got == pytest.approx(26 * (26 * d_bytes + 26 * p_bytes) / (2.4e12 * 0.26),
                                rel=1e-12)
    got = moe.permute_seconds(args, layers, 16_384, 2, "none", dev, False, 1, PADDED)
    assert got == pytest.approx(26 * (18 * d_bytes + 9 * p_bytes) / (2.4e12 * 0.40),
                                rel=1e-12)


def test_eager_host_seconds_by_hand():
    """The eager step's host time over DeepSeek-V3 16B's 26 routed blocks, from the
    profile's per-pass figures (11.1 ms a block pass, 7.6 ms more with expert
    parallelism's exchange, 9.3 ms per forward run under selective AC's dispatch mode):
    full AC at EP 8, 3 passes (forward, recomputation, backward): 26 x 3 x 18.7 ms =
    1.4586 s; selective at EP 8, the same 3 passes and 2 forward runs under the mode:
    26 x (3 x 18.7 + 2 x 9.3) ms = 1.9422 s; no AC at EP 1, 2 passes: 26 x 2 x 11.1 ms =
    0.5772 s (rel 1e-12: float arithmetic)."""
    args = MOE_PRESETS["deepseek_v3_16b"]
    layers, dev = list(range(args.n_layers)), gpu_profile("h200")
    assert moe.host_seconds(args, layers, "full", 8, dev) == pytest.approx(1.4586, rel=1e-12)
    assert moe.host_seconds(args, layers, "selective", 8, dev) == pytest.approx(1.9422,
                                                                                 rel=1e-12)
    assert moe.host_seconds(args, layers, "none", 1, dev) == pytest.approx(0.5772, rel=1e-12)


def _ffn_tp_seconds():
    from simplefsdp.config.job import load_config

    cfg = load_config(None, ["--model.name", "debug_moe", "--parallel.tp", "2",
                             "--training.seq_len", "64", "--training.batch_size", "1",
                             "--compile.enable", "true", "--compile.bucketing", "manual"])
    from simplefsdp.plan.trace import trace, trace_key

    tr = trace(trace_key(cfg, "full", 1, 1, 1, 1))
    dev = gpu_profile("h100-sxm")
    fabric = timing.MeshLinks(dev, cfg.parallel.resolve(2).dims(), 8)
    return [[timing.graph_seconds(g, dev, fabric, tr.groups, True, 1.0, shard, ffn_tp)
             for g, shard in zip((tr.forward, tr.backward), memory.trace_shards(tr),
                                 strict=True)] for ffn_tp in (True, False)]


def test_stand_in_ffn_has_no_tp_collectives_without_a_shared_expert(planner):
    """Issue 28: under TP the routed experts take each TP rank's own tokens (no gather,
    no reduce-scatter, ``moe_tp_plan``); only a shared expert is sequence-parallel.
    debug_moe (no shared expert) at tp 2, 64 tokens of 128 float32 values (32,768 B), one
    block on H100 SXM: the traced stand-in's FFN gathers its input and reduce-scatters its
    output in forward, the converse in backward, each 15 us + 1 us (one ring step) +
    32,768 / 2 / 360e9 = 16.0455 us on NVLink, exposed whole (the next matmul needs
    them): left out, forward and backward each take 2 x 16.0455 us less, exposed too
    (relative 1e-9: float arithmetic). The speed bound's TP floor counts attention's
    gather + reduce-scatter only: 2 x (forward + backward) x 16.0455 us for the block."""
    with_ffn, without = planner(_ffn_tp_seconds)
    one = 15e-6 + 1e-6 + 32_768 / 2 / 360e9
    for (seconds, exposed), (seconds_, exposed_) in zip(with_ffn, without, strict=True):
        assert seconds - seconds_ == pytest.approx(2 * one, rel=1e-9)
        assert exposed - exposed_ == pytest.approx(2 * one, rel=1e-9)
    assert not moe.ffn_tp_collectives(MOE_PRESETS["debug_moe"])
    assert moe.ffn_tp_collectives(MOE_PRESETS["deepseek_v3_16b"])  # its shared expert
    fabric = timing.MeshLinks(gpu_profile("h100-sxm"), ParallelDims(dp_shard=1, tp=2), 8)
    floor = timing.tp_comm_floor_seconds(MOE_PRESETS["debug_moe"], 64, 1, False, 4, fabric)
    assert floor == pytest.approx(4 * one, rel=1e-9)


def _deepseek_compiled() -> dict:
    """Issue 28's published layout, DeepSeek-V3 16B on 8 GPUs (FSDP 8 x EP 8, local batch
    4 x 4096, compiled), predicted with selective and full AC on an H200 and on an H100
    96 GB: {(ac, gpu): Prediction}. One planner call, so the four share one pair of
    traces (a trace holds no device figure; a compiled MoE's selective is priced as whole
    block recomputation, ``ac_mode_run``, the same graphs as full)."""
    from simplefsdp.config.job import load_config
    from simplefsdp.plan import predict

    out = {}
    for ac in ("selective", "full"):
        cfg = load_config("configs/deepseek_v3_16b.toml", [
            "--training.batch_size", "4", "--activation_checkpoint.mode", ac,
            "--compile.enable", "true", "--compile.bucketing", "manual"])
        for gpu in ("h200", "h100-96gb"):
            out[ac, gpu] = predict(cfg, 8, gpu)
    return out


@pytest.fixture(scope="module")
def deepseek_compiled(planner) -> dict:
    return planner(_deepseek_compiled)


@pytest.mark.parametrize("ac, step_s, allocated_gib", [("selective", 1.139, 62.20),
                                                        ("full", 1.138, 42.68)])
def test_compiled_moe_prediction_matches_a_measured_h200_run(deepseek_compiled, ac, step_s,
                                                             allocated_gib):
    """Issue 28's published layout measured with our trainer on a real GPU (README,
    "Measured on a GPU": one H200, torch 2.11, 2026-11-27, ``scripts/device_check.py``'s
    ``moe_ep8_{selective,full}_compiled``; ``docs/device_check_h200_2026-11-27/``): rank 0
    of DeepSeek-V3 16B, FSDP 8 x EP 8, 4 x 4096 tokens, compiled with Inductor, under a
    fake process group of 8 (real kernels and memory; the all-to-all made the identity,
    so the rank's experts get an EP rank's rows). Selective 1.139 s a step,
    ``max_memory_allocated`` 62.20 GiB; full 1.138 s, 42.68 GiB. The same graphs (both
    recompute a compiled MoE model's blocks whole, ``ac_mode_run``); selective
    keeps the 26 routed blocks' exchanged rows, 26 x 768 MiB = 19.5 GiB, the measured
    difference. Predicted: the step less the exposed communication 1.011 s for both
    (-11.3% and -11.2%), memory 62.56 GiB (+0.6%) and 43.06 GiB (+0.9%).

    Bounds just outside those errors, so that the terms this test is about fail it: time
    12% (the measured error is 11.3%: a lost or doubled routed-block term moves it by
    more than a point); memory 2% (the measured errors are under 1%; 2% leaves a point for
    the graphs' small differences between torch 2.11 and 2.13, where the H200 run and
    this prediction were made, while a quarter of the 19.5 GiB kept-exchange term, 4.9
    GiB, is 7.8% of the selective figure and 11% of the full one)."""
    got = deepseek_compiled[ac, "h200"]
    assert got.step_time_s - got.exposed_comm_s == pytest.approx(step_s, rel=0.12)
    assert got.peak_memory_gib == pytest.approx(allocated_gib, rel=0.02)


def test_eager_moe_step_waits_for_the_host(planner):
    """Our eager DeepSeek-V3 16B step on an H200 (FSDP 8 x EP 8, 4 x 4096 tokens, full AC,
    the fake group's identity exchange: docs/performance.md "Measured on an H200"): 1.458
    s, host-bound (the device busy ~1.05 s of it). The prediction's device step is shorter
    (its all-to-alls included), so the step is the host's 26 routed blocks x 3 passes x
    18.7 ms = 1.4586 s (``test_eager_host_seconds_by_hand``) plus the eager loss after the
    blocks. The host figures were fitted to this row (and two others), so the 3% bound
    only checks that the term reaches the step; the step itself is checked exactly: the
    host's time, then the loss and the optimizer step."""
    from simplefsdp.config.job import load_config
    from simplefsdp.plan import predict

    cfg = load_config("configs/deepseek_v3_16b.toml", [
        "--training.batch_size", "4", "--activation_checkpoint.mode", "full"])
    got = planner(predict, cfg, 8, "h200")
    assert got.detail["full"]["host_s"] == pytest.approx(1.4586, rel=1e-12)
    # the step: the host's time, then the eager loss on 16,384 tokens' logits and the
    # optimizer step on the rank's parameters (relative 1e-9: float sums)
    args, dev = MOE_PRESETS["deepseek_v3_16b"], gpu_profile("h200")
    params = memory.rank_params(args, "full", list(range(args.n_layers)),
                                ParallelDims(dp_shard=8, ep=8), "fully_shard")
    after_blocks = timing.loss_seconds(16_384, args.vocab_size, dev) \
        + timing.optimizer_seconds(params, dev)
    assert got.step_time_s == pytest.approx(1.4586 + after_blocks, rel=1e-9)
    assert got.step_time_s == pytest.approx(1.458, rel=0.03)


@pytest.mark.parametrize("ac, published_gib", [("selective", 84.78), ("full", 52.02)])
def test_deepseek_published_memory(deepseek_compiled, ac, published_gib):
    """Issue 28's published case: torchtitan's graph trainer, DeepSeek-V3 16B on 8 H100
    (96 GB), FSDP 8 x EP 8, local batch 4 x 4096, compiled: 84.78 GiB reserved with its
    default (selective) AC, 52.02 GiB with full recompute. Predicted 75.07 GiB (-11.5%)
    and 51.67 GiB (-0.7%), within the issue's 15%. Selective keeps the token exchanges'
    outputs, 2 x 16,384 x 6 x 2,048 x 2 B = 768 MiB a routed block (26 of them), where full
    AC exchanges again (``parallel.expert.keep_exchanges``); the graphs recompute whole in
    both (our compiled MoE blocks), where the published graph SAC also keeps matmul
    outputs: the selective row's remaining gap. Not checked here (README, "Validation"):
    the tokens/s, 8,325 and 7,444 published, 10,803 and 10,444 predicted (+30%, +40%, out
    of the issue's 20%: our trainer on this layout is predicted faster than that run)."""
    got = deepseek_compiled[ac, "h100-96gb"]
    assert got.reserved_memory_gib == pytest.approx(published_gib, rel=0.15)
