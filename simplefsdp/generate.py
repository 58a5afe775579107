"""Sample text from a trained model: ``python -m simplefsdp.generate``.

    python -m simplefsdp.generate --checkpoint outputs/checkpoints/step-200 \\
        --prompt "ROMEO:" --max-new-tokens 200 --temperature 0.8 --top-k 50 --seed 0
    python -m simplefsdp.generate --hf outputs/hf --prompt "ROMEO:" --temperature 0

``--checkpoint``: a trainer checkpoint (``step-<N>``) of our Llama or MoE families, read
into one process. The model and tokenizer are the run's: the job config the trainer
recorded next to its checkpoints (``<checkpoint.folder>/config.json``), to which the
trainer's own flags (``--config FILE``, ``--model.key value``, ``--data.tokenizer``)
may be added; the checkpoint's fingerprint must match the model config. ``--hf``: a
Hugging Face model folder (e.g. the trainer's ``checkpoint.export_hf``), run with
transformers, with its own tokenizer (else bytes).

Decoding keeps a key/value cache (our models: ``models.kv_cache``; transformers': its
own), so each new token costs one token's forward. ``--temperature 0`` is greedy; else
the logits divided by the temperature, cut to the ``--top-k`` largest, are sampled from
a generator seeded by ``--seed``. Generation stops early at the tokenizer's EOS token.
"""

from __future__ import annotations

import argparse
import json
import sys
import warnings
from collections.abc import Callable
from pathlib import Path

import torch
from torch import nn

from .errors import ConfigError

# A callable that takes the next tokens (1, new) and returns their logits (1, new, vocab),
# remembering what it was given before (a key/value cache).
Decoder = Callable[[torch.Tensor], torch.Tensor]


@torch.no_grad()
def sample(decode: Decoder, prompt: list[int], max_new_tokens: int, temperature: float = 0.0,
           top_k: int | None = None, seed: int = 0, eos_id: int | None = None,
           device: torch.device | str = "cpu") -> list[int]:
    """The tokens generated after ``prompt`` (see the module docstring)."""
    if not prompt:
        raise ValueError("the prompt encodes to no tokens: give --prompt some text")
    generator = torch.Generator(device=device).manual_seed(seed)
    logits = decode(torch.tensor([prompt], device=device))[0, -1]
    out: list[int] = []
    for _ in range(max_new_tokens):
        token = _next_token(logits.float(), temperature, top_k, generator)
        out.append(token)
        if token == eos_id:
            break
        logits = decode(torch.tensor([[token]], device=device))[0, -1]
    return out


