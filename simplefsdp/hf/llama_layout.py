"""Our Llama (``simplefsdp.models.llama``) <-> the Hugging Face Llama layout.

Names map one to one (``layers.3.attention.wq.weight`` <->
``model.layers.3.self_attn.q_proj.weight``). One thing differs beyond names: RoPE. Our
model rotates interleaved feature pairs ``(2i, 2i+1)`` (Meta's layout); Hugging Face's
rotates ``(i, i + head_dim/2)``. Permuting the rows of ``wq`` and ``wk`` within each
head turns one into the other, exactly (a permutation: the round trip is bitwise).
"""

from __future__ import annotations

import re

from ..models.llama import ModelArgs, ffn_hidden_dim
from . import HFError
from .weights import Source

_LAYER = {
    "attention.wq": "self_attn.q_proj", "attention.wk": "self_attn.k_proj",
    "attention.wv": "self_attn.v_proj", "attention.wo": "self_attn.o_proj",
    "feed_forward.w1": "mlp.gate_proj", "feed_forward.w3": "mlp.up_proj",
    "feed_forward.w2": "mlp.down_proj",
    "attention_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
    # our MoE (models/moe.py): transformers' in-memory MoE names (Mixtral, Qwen2/3-MoE)
    "feed_forward.gate": "mlp.gate", "feed_forward.experts.gate_up_proj":
        "mlp.experts.gate_up_proj", "feed_forward.experts.down_proj": "mlp.experts.down_proj",
}
_TOP = {"tok_embeddings.weight": "model.embed_tokens.weight",
        "norm.weight": "model.norm.weight", "output.weight": "lm_head.weight"}
_LAYER_RE = re.compile(r"layers\.(\d+)\.(.+?)(\.weight)?")


def to_hf_name(name: str) -> str:
    """Our parameter name -> the Hugging Face Llama name."""
    if name in _TOP:
        return _TOP[name]
    match = _LAYER_RE.fullmatch(name)
    if match is None or match.group(2) not in _LAYER:
        raise HFError(f"{name!r} has no Hugging Face Llama counterpart")
    return f"model.layers.{match.group(1)}.{_LAYER[match.group(2)]}{match.group(3) or ''}"


def rope_heads(name: str, args: ModelArgs) -> int | None:
    """Number of heads whose rows are RoPE-permuted in ``name`` (wq, wk), else None."""
    if name.endswith("attention.wq.weight"):
        return args.n_heads
    if name.endswith("attention.wk.weight"):
        return args.kv_heads
    return None


def sources_from_hf(names: list[str], args: ModelArgs) -> dict[str, Source]:
    """How to read each of our parameters from a Hugging Face Llama folder."""
    return {n: Source(to_hf_name(n), rope_heads(n, args)) for n in names}


def hf_config(args: ModelArgs, dtype: str = "float32"):
    """A ``transformers.LlamaConfig`` for ``args``."""
    from transformers import LlamaConfig

    config = LlamaConfig(
        vocab_size=args.vocab_size, hidden_size=args.dim,
        intermediate_size=ffn_hidden_dim(args), num_hidden_layers=args.n_layers,
        num_attention_heads=args.n_heads, num_key_value_heads=args.kv_heads,
        head_dim=args.head_dim, max_position_embeddings=args.max_seq_len,
        rms_norm_eps=args.norm_eps, tie_word_embeddings=args.tie_embeddings,
        attention_bias=False, mlp_bias=False, hidden_act="silu",
        rope_theta=args.rope_theta, bos_token_id=None, eos_token_id=None, pad_token_id=None)
    config.architectures = ["LlamaForCausalLM"]
    config.torch_dtype = dtype
    return config


# Our MoE's settings that Mixtral (softmax router, top-k weights renormalized, every
# block routed, no shared expert, no router bias) computes alike: key -> required value.
MIXTRAL_SAME = {"score_func": "softmax", "norm_topk_prob": True, "shared_hidden_dim": 0,
                "n_dense_layers": 0}


def mixtral_refusal(args) -> str | None:
    """Why our MoE ``args`` has no Mixtral counterpart (a ``model.`` key and its needed
    value), or None."""
    odd = {k: getattr(args, k) for k, v in MIXTRAL_SAME.items() if getattr(args, k) != v}
    if args.load_balance == "bias":
        odd["load_balance"] = "bias"
    if not odd:
        return None
    keys = ", ".join(f"model.{k} = {v!r}" for k, v in odd.items())
    return (f"{keys}: the export writes a Mixtral folder (Llama attention, softmax top-k "
            f"router with renormalized weights, routed experts only), which computes "
            f"{MIXTRAL_SAME} and no router bias (load_balance aux_loss or none)")


def hf_moe_config(args, dtype: str = "float32"):
    """A ``transformers.MixtralConfig`` for our MoE ``args`` (:func:`mixtral_refusal`
    None): Llama's fields of :func:`hf_config`, the experts', and the balance loss as
    transformers adds it (``output_router_logits``, ``router_aux_loss_coef``)."""
    from transformers import MixtralConfig

    fields = {k: v for k, v in hf_config(args, dtype).to_dict().items()
              if k in MixtralConfig().to_dict() and k not in ("architectures", "model_type")}
    config = MixtralConfig(**{**fields, "intermediate_size": args.moe_hidden_dim,
                              "num_local_experts": args.num_experts,
                              "num_experts_per_tok": args.top_k, "router_jitter_noise": 0.0,
                              "output_router_logits": args.load_balance == "aux_loss",
                              "router_aux_loss_coef": args.aux_loss_coef,
                              "sliding_window": None})
    config.architectures = ["MixtralForCausalLM"]
    return config


def _rope_theta(config) -> float:
    params = getattr(config, "rope_parameters", None) or {}
    theta = params.get("rope_theta", getattr(config, "rope_theta", None))
    kind = params.get("rope_type") or (getattr(config, "rope_scaling", None) or {}).get(
        "rope_type", "default")
    if kind != "default":
        raise HFError(f"the Hugging Face config uses rope_type = {kind!r}; our Llama "
                      f"implements only the default RoPE (set model.hf_path to train it "
                      f"with transformers' own class instead)")
    return float(theta)


def check_matches(config, args: ModelArgs, where: str) -> None:
    """Raise an HFError naming each field where a Hugging Face Llama config and our
    model's shape disagree."""
    if getattr(config, "model_type", None) != "llama":
        raise HFError(f"{where}: model_type = {getattr(config, 'model_type', None)!r}; our "
                      f"Llama reads only Hugging Face Llama folders (model_type 'llama')")
    kv = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
    pairs = {"hidden_size (model.dim)": (config.hidden_size, args.dim),
             "num_hidden_layers (model.n_layers)": (config.num_hidden_layers, args.n_layers),
             "num_attention_heads (model.n_heads)": (config.num_attention_heads, args.n_heads),
             "num_key_value_heads (model.n_kv_heads)": (kv, args.kv_heads),
             "vocab_size (model.vocab_size)": (config.vocab_size, args.vocab_size),
             "intermediate_size (FFN width)": (config.intermediate_size, ffn_hidden_dim(args)),
             "rope_theta (model.rope_theta)": (_rope_theta(config), args.rope_theta),
             "tie_word_embeddings (model.tie_embeddings)":
                 (bool(config.tie_word_embeddings), args.tie_embeddings)}
    bad = [f"{k}: {a} there, {b} here" for k, (a, b) in pairs.items() if a != b]
    if bad:
        raise HFError(f"{where}: the config does not match the model preset: "
                      f"{'; '.join(bad)}; pick the matching model.name or override those keys")
