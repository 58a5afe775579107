"""transformers' checkpoint conversion mapping in our sharded loader and export.

transformers 5 holds some weights in memory under other names and shapes than in its
files: MoE experts are saved per expert (``mlp.experts.3.gate_proj.weight``; Mixtral
``block_sparse_moe.experts.3.w1.weight``) and held fused (``mlp.experts.gate_up_proj
[E, 2I, H]``). Per model type it lists ``WeightRenaming`` / ``WeightConverter`` objects
(``transformers.conversion_mapping``) that ``from_pretrained`` applies while loading and
``save_pretrained`` reverses. Here those same objects, never a table of ours, decide:

- which file tensors make each in-memory tensor (:func:`sources`): every file name goes
  through ``core_model_loading.rename_source_key`` and is grouped under the converter
  it matched, in transformers' key order (``dot_natural_key``: expert 10 after 9);
- how to build rows ``[a, b)`` of a converted tensor (:meth:`Converted.read_rows`): a
  file piece one dimension smaller than the target is row ``i`` of it, ``i`` its place
  in the group (one expert): transformers' own rule for sharded loading
  (``distributed.sharding_utils.DtensorShardOperation``). Only pieces ``a..b-1`` are
  read and the converter's own ``convert`` stacks and concatenates them. A converter
  whose pieces are whole tensors is run on all of them and its result sliced;
- the files' layout on export (:func:`file_tensors`): transformers' reverse conversion
  (``revert_weight_conversion``) of each tensor, with the conversions the load used.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

import torch
from torch import nn

from . import HFError
from .weights import Source, WeightFiles, unique_tensors


@dataclass(frozen=True, eq=False)
class Converted:
    """An in-memory tensor that a transformers ``WeightConverter`` builds from file
    tensors: ``parts`` holds, per source pattern of the converter, the file names it
    collects, in transformers' order."""

    name: str  # the in-memory name (the converter's target)
    shape: tuple[int, ...]  # the model's tensor
    converter: object  # transformers' WeightConverter; each read runs a fresh copy
    parts: tuple[tuple[str, tuple[str, ...]], ...]
    config: object  # the model's config (some operations read it)

    def first_key(self) -> str:
        return self.parts[0][1][0]

    def _convert(self, pieces: dict[str, list[torch.Tensor]]) -> torch.Tensor:
        converter = copy.deepcopy(self.converter)
        for pattern, tensors in pieces.items():
            for tensor in tensors:
                converter.add_tensor(self.name, self.name, pattern, tensor)
        out = converter.convert(self.name, config=self.config)
        if self.name not in out:
            raise HFError(f"transformers' {type(self.converter).__name__} for {self.name!r} "
                          f"made {sorted(out)}, not {self.name!r}; this model's checkpoint "
                          f"conversion is not supported by the sharded loader")
        value = out[self.name]
        return value[0] if isinstance(value, list) else value

    def file_shape(self, files: WeightFiles) -> tuple[int, ...]:
        """The converted tensor's shape, from the file headers: the converter runs on
        meta tensors of the pieces' shapes (nothing is read)."""
        pieces = {pattern: [torch.empty(files.shape(k), device="meta") for k in keys]
                  for pattern, keys in self.parts}
        try:
            return tuple(self._convert(pieces).shape)
        except (RuntimeError, ValueError, IndexError) as e:
            keys = [k for _, ks in self.parts for k in ks]
            raise HFError(f"{files.folder}: transformers' conversion of {keys[0]!r} ... "
                          f"{keys[-1]!r} ({len(keys)} tensors) into the model's {self.name!r} "
                          f"{list(self.shape)} fails on their shapes ({e}); do the weights "
                          f"match config.json?") from None

    def _per_row(self, files: WeightFiles) -> bool:
        """Every piece is one row of the target (transformers' per-expert rule)."""
        return all(len(keys) == self.shape[0] and len(files.shape(keys[0])) == len(self.shape) - 1
                   for _, keys in self.parts)

    def read_rows(self, files: WeightFiles, start: int, stop: int) -> tuple[torch.Tensor, int]:
        """Rows ``[start, stop)`` of the converted tensor and the bytes read for them."""
        per_row = self._per_row(files)
        pieces = {pattern: [files.tensor(k) for k in (keys[start:stop] if per_row else keys)]
                  for pattern, keys in self.parts}
        read = sum(t.numel() * t.element_size() for ts in pieces.values() for t in ts)
        value = self._convert(pieces)
        return (value if per_row else value[start:stop]), read


