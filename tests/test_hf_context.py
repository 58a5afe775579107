"""Context parallelism on Hugging Face models (issue 29; ``simplefsdp/hf/context_parallel.py``).

* The trainer on 4 gloo processes, a tiny Llama saved here with ``save_pretrained``
  (4 query heads, 2 KV heads: GQA), DP 2 x ring 2 and ring 2 x Ulysses 2, against one
  process without CP on the same global batch of 4 sequences: the losses and gradient
  norms of 3 steps, and every parameter after them (the safetensors export). Float32
  results differing only in summation order (attention merged by log-sum-exp, sums over
  4 ranks): bounds as ``test_context_parallel``'s, 1e-6 relative for losses and norms,
  1e-5 absolute for parameters (AdamW at lr 1e-3 moves a weight by ~1e-3 a step: a wrong
  update shows). The first loss also equals transformers' own model's loss over the
  whole sequences (its SDPA attention, its mean; 1e-6 relative, float32 rounding).
* Qwen3 (q/k norms) and Mistral (a sliding window longer than the sequence), ring 2 x
  Ulysses 2 on the same 4 processes, the model called directly (``causal_lm_call``):
  each rank's logits equal the whole-sequence model's at its positions (1e-5 absolute:
  float32, logits ~1), and the gradients of the summed loss, all-reduced over the ranks,
  equal the whole-sequence model's (1e-5 absolute, gradients ~1e-1).
* Refused at config load, naming the config.json key: sliding windows shorter than the
  sequence, attention softcapping (Gemma 2), non-causal attention, heads that Ulysses
  cannot split, attention dropout (``attention_dropout``, GPT-2's ``attn_pdrop``, DBRX's
  nested ``attn_config.attn_pdrop``, BERT-style ``attention_probs_dropout_prob``).
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")  # the [hf] extra; CI installs it with .[dev]

from rank_runner import run_ranks  # noqa: E402

from simplefsdp.config.job import load_config  # noqa: E402
from simplefsdp.errors import ConfigError

pytestmark = pytest.mark.many_ranks  # more than 2 ranks at once (conftest.py)

os.environ.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", HF_DATASETS_OFFLINE="1")
SEQ = 32
SHAPE = dict(vocab_size=256, hidden_size=48, intermediate_size=72, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
             tie_word_embeddings=False, eos_token_id=0, bos_token_id=None)


def _save(folder: Path, kind: str, **kw) -> Path:
    import transformers

    torch.manual_seed(0)
    config = getattr(transformers, f"{kind}Config")(**{**SHAPE, **kw})
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(folder)
    return folder


def _argv(folder: Path, out: Path, *flags: str) -> list[str]:
    return ["--model.hf_path", str(folder), "--data.tokenizer", "byte", "--training.steps",
            "3", "--training.seq_len", str(SEQ), "--training.warmup_steps", "0",
            "--metrics.log_every", "1", "--checkpoint.export_safetensors", "true",
            "--training.hang_watchdog_s", "0", "--metrics.output_dir", str(out), *flags]


CELLS = {  # a global batch of 4 sequences on 4 processes
    "dp2_ring2": ["--training.batch_size", "2", "--parallel.cp_ring", "2",
                  "--activation_checkpoint.mode", "full"],
    "ring2_ulysses2": ["--training.batch_size", "4", "--parallel.cp_ring", "2",
                       "--parallel.cp_ulysses", "2"],
}


def _direct(folder: str, seq: int):
    """Rank's logits at its positions vs the whole-sequence model's, and the gradients
    (all-reduced over the cp ranks) vs the whole-sequence model's: max abs differences."""
    import copy

    import torch.distributed as dist
    import torch.nn.functional as F
    from transformers import AutoModelForCausalLM

    from simplefsdp.hf.context_parallel import apply_cp
    from simplefsdp.hf.model import causal_lm_call
    from simplefsdp.mesh import ParallelDims
    from simplefsdp.parallel.context import rank_positions

    mesh = ParallelDims(cp_ring=2, cp_ulysses=2).resolve(4).build_mesh()
    whole = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    model = copy.deepcopy(whole)
    apply_cp(model, mesh, seq)
    tokens = torch.randint(0, 256, (2, seq + 1), generator=torch.Generator().manual_seed(1))
    inputs, targets = tokens[:, :-1], tokens[:, 1:]
    ref = causal_lm_call(whole, whole)(inputs)
    F.cross_entropy(ref.flatten(0, 1), targets.flatten(), reduction="sum").backward()
    mine = rank_positions(mesh, seq)
    logits = causal_lm_call(model, model)(inputs[:, mine])
    F.cross_entropy(logits.flatten(0, 1), targets[:, mine].flatten(), reduction="sum").backward()
    logit_diff = (logits - ref[:, mine]).abs().max().item()
    grad_diff = grad_max = 0.0
    for p, q in zip(model.parameters(), whole.parameters(), strict=True):
        dist.all_reduce(p.grad)
        grad_diff = max(grad_diff, (p.grad - q.grad).abs().max().item())
        grad_max = max(grad_max, q.grad.abs().max().item())
    return logit_diff, grad_diff, ref.abs().max().item(), grad_max


