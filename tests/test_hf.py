"""Hugging Face models in the trainer: sharded loading, tokenizers, data, export.

Everything is made here: a tiny random Llama and GPT-2 saved with ``save_pretrained``,
a BPE tokenizer trained with ``tokenizers`` on the shipped Shakespeare text, jsonl and
parquet files. No network (the loaders run offline), nothing large.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")  # the [hf] extra; CI installs it with .[dev]

from rank_runner import run_ranks  # noqa: E402

os.environ.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", HF_DATASETS_OFFLINE="1")
VOCAB = 321  # odd: the embedding rows split unevenly over 2 ranks
TOKENIZER_VOCAB = 300


# ---------------------------------------------------------------------------------------
# Assets.
# ---------------------------------------------------------------------------------------
def _documents() -> list[str]:
    from simplefsdp.corpus.text import read_corpus

    text = read_corpus("shakespeare")[:60_000]
    return [d.strip() for d in text.split("\n\n") if d.strip()]


def _train_tokenizer(folder: Path, vocab: int) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab, special_tokens=["<eos>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(_documents(), trainer)
    folder.mkdir(parents=True, exist_ok=True)
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps(
        {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "<eos>"}))


def _llama_config(**kw):
    from transformers import LlamaConfig

    base = dict(vocab_size=VOCAB, hidden_size=48, intermediate_size=72, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                tie_word_embeddings=False, eos_token_id=0, bos_token_id=None)
    return LlamaConfig(**{**base, **kw})


def _save_hf(folder: Path, config, max_shard_size=None) -> None:
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config)
    kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(folder, **kwargs)
    _train_tokenizer(folder, TOKENIZER_VOCAB)


@pytest.fixture(scope="module")
def assets(tmp_path_factory) -> dict[str, Path]:
    from transformers import GPT2Config

    root = tmp_path_factory.mktemp("hf")
    # Llama: untied head, sharded into several files (index); GPT-2: tied, Conv1D, one file.
    _save_hf(root / "llama", _llama_config(), max_shard_size="40KB")
    _save_hf(root / "gpt2", GPT2Config(vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=4,
                                       n_positions=64, resid_pdrop=0.0, embd_pdrop=0.0,
                                       attn_pdrop=0.0, eos_token_id=0, bos_token_id=0))
    docs = _documents()
    with open(root / "docs.jsonl", "w") as f:
        for d in docs:
            f.write(json.dumps({"body": d, "id": len(d)}) + "\n")
    import pyarrow as pa
    import pyarrow.parquet as pq

    (root / "parquet").mkdir()
    half = len(docs) // 2
    pq.write_table(pa.table({"text": docs[:half]}), root / "parquet" / "a.parquet")
    pq.write_table(pa.table({"text": docs[half:]}), root / "parquet" / "b.parquet")
    return {"root": root, "llama": root / "llama", "gpt2": root / "gpt2",
            "jsonl": root / "docs.jsonl", "parquet": root / "parquet"}


def _argv(out: Path, model: Path, data: Path, *extra: str) -> list[str]:
    return ["--model.hf_path", str(model), "--data.dataset", str(data),
            "--data.text_field", "body" if data.suffix == ".jsonl" else "text",
            "--training.steps", "1", "--training.batch_size", "2", "--training.seq_len", "32",
            "--training.warmup_steps", "0", "--metrics.output_dir", str(out),
            "--metrics.log_every", "1", *extra]


# ---------------------------------------------------------------------------------------
# Data and tokenizers.
# ---------------------------------------------------------------------------------------
def packed_documents(data, tokenizer, text_field: str = "text"):
    """The trainer's corpus rebuilt in memory without its token cache, as the reference
    the trainer's batches are checked against: every non-empty document of ``data`` (read
    as the cache reads them), tokenized one by one and followed by EOS, in order, with the
    trainer's train/validation split (``corpus.setup.VAL_FRACTION``)."""
    from simplefsdp.corpus.setup import VAL_FRACTION
    from simplefsdp.corpus.sources import documents, resolve
    from simplefsdp.corpus.text import TextDataset

    stream: list[int] = []
    for _, text in documents(resolve(str(data)).files, text_field):
        if text:
            stream += [*tokenizer.encode(text), tokenizer.eos_id]
    return TextDataset(str(data), tokenizer, VAL_FRACTION,
                       tokens=torch.tensor(stream, dtype=torch.int32))


