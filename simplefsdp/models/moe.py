"""A mixture-of-experts decoder: our Llama block with its FFN replaced by a routed MoE.

Norms and RoPE are ``models/llama.py``'s, attention Llama's or, with ``attention = "mla"``,
DeepSeek's multi-head latent attention (``models/mla.py``); the FFN changes (the block's
``feed_forward`` slot, so parameter names stay ``layers.<i>.feed_forward...``). Inside it
the layout is Hugging Face transformers 5's (Qwen3-MoE, Qwen2-MoE, Mixtral):

* ``gate.weight [E, dim]``: the router, kept and computed in float32;
* ``experts.gate_up_proj [E, 2I, dim]`` and ``experts.down_proj [E, dim, I]``: the
  routed SwiGLU experts as 3-D tensors (gate rows first, then up rows);
* ``shared_expert.{w1,w2,w3}``: an optional always-on SwiGLU (DeepSeek, Qwen2-MoE).

Routing is dropless: every token reaches its ``top_k`` experts, whatever the load, unless
the layer's ``capacity_factor`` is set (the padded dispatch, :func:`padded_experts`).
Load balancing is ``aux_loss`` (Switch Transformer's loss, scaled by a coefficient; the
caller adds :func:`aux_loss` to its loss), ``bias`` (DeepSeek-V3's auxiliary-loss-free
method: a per-expert bias shifts which experts are chosen, not their weights, and
:func:`update_expert_bias` moves it after each step against the measured load) or
``none``.

Expert parallelism comes from outside (``simplefsdp/parallel/expert.py``): it swaps the
class of ``experts`` for one that sends each expert's tokens to the rank holding it; the
router, the token order and the combine below stay as they are.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from .._torch_compat import (
    check_size,
    check_that,
    current_graph_task_id,
    grouped_mm,
    grouped_mm_aligned,
)
from .balance_loss import switch_aux_loss
from .llama import (
    FeedForward,
    Transformer,
    TransformerBlock,
    _trunc_normal,
)
from .mla import MLAArgs

SCORE_FUNCS = ("softmax", "sigmoid")
# The MoE layers' per-step counter buffers (summed after each step, kept around validation).
COUNTERS = ("tokens_per_expert", "tokens_dropped")
LOAD_BALANCE = ("aux_loss", "bias", "none")


@dataclass
class MoEArgs(MLAArgs):
    """Llama's shape (attention: Llama's or MLA, ``models/mla.py``) plus the routed FFN's.
    ``n_dense_layers`` first blocks keep the dense SwiGLU (DeepSeek-V3);
    ``shared_hidden_dim = 0`` means no shared expert."""

    num_experts: int = 8
    top_k: int = 2
    moe_hidden_dim: int = 128  # width I of each routed expert
    shared_hidden_dim: int = 0
    score_func: str = "softmax"  # softmax | sigmoid
    norm_topk_prob: bool = True  # rescale the top-k weights to sum to 1
    load_balance: str = "aux_loss"  # aux_loss | bias | none
    aux_loss_coef: float = 0.01
    bias_update_rate: float = 1e-3
    n_dense_layers: int = 0

    def __post_init__(self) -> None:
        super().__post_init__()
        if not 1 <= self.top_k <= self.num_experts:
            raise ValueError(f"top_k={self.top_k} must be between 1 and num_experts="
                             f"{self.num_experts}")
        if self.score_func not in SCORE_FUNCS:
            raise ValueError(f"score_func={self.score_func!r}: choose one of {SCORE_FUNCS}")
        if self.load_balance not in LOAD_BALANCE:
            raise ValueError(f"load_balance={self.load_balance!r}: choose one of "
                             f"{LOAD_BALANCE}")
        if not 0 <= self.n_dense_layers <= self.n_layers:
            raise ValueError(f"n_dense_layers={self.n_dense_layers} must be between 0 and "
                             f"n_layers={self.n_layers}")

    def is_moe(self, layer: int | None) -> bool:
        """Whether block ``layer`` routes (``None``: a typical block, routed)."""
        return layer is None or layer >= self.n_dense_layers

    def ffn_matmul_params(self, layer: int | None = None, activated: bool = False) -> int:
        """A routed block: the router (``E x dim``), the routed experts (all ``E``, or with
        ``activated`` the ``top_k`` a token reaches; three ``I x dim`` matrices each) and
        the shared expert (three ``S x dim``); a dense block: Llama's SwiGLU."""
        if not self.is_moe(layer):
            return super().ffn_matmul_params(layer, activated)
        experts = self.top_k if activated else self.num_experts
        return self.dim * (self.num_experts + 3 * (experts * self.moe_hidden_dim
                                                   + self.shared_hidden_dim))

    def routed_params(self, layer: int | None = None) -> int:
        """The router and every routed expert (tensor parallelism splits neither)."""
        return self.router_params(layer) + self.expert_params(layer)

    def router_params(self, layer: int | None = None) -> int:
        """The router's gate (``E x dim``) of a routed block."""
        return self.dim * self.num_experts if self.is_moe(layer) else 0

    def expert_params(self, layer: int | None = None) -> int:
        """Every routed expert's three ``I x dim`` matrices (``E x 3 x I x dim``)."""
        return 3 * self.dim * self.num_experts * self.moe_hidden_dim if self.is_moe(layer) \
            else 0

    @property
    def activated_hidden_dim(self) -> int:
        """The SwiGLU width one token's routed block computes: ``top_k`` experts of width
        ``I`` and the shared expert (what the planner's dense stand-in block is given)."""
        return self.top_k * self.moe_hidden_dim + self.shared_hidden_dim


