"""The Llama model: shapes, causality, GQA, RoPE, tied weights, meta init, FLOP count."""

from __future__ import annotations

import copy
from dataclasses import replace

import pytest
import torch
from toy import OpCalls

from simplefsdp.models.llama import (
    LLAMA3_PRESETS,
    ModelArgs,
    Transformer,
    apply_rope,
    ffn_hidden_dim,
    flops_per_token,
    num_params,
    rope_cache,
)

pytestmark = pytest.mark.quick  # unit checks in one process: the whole file is in the quick tier

TINY = ModelArgs(dim=32, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=64,
                 multiple_of=16, max_seq_len=32)


def _model(args: ModelArgs = TINY, seed: int = 0) -> Transformer:
    model = Transformer(args)
    torch.manual_seed(seed)  # init_weights alone decides the values
    model.init_weights()
    return model


def test_shapes_and_names():
    model = _model()
    tokens = torch.randint(0, TINY.vocab_size, (3, 10))
    assert model(tokens).shape == (3, 10, TINY.vocab_size)
    names = set(dict(model.named_parameters()))
    for name in ["tok_embeddings.weight", "layers.1.attention.wq.weight",
                 "layers.1.attention.wo.weight", "layers.0.attention_norm.weight",
                 "layers.0.feed_forward.w3.weight", "layers.0.ffn_norm.weight",
                 "norm.weight", "output.weight"]:
        assert name in names
    assert "rope_cache" not in model.state_dict()  # derived, not checkpointed


def test_causal_masking():
    model = _model()
    tokens = torch.randint(0, TINY.vocab_size, (2, 16))
    changed = tokens.clone()
    changed[:, 9:] = torch.randint(0, TINY.vocab_size, (2, 7))
    with torch.no_grad():
        a, b = model(tokens), model(changed)
    torch.testing.assert_close(a[:, :9], b[:, :9])
    assert not torch.allclose(a[:, 9:], b[:, 9:])


def test_gqa_matches_multi_head_with_repeated_kv_heads():
    """GQA equals plain multi-head attention whose key/value heads are copies."""
    gqa = _model()
    mha = Transformer(replace(TINY, n_kv_heads=None))
    state = copy.deepcopy(gqa.state_dict())
    n_rep, hd = TINY.n_heads // TINY.n_kv_heads, TINY.head_dim
    for key, value in list(state.items()):
        if key.endswith(("wk.weight", "wv.weight")):
            heads = value.view(TINY.n_kv_heads, hd, TINY.dim)
            state[key] = heads.repeat_interleave(n_rep, dim=0).reshape(-1, TINY.dim)
    mha.load_state_dict(state)
    assert gqa.layers["0"].attention.wk.weight.shape == (TINY.n_kv_heads * hd, TINY.dim)
    tokens = torch.randint(0, TINY.vocab_size, (2, 12))
    with torch.no_grad():
        torch.testing.assert_close(gqa(tokens), mha(tokens))


def test_rope_scores_depend_on_relative_position_only():
    cache = rope_cache(head_dim=8, max_seq_len=16, theta=10000.0)
    q, k = torch.randn(8), torch.randn(8)

    def score(i: int, j: int) -> torch.Tensor:
        seq = torch.zeros(1, 16, 1, 8)
        qs, ks = seq.clone(), seq.clone()
        qs[0, i, 0], ks[0, j, 0] = q, k
        return (apply_rope(qs, cache)[0, i, 0] * apply_rope(ks, cache)[0, j, 0]).sum()

    torch.testing.assert_close(score(5, 2), score(12, 9))
    torch.testing.assert_close(apply_rope(q.view(1, 1, 1, 8), cache).norm(), q.norm())


def test_tied_embeddings_share_one_parameter():
    model = _model(replace(TINY, tie_embeddings=True))
    assert model.output.weight is model.tok_embeddings.weight
    untied = _model()
    assert num_params(untied) - num_params(model) == TINY.vocab_size * TINY.dim


