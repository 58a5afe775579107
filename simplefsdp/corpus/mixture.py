"""Several token sources sampled by weight, resumable from the global sample counter.

Global sample ``p`` comes from source ``s(p)``: blocks of ``BLOCK`` samples draw their
sources i.i.d. from the weights with a generator seeded by ``(seed, block)``. A source's
own samples are numbered in order of appearance (``k``), and its ``k``-th sample is its
loader's window for position ``k`` (its own epochs and permutations, see ``BatchLoader``).
So, as for one source, the whole state is the counter, and data-parallel ranks take
consecutive slices of each global batch; a run resumed at another data-parallel size
continues the same global sample order. ``Schedule`` (the draw) also serves the
streamed mixture (:mod:`.stream`).
"""

from __future__ import annotations

import torch

from .text import BatchLoader, SampleCounter, gather_windows

BLOCK = 4096


class Schedule:
    """Which source each global sample position comes from, drawn by weight in blocks of
    ``BLOCK`` positions, and its number among that source's samples."""

    def __init__(self, weights: list[float], seed: int):
        self.weights = torch.tensor(weights, dtype=torch.float64)
        self.seed = seed
        self._before: list[torch.Tensor] = [torch.zeros(len(weights), dtype=torch.long)]

    def block_sources(self, block: int) -> torch.Tensor:
        """Source of each sample of ``block``."""
        gen = torch.Generator().manual_seed(self.seed * 1_000_003 + 7919 * block + 17)
        return torch.multinomial(self.weights, BLOCK, replacement=True, generator=gen)

    def sources_of(self, positions: torch.Tensor) -> list[int]:
        """Source of each global position (what a stream needs: no numbering)."""
        blocks, offsets = (positions // BLOCK).tolist(), (positions % BLOCK).tolist()
        drawn = {b: self.block_sources(b) for b in set(blocks)}
        return [int(drawn[b][o]) for b, o in zip(blocks, offsets, strict=True)]

    def assign(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(source, that source's own sample number) of each global position."""
        n = len(self.weights)
        sources, numbers = torch.empty_like(positions), torch.empty_like(positions)
        for block in (positions // BLOCK).unique().tolist():
            while len(self._before) <= block:  # samples of each source before each block
                drawn = self.block_sources(len(self._before) - 1)
                self._before.append(self._before[-1] + torch.bincount(drawn, minlength=n))
            drawn = self.block_sources(block)
            onehot = torch.nn.functional.one_hot(drawn, n)
            seen = onehot.cumsum(0) - onehot  # earlier samples of the same source
            mask = positions // BLOCK == block
            offsets = positions[mask] % BLOCK
            src = drawn[offsets]
            sources[mask] = src
            numbers[mask] = self._before[block][src] + seen[offsets, src]
        return sources, numbers


class MixtureLoader(SampleCounter):
    """``BatchLoader``'s interface (iterator, ``state_dict``) over weighted sources."""

    def __init__(self, sources: list[BatchLoader], weights: list[float], batch_size: int,
                 seq_len: int, dp_rank: int = 0, dp_world: int = 1, seed: int = 0):
        if len(sources) != len(weights):
            raise ValueError(f"{len(sources)} sources but {len(weights)} weights")
        self.sources, self.batch_size, self.seq_len = sources, batch_size, seq_len
        self.dp_rank, self.dp_world, self.seed = dp_rank, dp_world, seed
        self.schedule = Schedule(weights, seed)
        self.samples = 0

    def __next__(self) -> tuple[torch.Tensor, torch.Tensor]:
        first = self.samples + self.dp_rank * self.batch_size
        sources, numbers = self.schedule.assign(torch.arange(first, first + self.batch_size))
        chunk = torch.empty(self.batch_size, self.seq_len + 1, dtype=torch.long)
        for s in sources.unique().tolist():
            mask = sources == s
            loader = self.sources[s]
            chunk[mask] = gather_windows(loader.tokens, loader._windows(numbers[mask]),
                                         self.seq_len)
        self.samples += self.global_batch_size
        return chunk[:, :-1], chunk[:, 1:]
