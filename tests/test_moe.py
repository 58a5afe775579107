"""The MoE model family (models/moe.py) against transformers' own Qwen3-MoE sparse block,
and its load balancing against hand-computed values."""

from __future__ import annotations

import pytest
import torch
from transformers.models.qwen3_moe import modeling_qwen3_moe as hf_qwen3_moe

from simplefsdp import _torch_compat
from simplefsdp.models import moe
from simplefsdp.models.llama import num_params

DIM, WIDTH, EXPERTS, TOP_K = 32, 16, 8, 2


def _pair(norm_topk_prob: bool, seed: int = 0):
    """transformers' Qwen3MoeSparseMoeBlock with random weights and our MoE holding copies
    of them (gate.weight, experts.gate_up_proj, experts.down_proj: the same layout)."""
    torch.manual_seed(seed)
    config = hf_qwen3_moe.Qwen3MoeConfig(
        hidden_size=DIM, moe_intermediate_size=WIDTH, num_experts=EXPERTS,
        num_experts_per_tok=TOP_K, norm_topk_prob=norm_topk_prob, hidden_act="silu")
    theirs = hf_qwen3_moe.Qwen3MoeSparseMoeBlock(config)
    for param in theirs.parameters():
        torch.nn.init.normal_(param, std=0.3)
    args = moe.MoEArgs(dim=DIM, n_layers=1, n_heads=4, num_experts=EXPERTS, top_k=TOP_K,
                       moe_hidden_dim=WIDTH, norm_topk_prob=norm_topk_prob)
    ours = moe.MoE(args)
    ours.load_state_dict(theirs.state_dict())  # same names, same shapes
    return theirs, ours


@pytest.mark.quick
@pytest.mark.parametrize("norm_topk_prob", [True, False])
@pytest.mark.parametrize("grouped", [False, True])
def test_matches_transformers_qwen3_moe_block(monkeypatch, norm_topk_prob: bool, grouped: bool):
    """Same output as transformers 5's Qwen3-MoE block on the same weights and input.

    The loop path runs transformers' own per-expert ``F.linear`` calls on the same rows
    in the same order (choice rank, then token, inside each expert) and adds each token's
    expert outputs in expert order, as its ``index_add_`` does: bitwise (with token order
    inside an expert instead, 7e-7 = 1 ulp apart). The
    grouped-matmul path (CPU float32 has ``torch._grouped_mm`` on torch 2.13) sums the
    same products in another kernel: within 1e-6 (float32 rounding of ~dim-long sums of
    values ~1, a few ulps of outputs ~1-10)."""
    if not grouped:
        monkeypatch.setattr(moe, "grouped_mm", lambda device, dtype: None)
    elif _torch_compat.grouped_mm(torch.device("cpu"), torch.float32) is None:
        pytest.fail("this torch has no CPU float32 grouped matmul; the loop test covers it")
    theirs, ours = _pair(norm_topk_prob)
    x = torch.randn(3, 5, DIM)
    expected = theirs(x)
    got = ours(x)
    if grouped:
        torch.testing.assert_close(got, expected, rtol=0, atol=1e-6)
    else:
        assert torch.equal(got, expected)
    # Gradients reach every parameter the same way (same tolerance reasoning).
    grad = torch.randn_like(x)
    expected.backward(grad)
    got.backward(grad)
    theirs_grads = dict(theirs.named_parameters())
    for name, param in ours.named_parameters():
        torch.testing.assert_close(param.grad, theirs_grads[name].grad, rtol=1e-5, atol=1e-6)


@pytest.mark.quick
def test_aux_loss_matches_transformers():
    """One layer's Switch balance loss equals transformers' ``load_balancing_loss_func``
    on that layer's router logits (float32 sums of 15 tokens: 1e-6)."""
    theirs, ours = _pair(True, seed=1)
    x = torch.randn(15, DIM)
    logits, _, _ = theirs.gate(x)
    expected = hf_qwen3_moe.load_balancing_loss_func((logits,), EXPERTS, TOP_K)
    ours(x)
    torch.testing.assert_close(ours.aux_loss, expected, rtol=0, atol=1e-6)


