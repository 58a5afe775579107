"""Job configuration: a TOML file and ``--section.key value`` overrides -> dataclasses.

Every section is a dataclass below; its field types are the schema. A value is checked
against its field's type (``int``, ``float``, ``bool``, ``str``, a ``Literal`` of allowed
strings, or ``X | None``), and every error names the key, so a typo fails at start-up
instead of hours into a run. The defaults are the ``debug`` run, which trains a tiny
model on a laptop CPU: ``load_config(None, [])`` is that run, and so is
``configs/debug.toml``.

    cfg = load_config("configs/llama3_8b.toml", ["--training.steps", "10"])
    cfg.parallel.resolve(world_size)  # fills dp_shard = -1, checks the product
"""

from __future__ import annotations

import dataclasses
import difflib
import os
import tomllib
import types
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, Literal, Union, get_args, get_origin, get_type_hints

from ..models.llama import LLAMA3_PRESETS, ModelArgs, ffn_hidden_dim

DType = Literal["float32", "bfloat16"]
# Every process group's timeout: a hung collective fails after this instead of waiting.
PG_TIMEOUT_S = int(os.environ.get("SIMPLEFSDP_PG_TIMEOUT_S", "600"))


class ConfigError(ValueError):
    """A configuration value is unknown, of the wrong type or out of range."""


_NOT_MODEL_ARGS = ("name", "hf_path", "init_from_hf", "load_weights")


@dataclass
class ModelConfig:
    """``name`` picks a preset of ``LLAMA3_PRESETS``; any other key overrides one of its
    ``ModelArgs`` fields (left out = the preset's value)."""

    name: str = "debug"
    dim: int | None = None
    n_layers: int | None = None
    n_heads: int | None = None
    n_kv_heads: int | None = None
    vocab_size: int | None = None
    multiple_of: int | None = None
    ffn_dim_multiplier: float | None = None
    norm_eps: float | None = None
    rope_theta: float | None = None
    max_seq_len: int | None = None
    tie_embeddings: bool | None = None
    # [hf] A local Hugging Face causal LM folder, trained with transformers' own class
    # (``name`` and the shape keys above are then unused) ...
    hf_path: str | None = None
    # ... or a Hugging Face Llama folder whose weights initialize the ``name`` preset.
    init_from_hf: str | None = None
    # How those weights are read: rank 0 reads and scatters, or each rank reads its rows.
    load_weights: Literal["broadcast", "all_ranks"] = "broadcast"

    def model_args(self) -> ModelArgs:
        """The preset with the overrides applied."""
        if self.name not in LLAMA3_PRESETS:
            raise ConfigError(f"model.name = {self.name!r} is not a preset; choose one of "
                              f"{_choices(LLAMA3_PRESETS)}")
        overrides = {f.name: getattr(self, f.name) for f in fields(self)
                     if f.name not in _NOT_MODEL_ARGS and getattr(self, f.name) is not None}
        try:
            return dataclasses.replace(LLAMA3_PRESETS[self.name], **overrides)
        except ValueError as e:
            raise ConfigError(f"[model]: {e}") from None


@dataclass
class TrainingConfig:
    steps: int = 200
    batch_size: int = 8  # sequences per data-parallel rank and micro-step
    seq_len: int = 128
    lr: float = 1e-3
    warmup_steps: int = 20
    weight_decay: float = 0.1
    max_norm: float = 1.0  # gradient clipping
    grad_accum_steps: int = 1
    seed: int = 0
    mixed_precision_param: DType = "float32"  # dtype of gathered params and compute
    mixed_precision_reduce: DType = "float32"  # dtype of gradient reduction


@dataclass
class ParallelConfig:
    """Mesh sizes; their product must equal the world size (``dp_shard = -1``: the rest)."""

    dp_replicate: int = 1
    dp_shard: int = -1
    tp: int = 1
    pp: int = 1
    dp_mode: Literal["fully_shard", "hybrid_shard", "replicate"] = "fully_shard"
    pp_microbatches: int = 1
    reshard_after_forward: bool = True

    def resolve(self, world_size: int) -> ParallelConfig:
        """A copy with ``dp_shard`` filled in; raises if ``pp * dp_replicate * dp_shard * tp``
        cannot equal ``world_size`` or if ``dp_mode`` does not fit the sizes."""
        rest = self.pp * self.dp_replicate * self.tp
        dp_shard = self.dp_shard
        if dp_shard == -1:
            if world_size % rest:
                raise ConfigError(
                    f"world size {world_size} is not divisible by parallel.pp * "
                    f"parallel.dp_replicate * parallel.tp = {self.pp} * {self.dp_replicate} * "
                    f"{self.tp} = {rest}; change those sizes or the number of processes")
            dp_shard = world_size // rest
        product = rest * dp_shard
        if product != world_size:
            raise ConfigError(
                f"parallel.pp * dp_replicate * dp_shard * tp = {self.pp} * {self.dp_replicate} "
                f"* {dp_shard} * {self.tp} = {product}, but the world size is {world_size}; "
                f"set parallel.dp_shard = -1 to use the rest, or change the sizes")
        if self.dp_mode == "replicate" and dp_shard > 1:
            replicas = dp_shard * self.dp_replicate
            raise ConfigError(
                f"parallel.dp_mode = 'replicate' needs parallel.dp_shard = 1 (got {dp_shard}); "
                f"set parallel.dp_shard = 1 and parallel.dp_replicate = {replicas}, "
                f"or use dp_mode = 'fully_shard' / 'hybrid_shard'")
        return dataclasses.replace(self, dp_shard=dp_shard)

    @property
    def dp_degree(self) -> int:
        """Number of data-parallel ranks (after ``resolve``)."""
        return self.dp_replicate * self.dp_shard


