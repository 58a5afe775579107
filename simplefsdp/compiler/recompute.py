"""Full activation recomputation under ``torch.compile``: the partitioner we hand AOTAutograd.

Full activation checkpointing (``checkpoint_wrapper`` around each block, nothing saved but
the block's input) recomputes every op of a block in backward, attention included. On
CPU, ``aten._scaled_dot_product_flash_attention_for_cpu`` carries the
``nondeterministic_seeded`` tag (it could apply dropout), so the min-cut partitioner
(``functionalize_rng_ops``) makes the forward save the CPU RNG state for the recomputed
call. It appends that state to the forward's saved values just before the symbolic
sizes, that is *after* the opaque objects (the ``DeviceMesh`` of every DTensor
parameter, which the backward needs to rebuild the DTensor gradients: DeviceMesh is an
opaque graph value in torch 2.13). AOTAutograd's runtime expects
``tensors, opaque objects, symbolic sizes`` and slices by counts, so the mesh lands among
the tensors handed to ``save_for_backward``:
``AssertionError: expected all tensors_saved_with_vc_check to be Tensors``.
Selective AC never hits it (attention is saved, not recomputed); on CUDA the partitioner
threads the RNG state as a graph input instead (read in the 2.13 source, not run here).

:func:`partition` runs the min-cut partitioner and then restores the runtime's layout:
saved tensors first (version-checked, then not version-checked), then opaque objects, in
the forward's outputs and, in the same permutation, in the backward's inputs. Where the
layout is already right (no AC, selective AC, CUDA, a fixed torch) it changes nothing.
The tensors-without-version-check slice (pytorch#171353) and DeviceMesh as an opaque
graph value (pytorch#169867) are torch 2.11's; a torch without them saves no opaque
mesh and no such tensors, and the layout is already right there.
:func:`partition` also drops saved symbolic booleans the backward never reads
(:func:`drop_unread_saved_conditions`: torch 2.11 saves a traced ``torch._check``'s
condition, which 2.11's Inductor cannot take as a backward input).
:func:`inductor_partitioner` wraps it for Inductor's ``custom_partitioner_fn``.

Full recomputation itself comes from the checkpoint wrapper, the same code path as eager.
"""

from __future__ import annotations

import functools
import hashlib
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import fx

log = logging.getLogger("simplefsdp.compiler")
_SYM_TYPES = (torch.SymInt, torch.SymFloat, torch.SymBool, int, float, bool)
_NO_VC_CHECK = "saved_tensor_with_no_vc_check"  # AOTAutograd's node.meta key


def _kind(node: Any) -> int:
    """Rank of a saved value in the runtime's layout: 0 tensor (version-checked),
    1 tensor stashed without version check, 2 opaque object, 3 symbolic size."""
    val = node.meta.get("val") if isinstance(node, fx.Node) else None
    if isinstance(val, torch.Tensor) or val is None:  # None: AOTAutograd counts a tensor
        return 1 if isinstance(node, fx.Node) and node.meta.get(_NO_VC_CHECK, False) else 0
    if isinstance(val, _SYM_TYPES):
        return 3
    return 2


@dataclass
class LayoutFix:
    """What :func:`order_saved_values` did: ``moved`` names the saved values it moved
    (empty: the partitioner's layout was already right)."""

    saved: int = 0
    moved: list[str] = field(default_factory=list)
    skipped: str | None = None  # why nothing was done although the layout was off


def _saved_values(fw_module: fx.GraphModule, num_fwd_outputs: int):
    """(the forward's output node, its outputs, the saved values among them, how many of
    those at the end are symbolic sizes)."""
    fw_out = next(iter(fw_module.graph.find_nodes(op="output")))
    outputs = list(fw_out.args[0])
    saved = outputs[num_fwd_outputs:]
    n_sym = 0
    while n_sym < len(saved) and _kind(saved[len(saved) - 1 - n_sym]) == 3:
        n_sym += 1
    return fw_out, outputs, saved, n_sym


def order_saved_values(fw_module: fx.GraphModule, bw_module: fx.GraphModule,
                       num_fwd_outputs: int) -> LayoutFix:
    """Reorder the forward's saved values (its outputs after the first
    ``num_fwd_outputs``) into AOTAutograd's runtime layout (tensors, then tensors without
    version check, then opaque objects, then symbolic sizes), and the backward's inputs
    the same way. Stable: values of one kind keep their order. In place; recompiles."""
    fw_out, outputs, saved, n_sym = _saved_values(fw_module, num_fwd_outputs)
    body = saved[:len(saved) - n_sym]
    fix = LayoutFix(saved=len(body))
    order = sorted(range(len(body)), key=lambda i: _kind(body[i]))
    if order == list(range(len(body))):
        return fix
    # The backward receives (symbolic sizes, saved values in forward order, tangents...):
    # its placeholders n_sym .. n_sym + len(body) are ``body``, position by position.
    placeholders = list(bw_module.graph.find_nodes(op="placeholder"))
    bw_body = placeholders[n_sym:n_sym + len(body)]
    if len(bw_body) != len(body) or any(
            _kind(a) != _kind(b) for a, b in zip(body, bw_body, strict=True)):
        fix.skipped = "backward inputs do not mirror the forward's saved values"
        return fix
    fix.moved = [body[i].name for new, i in enumerate(order) if new != i]
    fw_out.args = (tuple(outputs[:num_fwd_outputs] + [body[i] for i in order]
                         + saved[len(body):]),) + tuple(fw_out.args[1:])
    anchor = placeholders[n_sym - 1] if n_sym else None
    for i in order:  # re-insert the placeholders in the new order
        node = bw_body[i]
        if anchor is None:
            next(iter(bw_module.graph.nodes)).prepend(node)
        else:
            anchor.append(node)
        anchor = node
    fw_module.recompile()
    bw_module.recompile()
    return fix