def _transforms(model: nn.Module):
    """(renamings, converters) transformers applies when loading ``model``
    (``from_pretrained``'s defaults: ``get_model_conversion_mapping``)."""
    from transformers.conversion_mapping import get_model_conversion_mapping
    from transformers.core_model_loading import WeightConverter, WeightRenaming

    mapping = get_model_conversion_mapping(model)
    return ([t for t in mapping if isinstance(t, WeightRenaming)],
            [t for t in mapping if isinstance(t, WeightConverter)], mapping)


def sources(model: nn.Module, files: WeightFiles) -> dict[str, Source]:
    """Where each tensor of the (unparallelized) transformers ``model`` comes from in
    ``files``: the name transformers' renamings give a file tensor, or a
    :class:`Converted` group. Names absent from the files are left out (the loader
    reports a missing parameter). Records the conversions used on ``model``
    (``_weight_conversions``, as ``from_pretrained`` does) for the export."""
    from transformers.core_model_loading import dot_natural_key, rename_source_key

    renamings, converters, mapping = _transforms(model)
    by_pattern = {p: c for c in converters for p in c.source_patterns}
    shapes = {n: tuple(v.shape) for names, v in unique_tensors(model) for n in names}
    known = dict.fromkeys(shapes, True)  # what rename_source_key looks names up in
    prefix = getattr(model, "base_model_prefix", None)
    found: dict[str, Source] = {}
    groups: dict[str, tuple[object, dict[str, list[str]]]] = {}
    for key in sorted(files.files, key=dot_natural_key):
        name, pattern = rename_source_key(key, renamings, converters, prefix, known)
        if name not in known and key in known:  # as transformers: only the prefix logic
            name, pattern = rename_source_key(key, [], [], prefix, known)
        if name not in known:
            continue
        if pattern is None:
            found.setdefault(name, Source(key))
        else:
            converter, parts = groups.setdefault(name, (by_pattern[pattern], {}))
            parts.setdefault(pattern, []).append(key)
    for name, (converter, parts) in groups.items():
        ordered = tuple((p, tuple(parts[p])) for p in converter.source_patterns if p in parts)
        converted = Converted(name, shapes[name], converter, ordered, model.config)
        found[name] = Source(converted.first_key(), converted=converted)
    model._weight_conversions = [t for t in mapping if t.was_used()]
    return found


def check_export(model: nn.Module) -> None:
    """Refuse, before training, an export whose reverse conversion would need several
    in-memory tensors at once (:func:`file_tensors` converts one at a time)."""
    reverse = [t.reverse_transform() for t in getattr(model, "_weight_conversions", None) or []]
    for names, _ in unique_tensors(model):
        if any(len(t.source_patterns) > 1 and t.rename_source_key(names[0])[1] is not None
               for t in reverse):
            raise HFError(f"checkpoint.export_hf: transformers saves {names[0]!r} merged with "
                          f"other tensors; exporting this model type is not supported (set "
                          f"checkpoint.export_hf = false)")


def file_tensors(model: nn.Module, name: str, value: torch.Tensor) -> dict[str, torch.Tensor]:
    """The file tensors that in-memory ``name`` (its full value) is saved as:
    transformers' reverse conversion with the conversions the load recorded
    (``revert_weight_conversion``). Each is its own copy: safetensors refuses tensors
    that share memory, as the per-expert views of one fused tensor do."""
    from transformers.core_model_loading import revert_weight_conversion

    out = revert_weight_conversion(model, {name: value})
    return {key: tensor.contiguous().clone() for key, tensor in out.items()}
