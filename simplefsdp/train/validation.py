"""Validation: the loss on the corpus's held-out tail, every ``validation.every`` steps.

The held-out split is each source's last ``VAL_FRACTION`` of tokens (``corpus.setup``),
which no training batch reads. It is cut into non-overlapping windows of
``seq_len + 1`` tokens, source after source, in order (no shuffling); evaluation ``k``
reads the same first ``validation.steps`` global batches every time, so the values
are comparable along the run. A global batch is ``batch_size * dp_size`` consecutive
windows, data-parallel rank ``r`` taking the ``r``-th slice, as training's loader does.

An evaluation runs with gradients off and the model in eval mode, and leaves training
as it found it: the RNG state is forked, and the mixture of experts' load counters
(the ``tokens_per_expert`` buffers of our MoE and of Hugging Face experts), which the next
optimizer step reads for its bias update and figures, are put back. So a run's training
losses are bitwise the same with and without validation.

The loss is token-weighted over every rank as training's is: the sum of the token
cross-entropies over the ranks that hold a loss (``Coords.counts_loss``: the last
pipeline stage, TP rank 0, every context-parallel rank) divided by the held-out
targets over the ranks that count tokens (``Coords.counts_tokens``), one all-reduce.
Under tensor parallelism the loss runs on vocabulary-sharded logits
(``step.loss_context``); under pipeline parallelism through the schedule's
forward-only ``eval``; under context parallelism on each rank's part of the sequence.
"""

from __future__ import annotations

import contextlib
import math
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from torch import nn

from ..corpus.text import gather_windows
from ..errors import ConfigError
from ..models.moe import COUNTERS
from ..parallel.context import cp_batches
from ..parallel.pipeline import aux_loss_stage, run_schedule
from ..parallel.tensor import IGNORE_INDEX, loss_context, token_loss_sum

if TYPE_CHECKING:
    from ..config.job import JobConfig
    from ..mesh import Coords
    from .run import Setup

# The metrics columns an evaluation fills (``MetricsLogger``: empty on other rows).
COLUMNS = ("val_loss", "val_ppl")