@dataclass
class ActivationCheckpointConfig:
    mode: Literal["none", "selective", "full"] = "none"


@dataclass
class CompileConfig:
    enable: bool = False
    backend: Literal["inductor", "aot_eager"] = "inductor"
    bucketing: Literal["none", "manual", "auto"] = "manual"
    reordering: bool = True
    memory_limit_gb: float | None = None  # for bucketing = "auto"; None: no limit


@dataclass
class DataConfig:
    # The shipped corpus, or a .txt / .jsonl / .parquet file or a folder of them.
    dataset: str = "shakespeare"
    # 'byte', a tokenizer.json (or its folder), a tiktoken file; 'auto': the
    # model.hf_path folder's own tokenizer, else 'byte'.
    tokenizer: str = "auto"
    text_field: str = "text"  # the document text's field in .jsonl / .parquet rows


@dataclass
class MetricsConfig:
    log_every: int = 10
    output_dir: str = "outputs"
    tensorboard: bool = False


@dataclass
class CheckpointConfig:
    enable: bool = False
    every: int = 100  # steps between checkpoints
    folder: str = "checkpoints"  # a relative path lies under metrics.output_dir
    keep_latest: int = 2  # 0 keeps them all
    export_safetensors: bool = False  # also write a full-model .safetensors at the end
    export_hf: bool = False  # also write <metrics.output_dir>/hf, a Hugging Face model folder
    # Continue from the newest complete checkpoint in ``folder`` (``--resume``). Off, a
    # folder that already holds complete checkpoints is an error, not silently reused.
    resume: bool = False


@dataclass
class JobSection:
    device: Literal["cpu", "cuda"] = "cpu"
    name: str = "debug"


