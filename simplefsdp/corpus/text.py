"""Text data: a byte-level tokenizer and a resumable, data-parallel batch loader.

The corpus is tokenized once into one long 1-D tensor and cut into non-overlapping
windows of ``seq_len + 1`` tokens (inputs are the first ``seq_len``, targets the last
``seq_len``). A window's place in the stream is a pure function of a global sample
counter: sample ``p`` is window ``perm(epoch)[p % n]`` with ``epoch = p // n`` and a
permutation seeded by ``(seed, epoch)``: a stored ``torch.randperm`` up to
``PERMUTATION_MAX_WINDOWS`` windows (at most 8 MB), above it a keyed Feistel network
computed per position (no memory that grows with the corpus). A global batch is
``dp_world * batch_size`` consecutive samples; DP rank ``r`` takes the ``r``-th slice of
``batch_size``. So the ranks read disjoint slices that together are the single-rank
global batch, and the whole state to checkpoint is the counter.
"""

from __future__ import annotations

from collections.abc import Sequence
from importlib import resources
from pathlib import Path
from typing import Protocol, runtime_checkable

import numpy as np
import torch

from ..errors import ConfigError

SHAKESPEARE = "shakespeare"  # the corpus shipped in simplefsdp/data/
# Up to this many windows an epoch's order is a stored randperm (8 bytes a window: the
# order every run so far used); above it, feistel_permute (README "Data").
PERMUTATION_MAX_WINDOWS = 1 << 20
FEISTEL_ROUNDS = 4


@runtime_checkable
class Tokenizer(Protocol):
    """What the trainer needs from a tokenizer; plug in any object that has these."""

    @property
    def vocab_size(self) -> int: ...

    def encode(self, text: str) -> list[int]: ...


class ByteTokenizer:
    """UTF-8 bytes are the tokens: 256 ids, no unknown words, no training needed."""

    vocab_size = 256
    fingerprint = "byte"  # keys the token cache (simplefsdp.corpus.cache)

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: Sequence[int] | torch.Tensor) -> str:
        # Bytes cut mid-character (e.g. by a window edge) decode as U+FFFD.
        return bytes(int(i) for i in ids).decode("utf-8", errors="replace")


def build_tokenizer(name: str) -> Tokenizer:
    """Tokenizer by config name (``[data] tokenizer``)."""
    if name == "byte":
        return ByteTokenizer()
    raise ValueError(f"data.tokenizer = {name!r} is unknown; choose 'byte', or pass your own "
                     f"Tokenizer object to TextDataset")


def shipped_corpus() -> Path:
    """The file of the corpus shipped in ``simplefsdp/data/`` (``data.dataset = "shakespeare"``)."""
    return Path(str(resources.files("simplefsdp") / "data" / "shakespeare.txt"))


def read_corpus(dataset: str) -> str:
    """Text of ``dataset``: ``"shakespeare"`` (shipped with the package) or a .txt path."""
    if dataset == SHAKESPEARE:
        return shipped_corpus().read_text("utf-8")
    path = Path(dataset)
    if not path.is_file():
        raise FileNotFoundError(f"data.dataset = {dataset!r}: no such file (use "
                                f"'{SHAKESPEARE}' or a path to a .txt file)")
    try:
        return path.read_text("utf-8")
    except UnicodeDecodeError as e:
        raise ConfigError(f"data.dataset = {dataset!r} is not UTF-8 text (byte {e.start} "
                          f"cannot be decoded; a binary file?); give a .txt file") from None


def gather_windows(tokens, windows: torch.Tensor, seq_len: int) -> torch.Tensor:
    """``(len(windows), seq_len + 1)`` int64 tokens of the given windows; ``tokens`` is a
    tensor or a NumPy array (a memory map: only the windows' pages are read)."""
    index = windows[:, None] * seq_len + torch.arange(seq_len + 1)
    if isinstance(tokens, torch.Tensor):
        return tokens[index].long()
    return torch.from_numpy(np.asarray(tokens[index.numpy()], dtype=np.int64))