MOE_PRESETS: dict[str, MoEArgs] = {
    # The debug Llama's attention (dim 128, 4 blocks, 4 heads, 2 KV heads) with 8 experts of
    # width 128, top-2: 1.84M parameters, ~0.66M active per token. CPU, minutes.
    "debug_moe": MoEArgs(dim=128, n_layers=4, n_heads=4, n_kv_heads=2, vocab_size=256,
                         multiple_of=32, rope_theta=10000.0, max_seq_len=256,
                         num_experts=8, top_k=2, moe_hidden_dim=128),
    # Qwen3-30B-A3B's routed shapes (128 experts of width 768, top-8, normalized softmax
    # weights, aux loss 0.001). Attention is our Llama's: head_dim = dim / n_heads = 64
    # and no q/k norms, where Qwen3 has head_dim 128 (q: 2048 -> 4096) and q/k RMSNorm.
    "qwen3_30b_a3b": MoEArgs(dim=2048, n_layers=48, n_heads=32, n_kv_heads=4,
                             vocab_size=151936, norm_eps=1e-6, rope_theta=1e6,
                             max_seq_len=4096, num_experts=128, top_k=8, moe_hidden_dim=768,
                             norm_topk_prob=True, load_balance="aux_loss",
                             aux_loss_coef=0.001),
    # DeepSeek-V3 16B (torchtitan's "16B" DeepSeek-V3 flavour; DeepSeek-MoE-16B shapes): the
    # first block dense (width 10944), then 64 experts of width 1408, top-6 softmax without
    # renormalization, 2 shared experts (one SwiGLU of width 2 * 1408), bias balancing.
    # Attention is DeepSeek's MLA (models/mla.py): 16 heads, no query compression, a key/value
    # latent of 512, query/key heads of 128 + 64 (RoPE), value heads of 128.
    "deepseek_v3_16b": MoEArgs(dim=2048, n_layers=27, n_heads=16, vocab_size=102400,
                               multiple_of=64, ffn_dim_multiplier=2.004, rope_theta=10000.0,
                               max_seq_len=4096, num_experts=64, top_k=6, moe_hidden_dim=1408,
                               shared_hidden_dim=2816, norm_topk_prob=False,
                               load_balance="bias", n_dense_layers=1, attention="mla",
                               kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64,
                               v_head_dim=128),
}