@dataclass
class JobConfig:
    """The whole job: one attribute per TOML section."""

    model: ModelConfig = field(default_factory=ModelConfig)
    training: TrainingConfig = field(default_factory=TrainingConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    activation_checkpoint: ActivationCheckpointConfig = field(
        default_factory=ActivationCheckpointConfig)
    compile: CompileConfig = field(default_factory=CompileConfig)
    data: DataConfig = field(default_factory=DataConfig)
    metrics: MetricsConfig = field(default_factory=MetricsConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    job: JobSection = field(default_factory=JobSection)

    def to_dict(self) -> dict[str, dict[str, Any]]:
        return dataclasses.asdict(self)

    def validate(self) -> None:
        """Range and consistency checks that types alone cannot express."""
        t, p = self.training, self.parallel
        args = self.model.model_args()
        for key in ("steps", "batch_size", "seq_len", "grad_accum_steps"):
            _require(getattr(t, key) >= 1, f"training.{key}", getattr(t, key), ">= 1")
        _require(t.lr > 0, "training.lr", t.lr, "> 0")
        _require(t.warmup_steps >= 0, "training.warmup_steps", t.warmup_steps, ">= 0")
        _require(t.weight_decay >= 0, "training.weight_decay", t.weight_decay, ">= 0")
        _require(t.max_norm > 0, "training.max_norm", t.max_norm, "> 0")
        hf_model = self.model.hf_path is not None  # its shapes are in its config.json
        if not hf_model and t.seq_len > args.max_seq_len:
            raise ConfigError(f"training.seq_len = {t.seq_len} exceeds the model's "
                              f"max_seq_len = {args.max_seq_len}; lower training.seq_len or "
                              f"raise model.max_seq_len")
        for key in ("dp_replicate", "tp", "pp", "pp_microbatches"):
            _require(getattr(p, key) >= 1, f"parallel.{key}", getattr(p, key), ">= 1")
        _require(p.dp_shard >= 1 or p.dp_shard == -1, "parallel.dp_shard", p.dp_shard,
                 ">= 1 or -1 (the rest of the world size)")
        if p.dp_mode == "fully_shard" and p.dp_replicate > 1:
            raise ConfigError(f"parallel.dp_mode = 'fully_shard' needs parallel.dp_replicate "
                              f"= 1 (got {p.dp_replicate}); use dp_mode = 'hybrid_shard'")
        if p.pp > 1 and t.batch_size % p.pp_microbatches:
            raise ConfigError(f"training.batch_size = {t.batch_size} must be divisible by "
                              f"parallel.pp_microbatches = {p.pp_microbatches}")
        _require(self.metrics.log_every >= 1, "metrics.log_every", self.metrics.log_every,
                 ">= 1")
        _require(self.checkpoint.every >= 1, "checkpoint.every", self.checkpoint.every, ">= 1")
        _require(self.checkpoint.keep_latest >= 0, "checkpoint.keep_latest",
                 self.checkpoint.keep_latest, ">= 0 (0 keeps all)")
        if self.checkpoint.resume and not self.checkpoint.enable:
            raise ConfigError("checkpoint.resume = true (--resume) needs checkpoint.enable = "
                              "true: pass --checkpoint.enable true as well")
        if not hf_model:
            _check_shapes(args, p)
        limit = self.compile.memory_limit_gb
        _require(limit is None or limit > 0, "compile.memory_limit_gb", limit, "> 0")
        dataset = self.data.dataset
        if dataset != "shakespeare" and not Path(dataset).exists():
            raise ConfigError(f"data.dataset = {dataset!r} is neither 'shakespeare' nor an "
                              f"existing file or folder")
        from ..hf.hooks import validate as validate_hf  # [hf] keys; imports nothing heavy

        validate_hf(self)


def check_tp(args: ModelArgs, tp: int) -> None:
    """Raise a ConfigError if the model's heads or FFN width cannot be split ``tp`` ways."""
    for what, value in (("model.n_heads", args.n_heads), ("model.n_kv_heads", args.kv_heads),
                        ("the FFN hidden size", ffn_hidden_dim(args))):
        if value % tp:
            raise ConfigError(f"parallel.tp = {tp} does not divide {what} = {value}")


def _check_shapes(args: ModelArgs, p: ParallelConfig) -> None:
    """The model's shapes must split over ``tp`` and ``pp``: checked here, before any
    process group exists, so every rank fails at once with the same message."""
    check_tp(args, p.tp)
    if p.pp > 1:
        if args.n_layers < p.pp:
            raise ConfigError(f"parallel.pp = {p.pp} stages need at least {p.pp} layers, the "
                              f"model has model.n_layers = {args.n_layers}")
        if args.tie_embeddings:
            raise ConfigError("model.tie_embeddings = true cannot be split into pipeline "
                              "stages (parallel.pp > 1): the embedding and the output live "
                              "on different ranks")


def _require(ok: bool, key: str, value: object, rule: str) -> None:
    if not ok:
        raise ConfigError(f"{key} = {value!r} is out of range: it must be {rule}")


def _choices(values) -> str:
    return ", ".join(repr(v) for v in values)


# ---------------------------------------------------------------------------------------
# Reading values: TOML values are checked, command-line strings are parsed.
# ---------------------------------------------------------------------------------------
def _optional_inner(tp: Any) -> Any | None:
    """``X`` for ``X | None``; None for any other type."""
    if get_origin(tp) in (types.UnionType, Union):
        inner = [a for a in get_args(tp) if a is not type(None)]
        return inner[0]
    return None


def _type_name(tp: Any) -> str:
    inner = _optional_inner(tp)
    if inner is not None:
        return f"{_type_name(inner)} or none"
    if get_origin(tp) is Literal:
        return f"one of {_choices(get_args(tp))}"
    return {bool: "a boolean (true/false)", int: "an integer", float: "a number",
            str: "a string"}[tp]


def _check(value: Any, tp: Any, key: str) -> Any:
    """Check a TOML value against the field type ``tp``; ints are accepted as floats."""
    inner = _optional_inner(tp)
    if inner is not None:
        return None if value is None else _check(value, inner, key)
    if get_origin(tp) is Literal:
        ok = isinstance(value, str) and value in get_args(tp)
    elif tp is float:
        ok = isinstance(value, int | float) and not isinstance(value, bool)
        value = float(value) if ok else value
    elif tp is int:
        ok = isinstance(value, int) and not isinstance(value, bool)
    else:
        ok = isinstance(value, tp)
    if not ok:
        raise ConfigError(f"{key} = {value!r} is invalid: expected {_type_name(tp)}")
    return value


def _parse(text: str | None, tp: Any, key: str) -> Any:
    """Parse a command-line string for a field of type ``tp`` (``None``: a bare flag)."""
    inner = _optional_inner(tp)
    if inner is not None:
        if text is not None and text.lower() in ("none", "null"):
            return None
        return _parse(text, inner, key)
    if tp is bool:
        if text is None:
            return True
        if text.lower() in ("true", "false"):
            return text.lower() == "true"
    elif text is None:
        raise ConfigError(f"--{key} needs a value ({_type_name(tp)})")
    elif tp is int or tp is float:
        try:
            return tp(text)
        except ValueError:
            pass
    else:  # str or Literal
        return _check(text, tp, key)
    raise ConfigError(f"{key} = {text!r} is invalid: expected {_type_name(tp)}")


def _section(cfg: JobConfig, name: str) -> Any:
    names = [f.name for f in fields(cfg)]
    if name not in names:
        raise ConfigError(f"unknown section [{name}]{_did_you_mean(name, names)}; sections "
                          f"are {', '.join(names)}")
    return getattr(cfg, name)


def _field_type(section_obj: Any, section: str, key: str) -> Any:
    hints = get_type_hints(type(section_obj))
    if key not in hints:
        raise ConfigError(f"unknown key {section}.{key}{_did_you_mean(key, list(hints))}; "
                          f"keys of [{section}] are {', '.join(hints)}")
    return hints[key]


def _did_you_mean(word: str, options: list[str]) -> str:
    close = difflib.get_close_matches(word, options, n=1)
    return f" (did you mean {close[0]!r}?)" if close else ""


def apply_toml(cfg: JobConfig, data: dict[str, Any]) -> None:
    """Set the values of a parsed TOML document on ``cfg``, checking each one."""
    for section, table in data.items():
        obj = _section(cfg, section)
        if not isinstance(table, dict):
            raise ConfigError(f"{section} must be a table: write it as [{section}]")
        for key, value in table.items():
            setattr(obj, key, _check(value, _field_type(obj, section, key), f"{section}.{key}"))


def apply_overrides(cfg: JobConfig, overrides: list[str]) -> None:
    """Apply ``["--section.key", "value", "--section.key=value", "--bool.flag", ...]``."""
    i = 0
    while i < len(overrides):
        arg = overrides[i]
        if not arg.startswith("--"):
            raise ConfigError(f"unexpected argument {arg!r}: overrides look like "
                              f"--section.key value")
        dotted, eq, text = arg[2:].partition("=")
        value: str | None = text if eq else None
        if not eq and i + 1 < len(overrides) and not overrides[i + 1].startswith("--"):
            value = overrides[i + 1]
            i += 1
        section, dot, key = dotted.partition(".")
        if not dot:
            raise ConfigError(f"--{dotted}: overrides are named --section.key, e.g. "
                              f"--training.steps")
        obj = _section(cfg, section)
        setattr(obj, key, _parse(value, _field_type(obj, section, key), dotted))
        i += 1


def load_config(path: str | Path | None, overrides: list[str] | None = None) -> JobConfig:
    """Defaults, then the TOML file at ``path`` (if any), then ``overrides``; validated."""
    cfg = JobConfig()
    if path is not None:
        if not Path(path).is_file():
            raise ConfigError(f"--config {path}: no such file (the presets are in configs/, "
                              f"e.g. configs/debug.toml)")
        with open(path, "rb") as f:
            try:
                data = tomllib.load(f)
            except tomllib.TOMLDecodeError as e:
                raise ConfigError(f"{path}: invalid TOML: {e}") from None
        apply_toml(cfg, data)
    apply_overrides(cfg, list(overrides or []))
    cfg.validate()
    return cfg


def parse_args(argv: list[str]) -> JobConfig:
    """Command line -> config: ``[--config FILE] [--resume] [--section.key value ...]``.

    ``--resume`` is short for ``--checkpoint.resume true``.
    """
    argv = ["--checkpoint.resume=true" if arg == "--resume" else arg for arg in argv]
    path = None
    for i, arg in enumerate(argv):
        if arg == "--config":
            if i + 1 >= len(argv):
                raise ConfigError("--config needs a path to a TOML file")
            path = argv[i + 1]
            del argv[i:i + 2]
            break
        if arg.startswith("--config="):
            path = arg.partition("=")[2]
            del argv[i]
            break
    return load_config(path, argv)


def config_help() -> str:
    """Every key with its type and default, for ``--help``."""
    lines = ["usage: [--config FILE.toml] [--resume] [--section.key value ...]",
             "  --resume is short for --checkpoint.resume true", ""]
    for section in fields(JobConfig):
        obj = getattr(JobConfig(), section.name)
        lines.append(f"[{section.name}]")
        for key, tp in get_type_hints(type(obj)).items():
            flag = f"--{section.name}.{key}"
            lines.append(f"  {flag:<40} {_type_name(tp)}; default {getattr(obj, key)!r}")
    return "\n".join(lines)