def _next_token(logits: torch.Tensor, temperature: float, top_k: int | None,
                generator: torch.Generator) -> int:
    if temperature == 0:
        return int(logits.argmax())
    logits = logits / temperature
    if top_k is not None and top_k < logits.numel():
        kth = torch.topk(logits, top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    return int(torch.multinomial(probs, 1, generator=generator))


# ---------------------------------------------------------------------------------------
# Our checkpoints.
# ---------------------------------------------------------------------------------------
def job_config(checkpoint: Path, flags: list[str]):
    """The run's job config: ``<checkpoint>/../config.json`` (if the trainer recorded
    it), then ``flags`` (the trainer's); validated for one process."""
    from .config.job import JobConfig, parse_args
    from .config.reader import apply_overrides, apply_toml, split_argv
    from .train.checkpoint import RECORDED_CONFIG

    recorded = checkpoint.parent / RECORDED_CONFIG
    if not recorded.is_file():
        return parse_args(flags, 1)
    cfg = JobConfig()
    data = json.loads(recorded.read_text())
    data["parallel"] = {}  # one process here, whatever the run's layout was
    apply_toml(cfg, {section: {k: v for k, v in keys.items() if v is not None}
                     for section, keys in data.items()})
    path, overrides = split_argv(flags)
    if path is not None:
        raise ConfigError(f"--config {path}: the checkpoint's run recorded its config in "
                          f"{recorded}; override single keys with --section.key value")
    apply_overrides(cfg, overrides)
    cfg.validate(1)
    return cfg


def load_checkpoint_model(checkpoint: str | Path, cfg, device: torch.device) -> nn.Module:
    """Our Llama or MoE model of ``cfg`` with the weights of the trainer checkpoint
    ``checkpoint`` (any layout it was trained with), on ``device``, in eval mode."""
    import torch.distributed.checkpoint as dcp

    from .models.llama import Transformer
    from .models.moe import MoETransformer
    from .train.checkpoint import config_fingerprint, read_manifest

    checkpoint = Path(checkpoint)
    manifest = read_manifest(checkpoint)
    if manifest is None:
        raise ConfigError(f"--checkpoint {checkpoint}: not a complete trainer checkpoint "
                          f"(no manifest.json); give a step-<N> folder")
    family = cfg.model.family_entry()
    classes = {"llama": Transformer, "moe": MoETransformer}
    if family.name not in classes:
        raise ConfigError(f"model.family = {family.name!r}: --checkpoint samples our "
                          f"families ({', '.join(classes)}); export a Hugging Face folder "
                          f"(checkpoint.export_hf) and use --hf")
    if manifest.get("fingerprint") != config_fingerprint(family.fingerprint(cfg)):
        raise ConfigError(f"--checkpoint {checkpoint} was written for another model config "
                          f"than the one given; pass the run's --config / --model.* flags")
    with torch.device("meta"):
        model = classes[family.name](cfg.model.model_args())
    model.to_empty(device=device)
    model.rope_cache = model._rope_cache(device)  # a buffer no checkpoint holds
    state = {"app": {"model": model.state_dict()}}
    with warnings.catch_warnings():  # DCP's note that it reads in one process: it does
        warnings.filterwarnings("ignore", "torch.distributed is disabled")
        dcp.load(state, checkpoint_id=str(checkpoint), no_dist=True)
    return model.eval()


def our_decoder(model: nn.Module):
    """A :data:`Decoder` over our model, with its key/value cache (a context manager)."""
    from .models.kv_cache import KVCache

    return KVCache(model)


# ---------------------------------------------------------------------------------------
# Hugging Face folders.
# ---------------------------------------------------------------------------------------
class HFDecoder:
    """A :data:`Decoder` over a transformers causal LM, with its ``past_key_values``."""

    def __init__(self, model: nn.Module):
        import inspect

        self.model, self.past = model, None
        # transformers 5 renamed the argument ``past_key_values`` to ``cache``
        params = inspect.signature(model.forward).parameters
        self.cache_arg = "cache" if "cache" in params else "past_key_values"

    def __enter__(self) -> HFDecoder:
        return self

    def __exit__(self, *exc) -> None:
        self.past = None

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        out = self.model(input_ids=tokens, use_cache=True, **{self.cache_arg: self.past})
        past = getattr(out, "cache", None)
        self.past = past if past is not None else out.past_key_values
        return out.logits


def hf_tokenizer(folder: Path):
    """The folder's tokenizer.json, else bytes (our byte-level runs export none)."""
    from .corpus.text import ByteTokenizer

    if (folder / "tokenizer.json").is_file():
        from .hf.tokenizer import HFTokenizer

        return HFTokenizer(folder)
    return ByteTokenizer()


# ---------------------------------------------------------------------------------------
# The command line.
# ---------------------------------------------------------------------------------------
def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m simplefsdp.generate", description=__doc__.split("\n\n")[0],
        epilog="Other --section.key flags (and --config FILE) are the trainer's, for "
               "--checkpoint: they add to the run's recorded config.")
    source = p.add_mutually_exclusive_group(required=True)
    source.add_argument("--checkpoint", type=Path, help="a trainer checkpoint, step-<N>")
    source.add_argument("--hf", type=Path, help="a Hugging Face model folder")
    p.add_argument("--prompt", default="\n", help="the text to continue")
    p.add_argument("--max-new-tokens", type=int, default=100)
    p.add_argument("--temperature", type=float, default=0.8, help="0: greedy")
    p.add_argument("--top-k", type=int, default=None, help="sample among the k likeliest")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default="cpu", help="cpu or cuda")
    return p


def generate(argv: list[str]) -> tuple[list[int], str]:
    """Parse ``argv``, load the model, sample; returns (new token ids, their text)."""
    args, flags = _parser().parse_known_args(argv)
    if args.max_new_tokens < 1:
        raise ConfigError(f"--max-new-tokens {args.max_new_tokens}: must be >= 1")
    if args.temperature < 0:
        raise ConfigError(f"--temperature {args.temperature}: must be >= 0 (0: greedy)")
    if args.top_k is not None and args.top_k < 1:
        raise ConfigError(f"--top-k {args.top_k}: must be >= 1")
    device = torch.device(args.device)
    if args.hf is not None:
        if flags:
            raise ConfigError(f"{flags[0]}: --hf takes no trainer flags (the folder has "
                              f"its config)")
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(args.hf, dtype=torch.float32)
        model = model.to(device).eval()
        tokenizer, decoder = hf_tokenizer(args.hf), HFDecoder(model)
    else:
        cfg = job_config(args.checkpoint, flags)
        tokenizer = cfg.model.family_entry().tokenizer(cfg)
        decoder = our_decoder(load_checkpoint_model(args.checkpoint, cfg, device))
    with decoder:
        ids = sample(decoder.forward, tokenizer.encode(args.prompt), args.max_new_tokens,
                     args.temperature, args.top_k, args.seed,
                     getattr(tokenizer, "eos_id", None), device)
    return ids, tokenizer.decode(ids)


def main(argv: list[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        prompt = _parser().parse_known_args(argv)[0].prompt
        _, text = generate(argv)
    except ConfigError as e:
        sys.exit(f"error: {e}")
    print(prompt + text, flush=True)


if __name__ == "__main__":
    main()
