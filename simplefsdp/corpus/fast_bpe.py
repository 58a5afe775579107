"""A byte-level BPE ``tokenizer.json`` as a tiktoken ``Encoding``, for building token caches.

tiktoken's Rust BPE is several times faster per CPU than Hugging Face ``tokenizers``,
but it is another algorithm: it merges the adjacent pair whose *concatenation* has the
lowest id and emits a pre-token found whole in the vocabulary at once, where Hugging
Face merges the pair that comes first in ``merges``. :func:`convert` returns an encoder
only when every check below passes for the given tokenizer, else ``None`` and the
first reason (the cache builder then tokenizes with Hugging Face and logs why):

- the pipeline is one tiktoken can run: no normalizer; a ``ByteLevel`` pre-tokenizer
  (its GPT-2 pattern) or ``Split(pattern, isolated)`` then ``ByteLevel(use_regex=false)``
  (the Llama 3 kind), without a prefix space; a ``BPE`` model without dropout,
  subword prefix/suffix or byte fallback;
- the vocabulary holds all 256 bytes; every other entry (added tokens aside) is made
  by exactly one merge of two vocabulary entries, and the ids of the merge results
  rise with the merge order (so "lowest id first" picks the same merge as "first in
  ``merges``");
- each vocabulary entry, run alone through the Hugging Face merges (the model rebuilt
  with ``ignore_merges`` off), comes out as itself: tiktoken's whole-word shortcut then
  gives what the merges give, and an entry whose own merges stop at another split of
  it (where tiktoken would still join the parts) is refused;
- added tokens are matched as plain strings (not ``single_word``/``lstrip``/``rstrip``),
  none inside another; they become tiktoken special tokens with their ids;
- a probe text (every code point of planes 0 and 1 and every 61st above, each between
  a letter, a digit and a space; whitespace runs; the added tokens) gives the same ids
  through both: the regex engines (Oniguruma, fancy-regex) agree on the pattern's
  character classes, which no table check can show.

With the merge order equal to the id order, both algorithms pick the same pair among
the pairs that ``merges`` lists; they can differ only where two adjacent parts join
into an entry by a split other than its merge. The third check refuses the tables where
an entry's own bytes do that; it is a check, not a proof for every context, which is why
the cache test also compares ``tokens.bin`` through both paths on text with unicode,
whitespace runs, digits, punctuation and added tokens. The tokenizers that Hugging
Face's BPE trainer made in the tests and the benchmark pass every check.
"""

from __future__ import annotations

import json

import numpy as np

# Hugging Face ByteLevel's default pattern (GPT-2's), in tiktoken's syntax.
GPT2_PATTERN = r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""
PROBE_ALL_BELOW = 0x20000  # every code point of planes 0 and 1, then every 61st


def byte_alphabet() -> dict[str, int]:
    """ByteLevel's character for each byte -> the byte: printable Latin-1 characters stand
    for themselves, the other bytes for U+0100 upwards in byte order."""
    kept = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1),
            *range(ord("®"), ord("ÿ") + 1)]
    out, extra = {}, 0
    for b in range(256):
        if b in kept:
            out[chr(b)] = b
        else:
            out[chr(256 + extra)] = b
            extra += 1
    return out


class FastBPE:
    """The converted encoder: the same ``encode_batch`` ids as the Hugging Face tokenizer
    it came from, special tokens included."""

    parallel_batches = True  # tiktoken's encode runs in Rust without the GIL

    def __init__(self, encoding):
        self.enc = encoding

    def encode_batch(self, texts: list[str]) -> list[np.ndarray]:
        return [self.enc.encode_to_numpy(t, allowed_special="all", disallowed_special=())
                for t in texts]


_CONVERTED: dict[str, tuple[FastBPE | None, str]] = {}  # by fingerprint: checks run once


def convert(tokenizer) -> tuple[FastBPE | None, str]:
    """``(encoder, "")`` when proven equal (module docstring), else ``(None, reason)``."""
    to_str = getattr(getattr(tokenizer, "tok", None), "to_str", None)
    if to_str is None:
        return None, f"{type(tokenizer).__name__} is not a Hugging Face tokenizer.json"
    try:
        import tiktoken  # noqa: F401 - the [hf] extra
    except ImportError:
        return None, "tiktoken is not installed (pip install 'simplefsdp[hf]')"
    key = str(getattr(tokenizer, "fingerprint", "")) or to_str()
    if key not in _CONVERTED:
        _CONVERTED[key] = _convert(tokenizer, json.loads(to_str()))
    return _CONVERTED[key]


def _convert(hf_tokenizer, spec: dict) -> tuple[FastBPE | None, str]:
    import tiktoken

    pattern, reason = _pattern(spec)
    if reason:
        return None, reason
    ranks, specials, reason = _ranks(spec)
    if reason:
        return None, reason
    reason = _entries_merge_to_themselves(spec, ranks)
    if reason:
        return None, reason
    enc = tiktoken.Encoding("simplefsdp-fast-bpe", pat_str=pattern, mergeable_ranks=ranks,
                            special_tokens=specials)
    fast = FastBPE(enc)
    probe = _probe_texts(list(specials))
    want = [e.ids for e in hf_tokenizer.tok.encode_batch_fast(probe, add_special_tokens=False)]
    got = fast.encode_batch(probe)
    for text, w, g in zip(probe, want, got, strict=True):
        if w != g.tolist():
            return None, f"the probe text {text[:40]!r} gives other ids through tiktoken"
    return fast, ""


