"""Hugging Face models and tokenizers in the trainer (the optional ``[hf]`` extra).

- :mod:`.family`: the ``hf`` model family of ``models.registry`` (``model.hf_path``).
- :mod:`.model`: build a local Hugging Face causal LM on the meta device, parallelize it
  with ``data_parallel`` and load its weights sharded (no rank holds the whole model).
- :mod:`.weights`: reading safetensors folders one tensor (or one row range) at a time.
- :mod:`.conversion`: transformers' checkpoint conversion mapping (file layout <->
  in-memory layout, e.g. per-expert files <-> fused MoE experts) for loading and export.
- :mod:`.experts`: transformers' fused MoE experts, run so that every rank gathers alike.
- :mod:`.context_parallel`: ring / Ulysses attention registered in transformers.
- :mod:`.llama_layout`: our Llama <-> Hugging Face Llama names, shapes and RoPE layout.
- :mod:`.tokenizer`: Hugging Face (``tokenizer.json``) and tiktoken tokenizers.
- :mod:`.export`: write a folder ``AutoModelForCausalLM.from_pretrained`` opens.
- :mod:`.hooks`: the few calls the trainer makes.

Documents (``.txt`` / ``.jsonl`` / ``.parquet``) are read by ``simplefsdp.corpus`` for
every family. Nothing here imports transformers & co. at import time: :func:`require`
checks them when a job asks for them, and every load runs with the hub switched off.
"""

from __future__ import annotations

import importlib
import os

from ..errors import ConfigError

PACKAGES = ("transformers", "tokenizers", "datasets", "safetensors")
_OFFLINE = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}


class HFError(ConfigError):
    """A Hugging Face model folder, weight file, tokenizer or data file is unusable."""


def offline() -> None:
    """Forbid every network access of the Hugging Face libraries (local files only)."""
    os.environ.update(_OFFLINE)


def require(*packages: str) -> None:
    """Import-check ``packages`` (default: all of the ``[hf]`` extra) with one clear error."""
    offline()
    missing = []
    for name in packages or PACKAGES:
        try:
            importlib.import_module(name)
        except ImportError:
            missing.append(name)
    if missing:
        raise HFError(f"Hugging Face support needs {', '.join(missing)}: "
                      f"pip install 'simplefsdp[hf]'")