@pytest.mark.quick
def test_bias_steers_the_choice_not_the_weights():
    """Bias balancing by hand: two experts, top-1, one token whose softmax scores are
    (0.8, 0.2). A bias of +1 on expert 1 makes the router pick it, with weight 0.2 (its
    unbiased score; no renormalization). One update after that choice: expert 1 had the
    token (load (0, 1), mean 0.5), so bias 0 rises by the rate and bias 1 falls by it."""
    args = moe.MoEArgs(dim=4, n_layers=1, n_heads=1, num_experts=2, top_k=1, moe_hidden_dim=16,
                       norm_topk_prob=False, load_balance="bias", bias_update_rate=0.25)
    model = moe.MoETransformer(args)
    layer = moe.moe_layers(model)[0]
    router = layer.gate
    with torch.no_grad():
        router.weight.zero_()
        router.weight[0, 0] = torch.log(torch.tensor(4.0))  # exp(l0) / exp(l1) = 4: 0.8 / 0.2
    x = torch.tensor([[1.0, 0.0, 0.0, 0.0]])
    _, weights, ids = router(x)
    assert ids.tolist() == [[0]] and weights.item() == pytest.approx(0.8)
    router.expert_bias.copy_(torch.tensor([0.0, 1.0]))
    _, weights, ids = router(x)
    assert ids.tolist() == [[1]] and weights.item() == pytest.approx(0.2)
    layer(x.view(1, 1, 4))
    assert layer.tokens_per_expert.tolist() == [0.0, 1.0]
    loads = moe.update_expert_bias(model)
    assert loads.tolist() == [[0.0, 1.0]]
    assert router.expert_bias.tolist() == [0.25, 0.75]
    assert layer.tokens_per_expert.tolist() == [0.0, 0.0]


def test_presets_parameter_counts():
    """Counted by hand from the shapes (embedding + output V*d each, per block attention
    d*hd*(2h + 2kv), two norms 2d, router E*d, experts 3*E*d*I, shared 3*d*S, dense FFN
    3*d*F; final norm d; MLA: d*h*(nope + rope) + d*(rank + rope) + rank + rank*h*(nope +
    v) + h*v*d). Published totals: Qwen3-30B-A3B 30.5B (ours attends with head_dim 64, see
    the preset), DeepSeek-V3 16B (DeepSeek-V2-Lite's shapes, with MLA) 15.7B: ours
    15,706,484,224."""
    def expected(a, dense_width=0):
        attention = a.dim * a.head_dim * (2 * a.n_heads + 2 * a.kv_heads)
        if a.attention == "mla":  # wq, wkv_a, the latent's norm, wkv_b, wo
            qk = a.qk_nope_head_dim + a.qk_rope_head_dim
            attention = (a.dim * a.n_heads * qk + a.dim * (a.kv_lora_rank + a.qk_rope_head_dim)
                         + a.kv_lora_rank
                         + a.kv_lora_rank * a.n_heads * (a.qk_nope_head_dim + a.v_head_dim)
                         + a.n_heads * a.v_head_dim * a.dim)
        moe_block = (attention + 2 * a.dim + a.num_experts * a.dim
                     + 3 * a.num_experts * a.dim * a.moe_hidden_dim
                     + 3 * a.dim * a.shared_hidden_dim)
        dense_block = attention + 2 * a.dim + 3 * a.dim * dense_width
        return (2 * a.vocab_size * a.dim + a.dim + a.n_dense_layers * dense_block
                + (a.n_layers - a.n_dense_layers) * moe_block)

    presets = moe.MOE_PRESETS
    for name, dense_width in (("debug_moe", 0), ("qwen3_30b_a3b", 0),
                              ("deepseek_v3_16b", 10944)):
        with torch.device("meta"):
            model = moe.MoETransformer(presets[name])
        assert num_params(model) == expected(presets[name], dense_width), name
    assert num_params(moe.MoETransformer(presets["debug_moe"])) == 1_840_256
    with torch.device("meta"):
        assert num_params(moe.MoETransformer(presets["deepseek_v3_16b"])) == 15_706_484_224


