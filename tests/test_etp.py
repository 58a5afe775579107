"""Expert tensor parallelism (``parallel.etp``, ``parallel/expert.py``'s ``apply_etp``):
each routed expert's width split over the TP ranks, every TP rank computing its slice for
the routed slots of its whole TP group.

* the trainer: TP 2 with ETP 2 against TP 2 with ETP 1 on the same 2 gloo ranks and the
  same global batch (losses, exported parameters);
* one MoE layer by hand: the routed grouped matmuls' FLOPs per TP rank (counted with
  ``FlopCounterMode``) and the layer's output and weight gradients against ETP 1;
* bad input refused at config load, naming the key.

The 4-rank and 8-rank commands (FSDP 2 x TP 2, HSDP 2 x 2 x TP 2) are in docs/moe.md."""

from __future__ import annotations

import pytest
import torch
from rank_runner import run_ranks
from toy import relabel_odd_bytes

from simplefsdp.config.job import load_config
from simplefsdp.errors import ConfigError

# test_moe_trainer's tiny debug_moe: 2 blocks of width 32, 4 experts of width 32, top-2,
# a shared expert, a balance loss with a large coefficient.
TINY = ["--model.name", "debug_moe", "--model.dim", "32", "--model.n_layers", "2",
        "--model.n_heads", "4", "--model.n_kv_heads", "2", "--model.num_experts", "4",
        "--model.moe_hidden_dim", "32", "--model.shared_hidden_dim", "32",
        "--model.aux_loss_coef", "0.1", "--training.seq_len", "32",
        "--training.batch_size", "2", "--training.steps", "3", "--training.warmup_steps", "1",
        "--training.lr", "1e-2", "--checkpoint.export_safetensors", "true"]
TP2 = ["--parallel.tp", "2"]


def _train(rank: int, world: int, out: str) -> dict:
    """TP 2 with ETP 1, then ETP 2, on these ranks: each run's losses and how many
    forwards went through ``etp_forward`` (the split experts)."""
    from simplefsdp.parallel import expert
    from simplefsdp.train.__main__ import main

    calls, split_forward = [], expert.etp_forward

    def counted(*args, **kwargs):
        calls.append(1)
        return split_forward(*args, **kwargs)

    expert.etp_forward, found = counted, {}
    for etp in (1, 2):
        calls.clear()
        losses = main([*TINY, *TP2, "--parallel.etp", str(etp), "--metrics.output_dir",
                       f"{out}/etp{etp}"], batch_transform=relabel_odd_bytes).losses
        found[etp] = (losses, len(calls))
    return found


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    out = tmp_path_factory.mktemp("etp")
    return out, run_ranks(_train, 2, str(out))


def _params(path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(path / "model.safetensors"))


def _initial_down() -> torch.Tensor:
    """The trainer's initial ``layers.1`` down-projection (seed 0, initialized on a
    meta-built model, as test_moe_trainer's ``_initial_model``)."""
    from simplefsdp.models import moe

    torch.manual_seed(0)
    with torch.device("meta"):
        model = moe.MoETransformer(load_config(None, TINY).model.model_args())
    model.to_empty(device="cpu")
    model.init_weights()
    return model.state_dict()["layers.1.feed_forward.experts.down_proj"]


def test_etp2_matches_etp1(trained):
    """3 AdamW steps of TP 2 with the experts split over TP equal TP 2 without (the
    experts' weights FSDP-sharded over the 2 TP ranks in both): routing is the same (the
    router and everything outside the experts is unchanged); only each expert's
    down-projection is summed in two halves over the ranks instead of in one matmul, a
    float32 reordering of a few ulps. Losses within 1e-6 relative; exported parameters
    within test_moe_trainer's TP tolerance (3.5e-5 absolute: AdamW's first steps move a
    weight whose gradient is near eps by up to ~lr, so a few-ulp gradient difference
    shows there; a lost slice or a doubled gradient moves thousands of elements by
    ~1e-3)."""
    out, results = trained
    for rank in range(2):
        assert results[rank][2][0] == pytest.approx(results[0][1][0], rel=1e-6)
        # ETP 2 ran the split experts: 2 routed blocks x 3 steps; ETP 1 never did
        assert (results[rank][1][1], results[rank][2][1]) == (0, 6)
    want, got = _params(out / "etp1"), _params(out / "etp2")
    assert set(got) == set(want)
    for name, value in want.items():
        torch.testing.assert_close(got[name], value, rtol=0, atol=3.5e-5, msg=name)
    moved = got["layers.1.feed_forward.experts.down_proj"] - _initial_down()
    assert moved.abs().max() > 1e-3  # the comparison is not between two initial models


def _grouped_mm_flops(rows, weights, *_, out_shape=None, **__) -> int:
    """FLOPs of one forward grouped matmul (FlopCounterMode has no formula for it):
    ``rows [M, K]`` against the experts' ``[E, K, N]``, each row through one expert:
    2 x M x K x N."""
    assert len(rows) == 2 and len(weights) == 3, (rows, weights)
    return 2 * rows[0] * rows[1] * weights[2]


