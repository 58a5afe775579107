"""Write a Hugging Face model folder from a sharded model, one shard file at a time.

The folder holds ``config.json``, the weights as ``model.safetensors`` or
``model-0000i-of-0000N.safetensors`` + ``model.safetensors.index.json`` (original
names), and the tokenizer files when the tokenizer came from Hugging Face:
``AutoModelForCausalLM.from_pretrained(folder)`` opens it. Each tensor is gathered
(a collective over its mesh), rank 0 keeps a CPU copy until its shard file is full and
written, so rank 0 holds at most one shard (``max_shard_bytes``) of the model.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from .weights import SINGLE, meta_rows_to_hf, unique_tensors


def set_dtype(config, dtype: torch.dtype) -> None:
    """Record the weights' dtype in a transformers config (``dtype``; ``torch_dtype``
    before transformers 4.56)."""
    name = str(dtype).removeprefix("torch.")  # torch.bfloat16 -> "bfloat16"
    if "dtype" in getattr(config, "__dict__", {}) or not hasattr(config, "torch_dtype"):
        config.dtype = name
    else:
        config.torch_dtype = name


def _plan(entries: list[tuple[str, torch.Tensor]], max_bytes: int) -> list[list[int]]:
    shards: list[list[int]] = [[]]
    size = 0
    for i, (_, value) in enumerate(entries):
        nbytes = value.numel() * value.element_size()
        if shards[-1] and size + nbytes > max_bytes:
            shards.append([])
            size = 0
        shards[-1].append(i)
        size += nbytes
    return shards


FileTensors = Callable[[str, torch.Tensor], dict[str, torch.Tensor]]


def renamed(rename: Callable[[str], str],
             rope_heads: Callable[[str], int | None]) -> FileTensors:
    def to_files(name: str, full: torch.Tensor) -> dict[str, torch.Tensor]:
        heads = rope_heads(name)
        if heads is not None:
            full = meta_rows_to_hf(full, heads)
        return {rename(name): full.contiguous()}

    return to_files


@torch.no_grad()
def export_hf(model: nn.Module, folder: str | Path, config, tokenizer=None,
              rename: Callable[[str], str] = lambda name: name,
              rope_heads: Callable[[str], int | None] = lambda name: None,
              max_shard_bytes: int = 2 * 1024**3, to_files: FileTensors | None = None) -> Path:
    """Write ``model`` (sharded or not) to ``folder`` as a Hugging Face model (a
    collective: every rank calls it; rank 0 writes). ``rename`` maps our names to the
    file's; ``rope_heads(name)`` set means Meta-order rows to turn into rotate-half order;
    ``to_files(name, full tensor)``, when given, replaces both: the file tensors (name ->
    tensor) one model tensor is saved as (``conversion.file_tensors``).
    A tied weight is written once, under its first name."""
    from safetensors.torch import save_file

    rank = dist.get_rank() if dist.is_initialized() else 0
    to_files = to_files or renamed(rename, rope_heads)
    folder = Path(folder)
    entries = [(names[0], value) for names, value in unique_tensors(model)]
    shards = _plan(entries, max_shard_bytes)
    weight_map: dict[str, str] = {}
    total = 0
    if rank == 0:
        folder.mkdir(parents=True, exist_ok=True)
    for n, shard in enumerate(shards, 1):
        file = SINGLE if len(shards) == 1 else f"model-{n:05d}-of-{len(shards):05d}.safetensors"
        tensors: dict[str, torch.Tensor] = {}
        for i in shard:
            name, value = entries[i]
            full = value.full_tensor() if isinstance(value, DTensor) else value
            if rank != 0:
                continue
            for key, tensor in to_files(name, full.detach().to("cpu", copy=True)).items():
                tensors[key] = tensor
                weight_map[key] = file
                total += tensor.numel() * tensor.element_size()
        if rank == 0:
            save_file(tensors, str(folder / file), metadata={"format": "pt"})
        del tensors
    if rank == 0:
        if len(shards) > 1:
            index = {"metadata": {"total_size": total}, "weight_map": weight_map}
            (folder / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
        dtype = entries[0][1].dtype if entries else torch.float32
        set_dtype(config, dtype)
        config.save_pretrained(folder)
        if tokenizer is not None and hasattr(tokenizer, "save"):
            tokenizer.save(folder)
    if dist.is_initialized():
        dist.barrier()
    return folder
