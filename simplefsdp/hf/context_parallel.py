"""Context parallelism for Hugging Face causal LMs (``model.hf_path`` with
``parallel.cp_ring`` / ``parallel.cp_ulysses`` > 1).

Our ring / Ulysses attention (``parallel.context.ContextAttention``) is registered in
transformers' ``AttentionInterface`` as :data:`NAME` and selected on the model
(``set_attn_implementation``): every attention module of the Llama family (Llama,
Mistral, Qwen2/3, ...) hands it its rotated q/k/v, ``(batch, heads, seq, head_dim)``,
k/v with fewer heads under GQA. Each rank's global positions (``rank_positions``: the
head-tail layout) are passed to the forward as ``position_ids``, so RoPE turns each token
by its place in the whole sequence (:func:`.model.causal_lm_call`).

The mask: transformers builds none for an attention function that has no mask function
of the same name in ``AttentionMaskInterface`` (``masking_utils``: ``attention_mask`` is
then None), so its locally sized causal mask never exists; causality comes from the
global layout inside the ring / Ulysses attention. What needs another mask or another
softmax is refused, at config load from config.json (:func:`check_config`: non-causal,
sliding windows shorter than the sequence, attention softcapping, a non-default scale,
dropout, vision-language configs) and, as a backstop, when the attention runs
(:func:`attention`: any mask, sinks, unknown arguments).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from . import HFError

NAME = "simplefsdp_context"  # our entry in transformers' AttentionInterface
# Arguments transformers' Llama-family attention modules pass on that change nothing here
# (``output_router_logits``: an MoE's, e.g. Mixtral's, asks for the routers' outputs).
_HARMLESS = frozenset({"position_ids", "use_cache", "cache_position", "output_attentions",
                       "output_router_logits"})
_LAYER_TYPES = frozenset({"full_attention", "sliding_attention"})
# config.json keys of attention-probability dropout in transformers' causal LMs:
# attention_dropout (Llama family and most others), attn_pdrop (GPT-2, GPT-J, CodeGen,
# GPTBigCode, OpenAI GPT; DBRX and MPT inside attn_config), attention_probs_dropout_prob
# (BERT-style models used as decoders)
_DROPOUT_KEYS = ("attention_dropout", "attn_pdrop", "attention_probs_dropout_prob")
_FIX = "set parallel.cp_ring = parallel.cp_ulysses = 1"


def _unfit(text, seq_len: int) -> str | None:
    """What of the language model's config (``text``) our causal attention over global
    positions cannot compute, naming its config.json key; None if it fits."""
    heads = text.num_attention_heads
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // heads
    window = getattr(text, "sliding_window", None)
    layer_types = getattr(text, "layer_types", None) or []
    windowed = getattr(text, "use_sliding_window", True) is not False and (
        not layer_types or "sliding_attention" in layer_types)
    scalar = getattr(text, "query_pre_attn_scalar", None)
    if getattr(text, "is_causal", True) is False:
        return "is_causal = false (bidirectional attention)"
    if set(layer_types) - _LAYER_TYPES:
        return f"layer_types has {sorted(set(layer_types) - _LAYER_TYPES)} (not softmax " \
               f"attention over the sequence)"
    if windowed and window is not None and window < seq_len:
        return f"sliding_window = {window} < training.seq_len = {seq_len} (a window " \
               f"shorter than the sequence needs its own mask)"
    if getattr(text, "attn_logit_softcapping", None) is not None:
        return "attn_logit_softcapping (tanh-capped attention scores)"
    if scalar is not None and scalar != head_dim:
        return f"query_pre_attn_scalar = {scalar} != head_dim = {head_dim} (the kernels " \
               f"scale by head_dim ** -0.5)"
    dropout = _attention_dropout(text)
    if dropout is not None:
        return f"{dropout[0]} = {dropout[1]} (attention dropout, which CP attention does not " \
               f"compute: set it to 0)"
    if getattr(text, "output_router_logits", False):
        return "output_router_logits = true (the balance loss's statistics are per " \
               "forward, here part of each sequence; model.router_aux_loss_coef = 0 turns it off)"
    return None


def _attention_dropout(text) -> tuple[str, float] | None:
    """(config.json key, value) of the first attention dropout above 0 in ``text``, also
    inside a nested ``attn_config`` (DBRX, MPT: an object or a dict); None without one."""
    nested = getattr(text, "attn_config", None)
    for prefix, where in (("", text), ("attn_config.", nested)):
        for key in _DROPOUT_KEYS:
            value = where.get(key) if isinstance(where, dict) else getattr(where, key, None)
            if value:
                return prefix + key, value
    return None


def check_config(cfg, dims) -> None:
    """Refuse at config load (an HFError naming the key) a ``model.hf_path`` model that
    context parallelism cannot run, and split its sequence and heads
    (``ParallelDims.check_cp`` on config.json's ``num_attention_heads``). Imports
    transformers (to read the config) only when ``cp > 1``. ``dims``: the config's
    ``ParallelDims``."""
    from ..errors import config_errors
    from .model import job_config, text_config

    if dims.cp == 1:
        return
    where = Path(cfg.model.hf_path) / "config.json"
    config = job_config(cfg)  # with model.router_aux_loss_coef applied
    text = text_config(config)
    if text is not config:
        raise HFError(f"{where}: {type(config).__name__} wraps a language model in a "
                      f"multimodal one (its masks are not causal); context parallelism runs "
                      f"text-only causal LMs; {_FIX}")
    if cfg.parallel.ep > 1:
        raise HFError(f"parallel.ep = {cfg.parallel.ep} with context parallelism on a Hugging "
                      f"Face model is not supported: set parallel.ep = 1 or {_FIX}")
    problem = _unfit(text, cfg.training.seq_len)
    if problem is not None:
        raise HFError(f"{where}: {problem}; context-parallel attention (parallel.cp_ring / "
                      f"parallel.cp_ulysses) computes plain causal softmax attention; {_FIX}")
    with config_errors():
        dims.check_cp(cfg.training.seq_len, text.num_attention_heads, "training.seq_len",
                      f"{where}: num_attention_heads")


@dataclass(frozen=True)
class _Setup:
    """What :func:`attention` needs, set on every module of a prepared model."""

    core: object  # parallel.context.ContextAttention over this rank's cp groups
    seq_len: int  # the whole sequence (sliding windows at least this long change nothing)


def _problem(setup: _Setup, module: nn.Module, query: torch.Tensor, value: torch.Tensor,
             mask, dropout: float, scaling, sliding_window, softcap, kwargs: dict
             ) -> str | None:
    """Why one attention call cannot run as causal softmax attention over global
    positions (None if it can)."""
    unknown = sorted(set(kwargs) - _HARMLESS)
    if mask is not None:
        return "a mask (padding, packed sequences or a custom mask)"
    if not getattr(module, "is_causal", True) or kwargs.get("is_causal", True) is False:
        return "non-causal attention"
    if sliding_window is not None and sliding_window < setup.seq_len:
        return f"a sliding window of {sliding_window} < training.seq_len = {setup.seq_len}"
    if softcap is not None:
        return "softcapped scores"
    if dropout:
        return f"dropout {dropout}"
    if scaling is not None and not math.isclose(scaling, query.shape[-1] ** -0.5,
                                                rel_tol=1e-6):
        return f"scale {scaling} (the kernels use head_dim ** -0.5)"
    if value.shape[-1] != query.shape[-1]:
        return "value heads of another size than the query heads"
    if unknown:
        return f"arguments it does not handle: {unknown} (e.g. attention sinks)"
    return None


def attention(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
              attention_mask, dropout: float = 0.0, scaling: float | None = None,
              sliding_window: int | None = None, softcap: float | None = None,
              is_causal: bool | None = None, **kwargs):
    """transformers' attention-function signature: q/k/v ``(batch, heads, seq,
    head_dim)`` of this rank's tokens -> (output ``(batch, seq, heads, head_dim)``, no
    weights), causal over the whole sequence (ring / Ulysses)."""
    setup = getattr(module, "_sf_context", None)
    if setup is None:
        raise HFError(f"{type(module).__name__}: attention {NAME!r} runs only on a model "
                      f"prepared by simplefsdp.hf.context_parallel.apply_cp")
    if is_causal is not None:
        kwargs["is_causal"] = is_causal
    problem = _problem(setup, module, query, value, attention_mask, dropout, scaling,
                       sliding_window, softcap, kwargs)
    if problem is not None:
        raise HFError(f"model.hf_path: {type(module).__name__} asks context-parallel "
                      f"attention for {problem}, which it does not compute; {_FIX}")
    out = setup.core(query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2))
    return out, None


def apply_cp(model: nn.Module, mesh, seq_len: int, rotate: str = "allgather") -> None:
    """Context parallelism on a transformers causal LM, in place: :func:`attention`
    registered and selected, every module given the ring / Ulysses core, and
    ``model._sf_positions`` this rank's global positions (the forward's ``position_ids``);
    ``rotate``: the ring's K/V exchange (``parallel.cp_rotate``).
    The inputs must then be this rank's tokens (``parallel.context.cp_batches``)."""
    from transformers import AttentionInterface

    from ..parallel.context import ContextAttention, rank_positions

    if not getattr(model, "_supports_attention_backend", False):
        raise HFError(f"model.hf_path: {type(model).__name__} does not route its attention "
                      f"through transformers' AttentionInterface, so context-parallel "
                      f"attention cannot replace it; {_FIX}")
    AttentionInterface.register(NAME, attention)
    setup = _Setup(ContextAttention(mesh, rotate), seq_len)
    for module in model.modules():  # the attention modules read it (they vary by class)
        module._sf_context = setup
    model.set_attn_implementation(NAME)
    model._sf_positions = rank_positions(mesh, seq_len)