def test_token_cache_packs_documents_with_eos_and_formats_agree(assets, tmp_path):
    """The trainer's token cache (``corpus.setup.open_caches``) of a .jsonl file and of a
    folder of parquet files holding the same documents: the same stream, each document's
    tokens followed by exactly one EOS, in order (against :func:`packed_documents`)."""
    from simplefsdp.config.job import DataConfig
    from simplefsdp.corpus.setup import open_caches
    from simplefsdp.corpus.sources import documents, resolve
    from simplefsdp.hf.tokenizer import load_tokenizer

    tok = load_tokenizer(assets["llama"])
    assert tok.eos_id == 0 and tok.vocab_size == TOKENIZER_VOCAB

    def read(name: str, field: str) -> list[str]:
        return [text for _, text in documents(resolve(str(assets[name])).files, field)]

    jsonl = read("jsonl", "body")
    assert jsonl == _documents() == read("parquet", "text")  # folder: a, b in order
    reference = packed_documents(assets["jsonl"], tok, "body")
    stream = torch.cat([reference.train_tokens, reference.val_tokens]).long()
    for name, field in (("jsonl", "body"), ("parquet", "text")):
        data = DataConfig(dataset=str(assets[name]), text_field=field, cache_dir=str(tmp_path),
                          tokenize_workers=1)
        (cache,) = open_caches(data, tok)
        assert torch.equal(torch.from_numpy(cache.tokens.astype("int64")), stream), name
    assert int((stream == tok.eos_id).sum()) == len(jsonl)
    first = tok.encode(jsonl[0])
    assert stream[:len(first)].tolist() == first and int(stream[len(first)]) == tok.eos_id
    assert tok.decode(first) == jsonl[0]


def test_tiktoken_file(tmp_path):
    import base64

    from simplefsdp.hf.tokenizer import load_tokenizer

    # A byte-level ranks file: 256 single bytes, then two merges.
    ranks = [bytes([i]) for i in range(256)] + [b"th", b"the"]
    path = tmp_path / "tok.tiktoken"
    path.write_text("".join(f"{base64.b64encode(t).decode()} {r}\n" for r, t in enumerate(ranks)))
    tok = load_tokenizer(path)
    assert tok.vocab_size == 259 and tok.eos_id == 258
    ids = tok.encode("the thin")
    assert 257 in ids and tok.decode(ids) == "the thin"


# ---------------------------------------------------------------------------------------
# Trainer: first loss, loading, training, export.
# ---------------------------------------------------------------------------------------
def _first_loss(rank: int, world: int, argv: list[str], model_dir: str, text_field: str,
                data: str, hf_kwargs: dict | None = None):
    from transformers import AutoModelForCausalLM

    from simplefsdp.hf.tokenizer import load_tokenizer
    from simplefsdp.train.__main__ import main

    ours = main(argv).losses[0]
    dataset = packed_documents(data, load_tokenizer(model_dir), text_field)
    inputs, targets = next(dataset.loader("train", 2, 32, seed=0))
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, **(hf_kwargs or {}))
    with torch.no_grad():
        theirs = hf(input_ids=inputs, labels=inputs, shift_labels=targets.contiguous()).loss.item()
    return ours, theirs


@pytest.mark.parametrize("name,data", [("llama", "jsonl"), ("gpt2", "parquet")])
def test_first_loss_equals_hf_loss(assets, tmp_path, name, data):
    field = "body" if data == "jsonl" else "text"
    ours, theirs = run_ranks(_first_loss, 1, _argv(tmp_path, assets[name], assets[data]),
                             str(assets[name]), field, str(assets[data]))[0]
    # Same float32 math on the same weights and batch; only the reduction differs
    # (our sum / token count vs. their mean): within float32 rounding of a sum of 64.
    assert ours == pytest.approx(theirs, rel=1e-6, abs=0)


def _eager_and_compiled(rank: int, world: int, argv: list[str], out: str):
    from simplefsdp.train.__main__ import main

    eager = main([*argv, "--metrics.output_dir", f"{out}/eager"]).losses
    compiled = main([*argv, "--metrics.output_dir", f"{out}/compiled",
                     "--compile.enable", "true", "--compile.backend", "aot_eager",
                     "--compile.bucketing", "manual"]).losses
    return eager, compiled


def test_compiled_hf_model_matches_eager(assets, tmp_path):
    """A Hugging Face Llama under our backend (aot_eager, manual buckets, reordering,
    selective AC), 2 ranks: the same losses as eager, bitwise (aot_eager runs the same
    kernels in the same order; bucketing only regroups the collectives)."""
    argv = _argv(tmp_path, assets["llama"], assets["jsonl"], "--training.steps", "3",
                 "--activation_checkpoint.mode", "selective")
    eager, compiled = run_ranks(_eager_and_compiled, 2, argv, str(tmp_path))[0]
    assert len(eager) == 3 and compiled == eager