def _pattern(spec: dict) -> tuple[str, str]:
    """The pre-tokenizer's regex, or a reason it is not one tiktoken runs alike."""
    if spec.get("normalizer") is not None:
        return "", f"it has a normalizer ({spec['normalizer'].get('type')})"
    pre = spec.get("pre_tokenizer") or {}
    steps = pre.get("pretokenizers", []) if pre.get("type") == "Sequence" else [pre]
    kinds = [s.get("type") for s in steps]
    if kinds == ["ByteLevel"] and steps[0].get("use_regex", True):
        pattern, byte_level = GPT2_PATTERN, steps[0]
    elif kinds == ["Split", "ByteLevel"] and not steps[1].get("use_regex", True):
        split, byte_level = steps[0], steps[1]
        regex = split.get("pattern", {}).get("Regex")
        if regex is None or split.get("behavior") != "Isolated" or split.get("invert"):
            return "", "its Split pre-tokenizer is not an isolated, non-inverted regex"
        pattern = regex
    else:
        return "", f"its pre-tokenizer is {kinds or None}, not a byte-level one"
    if byte_level.get("add_prefix_space"):
        return "", "its ByteLevel pre-tokenizer adds a prefix space"
    model = spec.get("model") or {}
    if model.get("type") != "BPE":
        return "", f"its model is {model.get('type')}, not BPE"
    for key in ("dropout", "continuing_subword_prefix", "end_of_word_suffix"):
        if model.get(key):
            return "", f"its BPE model sets {key}"
    if model.get("byte_fallback"):
        return "", "its BPE model sets byte_fallback"
    return pattern, ""


def _ranks(spec: dict) -> tuple[dict[bytes, int], dict[str, int], str]:
    """tiktoken's mergeable ranks (each entry's bytes -> its id) and special tokens."""
    alphabet, model = byte_alphabet(), spec["model"]
    added = {t["content"]: t["id"] for t in spec.get("added_tokens", [])}
    for t in spec.get("added_tokens", []):
        if t.get("single_word") or t.get("lstrip") or t.get("rstrip"):
            return {}, {}, f"added token {t['content']!r} is single_word/lstrip/rstrip"
        if any(t["content"] in other for other in added if other != t["content"]):
            return {}, {}, f"added token {t['content']!r} lies inside another added token"
    ranks: dict[bytes, int] = {}
    for token, token_id in model["vocab"].items():
        if token in added:
            continue
        if any(c not in alphabet for c in token):
            return {}, {}, f"vocabulary entry {token!r} is not byte-level"
        ranks[bytes(alphabet[c] for c in token)] = token_id
    if any(bytes([b]) not in ranks for b in range(256)):
        return {}, {}, "its vocabulary lacks some of the 256 bytes"
    made, last = {}, -1
    for merge in model.get("merges", []):
        left, right = merge.split(" ", 1) if isinstance(merge, str) else merge
        result = model["vocab"].get(left + right)
        if result is None or left not in model["vocab"] or right not in model["vocab"]:
            return {}, {}, f"merge {left!r} + {right!r} is not between vocabulary entries"
        if result <= last:
            return {}, {}, (f"merge {left!r} + {right!r} (id {result}) comes after a merge "
                            f"with a higher id: merge order and id order disagree")
        made[left + right], last = made.get(left + right, 0) + 1, result
    for token in model["vocab"]:
        if token not in added and len(bytes(alphabet[c] for c in token)) > 1 \
                and made.get(token) != 1:
            return {}, {}, f"vocabulary entry {token!r} is made by {made.get(token, 0)} merges"
    if set(added.values()) & set(ranks.values()):
        return {}, {}, "an added token shares its id with a vocabulary entry"
    return ranks, added, ""


def _entries_merge_to_themselves(spec: dict, ranks: dict[bytes, int]) -> str:
    """Runs every entry alone through Hugging Face's merges (``ignore_merges`` off)."""
    from tokenizers import models

    model = spec["model"]
    merges = [tuple(m.split(" ", 1)) if isinstance(m, str) else tuple(m)
              for m in model.get("merges", [])]
    kept = set(ranks.values())  # once: a 128k vocabulary made this quadratic
    vocab = {t: i for t, i in model["vocab"].items() if i in kept}
    bpe = models.BPE(vocab, merges, ignore_merges=False)
    for token, token_id in vocab.items():
        ids = [t.id for t in bpe.tokenize(token)]
        if ids != [token_id]:
            return f"vocabulary entry {token!r} merges to {ids}, not to itself"
    return ""


def _probe_texts(specials: list[str]) -> list[str]:
    """Texts that exercise the pattern's character classes and the added tokens."""
    points = [*range(PROBE_ALL_BELOW), *range(PROBE_ALL_BELOW, 0x110000, 61)]
    chars = [chr(c) for c in points if not 0xD800 <= c <= 0xDFFF]
    texts = ["".join(f"a{c}1{c} " for c in chars[i:i + 4096]) for i in range(0, len(chars), 4096)]
    spaced = " \t\n\r\x0b\x0c\x85\xa0\u2028\u3000"
    texts.append("".join(f"{a}{b}x{a}{a}{b}{b}  1 22 333 4444 ,, " for a in spaced
                         for b in spaced))
    texts.append("".join(f"x{s} {s}{s}\n{s}'ll" for s in specials) + " 12345 'RE 'Ve")
    return texts