def _runs(rank, world, cells, out, direct):
    from simplefsdp.train.__main__ import main

    results = {name: (run.losses, run.grad_norms) for name, run in
               ((name, main(argv + ["--metrics.output_dir", str(Path(out) / name)]))
                for name, argv in cells.items())}
    results.update({name: _direct(folder, SEQ) for name, folder in direct.items()})
    return results


def _reference(rank, world, argv, folder):
    """One process: the losses and norms, and transformers' own loss of the first
    global batch (captured as the trainer reads it)."""
    from transformers import AutoModelForCausalLM

    from simplefsdp.train.__main__ import main

    seen = []

    def capture(inputs, targets):
        seen.append((inputs, targets))
        return inputs, targets

    run = main(argv, batch_transform=capture)
    inputs, targets = seen[0]
    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    with torch.no_grad():
        theirs = hf(input_ids=inputs, labels=inputs, shift_labels=targets.contiguous()).loss
    return run.losses, run.grad_norms, theirs.item()


def _params(path):
    from safetensors.torch import load_file

    return load_file(str(path / "model.safetensors"))


def test_hf_llama_cp_matches_one_process(tmp_path):
    llama = _save(tmp_path / "llama", "Llama")
    direct = {"qwen3": str(_save(tmp_path / "qwen3", "Qwen3", head_dim=12)),
              "mistral": str(_save(tmp_path / "mistral", "Mistral", sliding_window=4096))}
    cells = {name: _argv(llama, tmp_path / name, *flags) for name, flags in CELLS.items()}
    got = run_ranks(_runs, 4, cells, str(tmp_path), direct)[0]
    ref_dir = tmp_path / "reference"
    losses, norms, theirs = run_ranks(_reference, 1, _argv(llama, ref_dir, "--training."
                                                           "batch_size", "4"), str(llama))[0]
    reference = _params(ref_dir)
    print(f"reference losses {losses}, transformers' first loss {theirs}")
    for name in CELLS:
        for got_list, want in zip(got[name], (losses, norms), strict=True):
            torch.testing.assert_close(torch.tensor(got_list), torch.tensor(want),
                                       rtol=1e-6, atol=0, msg=name)
        assert got[name][0][0] == pytest.approx(theirs, rel=1e-6, abs=0), name
        params = _params(tmp_path / name)
        print(name, got[name], max((v - reference[k]).abs().max().item()
                                   for k, v in params.items()))
        assert params.keys() == reference.keys()
        for key, value in params.items():
            torch.testing.assert_close(value, reference[key], rtol=0, atol=1e-5,
                                       msg=f"{name}: {key}")
    for name in direct:
        logit_diff, grad_diff, logit_max, grad_max = got[name]
        print(name, got[name])
        assert logit_diff <= 1e-5 and grad_diff <= 1e-5, (name, got[name])
        assert logit_max > 0.1 and grad_max > 1.0, (name, got[name])  # not vanishing