class _CountingOpen:
    """``safetensors.safe_open``, adding up the bytes of every tensor it hands out.

    safetensors memory-maps the file and copies out exactly the tensor or row slice
    asked for (``get_tensor`` / ``get_slice(name)[a:b]``), so the bytes of what these
    return are what the loader reads from the files: counted here, outside the loader,
    and compared with the file sizes and with the loader's own ``bytes_read``."""

    read = 0  # this process, since the last reset
    real_open = None  # safetensors' own, kept when this class replaces it

    def __init__(self, path, framework, device="cpu"):
        self._file = _CountingOpen.real_open(path, framework=framework, device=device)

    @staticmethod
    def _count(tensor: torch.Tensor) -> torch.Tensor:
        _CountingOpen.read += tensor.numel() * tensor.element_size()
        return tensor

    def __enter__(self):
        self._file.__enter__()
        return self

    def __exit__(self, *exc):
        return self._file.__exit__(*exc)

    def keys(self):
        return self._file.keys()

    def metadata(self):
        return self._file.metadata()

    def get_tensor(self, name: str) -> torch.Tensor:
        return self._count(self._file.get_tensor(name))

    def get_slice(self, name: str):
        return _CountingSlice(self._file.get_slice(name))


class _CountingSlice:
    def __init__(self, inner):
        self._inner = inner

    def get_shape(self):
        return self._inner.get_shape()

    def get_dtype(self):
        return self._inner.get_dtype()

    def __getitem__(self, index) -> torch.Tensor:
        return _CountingOpen._count(self._inner[index])


def _load_both_modes(rank: int, world: int, llama_dir: str, ours_dir: str):
    """Load each folder in each mode; return every parameter's ``full_tensor()`` (rank 0),
    the local row counts, and the bytes this rank read (counted by ``_CountingOpen``)
    with the loader's own ``bytes_read``."""
    import safetensors

    import simplefsdp
    from simplefsdp.config.job import load_config
    from simplefsdp.hf import weights
    from simplefsdp.state_dict import unwrapped_name

    loads = []
    real_load = weights.load_sharded

    def counted_load(*args, **kwargs):  # counts the file reads of this load only
        _CountingOpen.read = 0
        report = real_load(*args, **kwargs)
        loads.append((_CountingOpen.read, report.bytes_read))
        return report

    _CountingOpen.real_open = safetensors.safe_open
    safetensors.safe_open, weights.load_sharded = _CountingOpen, counted_load
    mesh = simplefsdp.make_mesh(dp_shard=world, device_type="cpu")
    out = {}
    for source, extra in ((llama_dir, ["--model.hf_path", llama_dir]),
                          (ours_dir, ["--model.init_from_hf", ours_dir,
                                      "--model.dim", "64", "--model.n_layers", "2",
                                      "--model.multiple_of", "16",
                                      "--model.vocab_size", str(VOCAB)])):
        for mode in ("broadcast", "all_ranks"):
            cfg = load_config(None, [*extra, "--model.load_weights", mode])
            dims = cfg.parallel.dims().resolve(mesh.size())
            _, model = cfg.model.family_entry().build(cfg, mesh, dims, torch.device("cpu"))
            state = {unwrapped_name(k): v for k, v in model.state_dict().items()}
            # A collective on all ranks; numpy: plain pickles back to the test process
            # (tensors would go through shared memory that dies with the rank).
            full = {k: v.full_tensor().numpy() for k, v in state.items()}
            (counted, reported), = loads
            loads.clear()
            out[source, mode] = {"full": full if rank == 0 else None,
                                 "rows": {k: v.to_local().shape[0] for k, v in state.items()},
                                 "read": counted, "reported": reported}
    return out