class Router(nn.Module):
    """Scores every expert, picks ``top_k`` per token, returns their weights.

    The gate's matmul runs in float32 whatever the model's dtype (routing decisions are
    sensitive to rounding). With bias balancing, ``expert_bias`` is added to the scores
    for the choice only; the weights come from the unbiased scores."""

    def __init__(self, args: MoEArgs):
        super().__init__()
        self.top_k, self.score_func, self.norm = args.top_k, args.score_func, args.norm_topk_prob
        self.weight = nn.Parameter(torch.empty(args.num_experts, args.dim, dtype=torch.float32))
        bias = torch.zeros(args.num_experts) if args.load_balance == "bias" else None
        self.register_buffer("expert_bias", bias)  # None: no bias balancing

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``x`` (tokens, dim) -> (scores (tokens, E) float32, weights (tokens, k) float32,
        expert ids (tokens, k))."""
        logits = F.linear(x.float(), self.gate_weight().float())
        scores = logits.softmax(-1) if self.score_func == "softmax" else logits.sigmoid()
        choice = scores if self.expert_bias is None else scores + self.expert_bias
        ids = choice.topk(self.top_k, dim=-1).indices
        weights = scores.gather(-1, ids)
        if self.norm:
            weights = weights / weights.sum(-1, keepdim=True)
        return scores, weights, ids

    def gate_weight(self) -> torch.Tensor:
        """The weight as the matmul takes it (tensor parallelism reads it differently:
        ``parallel/expert.py``)."""
        return self.weight

    def init_weights(self) -> None:
        _trunc_normal(self.weight, 0.02)
        if self.expert_bias is not None:
            self.expert_bias.zero_()


def expert_ffn(x: torch.Tensor, counts: list[int], gate_up: torch.Tensor,
               down: torch.Tensor) -> torch.Tensor:
    """SwiGLU experts on tokens grouped by expert: rows ``[sum(counts[:e]), +counts[e])``
    of ``x`` go through expert ``e`` of ``gate_up [E, 2I, dim]`` / ``down [E, dim, I]``.

    One grouped matmul per projection where torch has one for this device and dtype
    (``_torch_compat.grouped_mm``) and the shapes are aligned for it; a loop otherwise
    (also when traced in another dtype than bfloat16)."""
    # Traced, only bfloat16: torch's fake kernel of the grouped matmul takes no other dtype
    # (the loop then, as in eager where the grouped matmul does not run).
    traced = torch.compiler.is_compiling()
    mm = None if traced and x.dtype != torch.bfloat16 else grouped_mm(x.device, x.dtype)
    gate_up_t, down_t = gate_up.transpose(-2, -1), down.transpose(-2, -1)
    if mm is not None and x.shape[0] and grouped_mm_aligned(x, gate_up_t, down_t):
        offsets = torch.tensor(counts, device=x.device).cumsum(0).to(torch.int32)
        gate, up = mm(x, gate_up_t, offs=offsets).chunk(2, dim=-1)
        return mm((F.silu(gate) * up).contiguous(), down_t, offs=offsets)
    # Traced, each expert's matmul is one op of our own (``expert_linear``): the grouped
    # matmul's stand-in, which selective AC keeps as it keeps ``_grouped_mm``
    # (``parallel.activation_checkpoint``); a plain ``mm`` would count among the block's
    # every-other matmuls, and Inductor's ``bmm`` guards on the unbacked row counts.
    linear = expert_linear if traced else F.linear
    outs = []
    for e, rows in enumerate(x.split(counts)):
        gate, up = linear(rows, gate_up[e]).chunk(2, dim=-1)
        outs.append(linear(F.silu(gate) * up, down[e]))
    return torch.cat(outs) if outs else x.new_zeros(0, down.shape[1])


@torch.library.custom_op("simplefsdp::expert_linear", mutates_args=(),
                         schema="(Tensor rows, Tensor weight) -> Tensor")
def expert_linear(rows: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``F.linear(rows, weight)`` for one routed expert, as one op a checkpoint policy can
    name (``expert_ffn``'s traced loop, where the grouped matmul cannot run)."""
    return F.linear(rows, weight)


