"""``data.streaming``: documents tokenized on the fly, no cache, resumable.

Document units (a ``.txt`` file, a ``.jsonl`` line, a parquet row) are numbered in
reading order; data-parallel rank ``r`` of ``W`` takes units ``u`` with ``u % W == r``
(the others are skipped unparsed), appends EOS, packs them back to back and cuts
windows of ``seq_len + 1`` tokens advancing by ``seq_len`` (as the mapped loader). At
the end of the files the next epoch starts over, in the same order (no shuffling).

Its position is the document at the head of its buffer, ``(epoch, unit, cursor)``, and
the offset into that document's tokens: a resumed loader re-reads from that cursor (a
seek, not a replay) and yields the same windows. Ranks' positions differ, so each rank
saves its own key ``stream_dp<r>``; resuming needs the same data-parallel size.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator

import numpy as np
import torch

from ..train.config_reader import ConfigError
from ..train.data import SampleCounter
from .sources import Source, documents


class StreamLoader(SampleCounter):
    """Endless ``(inputs, targets)`` batches of one data-parallel rank, read and
    tokenized as they are needed."""

    def __init__(self, sources: list[Source], tokenizer, text_field: str, batch_size: int,
                 seq_len: int, dp_rank: int = 0, dp_world: int = 1, seed: int = 0):
        if len(sources) != 1:
            raise ConfigError("data.streaming = true reads one source (a file, folder or "
                              "glob): drop the other data.dataset entries and data.weights, "
                              "or turn streaming off to mix cached sources")
        self.files = sources[0].files
        self.name, self.tokenizer, self.field = sources[0].name, tokenizer, text_field
        self.batch_size, self.seq_len = batch_size, seq_len
        self.dp_rank, self.dp_world, self.seed = dp_rank, dp_world, seed
        self.samples = 0
        self._restart((0, 0, 0, 0), 0)

    def _restart(self, head: tuple[int, int, int, int], offset: int) -> None:
        """Read again from document ``head = (epoch, unit, file, place)``."""
        self._docs = self._read(*head)
        self._buffer: list[tuple[tuple[int, int, int, int], np.ndarray]] = []
        self._offset, self._head = offset, head

    def _read(self, epoch: int, unit: int, file: int, place: int
              ) -> Iterator[tuple[tuple[int, int, int, int], np.ndarray]]:
        eos = getattr(self.tokenizer, "eos_id", None)
        while True:
            found, seen = False, itertools.count(unit)  # select() sees units in order

            def mine(_cursor, seen=seen) -> bool:
                return next(seen) % self.dp_world == self.dp_rank

            units = documents(self.files, self.field, (file, place), mine)
            for u, (cursor, text) in zip(itertools.count(unit), units):
                if text:
                    ids = self.tokenizer.encode(text) + ([eos] if eos is not None else [])
                    found = True
                    yield (epoch, u, *cursor), np.asarray(ids, dtype=np.int64)
            if not found and unit == 0:
                raise ConfigError(f"data.dataset = {self.name!r}: data-parallel rank "
                                  f"{self.dp_rank} of {self.dp_world} got no document "
                                  f"(units u with u % {self.dp_world} == {self.dp_rank}); "
                                  f"use more documents or turn data.streaming off")
            epoch, unit, file, place = epoch + 1, 0, 0, 0

    def _window(self) -> np.ndarray:
        need = self._offset + self.seq_len + 1
        while sum(len(t) for _, t in self._buffer) < need:
            self._buffer.append(next(self._docs))
        tokens = np.concatenate([t for _, t in self._buffer])
        window = tokens[self._offset:need]
        self._offset += self.seq_len
        while len(self._buffer[0][1]) <= self._offset:  # drop documents fully used
            self._offset -= len(self._buffer.pop(0)[1])
        self._head = self._buffer[0][0]
        return window

    def __next__(self) -> tuple[torch.Tensor, torch.Tensor]:
        chunk = torch.from_numpy(np.stack([self._window() for _ in range(self.batch_size)]))
        self.samples += self.global_batch_size
        return chunk[:, :-1], chunk[:, 1:]

    @property
    def _key(self) -> str:
        return f"stream_dp{self.dp_rank}"

    def state_dict(self) -> dict:
        return {**super().state_dict(), self._key: [*self._head, self._offset]}

    def load_state_dict(self, state: dict) -> None:
        super().load_state_dict(state)
        *head, offset = (int(v) for v in state[self._key])
        self._restart(tuple(head), offset)