def test_sharded_loading_reads_the_files_tensors(assets, tmp_path):
    """2 ranks, both load modes, a Hugging Face Llama (several files, 321 vocabulary
    rows: uneven shards) and our Llama from its Hugging Face export (RoPE rows
    reordered). Every parameter gathered (``full_tensor()``) equals, bitwise, the
    tensor read from the files with ``safetensors.torch.load_file`` (HF) or the model
    that was exported (ours): the loader moves bytes, so nothing may differ. Under
    ``all_ranks`` each rank reads its own rows only: less than the files' size, and the
    two ranks together exactly the files' tensor bytes once; under ``broadcast`` rank 0
    reads every tensor once and rank 1 nothing. Bytes are counted around safetensors'
    ``safe_open`` (``_CountingOpen``), and the loader's ``bytes_read`` must agree."""
    from safetensors.torch import load_file

    ours_dir = tmp_path / "ours"
    reference = _export_our_llama(ours_dir)
    results = run_ranks(_load_both_modes, 2, str(assets["llama"]), str(ours_dir))
    for folder, expected in ((assets["llama"], None), (ours_dir, reference)):
        paths = sorted(folder.glob("*.safetensors"))
        file_tensors = {k: v for p in paths for k, v in load_file(p).items()}
        expected = file_tensors if expected is None else expected
        file_bytes = sum(p.stat().st_size for p in paths)
        tensor_bytes = sum(v.numel() * v.element_size() for v in file_tensors.values())
        for mode in ("broadcast", "all_ranks"):
            got = [r[str(folder), mode] for r in results]
            assert got[0]["full"].keys() == expected.keys(), (folder, mode)
            for key, value in expected.items():
                loaded = torch.from_numpy(got[0]["full"][key])
                assert torch.equal(loaded, value), (folder, mode, key)
            read = [g["read"] for g in got]
            print(f"{folder.name} {mode}: bytes read by rank {read}, files {file_bytes}")
            assert [g["reported"] for g in got] == read, (folder, mode)
            if mode == "broadcast":
                assert read == [tensor_bytes, 0], (folder, read, tensor_bytes)
            else:
                assert all(0 < r < file_bytes for r in read), (folder, read, file_bytes)
                assert sum(read) == tensor_bytes, (folder, read, tensor_bytes)
    # The embedding's 321 rows split unevenly: 161 + 160.
    rows = [r[str(assets["llama"]), "all_ranks"]["rows"] for r in results]
    assert [r["model.embed_tokens.weight"] for r in rows] == [161, 160]


def train_keeping_model(argv: list[str]):
    """``main(argv)`` on the hf family, keeping what it built: (result, (runnable, model)),
    the trained sharded model for a parity check."""
    import dataclasses

    from simplefsdp.models import registry
    from simplefsdp.train.__main__ import main

    built = []
    family = registry.get("hf")

    def capture(*args, **kwargs):
        built.append(family.build(*args, **kwargs))
        return built[-1]

    registry.register(dataclasses.replace(family, build=capture))
    try:
        result = main(argv)
    finally:
        registry.register(family)
    return result, built[0]


def exported_logits(runnable, out: str, data: str, **hf_kwargs):
    """Our trained model's logits on 2 x 32 validation tokens (a collective: every rank)
    and, on rank 0, those of the exported folder opened by ``from_pretrained``: (ours,
    theirs, their model); theirs and their model are None off rank 0."""
    import torch.distributed as dist
    from transformers import AutoModelForCausalLM

    from simplefsdp.hf.tokenizer import load_tokenizer

    tokens = packed_documents(data, load_tokenizer(Path(out) / "hf"), "body").val_tokens
    batch = tokens[: 2 * 32].long().view(2, 32)
    with torch.no_grad():
        ours = runnable(batch)
    if dist.get_rank() != 0:
        return ours, None, None
    hf = AutoModelForCausalLM.from_pretrained(Path(out) / "hf", dtype=torch.float32,
                                              **hf_kwargs)
    with torch.no_grad():
        return ours, hf(input_ids=batch).logits, hf


def _train_and_export(rank: int, world: int, argv: list[str], out: str, data: str):
    result, (runnable, _) = train_keeping_model(argv)
    ours, theirs, _ = exported_logits(runnable, out, data)
    if theirs is None:
        return result.losses, None
    return result.losses, (ours - theirs).abs().max().item()


def test_two_ranks_train_then_export_matches(assets, tmp_path):
    argv = _argv(tmp_path, assets["llama"], assets["jsonl"], "--training.steps", "20",
                 "--training.lr", "3e-3", "--training.warmup_steps", "2",
                 "--checkpoint.export_hf", "true", "--activation_checkpoint.mode", "full")
    (losses, diff), _ = run_ranks(_train_and_export, 2, argv, str(tmp_path), str(assets["jsonl"]))
    print(f"losses {[round(x, 3) for x in losses]}, export logits max diff {diff:.2e}")
    assert len(losses) == 20
    assert sum(losses[-5:]) / 5 < losses[0] - 0.3, losses  # the random model starts ~ln(321)
    # from_pretrained(hf/) runs the same float32 weights through the same HF code; the
    # trained model gathers them first. The logits agree to float32 rounding.
    assert diff <= 1e-5, diff
    files = sorted(p.name for p in (tmp_path / "hf").iterdir())
    assert "config.json" in files and "tokenizer.json" in files


