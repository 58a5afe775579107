"""Activation checkpointing per block (``none`` / ``selective`` / ``full``), for every
model family: our Llama's and MoE's blocks (``model.layers``) and Hugging Face decoder
layers (``hf/model.py``) take the same wrapper, built in :func:`checkpointed`. Usable
without the trainer: a model (or a block) and a mode.

``full`` recomputes the whole block in backward; ``selective`` is torchtitan's per-op
policy: it keeps the outputs of attention, TP reduce-scatters and every other matmul,
and recomputes the rest (the other matmuls, norms, activations, RoPE, and the FSDP
all-gathers, so resharding still holds). A block that routes tokens to experts also keeps
its token exchanges: eagerly through ``parallel.expert.keep_exchanges``; compiled, the
same policy keeps the all-to-alls' and the experts' (grouped) matmuls' outputs
(:func:`_compiled_routed_selective_context`), traced into the model's graph.

Under ``torch.compile``: :func:`ac_mode_run` says what a compiled block's graphs get,
:func:`compile_checkpointed_blocks` prepares the checkpointed blocks of a model that may
leave the graph, and :func:`check_composition` refuses what this torch cannot compile.
:func:`quiet_our_checkpoint_warning` drops torch's warning about our own regions.
"""

from __future__ import annotations

import collections
import contextlib
import functools
import logging
import operator
import re
import sys

import torch
from torch import nn
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

from .._torch_compat import checkpoint_wrapper, custom_partitioner_base
from .._torch_compat.checkpoint import full_recompute_context_fn
from .._torch_compat.float8 import scaled_mm_op
from .._torch_compat.internals import (
    CHECKPOINT_CONTEXT_FN_FRAME,
    CHECKPOINT_CONTEXT_FN_LOGGER,
    CHECKPOINT_CONTEXT_FN_META,
    attention_ops,
    checkpoint_keywords,
    checkpointed_inner,
    set_checkpoint_keywords,
)
from .._torch_compat.unbacked import grouped_mm_op
from ..compiler.collectives import ALL_TO_ALL, CollectiveKind
from ..errors import ConfigError
from .expert import holds_experts, keep_exchanges


def _matmul_ops() -> frozenset:
    """The matmuls of a block's linear layers: ``aten.mm``, and ``aten._scaled_mm`` where
    ``[float8]`` converted them (``simplefsdp/float8.py``)."""
    return frozenset({torch.ops.aten.mm.default, scaled_mm_op()})


def _saved_ops() -> set:
    """Ops whose outputs selective AC keeps (torchtitan's per-op list): attention, the TP
    reduce-scatters (not the FSDP all-gathers: those must be recomputed), ``max``; and
    matmuls, of which ``_selective_policy`` keeps every other one."""
    aten = torch.ops.aten
    return {*_matmul_ops(), aten.max.default, *attention_ops(),
            CollectiveKind.REDUCE_SCATTER.op}


def _selective_policy(saved: frozenset, mm_calls: collections.Counter, ctx, func,
                      *args, **kwargs) -> CheckpointPolicy:
    """torchtitan's op-level rule: save ``saved`` ops' outputs except every second
    matmul of a block's forward (its 2nd, 4th, ...; counted separately in the forward
    and in its recomputation, so both make the same decisions). In our Llama block that
    keeps wq, wv, w1, w2 and recomputes wk, wo, w3: about half the matmul memory. A
    float8 linear's ``_scaled_mm`` counts as its matmul, so a converted block keeps the
    same layers' outputs as a high-precision one."""
    if func in _MATMULS:
        mm_calls[ctx.is_recompute] += 1
        if mm_calls[ctx.is_recompute] % 2 == 0:
            return CheckpointPolicy.PREFER_RECOMPUTE
    return CheckpointPolicy.MUST_SAVE if func in saved else CheckpointPolicy.PREFER_RECOMPUTE


_MATMULS = _matmul_ops()


def _routed_saved_ops() -> set:
    """What selective AC keeps in a compiled routed block besides :func:`_saved_ops`: the
    token exchanges' outputs (``all_to_all_single``: recomputing one would repeat a
    collective in backward; the counts' exchange too, whose values size the rest) and the
    routed experts' matmuls, all of them (``aten._grouped_mm``; traced in float32
    ``models.moe.expert_ffn`` runs one ``expert_linear`` per expert in its place), not counted
    among the block's every-other matmuls. Not the exchanges' waits: the policy cannot
    tell them from the FSDP gathers' waits, which must be recomputed (a recomputed wait
    on a kept exchange's output moves nothing)."""
    grouped = grouped_mm_op()  # torch's grouped matmul, where it has one
    # models.moe (imported by .expert) registered simplefsdp::expert_linear
    return {ALL_TO_ALL, torch.ops.simplefsdp.expert_linear.default,
            *(() if grouped is None else (grouped,))}