@pytest.mark.parametrize("kind, kw, flags, message", [
    ("Mistral", {"sliding_window": 16}, [], "sliding_window = 16 < training.seq_len = 32"),
    ("Gemma2", {"head_dim": 12}, [], "attn_logit_softcapping"),
    ("Gemma2", {"head_dim": 12, "attn_logit_softcapping": None}, [],
     "query_pre_attn_scalar = 256 != head_dim = 12"),
    ("Llama", {"is_causal": False}, [], "is_causal = false"),
    ("Llama", {"layer_types": ["full_attention", "linear_attention"]}, [],
     "layer_types has ['linear_attention']"),
    ("Llama", {}, ["--parallel.cp_ulysses", "8"],
     "num_attention_heads = 4 is not divisible by parallel.cp_ulysses = 8"),
    # attention dropout under each key transformers' causal LMs use
    ("Llama", {"attention_dropout": 0.1}, [], "attention_dropout = 0.1 (attention dropout"),
    ("GPT2", {}, [], "attn_pdrop = 0.1 (attention dropout"),  # GPT-2's default
    ("Dbrx", {"attn_config": {"attn_pdrop": 0.2}}, [], "attn_config.attn_pdrop = 0.2"),
    ("BertGeneration", {}, [], "attention_probs_dropout_prob = 0.1"),  # its default
])
def test_unfit_hf_models_are_refused_at_load(tmp_path, kind, kw, flags, message):
    import transformers

    getattr(transformers, f"{kind}Config")(**{**SHAPE, **kw}).save_pretrained(tmp_path)
    with pytest.raises(ConfigError) as info:  # config.json is all the check reads
        load_config(None, _argv(tmp_path, tmp_path / "out", *(flags or
                                                              ["--parallel.cp_ring", "2"])))
    assert message in str(info.value) and "config.json" in str(info.value), info.value


@pytest.mark.parametrize("kwargs, message", [
    ({"attention_mask": torch.ones(1, 1, 4, 4, dtype=torch.bool)}, "a mask"),
    ({"sliding_window": 7}, "a sliding window of 7 < training.seq_len = 8"),
    ({"softcap": 50.0}, "softcapped scores"),
    ({"dropout": 0.1}, "dropout 0.1"),
    ({"scaling": 1.0}, "scale 1.0"),
    ({"s_aux": torch.zeros(4)}, "['s_aux']"),  # gpt-oss's attention sinks
    ({"is_causal": False}, "non-causal"),
    # runs: a window as long as the sequence, the default scale, what Llama / Mixtral pass
    ({"sliding_window": 8, "scaling": 0.25, "position_ids": None, "use_cache": False,
      "output_router_logits": False}, None),
])
def test_attention_refuses_what_it_does_not_compute(kwargs, message):
    """The backstop in the attention function itself, one call on (batch 1, 4 heads, 4 of
    8 tokens, head_dim 16): a core that returns its query stands in for ring / Ulysses."""
    from simplefsdp.hf import HFError
    from simplefsdp.hf.context_parallel import _Setup, attention

    module = torch.nn.Module()
    module._sf_context = _Setup(core=lambda q, k, v: q, seq_len=8)
    q = torch.randn(1, 4, 4, 16)
    kwargs = {"attention_mask": None, **kwargs}
    if message is None:
        out, weights = attention(module, q, q[:, :2], q[:, :2], **kwargs)
        assert torch.equal(out, q.transpose(1, 2)) and weights is None
        return
    with pytest.raises(HFError, match="parallel.cp_ring = parallel.cp_ulysses = 1") as info:
        attention(module, q, q[:, :2], q[:, :2], **kwargs)
    assert message in str(info.value), info.value


def test_a_model_that_bypasses_the_attention_interface_is_refused():
    """A module without transformers' ``_supports_attention_backend`` would never call our
    attention (each rank would attend over its own tokens only): refused before anything
    is changed."""
    from simplefsdp.hf import HFError
    from simplefsdp.hf.context_parallel import apply_cp

    model = torch.nn.Linear(2, 2)
    with pytest.raises(HFError, match="does not route its attention through"):
        apply_cp(model, None, 8)
    assert not hasattr(model, "_sf_context")
