"""Memory floors the layout search knows without tracing a layout, so that it skips
layouts sure not to fit: a rank's model states and the loss's logits
(:func:`lower_bound`), and the activations of layouts like ones already predicted
(:class:`ActivationFloor`)."""

from __future__ import annotations

from ..config.job import JobConfig
from ..parallel.pipeline import stage_layers
from . import memory
from .predict import ALLOC_OVERHEAD, CONTEXT_BYTES, Prediction


def lower_bound(c: JobConfig) -> float:
    """Bytes a rank needs at least, known without tracing: its model states, and on the
    stage with the head the eager loss's logits (``memory.loss_peaks``), which every
    prediction adds on top (compiled) or replays (eager)."""
    args, p, t = c.model.model_args(), c.parallel, c.training
    dims = p.dims()  # the layout's one view
    roles = ["full"] if p.pp == 1 else ["first", "last"]
    mb = t.batch_size // p.microbatches
    elem = memory.activation_elem_bytes(t)
    bound = 0.0
    for role in roles:
        layers = stage_layers(args.n_layers, p.pp, 0 if role == "first" else p.pp - 1)
        need = memory.states_bytes(memory.rank_params(args, role, layers, dims,
                                                     p.dp_mode, p.etp))
        if role != "first":
            need += memory.loss_peaks(memory.rank_tokens(mb, t.seq_len, dims),
                                      memory.loss_vocab(args, p), elem,
                                      p.vocab_sharded_loss)[0]
        bound = max(bound, need)
    return bound


class ActivationFloor:
    """A memory floor for untraced compiled layouts, from the ones predicted so far: a
    block's saved activations (``block_saved_floor_bytes``: its saved bytes less those the
    data-parallel shards size, which more shards would shrink) are a sum of tensors each
    sized by the rank's tokens (``memory.rank_tokens``), split by TP or not, or by
    neither (a gathered sequence, a gathered weight). So a layout with the same AC mode
    and way of moving K/V, no more tokens a rank and no fewer TP ranks than a predicted
    one keeps at least the predicted block's bytes scaled by both ratios
    (``min(1, tokens / tokens') x min(1, tp' / tp)``). Each stage role then holds at least
    that for all its blocks but the first (in flight under 1F1B: as many microbatches as
    ``predict`` counts) on top of its gradless model states. Only skips layouts the
    prediction would find too big, so the search's rows are unchanged."""

    def __init__(self):
        self.blocks: dict[tuple, list[tuple[int, int, float]]] = {}

    @staticmethod
    def _kind(c: JobConfig) -> tuple:
        """Sources bound layouts of their kind: the AC mode, and a split sequence's way
        (cp sizes, K/V rotation: a gathered sequence is not sized by a rank's tokens)."""
        p = c.parallel
        cp = (p.cp_ring, p.cp_ulysses, p.cp_rotate if p.cp_ring > 1 else "")
        return (c.activation_checkpoint.mode, *cp)

    @staticmethod
    def _tokens(c: JobConfig) -> int:
        p, t = c.parallel, c.training
        return memory.rank_tokens(t.batch_size // p.microbatches, t.seq_len, p.dims())

    def record(self, c: JobConfig, r: Prediction) -> None:
        """Keep ``r``'s block floor (``c`` its configuration; compiled rows only)."""
        floors = [d.get("block_saved_floor_bytes") for d in r.detail.values()]
        if c.compile.enable and floors and all(f is not None for f in floors):
            self.blocks.setdefault(self._kind(c), []).append(
                (self._tokens(c), c.parallel.tp, max(floors)))

    def block_bytes(self, c: JobConfig) -> float:
        """The largest saved bytes a block of ``c`` holds at least (0: nothing known)."""
        tokens, tp, kind = self._tokens(c), c.parallel.tp, self._kind(c)
        # whole-sequence sources bound split sequences too: each keeps at least a whole
        # sequence's tensors for its own tokens (gathered K/V only add to them)
        sources = {kind, (kind[0], 1, 1, "")}
        return max((saved * min(1.0, tokens / k) * min(1.0, t / tp)
                    for s in sources for k, t, saved in self.blocks.get(s, [])), default=0.0)

    def active_bytes(self, c: JobConfig, states_may_leave: bool) -> float:
        """The least active bytes a rank of ``c`` is predicted to hold (0: nothing known).
        ``states_may_leave``: a knob may take the model states off the device (CPU
        offload, a frozen base: at most all of them), so only the activations less the
        gradients count."""
        block = self.block_bytes(c)
        if not block or not c.compile.enable:
            return 0.0
        args, p = c.model.model_args(), c.parallel
        dims = p.dims()
        need = 0.0
        for role in ["full"] if p.pp == 1 else ["first", "last"]:
            layers = stage_layers(args.n_layers, p.pp, 0 if role == "first" else p.pp - 1)
            params = memory.rank_params(args, role, layers, dims, p.dp_mode, p.etp)
            base = -memory.gradient_bytes(params) if states_may_leave else \
                memory.states_bytes(params) - memory.gradient_bytes(params)
            in_flight = min(p.microbatches, p.pp) if role == "first" else 1
            need = max(need, base + in_flight * (len(layers) - 1) * block)
        return need

    def exceeds(self, c: JobConfig, limit: float, states_may_leave: bool) -> bool:
        """Whether ``c``'s predicted reserved memory (with the device context) is sure to
        exceed ``limit`` (``active_bytes``)."""
        need = self.active_bytes(c, states_may_leave)
        return need > 0 and need * (1 + ALLOC_OVERHEAD) + CONTEXT_BYTES > limit