def _selective_context(extra_saved: frozenset = frozenset()):
    """A fresh policy per checkpointed call: the matmul count restarts with each block;
    ``extra_saved``: ops kept besides :func:`_saved_ops` (a routed block's, compiled)."""
    policy = functools.partial(_selective_policy, frozenset(_saved_ops()) | extra_saved,
                               collections.Counter())
    return create_selective_checkpoint_contexts(policy)


def _compiled_routed_selective_context():
    """:func:`_selective_context` for a routed block traced into a compiled graph: the
    same policy, keeping the exchanges and the experts' matmuls (:func:`_routed_saved_ops`).
    Dispatch modes only, as a checkpoint traced by Dynamo needs; the Python-state
    exchanges of :func:`_routed_selective_context` are eager's."""
    return _selective_context(frozenset(_routed_saved_ops()))


def _routed_selective_context():
    """:func:`_selective_context` for a block that routes tokens to experts, its token
    exchanges kept as well (``parallel.expert.keep_exchanges``: the recomputation is
    served their outputs, so it moves no token again). Eager only: a checkpoint traced
    into a graph takes dispatch modes alone (:func:`_compiled_routed_selective_context`)."""
    return tuple(_both(*pair) for pair in zip(_selective_context(), keep_exchanges(),
                                              strict=True))


def _routes_tokens(block: nn.Module) -> bool:
    """Whether ``block`` holds routed experts (its forward leaves the graph for them)."""
    return any(holds_experts(m) for m in block.modules())


@contextlib.contextmanager
def _both(first, second):
    with first, second:
        yield


def apply_ac(model: nn.Module, mode: str, layers: nn.Module | None = None) -> None:
    """Wrap each block of ``layers`` (a ``ModuleDict`` or ``ModuleList``; default
    ``model.layers``, our Llama's) for ``full`` or ``selective`` checkpointing, in place.

    The wrapper's name (``_checkpoint_wrapped_module``) is stripped from state dict
    keys by the wrapper itself, so checkpoints do not depend on the mode.
    """
    if mode == "none":
        return
    blocks = model.layers if layers is None else layers
    keys = list(blocks.keys()) if isinstance(blocks, nn.ModuleDict) else range(len(blocks))
    for key in keys:
        blocks[key] = checkpointed(blocks[key], mode)


def checkpointed(block: nn.Module, mode: str) -> nn.Module:
    """``block`` wrapped for ``full`` or ``selective`` activation checkpointing (the one
    place the wrapper is built: our Llama's blocks and Hugging Face decoder layers)."""
    if mode not in ("full", "selective"):
        raise ConfigError(f"activation_checkpoint.mode = {mode!r} is unknown")
    if mode == "selective":
        kwargs = {"context_fn": _routed_selective_context if _routes_tokens(block)
                  else _selective_context}
    else:  # full: on some torch a context_fn, so compiled full AC recomputes every op
        full = full_recompute_context_fn()
        kwargs = {} if full is None else {"context_fn": full}
    return checkpoint_wrapper(block, preserve_rng_state=False, **kwargs)


def ac_mode_run(mode: str, compiled: bool, fullgraph: bool) -> str:
    """The activation checkpointing the planner prices for ``activation_checkpoint.mode``:
    ``selective`` as whole-block recomputation in a compiled model that may leave the
    graph (``fullgraph = False``: an MoE's), as compiled routed blocks ran before their
    op-level policy (:func:`compile_checkpointed_blocks`); the planner's MoE terms
    (``plan/moe.py``) are priced on that rule until they learn the op-level one."""
    return "full" if mode == "selective" and compiled and not fullgraph else mode


def compile_checkpointed_blocks(model: nn.Module, backend) -> None:
    """Prepare the checkpointed blocks of a model compiled with ``fullgraph = False`` (an
    MoE's).

    ``selective``: every block's checkpoint is traced into the model's graph, with the
    op-level policy applied in the graph. A routed block's policy also keeps its token
    exchanges and its experts' matmuls (:func:`_compiled_routed_selective_context`): its
    recomputation in backward repeats no all-to-all. The routed dispatch traces whole
    (``parallel.expert``'s exact one with unbacked sizes); a routed block's forward
    updates its load counters and balance loss, which the recomputation must not repeat
    (``_torch_compat.forward_side_effects_once``, set by ``models.parallelize.compile_model``).

    ``full``: each block's own call is compiled inside its eager checkpoint, so a
    recomputation, called by autograd outside the compiled model, runs the same graphs
    (a checkpoint around compiled frames would recompute the block eagerly, saving other
    tensors than the compiled forward: "Recomputed values ... have different metadata")."""
    for block in getattr(model, "layers", {}).values():
        inner = checkpointed_inner(block)
        if inner is None:
            continue
        keywords = checkpoint_keywords(block)
        if keywords.get("context_fn") in (None, full_recompute_context_fn()):  # full
            inner.compile(backend=backend)
        elif _routes_tokens(block):  # selective: dispatch modes only, traced with the model
            keywords["context_fn"] = _compiled_routed_selective_context
            set_checkpoint_keywords(block, keywords)


