"""transformers' MoE experts under ``data_parallel``.

transformers 5 keeps routed experts as two 3-D parameters, ``gate_up_proj [E, 2I, H]``
(gate rows, then up rows) and ``down_proj [E, H, I]``, in an ``experts`` module called as
``experts(hidden_states, top_k_index, top_k_weights)`` (Qwen2/3-MoE, Mixtral, OLMoE,
DeepSeek-V3, ...). Its default forward loops over the experts that received tokens and
reads the weights once per such expert; under ``data_parallel`` every read is an
all-gather (and in eager backward, every saved slice is gathered again), and ranks route
different tokens: they would issue different collectives and hang.

:func:`adapt_experts` gives each such module a forward that reads each weight once and
runs every expert, ours (``models.moe.routed_combine`` and ``expert_ffn``): on the loop
path it makes transformers' per-expert matmuls on the same rows in the same order and
adds each token's results in the same order (bitwise equal where the BLAS rounds rows
alike wherever they sit in memory; a CPU BLAS rounds some 2-3 row products by their
alignment); on the grouped-matmul path (``_torch_compat.grouped_mm`` with aligned
shapes) it agrees to float rounding. The router and the rest of the block stay
transformers'.

Refused before training (an ``HFError`` naming ``model.hf_path``): experts kept as a list
of per-expert modules, and fused experts of another layout (biases, transposed or
interleaved weights, no gate, an activation other than SiLU).
"""

from __future__ import annotations

import re

import torch
import torch.nn.functional as F
from torch import nn

from ..models.moe import counted_call, routed_combine, routed_ffn
from ..module_swap import derived_class
from ..parallel.expert import holds_experts
from . import HFError

WEIGHTS = ("gate_up_proj", "down_proj")
# Flags transformers' ``use_experts_implementation`` sets on an experts module, and the
# values of the layout ``expert_ffn`` computes.
_LAYOUT = {"has_gate": True, "has_bias": False, "is_transposed": False,
           "is_concatenated": True, "has_post_expert_norm": False}