GROUPED_MM_FLOPS = {torch.ops.aten._grouped_mm: _grouped_mm_flops}


def _layer(rank: int, world: int) -> dict:
    """One MoE layer (4 experts of width 32, dim 16) on TP 2 ranks, each routing 8 tokens
    of its own: its experts' FLOPs (``FlopCounterMode``), output and weight gradients,
    plain (ETP 1: this rank's slots, whole experts) and with :func:`apply_etp`."""
    import torch.distributed as dist
    from torch.utils.flop_counter import FlopCounterMode

    import simplefsdp as sf
    from simplefsdp._torch_compat import grouped_mm
    from simplefsdp.models.moe import MoE, MoEArgs
    from simplefsdp.parallel.expert import apply_etp

    args = MoEArgs(dim=16, n_layers=1, n_heads=2, vocab_size=32, num_experts=4, top_k=2,
                   moe_hidden_dim=32)
    torch.manual_seed(0)
    layer = MoE(args)
    layer.init_weights(0.02)
    torch.manual_seed(1 + rank)  # each TP rank's own tokens
    x = torch.randn(8, 16)
    grouped_mm(x.device, x.dtype)  # its first-use probe runs now, not inside a count
    found, counters = {}, []
    # counts the experts' call only (not the router): a counter entered around it
    layer.experts.register_forward_pre_hook(lambda *_: counters[-1].__enter__() and None)
    layer.experts.register_forward_hook(
        lambda *_: counters[-1].__exit__(None, None, None) and None)
    for etp in (1, 2):
        if etp == 2:
            apply_etp(layer, sf.make_mesh(dp_shard=1, tp=world)["tp"])
        layer.zero_grad()
        counters.append(FlopCounterMode(display=False, custom_mapping=GROUPED_MM_FLOPS))
        out = layer(x)
        experts = counters[-1].get_total_flops()
        out.square().sum().backward()
        grads = [p.grad.clone() for p in layer.experts.parameters()]
        for grad in grads:  # the experts' data parallel sums the slices over TP
            dist.all_reduce(grad)
        found[etp] = {"flops": experts, "out": out.detach(), "grads": grads}
    return found


@pytest.mark.quick
def test_etp_halves_the_width_per_rank():
    """Counted per TP rank: ETP 2 runs the grouped matmuls on the routed slots of both TP
    ranks (2 x 16) at half the width; ETP 1 here already gives each TP rank only its own
    part of the sequence (moe_tp_plan), so per rank the FLOPs are equal, and per routed
    slot halved. Output and summed weight gradients equal ETP 1's up to float32
    reordering (the down-projection summed in two halves: 1e-6 absolute on values and
    gradients of order 1e-2..1)."""
    results = run_ranks(_layer, 2)
    slots, dim, width = 16, 16, 32  # 8 tokens x top-2
    whole = 3 * 2 * slots * dim * width  # gate, up, down: 2 FLOPs per multiply-add
    for rank in range(2):
        etp1, etp2 = results[rank][1], results[rank][2]
        assert etp1["flops"] == whole
        assert etp2["flops"] == 3 * 2 * (2 * slots) * dim * (width // 2)
        assert etp2["flops"] / (2 * slots) == etp1["flops"] / slots / 2
        torch.testing.assert_close(etp2["out"], etp1["out"], rtol=0, atol=1e-6)
        for got, want in zip(etp2["grads"], etp1["grads"], strict=True):
            torch.testing.assert_close(got, want, rtol=0, atol=1e-6)


MOE = [*TINY, *TP2]


@pytest.mark.parametrize("flags, message", [
    (["--parallel.etp", "4"], "parallel.etp = 4 must be 1 or parallel.tp = 2"),
    (["--parallel.etp", "0"], "parallel.etp = 0 must be 1 or parallel.tp = 2"),
    (["--parallel.etp", "2", "--parallel.ep", "2"], "parallel.etp = 2 cannot be combined "
                                                    "with parallel.ep = 2"),
    (["--parallel.etp", "2", "--parallel.pp", "2", "--model.n_layers", "2"],
     "parallel.etp = 2 cannot be combined with parallel.pp = 2"),
    (["--parallel.etp", "2", "--parallel.cp_ring", "2"], "cp_ring / cp_ulysses > 1"),
    (["--parallel.etp", "2", "--parallel.expert_dispatch", "padded"],
     "expert_dispatch = 'padded'"),
    (["--parallel.etp", "2", "--compile.enable", "true"], "compile.enable = true"),
])
def test_etp_bad_input_refused(flags, message):
    """Each unsupported value or combination is refused at config load, naming the key
    and the fix (``set parallel.etp = ...``)."""
    with pytest.raises(ConfigError, match="parallel.etp") as caught:
        load_config(None, [*MOE, *flags], world_size=8)
    assert message in str(caught.value)
    assert "set parallel.etp = " in str(caught.value)


def test_etp_needs_an_moe_model():
    with pytest.raises(ConfigError, match="model.family = 'llama'"):
        load_config(None, ["--model.name", "debug", "--parallel.tp", "2",
                           "--parallel.etp", "2"], world_size=2)