# A tiny MLA: 4 heads, latent 16, query/key heads of 8 + 4 (RoPE), value heads of 6
MLA = dict(dim=32, n_layers=1, n_heads=4, attention="mla", kv_lora_rank=16,
           qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=6, rope_theta=500.0,
           max_seq_len=16)


def _rotate(t: torch.Tensor, theta: float) -> torch.Tensor:
    """RoPE by hand on (batch, seq, heads, r): pair (2i, 2i+1) of position p turns by
    p * theta ** (-2i / r)."""
    r, seq = t.shape[-1], t.shape[1]
    angle = torch.arange(seq)[:, None] * theta ** (-torch.arange(0, r, 2) / r)  # (seq, r/2)
    cos, sin = angle.cos()[None, :, None], angle.sin()[None, :, None]
    even, odd = t[..., 0::2], t[..., 1::2]
    out = torch.empty_like(t)
    out[..., 0::2], out[..., 1::2] = even * cos - odd * sin, even * sin + odd * cos
    return out


def _mla_by_hand(x: torch.Tensor, w: dict, a) -> torch.Tensor:
    """DeepSeek's MLA written out with einsums: queries (unrotated, rotated), a latent
    RMS-normalized then expanded to each head's unrotated key and value, one rotated key
    shared by every head, causal softmax at (nope + rope) ** -0.5, output projection."""
    n, r, v, rank = a.qk_nope_head_dim, a.qk_rope_head_dim, a.v_head_dim, a.kv_lora_rank
    b, s, _ = x.shape
    q = torch.einsum("bsd,ed->bse", x, w["wq.weight"]).reshape(b, s, a.n_heads, n + r)
    q = torch.cat([q[..., :n], _rotate(q[..., n:], a.rope_theta)], -1)
    down = torch.einsum("bsd,ed->bse", x, w["wkv_a.weight"])
    latent, k_rot = down[..., :rank], down[..., rank:]
    latent = latent * (latent.pow(2).mean(-1, keepdim=True) + a.norm_eps).rsqrt() \
        * w["kv_norm.weight"]
    up = torch.einsum("bsc,ec->bse", latent, w["wkv_b.weight"]).reshape(b, s, a.n_heads, n + v)
    k_rot = _rotate(k_rot[:, :, None], a.rope_theta).expand(b, s, a.n_heads, r)
    k, values = torch.cat([up[..., :n], k_rot], -1), up[..., n:]
    scores = torch.einsum("bqhe,bkhe->bhqk", q, k) / (n + r) ** 0.5
    scores = scores.masked_fill(~torch.ones(s, s, dtype=torch.bool).tril(), float("-inf"))
    out = torch.einsum("bhqk,bkhe->bqhe", scores.softmax(-1), values).reshape(b, s, -1)
    return torch.einsum("bse,de->bsd", out, w["wo.weight"])


@pytest.mark.quick
def test_mla_matches_a_computation_by_hand():
    """Our MLA module (models/mla.py) against the einsum computation above on the same
    random weights (the latent's norm weight random too, so a lost norm shows), through a
    whole MoE model's first block (its rope table, built with the rope part's 4 features).
    float32, values ~0.1-1: SDPA and the einsums sum the same products in other orders,
    within 1e-6 (a few ulps of ~16-term sums)."""
    torch.manual_seed(0)
    args = moe.MoEArgs(**MLA, num_experts=4, top_k=2, moe_hidden_dim=8)
    model = moe.MoETransformer(args)
    attention = model.layers["0"].attention
    for param in attention.parameters():
        torch.nn.init.normal_(param, std=0.3)
    x = torch.randn(2, 7, args.dim)
    got = attention(x, model.rope_cache)
    expected = _mla_by_hand(x, dict(attention.named_parameters()), args)
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-6)
    # the per-token FLOP and parameter arithmetic the planner uses, by hand
    assert args.attention_dims == (12, 6)
    assert args.attention_matmul_params() == 32 * 4 * 12 + 32 * 20 + 16 * 4 * 14 + 4 * 6 * 32