def _expert_linear_shape(rows: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return rows.new_empty(rows.shape[0], weight.shape[0])


def _expert_linear_setup(ctx, inputs, output) -> None:
    ctx.save_for_backward(*inputs)


def _expert_linear_backward(ctx, grad: torch.Tensor):
    """``F.linear``'s own gradients, the same matmuls in the same layouts (bitwise)."""
    rows, weight = ctx.saved_tensors
    return grad.mm(weight), rows.t().mm(grad).t()


expert_linear.register_fake(_expert_linear_shape)
expert_linear.register_autograd(_expert_linear_backward, setup_context=_expert_linear_setup)


def routed_combine(x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor,
                   counts: torch.Tensor, experts) -> torch.Tensor:
    """Each token ``x`` (tokens, dim) through its chosen experts ``ids`` (tokens, k),
    summed with ``weights`` (tokens, k); ``counts`` (E,): slots per expert;
    ``experts(slots grouped by expert, counts)`` runs them (locally or expert-parallel).

    Slots (choice, token) are sorted by expert; the stable sort keeps them by choice
    rank, then token, inside one expert: transformers' order, so rows meet the same
    matmuls, and each token's contributions are added in expert order, as it adds them."""
    order = ids.t().flatten().argsort(stable=True)
    token = order % x.shape[0]
    routed = experts(x[token], counts)
    routed = routed * weights.t().flatten()[order].unsqueeze(-1).to(routed.dtype)
    return torch.zeros_like(x).index_add_(0, token, routed.to(x.dtype))


def counted_call() -> bool:
    """Whether a forward adds to its counters (``COUNTERS``, a Hugging Face experts'
    ``tokens_per_expert`` too): not in an activation-checkpointing recomputation, which reruns the
    forward inside backward (a graph task is then current), so a checkpointed block counts
    its slots once, as without checkpointing. Always while ``torch.compile`` traces: a
    compiled backward recomputes values, it does not replay the forward's buffer updates."""
    return torch.compiler.is_compiling() or current_graph_task_id() == -1


def expert_capacity(slots: int, num_experts: int, capacity_factor: float) -> int:
    """Rows each rank sends to each expert under the padded dispatch: the capacity factor
    times an even share of its ``slots`` (``ceil``), at least 1."""
    return max(1, math.ceil(capacity_factor * slots / num_experts))


def padded_experts(x: torch.Tensor, counts: torch.Tensor, gate_up: torch.Tensor,
                   down: torch.Tensor, capacity: int, ep: int = 1,
                   exchange=None) -> torch.Tensor:
    """The padded (static-shape) dispatch: every rank sends each global expert exactly
    ``capacity`` rows, its first ``capacity`` slots for that expert (in ``x``'s order)
    and zero rows after them; the slots beyond are dropped (their output is 0).
    ``exchange(rows)``: an even all-to-all over the ``ep`` ranks holding the experts
    (``parallel/expert.py``; None with ``ep = 1``: every expert here). Both exchanges move
    ``E x capacity`` rows, so every shape is known when tracing."""
    experts, dim = counts.numel(), x.shape[1]
    slot = _padded_slots(counts, x.shape[0], capacity)  # E * capacity: dropped
    send = x.new_zeros(experts * capacity + 1, dim).index_add(0, slot, x)[:-1]
    local = experts // ep
    rows = send if exchange is None else exchange(send)
    # (source, local expert, capacity) -> (local expert, source, capacity)
    rows = rows.view(ep, local, capacity, dim).transpose(0, 1).reshape(-1, dim)
    out = expert_ffn(rows, [ep * capacity] * local, gate_up, down)
    out = out.view(local, ep, capacity, dim).transpose(0, 1).reshape(-1, dim)
    back = out if exchange is None else exchange(out)
    return torch.cat([back, back.new_zeros(1, dim)])[slot]


def _padded_slots(counts: torch.Tensor, slots: int, capacity: int) -> torch.Tensor:
    """For each of ``slots`` rows grouped by expert (``counts`` per expert), its row in
    the padded layout ``expert * capacity + position``, or ``E * capacity`` (a discarded
    row) where its position in its expert reaches ``capacity``."""
    experts = counts.numel()
    expert_of_row = torch.repeat_interleave(torch.arange(experts, device=counts.device),
                                            counts, output_size=slots)
    starts = counts.cumsum(0) - counts
    position = torch.arange(slots, device=counts.device) - starts[expert_of_row]
    return torch.where(position < capacity, expert_of_row * capacity + position,
                       experts * capacity)


def dropped_slots(counts: torch.Tensor, capacity: int) -> torch.Tensor:
    """Slots the padded dispatch drops on this rank: each expert's beyond ``capacity``."""
    return (counts - capacity).clamp(min=0).sum()


class Experts(nn.Module):
    """The routed experts as two 3-D parameters (Hugging Face transformers 5's layout)."""

    def __init__(self, num_experts: int, dim: int, hidden_dim: int):
        super().__init__()
        self.gate_up_proj = nn.Parameter(torch.empty(num_experts, 2 * hidden_dim, dim))
        self.down_proj = nn.Parameter(torch.empty(num_experts, dim, hidden_dim))

    def forward(self, x: torch.Tensor, counts: torch.Tensor,
                capacity: int | None = None) -> torch.Tensor:
        """``x`` (slots, dim) grouped by expert, ``counts`` (E,) slots per expert ->
        each slot through its expert, same order; ``capacity``: :func:`padded_experts`'s
        rows per expert (None: every slot, exact)."""
        if capacity is not None:
            return padded_experts(x, counts, self.gate_up_proj, self.down_proj, capacity)
        return routed_ffn(x, counts, self.gate_up_proj, self.down_proj)

    def init_weights(self, init_std: float) -> None:
        _trunc_normal(self.gate_up_proj, 0.02)
        _trunc_normal(self.down_proj, init_std)


def routed_ffn(x: torch.Tensor, counts: torch.Tensor, gate_up: torch.Tensor,
                down: torch.Tensor) -> torch.Tensor:
    """:func:`expert_ffn` with the counts read on the host: under ``torch.compile`` (with
    ``_torch_compat.data_dependent_shapes``, set by our compile path) unbacked sizes, which
    ``check_size``/``check_that`` say are sizes adding up to the rows."""
    sizes = counts.tolist()
    for size in sizes:
        check_size(size)
    check_that(sum(sizes) == x.shape[0])
    return expert_ffn(x, sizes, gate_up, down)


class MoE(nn.Module):
    """Router, routed experts and an optional shared expert, in place of the FFN.

    After each forward: ``aux_loss`` holds this call's load-balancing loss (uncoefficed;
    None unless ``load_balance = "aux_loss"``) and ``tokens_per_expert`` has this call's
    routed slots per expert added (for bias balancing and load metrics)."""

    def __init__(self, args: MoEArgs):
        super().__init__()
        self.num_experts, self.top_k = args.num_experts, args.top_k
        self.score_func, self.load_balance = args.score_func, args.load_balance
        self.gate = Router(args)
        self.experts = Experts(args.num_experts, args.dim, args.moe_hidden_dim)
        self.shared_expert = (FeedForward(args.dim, args.shared_hidden_dim)
                              if args.shared_hidden_dim else None)
        self.register_buffer("tokens_per_expert", torch.zeros(args.num_experts),
                             persistent=False)
        # The padded dispatch (``parallel.expert.set_expert_dispatch``): each expert takes
        # at most ``expert_capacity`` slots of a call, the rest are dropped and counted.
        self.capacity_factor: float | None = None  # None: dropless (exact)
        self.register_buffer("tokens_dropped", torch.zeros(()), persistent=False)
        self.aux_loss: torch.Tensor | None = None
        # Context (and tensor) parallelism: the ranks holding the other parts of these
        # sequences; the balance loss's statistics are over all of them (set by
        # parallel.context.apply_cp, parallel.expert.set_token_group). ``loss_copies``: how
        # many of them add the same loss for the same tokens (TP ranks; see switch_aux_loss).
        self.token_group: dist.ProcessGroup | None = None
        self.loss_copies = 1

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape, seqs = x.shape, x
        x = x.reshape(-1, shape[-1])
        scores, weights, ids = self.gate(x)
        # Slots per expert; not bincount, whose output length depends on the data (a
        # graph break under torch.compile).
        flat = ids.flatten()
        counts = torch.zeros(self.num_experts, dtype=flat.dtype, device=flat.device
                             ).index_add_(0, flat, torch.ones_like(flat))
        capacity = None
        if self.capacity_factor is not None:
            capacity = expert_capacity(flat.numel(), self.num_experts, self.capacity_factor)
        if counted_call():  # once per forward, not again in its recomputation
            with torch.no_grad():
                self.tokens_per_expert += counts
                if capacity is not None:
                    self.tokens_dropped += dropped_slots(counts, capacity)
        if self.load_balance == "aux_loss":
            self.aux_loss = switch_aux_loss(scores, counts, self.score_func, self.token_group,
                                            self.loss_copies)
        experts = self.experts if capacity is None else functools.partial(
            self.experts, capacity=capacity)
        out = routed_combine(x, weights, ids, counts, experts).view(shape)
        if self.shared_expert is not None:  # on (batch, seq, dim): TP gathers the sequence
            out = out + self.shared_expert(seqs)
        return out

    def init_weights(self, init_std: float) -> None:
        self.gate.init_weights()
        self.experts.init_weights(init_std)
        if self.shared_expert is not None:
            self.shared_expert.init_weights(init_std)
        self.tokens_per_expert.zero_()
        self.tokens_dropped.zero_()


class MoETransformer(Transformer):
    """The Llama decoder whose blocks (after ``n_dense_layers``) use :class:`MoE`."""

    def build_block(self, layer_id: int, args: MoEArgs) -> TransformerBlock:
        if layer_id < args.n_dense_layers:
            return TransformerBlock(layer_id, args)
        return TransformerBlock(layer_id, args, feed_forward=MoE(args))


def moe_layers(model: nn.Module) -> list[MoE]:
    """Every :class:`MoE` of ``model`` (through wrappers), in module order."""
    return [m for m in model.modules() if isinstance(m, MoE)]


def aux_loss(model: nn.Module) -> torch.Tensor | None:
    """``aux_loss_coef`` times the sum of the last forward's per-layer balance losses
    (None without ``load_balance = "aux_loss"``). Each is over the tokens of that forward:
    a caller that normalizes its loss by a global token count weights this by its share
    of the tokens, as the language-model loss is."""
    losses = [m.aux_loss for m in moe_layers(model) if m.aux_loss is not None]
    if not losses:
        return None
    return model_args(model).aux_loss_coef * torch.stack(losses).sum()


def model_args(model: nn.Module) -> MoEArgs:
    args = getattr(model, "args", None)
    if not isinstance(args, MoEArgs):
        raise TypeError(f"{type(model).__name__} is not an MoE model (no MoEArgs)")
    return args


@torch.no_grad()
def update_expert_bias(model: nn.Module, group: dist.ProcessGroup | None = None,
                       reduce=None) -> torch.Tensor:
    """Bias balancing's step (DeepSeek-V3, auxiliary-loss-free): every layer's
    ``expert_bias`` moves by ``bias_update_rate`` towards under-loaded experts
    (``+rate * sign(mean load - load)``), with loads summed over ``group``'s ranks when
    given (the ranks that routed different tokens: the data-parallel ranks of one pipeline
    stage and TP rank), or as ``reduce(local loads)`` returns them (same shape); then the
    counts restart. Returns the per-layer loads used, (layers, E). Call after each
    optimizer step."""
    layers = moe_layers(model)
    if not layers:
        return torch.zeros(0)
    loads = torch.stack([m.tokens_per_expert for m in layers])
    if group is not None:
        dist.all_reduce(loads, group=group)
    if reduce is not None:
        loads = reduce(loads)
    rate = model_args(model).bias_update_rate
    for m, load in zip(layers, loads, strict=True):
        if m.gate.expert_bias is not None:
            m.gate.expert_bias += rate * torch.sign(load.mean() - load)
        m.tokens_per_expert.zero_()
    return loads
