"""Training data at scale: tokenize once into memory-mapped caches, or stream.

- :mod:`.sources`: what ``data.dataset`` names (files, folders, globs, mixtures) and its
  documents, read one at a time from resumable cursors.
- :mod:`.cache`: tokenize a source once, in parallel, into ``uint16``/``uint32`` token
  files plus document boundaries, keyed by files, tokenizer and settings.
- :mod:`.mixture`: several sources sampled by ``data.weights``.
- :mod:`.stream`: ``data.streaming``: documents tokenized on the fly, split by
  data-parallel rank, packed, with a resumable position.
- :mod:`.setup`: the trainer's one call, :func:`build_loader`.
"""

from .setup import VAL_FRACTION, build_loader, held_out_tokens, open_caches

__all__ = ["VAL_FRACTION", "build_loader", "held_out_tokens", "open_caches"]
