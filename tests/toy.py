"""A tiny transformer-shaped model and a training loop shared by the multi-rank tests.

Small enough for CPU tests, shaped to hit the interesting cases: an embedding tied to
the output head, a hidden size of 7 (uneven shards on 2 and 4 ranks), a 1-row
parameter (empty shards on 4 ranks), a buffer, and a frozen parameter.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

VOCAB, DIM, HIDDEN = 16, 8, 7


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(DIM)
        self.up = nn.Linear(DIM, HIDDEN)
        self.down = nn.Linear(HIDDEN, DIM, bias=False)
        self.gate = nn.Parameter(torch.ones(1, DIM))  # 1 row: empty shards on 4 ranks

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.gate * self.down(F.gelu(self.up(self.norm(x))))


class Toy(nn.Module):
    def __init__(self, n_layers: int = 2, tie: bool = True, frozen: bool = True) -> None:
        super().__init__()
        self.tok_embeddings = nn.Embedding(VOCAB, DIM)
        self.layers = nn.ModuleList(Block() for _ in range(n_layers))
        self.norm = nn.LayerNorm(DIM)
        self.output = nn.Linear(DIM, VOCAB, bias=False)
        if tie:
            self.output.weight = self.tok_embeddings.weight
        self.register_buffer("position_scale", torch.linspace(0.5, 1.5, 4).unsqueeze(-1))
        if frozen:
            self.norm.bias.requires_grad_(False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.tok_embeddings(tokens)
        h = h * self.position_scale[: tokens.shape[1]].to(h.dtype)  # compute in param dtype
        for layer in self.layers:
            h = layer(h)
        return self.output(self.norm(h))


def global_batch(step: int, world: int, per_rank: int = 2, seq: int = 4) -> torch.Tensor:
    """The same deterministic tokens on every process: rank r trains on rows
    [r * per_rank, (r + 1) * per_rank), the reference on all of them."""
    g = torch.Generator().manual_seed(1000 + step)
    return torch.randint(0, VOCAB, (per_rank * world, seq + 1), generator=g)


class OpCalls(TorchDispatchMode):
    """Counts the calls of one ATen op (``calls``) while active, backward recomputation
    included."""

    def __init__(self, op):
        super().__init__()
        self.op, self.calls = op, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.calls += func is self.op
        return func(*args, **(kwargs or {}))


def token_batches(count: int, batch: int, seq: int, vocab: int
                  ) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``count`` (inputs, targets) pairs of ``batch`` random sequences of ``seq`` tokens,
    the targets shifted by one; the same on every rank and run (seed 1)."""
    gen = torch.Generator().manual_seed(1)
    out = []
    for _ in range(count):
        tokens = torch.randint(0, vocab, (batch, seq + 1), generator=gen)
        out.append((tokens[:, :-1], tokens[:, 1:]))
    return out


def moe_token_loss(model: nn.Module, inputs: torch.Tensor, targets: torch.Tensor,
                   total_tokens: int) -> torch.Tensor:
    """The trainer's token-normalized loss of a mixture of experts: this forward's
    token-loss sum over the step's ``total_tokens``, plus the balance loss
    (``models.moe.aux_loss``) weighted by this forward's share of the tokens."""
    from simplefsdp.models.moe import aux_loss

    logits = model(inputs)
    ce = F.cross_entropy(logits.flatten(0, 1), targets.flatten(), reduction="sum")
    return (ce + aux_loss(model) * targets.numel()) / total_tokens


def step_summed_over_ranks(loss: torch.Tensor, optimizer) -> float:
    """Backward, the loss summed over the ranks (an all-reduce of a detached copy), then
    ``optimizer``'s step; returns the summed loss."""
    import torch.distributed as dist

    loss.backward()
    total = loss.detach().clone()
    dist.all_reduce(total)
    optimizer.step()
    optimizer.zero_grad()
    return total.item()


def loss_fn(model: nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    logits = model(tokens[:, :-1])
    return F.cross_entropy(logits.float().flatten(0, 1), tokens[:, 1:].flatten())


def train(model: nn.Module, steps: int, rank: int | None, world: int, lr: float = 1e-2
          ) -> list[float]:
    """AdamW steps on this rank's slice of each global batch; rank=None trains on the
    whole global batch (the single-process reference). Returns the global mean loss."""
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.1, foreach=False)
    losses = []
    for step in range(steps):
        tokens = global_batch(step, world)
        local = tokens if rank is None else tokens[2 * rank:2 * (rank + 1)]
        loss = loss_fn(model, local)
        loss.backward()
        opt.step()
        opt.zero_grad()
        if rank is not None:  # every rank has an equal share: the global loss is the mean
            loss = loss.detach().clone()
            torch.distributed.all_reduce(loss)
            loss /= world
        losses.append(loss.item())
    return losses


# The debug models' vocabulary (256 byte ids) splits at 128 on TP 2; the shipped text is
# ASCII, so without a relabelling every target falls in TP rank 0's half.
VOCAB_SPLIT = 128


def relabel_odd_bytes(inputs: torch.Tensor, targets: torch.Tensor):
    """A batch transform: every odd byte id moves to ``id + 128`` (inputs and targets
    alike: the same text, its odd letters spelled with other ids), so the targets of every
    sequence fall on both halves of a 256-id vocabulary split over TP 2. Even ids stay."""
    assert int(inputs.max()) < VOCAB_SPLIT and int(targets.max()) < VOCAB_SPLIT
    return (torch.where(inputs % 2 == 1, inputs + VOCAB_SPLIT, inputs),
            torch.where(targets % 2 == 1, targets + VOCAB_SPLIT, targets))
