"""``data.streaming``: documents tokenized on the fly, no cache, resumable.

Document units (a ``.txt`` file, a ``.jsonl`` line, a parquet row) of a source are
numbered in reading order; data-parallel rank ``r`` of ``W`` takes units ``u`` with
``u % W == r`` (the others are skipped unparsed), appends EOS, packs them back to back
and cuts windows of ``seq_len + 1`` tokens advancing by ``seq_len`` (as the mapped
loader). At the end of the files the next epoch starts over, in the same order (no
shuffling). With several sources (a mixture), global sample position ``p`` takes its
next window from source ``s(p)``, drawn by ``data.weights`` exactly as the mapped mixture
draws (:class:`.mixture.Schedule`); each source is packed on its own.

A source's position is the document at the head of its buffer, ``(epoch, unit, file,
place)``, and the offset into that document's tokens: a resumed loader re-reads from
that place (a seek, not a replay) and yields the same windows. The checkpoint holds
every data-parallel rank's positions in one table, the same on every rank (gathered when
saved). The split of documents depends on the data-parallel size, so a checkpoint resumes
only at the size that wrote it; another size is refused with the fix.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator

import numpy as np
import torch
import torch.distributed as dist

from ..errors import ConfigError
from .mixture import Schedule
from .sources import Source, documents
from .text import SampleCounter

Head = tuple[int, int, int, int]  # (epoch, unit, file index, place in the file)


class SourceStream:
    """One source's documents for one data-parallel rank, packed into windows."""

    def __init__(self, source: Source, tokenizer, text_field: str, seq_len: int,
                 dp_rank: int, dp_world: int):
        self.files, self.name = source.files, source.name
        self.tokenizer, self.field, self.seq_len = tokenizer, text_field, seq_len
        self.dp_rank, self.dp_world = dp_rank, dp_world
        self.restart((0, 0, 0, 0), 0)

    def restart(self, head: Head, offset: int) -> None:
        """Read again from document ``head``, ``offset`` tokens into it."""
        self._docs = self._read(*head)
        self._buffer: list[tuple[Head, np.ndarray]] = []
        self._offset, self._head = offset, head

    @property
    def position(self) -> list[int]:
        return [*self._head, self._offset]

    def _read(self, epoch: int, unit: int, file: int, place: int
              ) -> Iterator[tuple[Head, np.ndarray]]:
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

    def window(self) -> np.ndarray:
        """The next ``seq_len + 1`` tokens; the window after starts ``seq_len`` later."""
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


class StreamLoader(SampleCounter):
    """Endless ``(inputs, targets)`` batches of one data-parallel rank, read and
    tokenized as they are needed; several sources are mixed by ``weights``."""

    def __init__(self, sources: list[Source], tokenizer, text_field: str, batch_size: int,
                 seq_len: int, dp_rank: int = 0, dp_world: int = 1, seed: int = 0,
                 weights: list[float] | None = None):
        if len(sources) > 1 and len(weights or []) != len(sources):
            raise ValueError(f"{len(sources)} sources need as many weights, got {weights}")
        self.streams = [SourceStream(s, tokenizer, text_field, seq_len, dp_rank, dp_world)
                        for s in sources]
        self.schedule = Schedule(weights, seed) if len(sources) > 1 else None
        self.batch_size, self.seq_len = batch_size, seq_len
        self.dp_rank, self.dp_world, self.seed = dp_rank, dp_world, seed
        self.samples = 0

    def __next__(self) -> tuple[torch.Tensor, torch.Tensor]:
        first = self.samples + self.dp_rank * self.batch_size
        picks = [0] * self.batch_size
        if self.schedule is not None:
            picks = self.schedule.sources_of(torch.arange(first, first + self.batch_size))
        chunk = torch.from_numpy(np.stack([self.streams[s].window() for s in picks]))
        self.samples += self.global_batch_size
        return chunk[:, :-1], chunk[:, 1:]

    def state_dict(self) -> dict:
        """The counter and every data-parallel rank's stream positions (a collective when
        a process group is up: each rank knows only its own; rows of ranks not known
        here, without a process group, are None)."""
        mine = [self.dp_rank, [s.position for s in self.streams]]
        rows = [mine]
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            rows = [None] * dist.get_world_size()
            dist.all_gather_object(rows, mine)
        table: list = [None] * self.dp_world
        for rank, positions in rows:  # ranks of one data-parallel coordinate agree
            table[rank] = positions
        return {**super().state_dict(), "stream_world": self.dp_world,
                "stream_positions": table}

    def load_state_dict(self, state: dict) -> None:
        saved = int(state["stream_world"])
        if saved != self.dp_world:
            raise ConfigError(
                f"data.streaming = true: the checkpoint holds the stream positions of "
                f"{saved} data-parallel ranks, this run has {self.dp_world}; a stream's "
                f"documents are split by data-parallel rank, so resume with {saved} "
                f"data-parallel ranks (parallel.dp_replicate * parallel.dp_shard), or start "
                f"a new run (data.streaming = false resumes at any data-parallel size)")
        positions = state["stream_positions"][self.dp_rank]
        if positions is None or len(positions) != len(self.streams):
            have = "no position" if positions is None else f"{len(positions)} sources"
            raise ConfigError(f"data.dataset: the checkpoint's stream for data-parallel rank "
                              f"{self.dp_rank} has {have}, this run streams "
                              f"{len(self.streams)}; resume with the data.dataset that "
                              f"wrote it")
        super().load_state_dict(state)
        for stream, (*head, offset) in zip(self.streams, positions, strict=True):
            stream.restart(tuple(int(v) for v in head), int(offset))
