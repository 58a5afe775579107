"""Data: byte tokenizer, disjoint data-parallel slices, resumable batch streams."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from simplefsdp.corpus.text import (
    BatchLoader,
    ByteTokenizer,
    TextDataset,
    Tokenizer,
    build_tokenizer,
    read_corpus,
)

pytestmark = pytest.mark.quick  # unit checks in one process: the whole file is in the quick tier


@pytest.fixture(scope="module")
def dataset() -> TextDataset:
    return TextDataset()


def test_byte_tokenizer_round_trip():
    tok = build_tokenizer("byte")
    assert isinstance(tok, Tokenizer) and tok.vocab_size == 256
    text = "To be, or not to be: that is the question. Æsop — naïve ☃\n"
    ids = tok.encode(text)
    assert all(0 <= i < 256 for i in ids) and len(ids) == len(text.encode("utf-8"))
    assert tok.decode(ids) == text
    assert tok.decode(torch.tensor(ids)) == text
    with pytest.raises(ValueError, match="data.tokenizer"):
        build_tokenizer("bpe")


def test_shipped_corpus(dataset: TextDataset):
    text = read_corpus("shakespeare")
    assert 200_000 < len(text) < 1_100_000 and "Hamlet" in text
    assert len(dataset.train_tokens) + len(dataset.val_tokens) == len(text.encode("utf-8"))
    assert 0 < len(dataset.val_tokens) < len(dataset.train_tokens) / 10


def test_custom_corpus_and_tokenizer(tmp_path: Path):
    class Letters:  # any object with vocab_size and encode plugs in
        vocab_size = 27

        def encode(self, text: str) -> list[int]:
            return [ord(c) - 96 if c.isalpha() else 0 for c in text.lower()]

    path = tmp_path / "tiny.txt"
    path.write_text("abc def " * 50)
    data = TextDataset(str(path), Letters(), val_fraction=0.1)
    inputs, targets = next(data.loader("train", batch_size=2, seq_len=8))
    assert int(inputs.max()) < 27
    with pytest.raises(FileNotFoundError, match="data.dataset"):
        TextDataset(str(tmp_path / "missing.txt"))


def test_inputs_and_targets_are_shifted(dataset: TextDataset):
    inputs, targets = next(dataset.loader("train", batch_size=4, seq_len=32))
    assert inputs.shape == targets.shape == (4, 32) and inputs.dtype == torch.long
    torch.testing.assert_close(inputs[:, 1:], targets[:, :-1])
    text = ByteTokenizer().decode(inputs[0])
    assert text in read_corpus("shakespeare")


def test_dp_ranks_get_disjoint_slices_of_the_global_batch(dataset: TextDataset):
    world, batch, seq = 4, 3, 64
    single = dataset.loader("train", batch * world, seq, seed=5)
    ranks = [dataset.loader("train", batch, seq, dp_rank=r, dp_world=world, seed=5)
             for r in range(world)]
    for _ in range(3):
        global_inputs, global_targets = next(single)
        per_rank = [next(loader) for loader in ranks]
        torch.testing.assert_close(torch.cat([x for x, _ in per_rank]), global_inputs)
        torch.testing.assert_close(torch.cat([y for _, y in per_rank]), global_targets)
        rows = {tuple(row.tolist()) for row in global_inputs}
        assert len(rows) == batch * world  # no window twice in one global batch


def test_epochs_cover_every_window_and_reshuffle():
    tokens = torch.arange(41, dtype=torch.int32)  # 10 windows of 4 (+1 target)
    loader = BatchLoader(tokens, batch_size=5, seq_len=4, seed=1)
    first = torch.cat([next(loader)[0][:, 0] for _ in range(2)])
    second = torch.cat([next(loader)[0][:, 0] for _ in range(2)])
    assert sorted(first.tolist()) == sorted(second.tolist()) == list(range(0, 40, 4))
    assert not torch.equal(first, second) and loader.epoch == 2
    in_order = BatchLoader(tokens, batch_size=5, seq_len=4, shuffle=False)
    assert next(in_order)[0][:, 0].tolist() == [0, 4, 8, 12, 16]


def test_resume_from_state_dict_reproduces_batches(dataset: TextDataset):
    make = lambda: dataset.loader("train", 2, 16, dp_rank=1, dp_world=2, seed=3)
    loader = make()
    for _ in range(5):
        next(loader)
    state = loader.state_dict()
    expected = [next(loader) for _ in range(3)]
    resumed = make()
    resumed.load_state_dict(state)
    for want, got in zip(expected, (next(resumed) for _ in range(3)), strict=True):
        torch.testing.assert_close(got, want)
    other_seed = dataset.loader("train", 2, 16, seed=4)
    with pytest.raises(ValueError, match="seed"):
        other_seed.load_state_dict(state)


def test_val_is_deterministic_and_separate(dataset: TextDataset):
    a = next(dataset.loader("val", 2, 32))[0]
    b = next(dataset.loader("val", 2, 32, seed=99))[0]
    torch.testing.assert_close(a, b)
    torch.testing.assert_close(a[0], dataset.val_tokens[:32].long())
    with pytest.raises(ValueError, match="split"):
        dataset.loader("test", 2, 32)


def test_bad_corpus_files_name_the_key_and_the_size_needed(tmp_path: Path):
    """Empty, tiny and binary files are refused naming the key (not a raw ValueError /
    UnicodeDecodeError), and a file smaller than one global batch is refused, not repeated
    within the batch."""
    from simplefsdp.errors import ConfigError

    empty, tiny, binary = tmp_path / "empty.txt", tmp_path / "tiny.txt", tmp_path / "x.bin"
    empty.write_text("")
    tiny.write_text("to be or not")
    binary.write_bytes(bytes(range(256)) * 4)
    for path in (empty, tiny):
        with pytest.raises(ConfigError, match=rf"data.dataset = '{path}' is too small.*needs 1 "
                                              rf"windows, about 33 tokens"):
            TextDataset(str(path)).loader("train", batch_size=1, seq_len=32)
    with pytest.raises(ConfigError, match=r"data.dataset = .*x.bin' is not UTF-8 text"):
        TextDataset(str(binary))
    # 100 windows of 17 tokens, but one global batch (4 ranks x 8 x 4 microsteps) needs 128.
    small = tmp_path / "small.txt"
    small.write_text("a" * (100 * 16 + 1))
    data = TextDataset(str(small), val_fraction=0)
    assert (len(data.train_tokens) - 1) // 16 == 100
    with pytest.raises(ConfigError, match="its train split has .* but one global batch "
                                          "needs 128 windows, about 2049 tokens"):
        data.loader("train", 8, 16, dp_rank=0, dp_world=4, min_windows=128)
    data.loader("train", 8, 16, dp_rank=0, dp_world=4, min_windows=100)  # exactly enough