# ---------------------------------------------------------------------------------------
# Our Llama <-> Hugging Face Llama.
# ---------------------------------------------------------------------------------------
def _our_llama():
    from simplefsdp.models.llama import ModelArgs, Transformer

    args = ModelArgs(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=VOCAB,
                     multiple_of=16, max_seq_len=64)
    torch.manual_seed(1)
    model = Transformer(args)
    model.init_weights()
    return model


def _export_our_llama(folder: Path) -> dict[str, torch.Tensor]:
    from simplefsdp.hf.export import export_hf
    from simplefsdp.hf.llama_layout import hf_config, rope_heads, to_hf_name

    model = _our_llama()
    export_hf(model, folder, hf_config(model.args), rename=to_hf_name,
              rope_heads=lambda n: rope_heads(n, model.args), max_shard_bytes=60_000)
    return {k: v.clone() for k, v in model.state_dict().items()}


def test_our_llama_round_trips_through_hf_layout(tmp_path):
    from transformers import AutoModelForCausalLM

    from simplefsdp.hf.llama_layout import sources_from_hf
    from simplefsdp.hf.weights import load_sharded, unique_tensors
    from simplefsdp.models.llama import Transformer

    original = _export_our_llama(tmp_path)
    assert (tmp_path / "model.safetensors.index.json").is_file()  # several shard files
    ours = _our_llama()
    hf = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32)
    tokens = torch.randint(0, VOCAB, (2, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        diff = (ours(tokens) - hf(input_ids=tokens).logits).abs().max().item()
    # Two implementations of the same function (RoPE pairs, attention kernels differ in
    # summation order); logits are O(1), float32.
    assert diff < 1e-5, diff
    back = Transformer(ours.args)  # random init, then overwritten from the HF folder
    names = [n for names, _ in unique_tensors(back) for n in names]
    load_sharded(back, tmp_path, "all_ranks", sources_from_hf(names, back.args))
    for key, value in back.state_dict().items():
        assert torch.equal(value, original[key]), key  # bitwise


# ---------------------------------------------------------------------------------------
# Bad input: clear errors before any step.
# ---------------------------------------------------------------------------------------
def _errors(rank: int, world: int, cases: list[tuple[list[str], str]]):
    from simplefsdp.errors import ConfigError
    from simplefsdp.train.__main__ import main

    messages = []
    for argv, _ in cases:
        with pytest.raises(ConfigError) as info:
            main(argv)
        messages.append(str(info.value))
    return messages


def test_bad_inputs_fail_before_any_step(assets, tmp_path):
    import shutil

    from safetensors.torch import load_file, save_file

    from simplefsdp.config.job import parse_args
    from simplefsdp.errors import ConfigError

    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(ConfigError, match="no config.json"):
        parse_args(["--model.hf_path", str(empty)])
    with pytest.raises(ConfigError, match="tensor or pipeline"):
        parse_args(["--model.hf_path", str(assets["gpt2"]), "--parallel.tp", "2"])

    missing = tmp_path / "missing"
    shutil.copytree(assets["gpt2"], missing)
    weights = load_file(missing / "model.safetensors")
    del weights["transformer.h.1.mlp.c_fc.weight"]
    save_file(weights, missing / "model.safetensors", metadata={"format": "pt"})

    shape = tmp_path / "shape"
    shutil.copytree(assets["gpt2"], shape)
    config = json.loads((shape / "config.json").read_text())
    (shape / "config.json").write_text(json.dumps({**config, "n_inner": 64}))

    small = tmp_path / "small"
    shutil.copytree(assets["gpt2"], small)
    config = json.loads((small / "config.json").read_text())
    (small / "config.json").write_text(json.dumps({**config, "vocab_size": 200}))
    for name in ("model.safetensors",):  # the files hold 321 rows: shapes would fail too
        weights = load_file(small / name)
        weights["transformer.wte.weight"] = weights["transformer.wte.weight"][:200]
        save_file(weights, small / name, metadata={"format": "pt"})

    out = tmp_path / "out"
    cases = [
        (_argv(out, missing, assets["parquet"]), "transformer.h.1.mlp.c_fc.weight"),
        (_argv(out, shape, assets["parquet"]), "shape"),
        (_argv(out, small, assets["parquet"]), "300 tokens"),
    ]
    messages = run_ranks(_errors, 1, cases)[0]
    for (_, expected), message in zip(cases, messages, strict=True):
        assert expected in message, message
    assert "model.safetensors" in messages[0] and "not in the files" in messages[0]
    assert "[32, 128]" in messages[1] and "[32, 64]" in messages[1]  # Conv1D: (in, out)
    assert "config.json" in messages[2]
    assert not (out / "metrics.jsonl").exists()  # no step ran