def experts_modules(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """``(name, module)`` of every fused experts module (a 3-D ``gate_up_proj``)."""
    return [(name, m) for name, m in model.named_modules() if holds_experts(m)]


def _refusal(name: str, module: nn.Module) -> str | None:
    """Why ``module`` does not have the layout ``expert_ffn`` computes, or None."""
    params = set(module._parameters)
    if params != set(WEIGHTS):
        return f"its parameters are {sorted(params)}, not {list(WEIGHTS)}"
    gate_up, down = (module._parameters[w] for w in WEIGHTS)
    experts, two_width, dim = gate_up.shape
    if two_width % 2 or tuple(down.shape) != (experts, dim, two_width // 2):
        return (f"gate_up_proj {list(gate_up.shape)} and down_proj {list(down.shape)} are not "
                f"[E, 2I, H] and [E, H, I]")
    odd = {k: getattr(module, k) for k, v in _LAYOUT.items() if getattr(module, k, v) != v}
    if odd:
        return f"its layout flags are {odd}, expected {dict(_LAYOUT)}"
    probe = torch.linspace(-4, 4, 17)
    act = getattr(module, "act_fn", None)
    if act is None or not torch.equal(act(probe), F.silu(probe)):
        return f"its activation {type(act).__name__} is not SiLU"
    return None


def check_experts(model: nn.Module) -> None:
    """Refuse (HFError) MoE experts that :func:`adapt_experts` cannot run."""
    for name, module in model.named_modules():
        if name.endswith("experts") and isinstance(module, nn.ModuleList):
            raise HFError(f"model.hf_path: {type(model).__name__} keeps {name} as a list of "
                          f"per-expert modules, which run only for the tokens each rank "
                          f"routes (ranks would gather different weights); only fused "
                          f"experts (gate_up_proj [E, 2I, H], down_proj [E, H, I]) train here")
    for name, module in experts_modules(model):
        why = _refusal(name, module)
        if why is not None:
            raise HFError(f"model.hf_path: {type(model).__name__}'s experts {name!r} cannot "
                          f"be trained here: {why}; supported are SwiGLU experts with "
                          f"gate_up_proj [E, 2I, H] (gate rows, then up) and down_proj "
                          f"[E, H, I], no biases (as Qwen3-MoE, Mixtral)")


class RoutedExperts(nn.Module):
    """The experts' forward (mixed into a transformers experts class). Its
    ``tokens_per_expert`` buffer (``models.moe.COUNTERS``, as our MoE's) adds this rank's
    routed slots per expert until :func:`take_loads` reads them; an
    activation-checkpointing recompute routes the same tokens again and is not counted
    (``models.moe.counted_call``). Traceable: the counts have a static shape, and
    the split sizes become unbacked sizes under our compile path."""

    _sf_num_experts: int
    tokens_per_expert: torch.Tensor

    def forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                top_k_weights: torch.Tensor) -> torch.Tensor:
        flat = top_k_index.flatten()
        if not torch.compiler.is_compiling() and flat.numel() \
                and int(flat.max()) >= self._sf_num_experts:
            raise ValueError(f"the router chose expert {int(flat.max())} of "
                             f"{self._sf_num_experts}: placeholder experts are not supported")
        # not bincount, whose output length depends on the data (a graph break)
        counts = torch.zeros(self._sf_num_experts, dtype=flat.dtype, device=flat.device
                             ).index_add_(0, flat, torch.ones_like(flat))
        if counted_call():
            with torch.no_grad():
                self.tokens_per_expert += counts
        return routed_combine(hidden_states, top_k_weights, top_k_index, counts, self._sf_run)

    def _sf_run(self, x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """``x`` grouped by expert, ``counts`` per expert -> through the experts (sent to
        the ranks holding them when :func:`expert_parallel` split them)."""
        if getattr(self, "_sf_ep_group", None) is not None:
            from ..parallel.expert import ep_forward

            return ep_forward(self, x, counts)
        return routed_ffn(x, counts, self.gate_up_proj, self.down_proj)


def adapt_experts(model: nn.Module) -> int:
    """Check (:func:`check_experts`), then give every fused experts module of ``model``
    :class:`RoutedExperts`' forward, in place, before ``data_parallel``. Returns how many."""
    check_experts(model)
    found = experts_modules(model)
    for _, module in found:
        if not isinstance(module, RoutedExperts):
            gate_up = module._parameters["gate_up_proj"]
            module._sf_num_experts = gate_up.shape[0]
            # a real tensor on a model built on meta (``model.materialize`` keeps buffers'
            # values); not in the state dict
            module.register_buffer("tokens_per_expert", torch.zeros(
                gate_up.shape[0], device="cpu" if gate_up.is_meta else gate_up.device),
                persistent=False)
            module.__class__ = derived_class(type(module), "Routed", RoutedExperts)
    return len(found)


def take_loads(model: nn.Module) -> torch.Tensor:
    """This rank's routed slots per expert since the last call, (layers, E) in module
    order (zeros for a layer that did not run), and restart the counts."""
    rows = []
    for _, module in experts_modules(model):
        rows.append(module.tokens_per_expert.clone())
        module.tokens_per_expert.zero_()
    return torch.stack(rows) if rows else torch.zeros(0, 0)


def router_globs(model: nn.Module) -> list[str]:
    """Module-name globs of the routers: the ``gate`` next to each fused experts module
    (transformers' ``mlp.gate``, weight [E, H]), layer numbers as ``*``; sorted."""
    from ..state_dict import unwrapped_name

    names = {unwrapped_name(name) for name, _ in model.named_modules()}
    globs = set()
    for name in (unwrapped_name(n) for n, _ in experts_modules(model)):
        gate = name.rsplit(".", 1)[0] + ".gate" if "." in name else "gate"
        if gate in names:
            globs.add(re.sub(r"(?<=\.)\d+(?=\.)", "*", gate))
    return sorted(globs)


def expert_parallel(model: nn.Module, mesh, cfg) -> None:
    """``parallel.ep`` on a model :func:`adapt_experts` adapted, before data parallel:
    each experts module split over the experts' mesh (``parallel.expert.split_experts``,
    ``ParallelDims.expert_mesh``) and ``data_parallel``-sharded there in the job's mode;
    the same exchange as our MoE's. Refused first: a model without fused experts, ``ep``
    not dividing the experts."""
    from ..data_parallel import data_parallel
    from ..mesh import ParallelDims
    from ..models.parallelize import dp_options
    from ..parallel.expert import check_expert_split, split_experts

    ep = cfg.parallel.ep
    found = experts_modules(model)
    if not found:
        raise HFError(f"parallel.ep = {ep} needs a mixture-of-experts model, but "
                      f"{type(model).__name__} (model.hf_path) has no fused experts; set "
                      f"parallel.ep = 1")
    for name, module in found:
        try:
            check_expert_split(ep, module._parameters["gate_up_proj"].shape[0], "parallel.")
        except ValueError as e:
            raise HFError(f"{e} ({name}, model.hf_path)") from None
    experts_mesh = ParallelDims.expert_mesh(mesh, ep)
    for _, module in found:
        split_experts(module, experts_mesh["ep"])
        data_parallel(module, experts_mesh, **dp_options(cfg))