class HeldOutBatches:
    """This data-parallel rank's validation batches: the first ``steps`` global batches
    of the held-out windows of ``sources`` (each a 1-D token tensor or array)."""

    def __init__(self, sources: list, batch_size: int, seq_len: int, dp_rank: int,
                 dp_world: int, steps: int):
        self.sources, self.seq_len = sources, seq_len
        self.batch_size, self.dp_rank, self.dp_world = batch_size, dp_rank, dp_world
        # (source, first window) of every held-out window, in order
        self.windows = [(i, w) for i, tokens in enumerate(sources)
                        for w in range(max(0, len(tokens) - 1) // seq_len)]
        self.global_batch = batch_size * dp_world
        available = len(self.windows) // self.global_batch
        if available < 1:
            raise ConfigError(
                f"validation.enable = true, but the held-out split of data.dataset holds "
                f"{len(self.windows)} windows of training.seq_len + 1 = {seq_len + 1} tokens, "
                f"fewer than one global batch of {self.global_batch} (training.batch_size "
                f"{batch_size} x {dp_world} data-parallel ranks); use a larger corpus, lower "
                f"training.batch_size / training.seq_len, or turn validation.enable off")
        if steps > available:
            raise ConfigError(
                f"validation.steps = {steps}, but the held-out split holds {available} "
                f"global batches of {self.global_batch} windows of {seq_len + 1} tokens; "
                f"set validation.steps <= {available}, or -1 for all of them")
        self.steps = available if steps == -1 else steps

    def __iter__(self):
        for step in range(self.steps):
            first = step * self.global_batch + self.dp_rank * self.batch_size
            rows = [self._window(i) for i in range(first, first + self.batch_size)]
            chunk = torch.cat(rows)
            yield chunk[:, :-1], chunk[:, 1:]

    def _window(self, index: int) -> torch.Tensor:
        source, window = self.windows[index]
        return gather_windows(self.sources[source], torch.tensor([window]), self.seq_len)


def held_out_batches(cfg: JobConfig, tokenizer, at: Coords) -> HeldOutBatches | None:
    """The run's validation batches (None unless ``validation.enable``); a ConfigError
    before step 1 if the held-out split cannot fill ``validation.steps`` global batches
    (one at least)."""
    if not cfg.validation.enable:
        return None
    from ..corpus import held_out_tokens

    t = cfg.training
    return HeldOutBatches(held_out_tokens(cfg, tokenizer), t.batch_size, t.seq_len,
                          at.dp, at.dp_size, cfg.validation.steps)


def validate(s: Setup, step: int) -> dict[str, float]:
    """``val_loss`` and ``val_ppl`` if step ``step`` evaluates (``validation.every``),
    else nothing; the console gets a line."""
    if s.validation is None or step % s.cfg.validation.every:
        return {}
    loss = evaluate(s, s.validation)
    s.metrics.note(f"[simplefsdp] step {step}: val_loss {loss:.4f}, val_ppl "
                   f"{perplexity(loss):.2f} ({s.validation.steps} held-out batches)")
    return {"val_loss": loss, "val_ppl": perplexity(loss)}


@torch.no_grad()
def evaluate(s: Setup, batches: HeldOutBatches) -> float:
    """The token-weighted mean cross-entropy of ``batches`` over every rank (see the
    module docstring); training's RNG, counters and module modes are left as found."""
    loss_sum = torch.zeros((), device=s.device)
    tokens = torch.zeros((), device=s.device)
    rng_devices = [s.device] if s.device.type == "cuda" else []
    with torch.random.fork_rng(devices=rng_devices), _eval_mode(s.model), \
            _kept_counters(s.model), loss_context(s.cfg.parallel.vocab_sharded_loss):
        for batch in batches:
            if s.dims.cp > 1:  # this rank's part of every sequence
                batch = cp_batches([batch], s.mesh, s.cfg.training.seq_len)[0]
            inputs, targets = (x.to(s.device) for x in batch)
            loss_sum += _forward_loss(s, inputs, targets)
            tokens += (targets != IGNORE_INDEX).sum()
    totals = torch.stack([loss_sum if s.at.counts_loss else torch.zeros_like(loss_sum),
                          tokens if s.at.counts_tokens else torch.zeros_like(tokens)])
    dist.all_reduce(totals)
    return float(totals[0] / totals[1].clamp(min=1))


def _forward_loss(s: Setup, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """The batch's summed token loss on this rank (0 off the last pipeline stage)."""
    if s.pipeline_schedule is None:
        return token_loss_sum(s.runnable(inputs), targets)
    carrier = aux_loss_stage(s.pipeline_schedule)
    losses = run_schedule(s.pipeline_schedule, s.at.first, s.at.last, inputs, targets,
                          train=False)
    if carrier is not None:
        carrier.take_aux()  # the balance loss of held-out tokens joins no step
    return sum((loss.detach() for loss in losses), torch.zeros((), device=s.device))


@contextlib.contextmanager
def _eval_mode(model: nn.Module):
    """``model`` in eval mode, each module's own mode put back afterwards."""
    modes = [(m, m.training) for m in model.modules()]
    model.eval()
    try:
        yield
    finally:
        for module, training in modes:
            module.training = training


@contextlib.contextmanager
def _kept_counters(model: nn.Module):
    """The experts' load counters saved and put back: held-out tokens are no training
    step's load (the bias update and the expert-load column read them)."""
    buffers = [b for n, b in model.named_buffers() if n.endswith(COUNTERS)]
    saved = [b.clone() for b in buffers]
    try:
        yield
    finally:
        for buffer, value in zip(buffers, saved, strict=True):
            buffer.copy_(value)


def perplexity(loss: float) -> float:
    """``exp(loss)``; inf past float range (a diverged run's loss)."""
    try:
        return math.exp(loss)
    except OverflowError:
        return math.inf