def check_composition(ac_mode: str, compiled: bool, backend: str = "inductor") -> None:
    """Refuse, before any work, the combinations this torch cannot compile. Full AC
    compiles through ``compiler/recompute.py`` (min-cut, then the saved values put back in
    the runtime's layout); Inductor needs ``custom_partitioner_fn`` for it (2.13 has it)."""
    if compiled and ac_mode == "full" and backend == "inductor" \
            and custom_partitioner_base() is None:
        raise ConfigError(
            "activation_checkpoint.mode = 'full' with compile.enable = true and "
            f"compile.backend = 'inductor' needs Inductor's custom_partitioner_fn, which "
            f"torch {torch.__version__} lacks; use compile.backend = 'aot_eager', "
            "activation_checkpoint.mode = 'selective', or compile.enable = false")


# ---------------------------------------------------------------------------------------
# torch's warning about our own checkpointed regions.
# ---------------------------------------------------------------------------------------
# torch logs this once per process when it compiles a torch.utils.checkpoint region that
# has a context_fn, asking the user to make sure the region holds no in-place op. Ours do
# not: the data-parallel gather (recomputed in backward, even with ac = none) and our
# selective AC policy on blocks without in-place ops. Left alone, every compiled run and
# the planner print it on every rank, and the user can do nothing about it.
_CONTEXT_FN_WARNING = re.compile(
    r"\s*Detected that context_fn is passed to torch\.utils\.checkpoint under torch\.compile")
_IN_PLACE_FUNCTIONS = {operator.setitem, operator.iadd, operator.isub, operator.imul,
                       operator.itruediv, operator.ifloordiv, operator.imod, operator.ipow,
                       operator.iand, operator.ior, operator.ixor, operator.ilshift,
                       operator.irshift, operator.imatmul}


def _our_context_fns() -> tuple:
    """The checkpoint context functions this library passes (looked up when needed)."""
    import importlib

    # the module by name: ``simplefsdp.data_parallel`` the attribute is the function
    gather = importlib.import_module("simplefsdp.data_parallel")
    return tuple(fn for fn in (getattr(gather, "_gather_policy_contexts", None),
                               _selective_context, _compiled_routed_selective_context,
                               full_recompute_context_fn())
                 if fn is not None)


def _has_in_place_op(region: nn.Module) -> bool:
    """Whether a checkpointed region's graph (as Dynamo captured it) writes in place:
    ``x.relu_()``, ``torch.relu_``, ``x += y``, ``x[i] = y``, an ``out=`` argument."""
    for module in region.modules():
        graph = getattr(module, "graph", None)
        for node in graph.nodes if graph is not None else ():
            if node.op not in ("call_function", "call_method"):
                continue
            name = node.target if isinstance(node.target, str) else \
                getattr(node.target, "__name__", "")
            if node.target in _IN_PLACE_FUNCTIONS or "out" in node.kwargs or \
                    (name.endswith("_") and not name.endswith("__")) or \
                    name in ("__setitem__", "__iadd__", "__isub__", "__imul__", "__itruediv__"):
                return True
    return False


class _OurCheckpointRegions(logging.Filter):
    """Drops torch's context_fn warning where the region is ours and holds no in-place
    op; any other region's warning passes, as does everything else on that logger.

    It reads the region, and the context_fn in its meta, from the frame of torch's
    ``tag_activation_checkpoint_impl`` (torch 2.11-2.13), which logs the warning; where
    that frame is not found (another torch), the warning passes. torch logs it once per
    process: after ours is dropped, a later region of someone else's in the same process
    is not warned about (in the trainer and the planner every region is ours)."""

    def filter(self, record: logging.LogRecord) -> bool:
        if not _CONTEXT_FN_WARNING.match(record.getMessage()):
            return True
        frame = sys._getframe(1)
        while frame is not None:
            if frame.f_code.co_name == CHECKPOINT_CONTEXT_FN_FRAME and \
                    frame.f_globals.get("__name__") == CHECKPOINT_CONTEXT_FN_LOGGER:
                region = frame.f_locals.get("gmod")
                meta = getattr(region, "meta", {})
                fn = meta.get(CHECKPOINT_CONTEXT_FN_META) if isinstance(meta, dict) else None
                ours = any(fn is mine for mine in _our_context_fns())
                return not (ours and isinstance(region, nn.Module) and
                            not _has_in_place_op(region))
            frame = frame.f_back
        return True


def quiet_our_checkpoint_warning() -> logging.Filter:
    """Install (once per process) the filter of torch's warning about our checkpointed
    regions; the trainer, the planner and the benchmark call it before compiling."""
    logger = logging.getLogger(CHECKPOINT_CONTEXT_FN_LOGGER)
    for existing in logger.filters:
        if isinstance(existing, _OurCheckpointRegions):
            return existing
    quiet = _OurCheckpointRegions()
    logger.addFilter(quiet)
    return quiet
