"""Incremental decoding for our Llama and MoE models: a key/value cache put in from
outside, as the parallelisms are, so the models stay plain training modules.

Every attention module (``llama.Attention``, ``mla.MultiHeadLatentAttention``) calls its
``core(q, k, v, mask)`` with the rotated keys and the values of the tokens it is given.
:class:`KVCache`
swaps each core for one that appends those keys and values to the layer's cache and
attends the new queries to everything cached, and sets the model's ``positions`` so that
RoPE turns each new token by its place in the whole sequence. A forward over the prompt
fills the caches; each later forward takes only the newest token.
"""

from __future__ import annotations

import torch
from torch import nn


class _CachedCore:
    """One layer's cache around its attention core ``core``."""

    def __init__(self, core):
        self.core = core
        self.k: torch.Tensor | None = None
        self.v: torch.Tensor | None = None

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 mask: torch.Tensor | None = None) -> torch.Tensor:
        if mask is not None:
            raise ValueError("the key/value cache decodes plain causal attention; the model "
                             "has a document mask (document_eos): set it to None")
        if self.k is not None:
            k, v = torch.cat([self.k, k], dim=1), torch.cat([self.v, v], dim=1)
        self.k, self.v = k, v
        new, total = q.shape[1], k.shape[1]
        if new == total:  # the prompt: plain causal attention
            return self.core(q, k, v, None)
        # query i sits at position total - new + i: it sees keys up to there
        causal = torch.ones(new, total, dtype=torch.bool, device=q.device).tril(total - new)
        return self.core(q, k, v, causal[None, None])


class KVCache:
    """Put the cache into ``model`` (a ``llama.Transformer`` or a subclass) for one
    generation; :meth:`close` (or leaving the ``with``) gives the model its cores back."""

    def __init__(self, model: nn.Module):
        self.model = model
        self.attentions = [m for m in model.modules()
                           if hasattr(m, "core") and callable(m.core) and
                           not isinstance(m.core, _CachedCore)]
        if not self.attentions:
            raise ValueError(f"{type(model).__name__} has no attention module with a core "
                             f"to cache (our Llama and MoE models have)")
        self.length = 0  # tokens cached

    def __enter__(self) -> KVCache:
        for attention in self.attentions:
            attention.core = _CachedCore(attention.core)
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        for attention in self.attentions:
            if isinstance(attention.core, _CachedCore):
                attention.core = attention.core.core
        self.model.positions = None
        self.length = 0

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        """Logits of ``tokens`` (batch, new), which follow the cached ones."""
        new = tokens.shape[1]
        if self.length + new > self.model.args.max_seq_len:
            raise ValueError(f"{self.length + new} tokens exceed the model's max_seq_len = "
                             f"{self.model.args.max_seq_len}")
        self.model.positions = torch.arange(self.length, self.length + new,
                                            device=tokens.device)
        logits = self.model(tokens)
        self.length += new
        return logits
