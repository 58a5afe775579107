"""Tokenizers for the trainer: a Hugging Face ``tokenizer.json`` (or folder) or a tiktoken
BPE file. Both give ``vocab_size``, ``encode(text)``, ``encode_batch(texts)``, ``decode``,
``eos_id`` (the token that joins documents) and ``save(folder)`` (for the export)."""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

from . import HFError, require

# The Llama 3 / cl100k pre-tokenizer pattern, for tiktoken files (which hold only ranks).
TIKTOKEN_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+")
TIKTOKEN_EOS = "<|end_of_text|>"
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")
_EOS_GUESSES = ("</s>", "<|endoftext|>", "<|end_of_text|>", "<eos>", "[SEP]")


class HFTokenizer:
    """A ``tokenizers.Tokenizer`` from ``tokenizer.json``; EOS from
    ``tokenizer_config.json`` next to it, the model's ``eos_token_id``, or a common name."""

    def __init__(self, path: str | Path, eos_id: int | None = None):
        require("tokenizers")
        from tokenizers import Tokenizer

        path = Path(path)
        file = path / "tokenizer.json" if path.is_dir() else path
        if not file.is_file():
            raise HFError(f"data.tokenizer = {str(path)!r}: no tokenizer.json there; give a "
                          f"tokenizer.json file, a folder holding one, or a .tiktoken file")
        try:
            self.tok = Tokenizer.from_file(str(file))
        except Exception as e:  # tokenizers raises a bare Exception on bad JSON
            raise HFError(f"{file}: not a Hugging Face tokenizer.json ({e})") from None
        self.folder = file.parent
        self.vocab_size = self.tok.get_vocab_size(with_added_tokens=True)
        self.eos_id = eos_id if eos_id is not None else self._find_eos()
        # Keys the token cache: changes whenever the serialized tokenizer does.
        self.fingerprint = "hf:" + hashlib.sha256(self.tok.to_str().encode()).hexdigest()

    def _find_eos(self) -> int | None:
        config = self.folder / "tokenizer_config.json"
        names = list(_EOS_GUESSES)
        if config.is_file():
            eos = json.loads(config.read_text()).get("eos_token")
            eos = eos.get("content") if isinstance(eos, dict) else eos
            names = [eos] + names if eos else names
        for name in names:
            token_id = self.tok.token_to_id(name)
            if token_id is not None:
                return token_id
        return None

    def encode(self, text: str) -> list[int]:
        return self.tok.encode(text, add_special_tokens=False).ids

    # encode_batch runs in Rust without the GIL (and on its own thread pool unless
    # TOKENIZERS_PARALLELISM=false): the token cache tokenizes with threads, not processes.
    parallel_batches = True

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        # The _fast variant skips the character offsets; the ids are encode's.
        return [e.ids for e in self.tok.encode_batch_fast(texts, add_special_tokens=False)]

    def decode(self, ids) -> str:
        return self.tok.decode([int(i) for i in ids])

    def save(self, folder: Path) -> None:
        """Write tokenizer.json (and its config files when it came with them)."""
        self.tok.save(str(folder / "tokenizer.json"))
        for name in _TOKENIZER_FILES[1:]:
            if (self.folder / name).is_file():
                shutil.copy(self.folder / name, folder / name)
        if not (folder / "tokenizer_config.json").is_file():
            eos = self.tok.id_to_token(self.eos_id) if self.eos_id is not None else None
            (folder / "tokenizer_config.json").write_text(json.dumps(
                {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": eos}, indent=2))


class TiktokenTokenizer:
    """A tiktoken BPE ranks file (``<base64 token> <rank>`` lines, as Meta ships
    ``tokenizer.model`` for Llama 3), with the Llama 3 pattern and one EOS token."""

    def __init__(self, path: str | Path):
        require("tiktoken")
        import tiktoken
        from tiktoken.load import load_tiktoken_bpe

        try:
            ranks = load_tiktoken_bpe(str(path))
        except Exception as e:  # noqa: BLE001 - any parse failure is the same user error
            raise HFError(f"data.tokenizer = {str(path)!r}: not a tiktoken BPE file ({e})") \
                from None
        self.eos_id = len(ranks)
        self.enc = tiktoken.Encoding(Path(path).name, pat_str=TIKTOKEN_PATTERN,
                                     mergeable_ranks=ranks,
                                     special_tokens={TIKTOKEN_EOS: self.eos_id})
        self.vocab_size = self.enc.n_vocab
        self.fingerprint = "tiktoken:" + hashlib.sha256(Path(path).read_bytes()).hexdigest()

    def encode(self, text: str) -> list[int]:
        return self.enc.encode_ordinary(text)

    parallel_batches = True  # encode_ordinary_batch: threads, Rust without the GIL

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        return self.enc.encode_ordinary_batch(texts)

    def decode(self, ids) -> str:
        return self.enc.decode([int(i) for i in ids])

    def save(self, folder: Path) -> None:  # transformers has no loader for a bare ranks file
        pass


def load_tokenizer(path: str | Path, eos_id: int | None = None):
    """A tokenizer by path: a folder or ``.json`` is Hugging Face's, anything else tiktoken."""
    path = Path(path)
    if not path.exists():
        raise HFError(f"data.tokenizer = {str(path)!r}: no such file or folder")
    if path.is_dir() or path.suffix == ".json":
        return HFTokenizer(path, eos_id)
    return TiktokenTokenizer(path)
