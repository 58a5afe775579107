"""Token caches: built once, keyed by files and tokenizer, never half-used; mapped loaders
match in-memory ones; mixtures; the data errors. Expectations are written by hand
(bytes of the text, EOS after each document) or come from the tokenizer itself."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from simplefsdp.config.job import load_config
from simplefsdp.corpus import cache as cache_mod
from simplefsdp.corpus import open_caches
from simplefsdp.corpus.mixture import MixtureLoader
from simplefsdp.corpus.text import ByteTokenizer, TextDataset
from simplefsdp.errors import ConfigError

DOCS = ["first doc", "", "second, longer document", "third ☃"]


class EosBytes(ByteTokenizer):
    """Bytes plus an EOS id 256 (so documents are joined by something visible)."""

    vocab_size = 257
    eos_id = 256
    fingerprint = "eos-bytes"


def _jsonl(path: Path, docs: list[str], field: str = "text") -> Path:
    path.write_text("".join(json.dumps({field: d}) + "\n" for d in docs))
    return path


def _data(tmp_path: Path, dataset: str, **kw) -> SimpleNamespace:
    d = dict(dataset=dataset, weights=[], text_field="text", cache_dir=str(tmp_path / "cache"),
             tokenize_workers=1, streaming=False, document_mask=False)
    return SimpleNamespace(**{**d, **kw})


def _expected(docs: list[str], eos: int | None) -> list[int]:
    out: list[int] = []
    for d in docs:
        if d:
            out += list(d.encode()) + ([eos] if eos is not None else [])
    return out


def _folders(cache: Path) -> list[str]:
    return sorted(p.name for p in cache.iterdir())


@pytest.mark.quick
def test_cache_hit_miss_and_invalidation(tmp_path: Path, monkeypatch):
    data = _jsonl(tmp_path / "a.jsonl", DOCS)
    cfg = _data(tmp_path, str(data), tokenize_workers=2)  # two workers: the forked pool
    (first,) = open_caches(cfg, EosBytes())
    assert first.tokens.dtype == np.uint16 and isinstance(first.tokens, np.memmap)
    assert first.tokens.tolist() == _expected(DOCS, 256)
    lengths = [len(d.encode()) + 1 for d in DOCS if d]
    assert first.doc_ends.tolist() == np.cumsum(lengths).tolist()

    def no_tokenizing(*args, **kwargs):
        raise AssertionError("a cache hit tokenized again")

    with monkeypatch.context() as m:  # hit: same files, same tokenizer
        m.setattr(cache_mod, "_tokenize", no_tokenizing)
        (hit,) = open_caches(cfg, EosBytes())
    assert hit.folder == first.folder and _folders(tmp_path / "cache") == [first.folder.name]

    class OtherEos(EosBytes):  # a changed tokenizer: another EOS id, another fingerprint
        eos_id = 10
        fingerprint = "eos-bytes-2"

    (other,) = open_caches(cfg, OtherEos())
    assert other.folder != first.folder and other.tokens.tolist() == _expected(DOCS, 10)
    # A changed file (same size, new mtime and content) is a new cache.
    time.sleep(0.01)
    _jsonl(data, ["FIRST doc"] + DOCS[1:])
    (changed,) = open_caches(cfg, EosBytes())
    assert changed.folder not in (first.folder, other.folder)
    assert changed.tokens.tolist() == _expected(["FIRST doc"] + DOCS[1:], 256)
    assert len(_folders(tmp_path / "cache")) == 3


RICH = DOCS + ["  leading spaces,\ttabs\nand\r\nnewlines  ", "naïve café — 東京 🙂 ∑x²",
               "repeat " * 300, "'s 't 're numbers 12345 678", "x",
               "an added </s> token inside text</s></s>", "runs:    \t\t\n\n\u3000\xa0 x  ",
               "digits 0 1 22 333 4444 55555 ٣٤ ..!!?? (a)-[b]_{c}", "ALL CAPS 'LL 'Ve"]


def _train_bpe(path: Path, vocab: int, normalizer=None, llama3: bool = False) -> Path:
    """A byte-level BPE tokenizer.json trained on RICH, ``</s>`` its added token; GPT-2's
    pre-tokenizer, or with ``llama3`` Llama 3's (its regex, then bytes)."""
    from tokenizers import Regex, Tokenizer, models, pre_tokenizers, trainers

    from simplefsdp.hf.tokenizer import TIKTOKEN_PATTERN

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    if llama3:
        tok.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(TIKTOKEN_PATTERN), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    if normalizer is not None:
        tok.normalizer = normalizer
    tok.train_from_iterator(RICH * 20, trainers.BpeTrainer(
        vocab_size=vocab, special_tokens=["</s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tok.save(str(path))
    return path


def test_hf_tokenizer_cache_follows_the_tokenizer_file(tmp_path: Path, monkeypatch, capsys):
    """A tokenizer.json's cache, built by 2 threads over several chunks, holds exactly
    each document's own ``Tokenizer.encode`` ids plus EOS, whichever path tokenized it:
    tiktoken (converted, from GPT-2's and Llama 3's pre-tokenizers; RICH has unicode,
    whitespace runs, digits, punctuation and the added token) or Hugging Face (a
    normalizer refuses the conversion, and the log says so); both paths write the same
    tokens.bin; another tokenizer file is another cache."""
    pytest.importorskip("tokenizers")  # the [hf] extra; CI installs it
    from tokenizers import normalizers

    from simplefsdp.corpus import fast_bpe
    from simplefsdp.hf.tokenizer import load_tokenizer

    monkeypatch.setattr(cache_mod, "CHUNK_BYTES", 200)  # several chunks, out of order
    monkeypatch.setattr(cache_mod, "ENCODE_BATCH", 3)  # several batches per chunk
    # A tenth of the code-point probe (every code point to U+2FFF, then every 61st): the
    # probe's cost is Hugging Face's encoding of it; the benchmark runs the full probe.
    monkeypatch.setattr(fast_bpe, "PROBE_ALL_BELOW", 0x3000)
    data = _jsonl(tmp_path / "a.jsonl", RICH * 3)
    used, encode_batch = [], fast_bpe.FastBPE.encode_batch  # did tiktoken encode the corpus?
    monkeypatch.setattr(fast_bpe.FastBPE, "encode_batch", lambda self, texts: (
        used.append(all(t in RICH for t in texts)), encode_batch(self, texts))[1])
    caches = []
    for name, vocab, norm, encoder in [("a", 270, None, "tiktoken"), ("b", 400, None, "tiktoken"),
                                       ("c", 400, normalizers.NFKC(), "HFTokenizer"),
                                       ("llama3", 400, None, "tiktoken")]:
        tok = load_tokenizer(_train_bpe(tmp_path / f"{name}.json", vocab, norm,
                                        llama3=name == "llama3"))
        assert tok.parallel_batches  # the thread pool, not forked processes
        (f,) = open_caches(_data(tmp_path, str(data), tokenize_workers=2), tok)
        own = [tok.tok.encode(d, add_special_tokens=False).ids for d in RICH * 3 if d]
        assert f.tokens.tolist() == [i for ids in own for i in ids + [tok.eos_id]]
        assert f.doc_ends.tolist() == np.cumsum([len(ids) + 1 for ids in own]).tolist()
        assert tok.tok.token_to_id("</s>") in f.tokens.tolist()  # the added token, matched
        assert f.meta["encoder"] == encoder
        assert any(used) == (encoder == "tiktoken")  # corpus batches, not only the probe
        used.clear()
        log = capsys.readouterr().err
        assert f"with {encoder}" in log and ("normalizer" in log) == (norm is not None)
        caches.append(f.folder)
    assert len(cache_mod.chunks((data,), "text")) > 3 and len(set(caches)) == 4
    # The same tokenizer through Hugging Face (fast path off): a byte-identical tokens.bin.
    monkeypatch.setattr(fast_bpe, "convert", lambda tok: (None, "switched off"))
    (slow,) = open_caches(_data(tmp_path, str(data), tokenize_workers=2,
                                cache_dir=str(tmp_path / "slow")),
                          load_tokenizer(tmp_path / "b.json"))
    assert slow.meta["encoder"] == "HFTokenizer"
    fast_bin = (caches[1] / "tokens.bin").read_bytes()
    assert (slow.folder / "tokens.bin").read_bytes() == fast_bin


def _handmade(tmp_path: Path, merges: list[tuple[str, str]], extra: list[str] = ()):
    """A byte-level BPE over the 256 bytes (ids in alphabet order) plus ``merges``' results
    (ids in the order given by ``extra`` when set, else merge order)."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    from simplefsdp.hf.tokenizer import load_tokenizer

    vocab = {c: i for i, c in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))}
    for token in list(extra) or [a + b for a, b in merges]:
        vocab[token] = len(vocab)
    tok = Tokenizer(models.BPE(vocab, merges))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.save(str(tmp_path / "hand.json"))
    return load_tokenizer(tmp_path / "hand.json")


@pytest.mark.parametrize("merges, extra, text, reason", [
    # Merge order (bc first) against id order (ab's id is lower): tiktoken would merge ab.
    ([("b", "c"), ("a", "b")], ["ab", "bc"], "abc", "merge order and id order disagree"),
    # Ids follow merges, but abc's merge (a + bc) never happens after a + b: Hugging Face
    # gives [ab, c] where tiktoken, merging any pair whose bytes are a token, gives [abc].
    ([("a", "b"), ("b", "c"), ("a", "bc")], [], "abc", "'abc' merges to"),
    # An entry no merge makes: tiktoken would make it from its bytes, Hugging Face never.
    ([("a", "b")], ["ab", "xy"], "xy", "'xy' is made by 0 merges"),
])
def test_fast_bpe_refuses_what_it_cannot_prove(tmp_path: Path, merges, extra, text, reason):
    """Tokenizers whose merges tiktoken's algorithm would apply differently are refused
    (with the reason), and on ``text`` the two algorithms do differ: tiktoken built from
    the same tables without the checks gives other ids than Hugging Face."""
    pytest.importorskip("tokenizers")
    import tiktoken

    from simplefsdp.corpus import fast_bpe

    tok = _handmade(tmp_path, merges, extra)
    fast, why = fast_bpe.convert(tok)
    assert fast is None and reason in why
    ranks = {bytes(fast_bpe.byte_alphabet()[c] for c in t): i
             for t, i in tok.tok.get_vocab().items()}
    unchecked = tiktoken.Encoding("x", pat_str=fast_bpe.GPT2_PATTERN, mergeable_ranks=ranks,
                                  special_tokens={})
    assert unchecked.encode_ordinary(text) != tok.encode(text)


_KILLED_BUILD = """
import sys, time
from types import SimpleNamespace
from simplefsdp.corpus import open_caches

class SlowBytes:  # the byte tokenizer's fingerprint, so the parent would reuse its cache
    vocab_size, fingerprint = 256, "byte"
    def encode(self, text):
        print("encoding", flush=True)
        time.sleep(60)
        return list(text.encode())

open_caches(SimpleNamespace(dataset=sys.argv[1], weights=[], text_field="text",
    cache_dir=sys.argv[2], tokenize_workers=1, streaming=False, document_mask=False),
    SlowBytes())
"""


def test_a_killed_build_leaves_no_usable_cache(tmp_path: Path):
    data = _jsonl(tmp_path / "a.jsonl", DOCS)
    cache = tmp_path / "cache"
    proc = subprocess.Popen([sys.executable, "-c", textwrap.dedent(_KILLED_BUILD), str(data),
                             str(cache)], stdout=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    try:
        assert proc.stdout.readline().strip() == "encoding"  # mid-build
        tmp = [p for p in cache.iterdir()]
        assert len(tmp) == 1 and ".tmp-" in tmp[0].name
        assert not cache_mod.is_complete(tmp[0])
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    (f,) = open_caches(_data(tmp_path, str(data)), ByteTokenizer())
    assert f.tokens.tolist() == _expected(DOCS, None)
    assert _folders(cache) == [f.folder.name]  # the dead build's temporary folder is gone


@pytest.mark.quick
def test_mapped_loader_equals_in_memory_and_resumes(tmp_path: Path):
    """Windows, per-rank slices and exact resume read from the map equal those of an
    in-memory ``TextDataset`` over the hand-built token list."""
    docs = [f"document {i}: " + "abcdefghij"[i % 10] * (7 * i % 23) for i in range(60)]
    data = _jsonl(tmp_path / "d.jsonl", docs)
    (f,) = open_caches(_data(tmp_path, str(data)), EosBytes())
    reference = TextDataset("ref", EosBytes(), tokens=torch.tensor(_expected(docs, 256)))
    mapped = TextDataset("mapped", EosBytes(), tokens=f.tokens)
    make = lambda ds: ds.loader("train", 3, 8, dp_rank=1, dp_world=2, seed=4)
    loader, ref = make(mapped), make(reference)
    for _ in range(4):
        got, want = next(loader), next(ref)
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
        assert got[0].dtype == torch.long
    state, expected = loader.state_dict(), [next(loader) for _ in range(3)]
    resumed = make(mapped)
    resumed.load_state_dict(state)
    for want, got in zip(expected, (next(resumed) for _ in range(3)), strict=True):
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    assert torch.equal(next(mapped.loader("val", 2, 8))[0], next(reference.loader("val", 2, 8))[0])


def test_formats_folders_and_globs_read_the_same_documents(tmp_path: Path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    folder = tmp_path / "corpus"
    folder.mkdir()
    _jsonl(folder / "a.jsonl", DOCS[:2], field="body")
    pq.write_table(pa.table({"body": DOCS[2:]}), folder / "b.parquet", row_group_size=1)
    (folder / "c.txt").write_text("a text file is one document\n")
    (folder / "notes.md").write_text("ignored: not a data file")
    want = _expected(DOCS + ["a text file is one document\n"], 256)
    for dataset in (str(folder), str(folder / "*.*"), str(tmp_path / "corpus" / "**" / "*")):
        (f,) = open_caches(_data(tmp_path, dataset, text_field="body"), EosBytes())
        assert f.tokens.tolist() == want, dataset


def test_mixture_follows_the_weights_and_resumes(tmp_path: Path):
    a = tmp_path / "a.txt"
    b = tmp_path / "b.txt"
    a.write_text("a" * 4001)  # every window of a holds only 'a', of b only 'b'
    b.write_text("b" * 4001)
    files = open_caches(_data(tmp_path, f"{a},{b}", weights=[3.0, 1.0]), ByteTokenizer())
    sources = [TextDataset(str(i), ByteTokenizer(), tokens=f.tokens).loader("train", 1, 16,
                                                                            seed=i)
               for i, f in enumerate(files)]
    make = lambda rank, world, batch: MixtureLoader(sources, [3.0, 1.0], batch, 16, rank,
                                                    world, seed=2)
    single = make(0, 1, 8)
    n = 500 * 8
    firsts = torch.cat([next(single)[0][:, 0] for _ in range(500)])
    assert set(firsts.tolist()) == {ord("a"), ord("b")}
    share = float((firsts == ord("a")).float().mean())
    # i.i.d. draws: std of the share sqrt(0.75 * 0.25 / 4000) = 0.0068; allow 5 std.
    assert abs(share - 0.75) <= 5 * (0.75 * 0.25 / n) ** 0.5, share
    # Two ranks take the two halves of each global batch; resume from the counter.
    ranks = [make(r, 2, 4) for r in range(2)]
    fresh = make(0, 1, 8)
    for _ in range(3):
        assert torch.equal(torch.cat([next(r)[0] for r in ranks]), next(fresh)[0])
    state = ranks[1].state_dict()
    expected = [next(ranks[1])[0] for _ in range(2)]
    resumed = make(1, 2, 4)
    resumed.load_state_dict(state)
    assert all(torch.equal(next(resumed)[0], e) for e in expected)


@pytest.mark.parametrize("overrides,message", [
    (["--data.dataset", "{a},{b}", "--data.weights", "1"],
     "data.weights has 1 entries but data.dataset names 2 sources"),
    (["--data.dataset", "{a},{b}"], "data.dataset names 2 sources: set data.weights"),
    (["--data.dataset", "{a}", "--data.weights", "-1"], "data.weights = .*must be > 0"),
    (["--data.dataset", "{bad}"], r"data.dataset = .*x.csv': unsupported file type '.csv'"),
    (["--data.dataset", "{empty}"], r"data.dataset = .*empty.jsonl is empty"),
    (["--data.dataset", "{tmp}/*.nothing"], r"data.dataset = .*the glob pattern matches no"),
    (["--data.dataset", "{tmp}/missing.jsonl"], r"data.dataset = .*no such file"),
    (["--data.document_mask", "true", "--parallel.pp", "2", "--model.n_layers", "2"],
     "data.document_mask = true works with our Llama without pipeline stages"),
])
def test_bad_data_config_names_the_key(tmp_path: Path, overrides, message):
    paths = dict(a=_jsonl(tmp_path / "a.jsonl", DOCS), b=_jsonl(tmp_path / "b.jsonl", DOCS),
                 bad=tmp_path / "x.csv", empty=tmp_path / "empty.jsonl", tmp=tmp_path)
    paths["bad"].write_text("text\nhello\n")
    paths["empty"].write_text("")
    with pytest.raises(ConfigError, match=message):
        load_config(None, [o.format(**paths) for o in overrides])


def test_bad_data_found_while_tokenizing_names_the_key(tmp_path: Path):
    with pytest.raises(ConfigError, match="data.tokenizer: a vocabulary of 8589934592 ids"):
        cache_mod.token_dtype(2**33)
    assert cache_mod.token_dtype(2**16) == np.uint16 and cache_mod.token_dtype(2**16 + 1) == \
        np.uint32
    data = _jsonl(tmp_path / "a.jsonl", DOCS)
    with pytest.raises(ConfigError, match=r"no 'body' field .*set data.text_field"):
        open_caches(_data(tmp_path, str(data), text_field="body"), EosBytes())
    blank = _jsonl(tmp_path / "blank.jsonl", ["", ""])
    with pytest.raises(ConfigError, match="no non-empty document"):
        open_caches(_data(tmp_path, str(blank)), EosBytes())

    class Overflowing(ByteTokenizer):
        vocab_size, fingerprint = 100, "overflow"  # bytes reach 255

    with pytest.raises(ConfigError, match="data.tokenizer: the tokenizer gave id"):
        open_caches(_data(tmp_path, str(data)), Overflowing())
    assert not any(cache_mod.is_complete(p) for p in (tmp_path / "cache").iterdir())


def _shared_build(rank: int, world: int, data: str, cache: str):
    import torch.distributed.checkpoint as dcp

    from simplefsdp.config.job import load_config
    from simplefsdp.corpus import build_loader

    # Streaming: the ranks' positions go through a DCP checkpoint (one table, gathered).
    stream = _stream(data, rank, world)
    for _ in range(3):
        next(stream)
    dcp.save({"loader": stream.state_dict()}, checkpoint_id=cache + "-ckpt")
    expected = [next(stream)[0].tolist() for _ in range(2)]
    resumed = _stream(data, rank, world)
    state = {"loader": resumed.state_dict()}
    dcp.load(state, checkpoint_id=cache + "-ckpt")
    resumed.load_state_dict(state["loader"])
    out: list = [[next(resumed)[0].tolist() for _ in range(2)] == expected]
    for folder, field in ((cache, "text"), (cache + "-bad", "body")):
        cfg = load_config(None, ["--data.dataset", data, "--data.cache_dir", folder,
                                 "--data.text_field", field, "--training.batch_size", "2",
                                 "--training.seq_len", "8", "--data.tokenize_workers", "1"])
        try:
            loader = build_loader(cfg, EosBytes(), rank, world, min_windows=4)
            out.append([next(loader)[0].tolist() for _ in range(2)])  # no tensors: the queue
            dcp.save({"loader": loader.state_dict()}, checkpoint_id=cache + "-mapped")
        except ConfigError as e:
            out.append(str(e))
    return out


def test_ranks_share_one_build_and_its_errors(tmp_path: Path):
    """Two gloo ranks build one cache and share its errors; their checkpoints resume on 1
    and 4 data-parallel ranks: the mapped loader continues the global sample order, the
    stream refuses with the fix."""
    import torch.distributed.checkpoint as dcp
    from rank_runner import run_ranks

    docs = [f"doc {i} " * (i % 5 + 1) for i in range(40)]
    data, cache = _jsonl(tmp_path / "d.jsonl", docs), tmp_path / "cache"
    (stream0, good0, bad0), (stream1, good1, bad1) = run_ranks(_shared_build, 2, str(data),
                                                               str(cache))
    assert stream0 and stream1  # each rank resumed its own stream from the checkpoint
    assert len(_folders(cache)) == 1  # one build, nothing half-done left
    reference = TextDataset("ref", EosBytes(), tokens=torch.tensor(_expected(docs, 256)))
    single = reference.loader("train", 4, 8, seed=0)
    for step in range(2):
        assert good0[step] + good1[step] == next(single)[0].tolist()
    # Only local rank 0 reads the file; rank 1 gets its error all the same.
    assert all(isinstance(e, str) and "no 'body' field" in e for e in (bad0, bad1))
    # The 2-rank checkpoint (after two steps of 2 x 2 samples) resumed by 1 rank of batch 4
    # and by 4 ranks of batch 1: the global samples go on with the reference's third step.
    (f,) = open_caches(_data(tmp_path, str(data)), EosBytes())
    mapped = TextDataset("mapped", EosBytes(), tokens=f.tokens)
    expected = [next(single)[0] for _ in range(2)]
    for world, batch in ((1, 4), (4, 1)):
        loaders = [mapped.loader("train", batch, 8, dp_rank=r, dp_world=world, seed=0)
                   for r in range(world)]
        for loader in loaders:
            state = {"loader": loader.state_dict()}
            dcp.load(state, checkpoint_id=str(cache) + "-mapped")
            loader.load_state_dict(state["loader"])
        for want in expected:
            assert torch.equal(torch.cat([next(loader)[0] for loader in loaders]), want), world
    for rank, world in ((0, 1), (3, 4)):
        resumed = _stream(str(data), rank, world)
        state = {"loader": resumed.state_dict()}
        dcp.load(state, checkpoint_id=str(cache) + "-ckpt")
        with pytest.raises(ConfigError, match=f"stream positions of 2 data-parallel ranks, "
                                              f"this run has {world}; .*resume with 2"):
            resumed.load_state_dict(state["loader"])


def _stream(data: str, rank: int = 0, world: int = 1, batch: int = 2, seq_len: int = 8,
            weights: list[float] | None = None):
    from simplefsdp.corpus.sources import resolve_all
    from simplefsdp.corpus.stream import StreamLoader

    return StreamLoader(resolve_all(data, weights or []), EosBytes(), "text", batch, seq_len,
                        rank, world, weights=weights)


def test_streaming_packs_each_ranks_documents_and_resumes(tmp_path: Path):
    docs = [f"doc {i} " * (i % 4) for i in range(30)]  # every 4th is empty
    data = str(_jsonl(tmp_path / "d.jsonl", docs))
    for rank in range(2):
        # Rank r packs documents r, r + 2, ... with EOS; windows of 9 advance by 8 and
        # run on into the next epoch (the same documents again).
        packed = _expected(docs[rank::2], 256)
        loop = packed * 10
        loader = _stream(data, rank, 2)
        windows = [w for _ in range(30) for w in next(loader)[0].tolist()]
        targets = torch.cat([next(_stream(data, rank, 2))[1]])
        assert windows == [loop[8 * k:8 * k + 8] for k in range(60)] and 8 * 60 > len(packed)
        assert targets[0].tolist() == loop[1:9]
        state = loader.state_dict()
        assert set(state) == {"samples", "seed", "stream_world", "stream_positions"}
        assert state["samples"] == 120 and state["stream_world"] == 2
        expected = [next(loader) for _ in range(3)]
        resumed = _stream(data, rank, 2)
        resumed.load_state_dict(state)
        for want, got in zip(expected, (next(resumed) for _ in range(3)), strict=True):
            assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    with pytest.raises(ConfigError, match="data-parallel rank 3 of 4 got no document"):
        next(_stream(str(_jsonl(tmp_path / "few.jsonl", ["a", "b", "c", ""])), 3, 4))


def test_streamed_mixture_follows_the_weights_and_resumes(tmp_path: Path):
    """Two streamed sources weighted 3:1: each window comes whole from one source, each
    source's windows are its own stream's in order, the shares are within 5 sigma of
    the weights, and a resumed loader yields the same batches."""
    a = _jsonl(tmp_path / "a.jsonl", ["a" * (5 + i % 17) for i in range(40)])
    b = _jsonl(tmp_path / "b.jsonl", ["b" * (3 + i % 11) for i in range(40)])
    for rank in range(2):
        mixed = _stream(f"{a},{b}", rank, 2, batch=8, weights=[3.0, 1.0])
        windows = [w for _ in range(250) for w in next(mixed)[0].tolist()]
        alone = [_stream(str(src), rank, 2, batch=1) for src in (a, b)]
        share = 0
        for w in windows:
            letters = set(w) - {256}
            assert letters in ({ord("a")}, {ord("b")}), w  # never two sources in one window
            src = 0 if letters == {ord("a")} else 1
            share += src == 0
            assert w == next(alone[src])[0][0].tolist()
        # i.i.d. draws: std of the share sqrt(0.75 * 0.25 / 2000) = 0.0097; allow 5 std.
        n = len(windows)
        assert abs(share / n - 0.75) <= 5 * (0.75 * 0.25 / n) ** 0.5, share / n
        state, expected = mixed.state_dict(), [next(mixed)[0] for _ in range(3)]
        resumed = _stream(f"{a},{b}", rank, 2, batch=8, weights=[3.0, 1.0])
        resumed.load_state_dict(state)
        assert all(torch.equal(next(resumed)[0], e) for e in expected)
    with pytest.raises(ConfigError, match="the checkpoint's stream for data-parallel rank 1 "
                                          "has 2 sources, this run streams 1"):
        _stream(str(a), 1, 2).load_state_dict(state)


def test_document_mask_equals_each_document_alone():
    """Three documents packed (the last cut off) with the mask give, token for token, the
    logits of each document run alone (positions from 0, plain causal attention)."""
    from simplefsdp.models.llama import LLAMA3_PRESETS, Transformer, document_positions

    torch.manual_seed(0)
    model = Transformer(LLAMA3_PRESETS["debug"])
    model.init_weights()
    eos = 3
    docs = [torch.randint(4, 256, (n,)) for n in (11, 1, 7)]
    parts = [torch.cat([docs[0], torch.tensor([eos])]), torch.cat([docs[1], torch.tensor([eos])]),
             docs[2]]
    packed = torch.cat(parts)[None]
    positions, mask = document_positions(packed, eos)
    assert positions[0].tolist() == list(range(12)) + [0, 1] + list(range(7))
    with torch.no_grad():
        alone = torch.cat([model(p[None])[0] for p in parts])
        plain = model(packed)[0]
        model.document_eos = eos
        masked = model(packed)[0]
    # float32; SDPA with a boolean mask against is_causal on the shorter sequence: the
    # masked scores add exact zeros, kernels may order sums differently: 1e-5 relative.
    torch.testing.assert_close(masked, alone, rtol=1e-5, atol=1e-5)
    assert (plain[12:] - alone[12:]).abs().max() > 1e-2  # without it, documents mix
    torch.testing.assert_close(plain[:12], alone[:12], rtol=1e-5, atol=1e-5)
    # One compiled step (aot_eager: the same kernels as eager) equals eager, gradients too.
    compiled = torch.compile(model, backend="aot_eager", fullgraph=True)
    eager_loss = model(packed).float().logsumexp(-1).sum()
    eager_loss.backward()
    eager_grad = model.layers["0"].attention.wq.weight.grad.clone()
    model.zero_grad()
    compiled_loss = compiled(packed).float().logsumexp(-1).sum()
    compiled_loss.backward()
    assert torch.equal(compiled_loss, eager_loss)
    assert torch.equal(model.layers["0"].attention.wq.weight.grad, eager_grad)


def test_feistel_order_is_a_seeded_permutation():
    """Every index once (sizes incl. non powers of two and a cycle-walked 4**k + 1), the
    same order for the same key and for any subset of positions, another for another key."""
    from simplefsdp.corpus.text import feistel_permute

    for n in [1, 2, 3, 5, 7, 64, 100, 1000, 4097]:
        perm = feistel_permute(torch.arange(n), n, key=11)
        assert torch.equal(perm.sort().values, torch.arange(n)), n
        assert torch.equal(feistel_permute(torch.arange(n), n, key=11), perm)
        some = torch.tensor([n - 1, 0, n // 2, n - 1])
        assert torch.equal(feistel_permute(some, n, key=11), perm[some])
        if n >= 64:  # small domains have few orders; these must move and depend on the key
            assert not torch.equal(perm, torch.arange(n))
            assert not torch.equal(feistel_permute(torch.arange(n), n, key=12), perm)


def test_large_corpus_order_is_computed_and_resumes(monkeypatch):
    """Above PERMUTATION_MAX_WINDOWS the loader stores no permutation, still reads each
    window once per epoch, and resumes exactly (across an epoch end, 2 DP ranks)."""
    from simplefsdp.corpus import text as data_mod

    monkeypatch.setattr(data_mod, "PERMUTATION_MAX_WINDOWS", 50)
    tokens = torch.arange(60 * 8 + 1)  # 60 windows of 8 + 1; window w starts at token 8 w
    loader = data_mod.BatchLoader(tokens, 4, 8, seed=3)
    seen = [int(x) // 8 for _ in range(15) for x in next(loader)[0][:, 0]]  # one epoch
    assert sorted(seen) == list(range(60)) and seen != list(range(60))
    assert loader._perm.numel() == 0  # nothing per window was stored
    nxt = [int(x) // 8 for _ in range(15) for x in next(loader)[0][:, 0]]
    assert sorted(nxt) == list(range(60)) and nxt != seen  # the next epoch: another order
    make = lambda rank: data_mod.BatchLoader(tokens, 3, 8, dp_rank=rank, dp_world=2, seed=3)
    ranks = [make(0), make(1)]
    for _ in range(9):  # 54 of 60 samples: the next 4 steps cross the epoch end
        [next(r) for r in ranks]
    states = [r.state_dict() for r in ranks]
    want = [[next(r) for _ in range(4)] for r in ranks]
    for rank in (0, 1):
        resumed = make(rank)
        resumed.load_state_dict(states[rank])
        for w, g in zip(want[rank], (next(resumed) for _ in range(4)), strict=True):
            assert torch.equal(w[0], g[0]) and torch.equal(w[1], g[1])
    single = data_mod.BatchLoader(tokens, 6, 8, seed=3)  # the ranks' slices = one rank's batch
    for _ in range(9):
        next(single)
    for step in range(4):
        assert torch.equal(next(single)[0], torch.cat([want[0][step][0], want[1][step][0]]))