def test_mla_refusals_name_the_key():
    """MLA's sizes are checked; tensor / context parallelism and the Hugging Face export
    are refused at config load, naming the key."""
    from simplefsdp.config.job import load_config
    from simplefsdp.errors import ConfigError

    with pytest.raises(ValueError, match="qk_rope_head_dim=3 must be even"):
        moe.MoEArgs(**{**MLA, "qk_rope_head_dim": 3})
    with pytest.raises(ValueError, match="n_kv_heads=2: attention='mla'"):
        moe.MoEArgs(**MLA, n_kv_heads=2)
    with pytest.raises(ValueError, match="attention='mha'"):
        moe.MoEArgs(attention="mha")
    base = ["--model.name", "debug_moe", "--model.attention", "mla", "--model.n_kv_heads", "4"]
    load_config(None, base)  # fine
    for flags, key in ((["--parallel.tp", "2"], "parallel.tp"),
                       (["--parallel.cp_ring", "2"], "parallel.cp_ring"),
                       (["--checkpoint.export_hf", "true"], "checkpoint.export_hf")):
        with pytest.raises(ConfigError, match=f"{key}.* model.attention = 'mla'"):
            load_config(None, [*base, *flags])


@pytest.mark.quick
def test_bad_args_refused():
    with pytest.raises(ValueError, match="top_k=9 must be between 1 and num_experts=8"):
        moe.MoEArgs(num_experts=8, top_k=9)
    with pytest.raises(ValueError, match="score_func='relu'"):
        moe.MoEArgs(score_func="relu")
    with pytest.raises(ValueError, match="load_balance='x'"):
        moe.MoEArgs(load_balance="x")


@pytest.mark.quick
@pytest.mark.parametrize("mode", ["full", "selective"])
def test_counters_count_once_under_activation_checkpointing(mode):
    """An activation-checkpointing recomputation reruns each block's forward inside
    backward; the routed slots per expert and the padded dispatch's dropped slots must
    still be counted once, as without checkpointing (they were doubled: bias balancing
    kept its sign, but the reported ``tokens_dropped`` read twice the drops). Two blocks,
    the padded dispatch at capacity factor 0.5 (so some slots drop), one forward and
    backward; counters equal the run without AC exactly (integer counts in float32)."""
    from simplefsdp.parallel.activation_checkpoint import apply_ac

    def counters(ac_mode: str) -> list[list[float]]:
        torch.manual_seed(0)
        args = moe.MoEArgs(dim=DIM, n_layers=2, n_heads=4, n_kv_heads=2, num_experts=4,
                           moe_hidden_dim=WIDTH, vocab_size=64)
        model = moe.MoETransformer(args)
        model.init_weights()
        for layer in moe.moe_layers(model):
            layer.capacity_factor = 0.5
        apply_ac(model, ac_mode)
        model(torch.randint(0, 64, (2, 16))).float().sum().backward()
        return [[*m.tokens_per_expert.tolist(), m.tokens_dropped.item()]
                for m in moe.moe_layers(model)]

    reference = counters("none")
    assert all(row[-1] > 0 for row in reference)  # drops happened in every layer
    assert all(min(row[:-1]) > 0 for row in reference)  # every expert routed to
    assert sum(reference[0][:-1]) == 2 * 16 * 2  # every (token, choice) slot counted once
    assert counters(mode) == reference