def test_meta_build_to_empty_init_weights():
    with torch.device("meta"):
        model = Transformer(TINY)
    model.to_empty(device="cpu")
    torch.manual_seed(0)
    model.init_weights()
    assert all(p.isfinite().all() for p in model.parameters())
    torch.testing.assert_close(model.rope_cache, _model().rope_cache)
    # Same RNG draws as a plain CPU build: init is deterministic.
    for p, q in zip(model.parameters(), _model().parameters(), strict=True):
        torch.testing.assert_close(p, q)
    out = model(torch.randint(0, TINY.vocab_size, (1, 8)))
    assert out.isfinite().all()


def test_init_scales():
    model = _model(replace(TINY, n_layers=4, dim=128, multiple_of=64))
    assert torch.equal(model.norm.weight, torch.ones(128))
    wo0 = model.layers["0"].attention.wo.weight.std()
    wo3 = model.layers["3"].attention.wo.weight.std()
    assert 0.8 < wo0 / (0.02 / 2**0.5) < 1.2
    assert 0.8 < wo3 / (0.02 / 8**0.5) < 1.2


def test_pipeline_stages_pass_hidden_states():
    full = _model()
    first, last = copy.deepcopy(full), copy.deepcopy(full)
    first.norm = first.output = None
    del first.layers["1"]
    last.tok_embeddings = None
    del last.layers["0"]
    assert "layers.1.attention.wq.weight" in dict(last.named_parameters())
    tokens = torch.randint(0, TINY.vocab_size, (2, 8))
    with torch.no_grad():
        hidden = first(tokens)
        assert hidden.shape == (2, 8, TINY.dim)
        torch.testing.assert_close(last(hidden), full(tokens))


def test_presets_and_flops():
    a = LLAMA3_PRESETS["llama3_8b"]
    assert ffn_hidden_dim(a) == 14336
    assert ffn_hidden_dim(LLAMA3_PRESETS["llama3_70b"]) == 28672
    assert ffn_hidden_dim(LLAMA3_PRESETS["llama3_405b"]) == 53248
    with torch.device("meta"):
        model = Transformer(a)
    assert 8.0e9 < num_params(model) < 8.1e9
    n = num_params(model, exclude_embeddings=True)
    seq = 8192
    assert flops_per_token(a, seq) == 6 * n + 12 * 32 * 32 * 128 * seq
    # Tied: the output matmul still costs FLOPs.
    assert flops_per_token(replace(TINY, tie_embeddings=True), 16) == flops_per_token(TINY, 16)
    debug = LLAMA3_PRESETS["debug"]
    assert debug.vocab_size == 256 and 64 <= debug.dim <= 128 and 2 <= debug.n_layers <= 4


def test_bad_args_rejected():
    with pytest.raises(ValueError, match="n_kv_heads"):
        ModelArgs(dim=32, n_heads=4, n_kv_heads=3)
    with pytest.raises(ValueError, match="max_seq_len"):
        _model()(torch.zeros(1, TINY.max_seq_len + 1, dtype=torch.long))


@pytest.mark.parametrize("mode", ["selective", "full"])
def test_activation_checkpointing_keeps_the_math_and_recomputes_its_matmuls(mode):
    """AC changes what is kept, not what is computed: loss and every gradient equal the
    unwrapped model's bitwise. The backward's matmul count shows the policy: a block has
    7 linears, each 2 matmuls in backward; ``full`` recomputes the first 6 forward
    matmuls (its recomputation stops early: w2's output is not needed by backward),
    ``selective`` (torchtitan's rule) the 2nd, 4th and 6th of each block (wk, wo, w3)."""
    from simplefsdp.parallel.activation_checkpoint import apply_ac

    reference = _model()
    wrapped = copy.deepcopy(reference)
    apply_ac(wrapped, mode)
    tokens = torch.randint(0, TINY.vocab_size, (2, 16),
                           generator=torch.Generator().manual_seed(1))
    counts, losses = [], []
    for model in (reference, wrapped):
        loss = torch.nn.functional.cross_entropy(model(tokens).flatten(0, 1), tokens.flatten())
        with OpCalls(torch.ops.aten.mm.default) as mm:
            loss.backward()
        counts.append(mm.calls)
        losses.append(loss)
    assert torch.equal(*losses)
    for (name, a), b in zip(reference.named_parameters(), wrapped.parameters(), strict=True):
        assert torch.equal(a.grad, b.grad), name
    recomputed = {"selective": 3, "full": 6}[mode] * TINY.n_layers
    assert counts[1] - counts[0] == recomputed, counts