def _round_keys(key: int) -> list[int]:
    """FEISTEL_ROUNDS 31-bit round keys from ``key`` (splitmix64 steps)."""
    keys, state = [], key & (2**64 - 1)
    for _ in range(FEISTEL_ROUNDS):
        state = (state + 0x9E3779B97F4A7C15) & (2**64 - 1)
        z = ((state ^ (state >> 30)) * 0xBF58476D1CE4E5B9) & (2**64 - 1)
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & (2**64 - 1)
        keys.append((z ^ (z >> 31)) & 0x7FFFFFFF)
    return keys


def _feistel(x: torch.Tensor, half: int, keys: list[int]) -> torch.Tensor:
    """One pass of a balanced Feistel network over ``[0, 2**(2 * half))``: a bijection
    whatever the round function (an integer hash whose products stay below 2**63)."""
    mask = (1 << half) - 1
    left, right = x >> half, x & mask
    for k in keys:
        h = ((right ^ k) * 0x2545F491) & 0xFFFFFFFF
        h = ((h ^ (h >> 16)) * 0x45D9F3B) & 0xFFFFFFFF
        left, right = right, left ^ ((h ^ (h >> 13)) & mask)
    return (left << half) | right


def feistel_permute(index: torch.Tensor, n: int, key: int) -> torch.Tensor:
    """``perm[index]`` for a permutation ``perm`` of ``[0, n)`` chosen by ``key``, without
    building ``perm``: the Feistel network runs over the smallest ``4**half >= n``, and a
    value that lands at ``n`` or above is sent through again (cycle walking: the cycle
    through an index below ``n`` comes back below ``n``), so ``[0, n)`` maps onto itself."""
    half = max(1, ((n - 1).bit_length() + 1) // 2)
    keys = _round_keys(key)
    x = _feistel(index.long(), half, keys)
    outside = x >= n
    while bool(outside.any()):
        x[outside] = _feistel(x[outside], half, keys)
        outside = x >= n
    return x


class SampleCounter:
    """The position of a loader whose batches are a pure function of the global sample
    counter: ``state_dict`` is the counter (and the seed it was drawn with)."""

    samples: int
    seed: int
    batch_size: int
    dp_world: int

    @property
    def global_batch_size(self) -> int:
        return self.batch_size * self.dp_world

    def __iter__(self):
        return self

    def state_dict(self) -> dict[str, int]:
        return {"samples": self.samples, "seed": self.seed}

    def load_state_dict(self, state: dict[str, int]) -> None:
        if state.get("seed", self.seed) != self.seed:
            raise ValueError(f"checkpointed data seed {state['seed']} differs from the "
                             f"configured training.seed {self.seed}")
        self.samples = int(state["samples"])


class BatchLoader(SampleCounter):
    """Endless iterator of ``(inputs, targets)``, each ``(batch_size, seq_len)`` int64,
    for one data-parallel rank. ``state_dict`` / ``load_state_dict`` save and restore
    the position, so a resumed run sees exactly the batches it would have seen."""

    def __init__(self, tokens: torch.Tensor, batch_size: int, seq_len: int,
                 dp_rank: int = 0, dp_world: int = 1, seed: int = 0, shuffle: bool = True):
        if not 0 <= dp_rank < dp_world:
            raise ValueError(f"dp_rank must be in [0, {dp_world}), got {dp_rank}")
        if batch_size < 1 or seq_len < 1:
            raise ValueError(f"batch_size and seq_len must be >= 1, got {batch_size}, {seq_len}")
        self.num_windows = (len(tokens) - 1) // seq_len
        if self.num_windows < 1:
            raise ValueError(f"{len(tokens)} tokens are too few for one window of "
                             f"seq_len + 1 = {seq_len + 1}")
        self.tokens = tokens
        self.batch_size, self.seq_len = batch_size, seq_len
        self.dp_rank, self.dp_world = dp_rank, dp_world
        self.seed, self.shuffle = seed, shuffle
        self.samples = 0  # global samples consumed, over all DP ranks
        self._perm_epoch, self._perm = -1, torch.empty(0, dtype=torch.long)

    @property
    def epoch(self) -> int:
        return self.samples // self.num_windows

    def _windows(self, positions: torch.Tensor) -> torch.Tensor:
        """Window index of each global sample position."""
        epochs, offsets = positions // self.num_windows, positions % self.num_windows
        if not self.shuffle:
            return offsets
        out = torch.empty_like(positions)
        for epoch in epochs.unique().tolist():
            mask, key = epochs == epoch, self.seed * 1_000_003 + epoch
            if self.num_windows > PERMUTATION_MAX_WINDOWS:
                out[mask] = feistel_permute(offsets[mask], self.num_windows, key)
                continue
            if epoch != self._perm_epoch:  # one permutation per epoch, made on demand
                self._perm = torch.randperm(self.num_windows,
                                            generator=torch.Generator().manual_seed(key))
                self._perm_epoch = epoch
            out[mask] = self._perm[offsets[mask]]
        return out

    def __next__(self) -> tuple[torch.Tensor, torch.Tensor]:
        first = self.samples + self.dp_rank * self.batch_size
        windows = self._windows(torch.arange(first, first + self.batch_size))
        chunk = gather_windows(self.tokens, windows, self.seq_len)
        self.samples += self.global_batch_size
        return chunk[:, :-1], chunk[:, 1:]



class TextDataset:
    """A corpus tokenized once, split into train (first part) and val (the tail)."""

    def __init__(self, dataset: str = SHAKESPEARE, tokenizer: Tokenizer | None = None,
                 val_fraction: float = 0.05, tokens: torch.Tensor | None = None):
        """``tokens``: the corpus already tokenized (e.g. packed documents); None reads
        and encodes ``dataset``."""
        if not 0 <= val_fraction < 1:
            raise ValueError(f"val_fraction must be in [0, 1), got {val_fraction}")
        self.name, self.val_fraction = dataset, val_fraction
        self.tokenizer = tokenizer if tokenizer is not None else ByteTokenizer()
        if tokens is None:
            tokens = torch.tensor(self.tokenizer.encode(read_corpus(dataset)), dtype=torch.int32)
        split = len(tokens) - int(len(tokens) * val_fraction)
        self.train_tokens, self.val_tokens = tokens[:split], tokens[split:]

    def loader(self, split: str, batch_size: int, seq_len: int, dp_rank: int = 0,
               dp_world: int = 1, seed: int = 0, shuffle: bool | None = None,
               min_windows: int = 1) -> BatchLoader:
        """Batches of ``split`` ("train" or "val") for one DP rank; val is not shuffled.

        Raises a ConfigError naming ``data.dataset`` if the split holds fewer than
        ``min_windows`` windows of ``seq_len + 1`` tokens (the trainer asks for one
        global batch: it refuses to repeat a tiny corpus within a step)."""
        if split not in ("train", "val"):
            raise ValueError(f"split must be 'train' or 'val', got {split!r}")
        tokens = self.train_tokens if split == "train" else self.val_tokens
        windows = max(0, len(tokens) - 1) // seq_len
        if windows < max(1, min_windows):
            need = max(1, min_windows) * seq_len + 1
            raise ConfigError(
                f"data.dataset = {self.name!r} is too small: its {split} split has "
                f"{len(tokens)} tokens ({windows} windows of seq_len + 1 = {seq_len + 1}), "
                f"but one global batch needs {max(1, min_windows)} windows, about {need} "
                f"tokens ({need / (1 - self.val_fraction):.0f} in the file with the "
                f"{self.val_fraction:.0%} validation tail); use a larger corpus or lower "
                f"training.batch_size / training.seq_len")
        shuffle = split == "train" if shuffle is None else shuffle
        return BatchLoader(tokens, batch_size, seq_len, dp_rank, dp_world, seed, shuffle)