def drop_unread_saved_conditions(fw_module: fx.GraphModule, bw_module: fx.GraphModule,
                                 num_fwd_outputs: int) -> list[str]:
    """Drop the symbolic booleans the forward saves for a backward that never reads them
    (from the forward's outputs and the backward's inputs, in place); returns their names.

    A traced ``torch._check`` on data-dependent sizes (the MoE dispatch's
    ``check_that``) is a ``SymBool`` read by a runtime assert. Inside a checkpointed
    region the assert is tagged for recomputation, so torch 2.11's min-cut partitioner
    saves the condition for backward, where the assert (no output) is then dead code:
    the backward never reads it, and 2.11's Inductor refuses a graph input that is a
    sympy condition rather than an expression (``GraphLowering.output``: "Unsupported
    inductor graph input type: Equality"). Torch 2.13's partitioner does not save
    assert-only booleans (``_is_assert_only_symbool``): nothing to drop there.
    AOTAutograd counts the saved symbolic values from the forward's outputs after the
    partitioner, so removing one from both graphs keeps its runtime consistent."""
    fw_out, outputs, saved, n_sym = _saved_values(fw_module, num_fwd_outputs)
    syms = saved[len(saved) - n_sym:]
    # the backward's first inputs are the forward's saved symbolic values, in order
    inputs = list(bw_module.graph.find_nodes(op="placeholder"))[:n_sym]
    if len(inputs) != n_sym or any(_kind(i) != 3 for i in inputs):
        return []
    unread = [k for k, (value, read) in enumerate(zip(syms, inputs, strict=True))
              if isinstance(value.meta.get("val"), torch.SymBool) and not read.users]
    if not unread:
        return []
    for k in unread:
        bw_module.graph.erase_node(inputs[k])
    kept = [value for k, value in enumerate(syms) if k not in unread]
    fw_out.args = (tuple(outputs[:len(outputs) - n_sym] + kept),) + tuple(fw_out.args[1:])
    fw_module.recompile()
    bw_module.recompile()
    return [syms[k].name for k in unread]


def partition(joint_module: fx.GraphModule, joint_inputs: Any, *, num_fwd_outputs: int,
              compiler: str = "inductor", **kwargs: Any
              ) -> tuple[fx.GraphModule, fx.GraphModule]:
    """AOTAutograd's min-cut partitioner (it honours the checkpoint recompute tags), with
    the saved values put back in the runtime's layout (:func:`order_saved_values`)."""
    from functorch.compile import min_cut_rematerialization_partition

    fw, bw = min_cut_rematerialization_partition(
        joint_module, joint_inputs, compiler, num_fwd_outputs=num_fwd_outputs, **kwargs)
    dropped = drop_unread_saved_conditions(fw, bw, num_fwd_outputs)
    if dropped:
        log.info("saved conditions the backward does not read dropped: %s", dropped)
    fix = order_saved_values(fw, bw, num_fwd_outputs)
    if fix.skipped:  # the runtime will reject the layout; say why it was left as is
        log.warning("saved values left in the partitioner's order: %s", fix.skipped)
    elif fix.moved:
        log.info("saved values reordered for the runtime: moved %s", fix.moved)
    return fw, bw


def inductor_partitioner(base: type) -> Any:
    """An instance of Inductor's ``custom_partitioner_fn`` that runs :func:`partition`;
    ``base`` is Inductor's ``CustomPartitionerFn`` (``_torch_compat``)."""
    return _partitioner_class(base)()


@functools.cache
def _partitioner_class(base: type) -> type:
    """Defined on first use (its base lives in Inductor, which ``import simplefsdp`` does
    not load) and then bound as this module's ``InductorPartitioner``, so Inductor's FX
    graph cache can pickle an instance by reference (a local class cannot be pickled, and
    the cache is then bypassed for every graph)."""

    class Partitioner(base):
        """Inductor calls it with the joint graph after its joint-graph passes."""

        def __call__(self, gm, joint_inputs, **kwargs):
            kwargs.pop("compiler", None)
            return partition(gm, joint_inputs, compiler="inductor", **kwargs)

        def uuid(self) -> str:
            return hashlib.sha256(Path(__file__).read_bytes()).hexdigest()

    Partitioner.__name__ = Partitioner.__qualname__ = "InductorPartitioner"
    globals()["InductorPartitioner"] = Partitioner
    return Partitioner
