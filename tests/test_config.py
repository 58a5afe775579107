"""Job config: defaults, files, command-line overrides, errors that name the key."""

from __future__ import annotations

from pathlib import Path

import pytest

from simplefsdp.config.job import JobConfig, load_config, parse_args
from simplefsdp.errors import ConfigError

pytestmark = pytest.mark.quick  # unit checks in one process: the whole file is in the quick tier

CONFIGS = Path(__file__).resolve().parents[1] / "configs"


def _toml(tmp_path: Path, text: str) -> str:
    path = tmp_path / "job.toml"
    path.write_text(text)
    return str(path)


def test_default_loads_and_is_the_debug_run():
    cfg = load_config(None, [])
    assert cfg == JobConfig()
    assert cfg.model.name == "debug" and cfg.job.device == "cpu"
    assert cfg.model.model_args().vocab_size == 256


def test_debug_file_equals_default():
    assert load_config(CONFIGS / "debug.toml", []) == load_config(None, [])


@pytest.mark.parametrize("name,world", [("llama3_8b", 8), ("llama3_70b", 64),
                                        ("llama3_405b", 256)])
def test_large_configs_load(name: str, world: int):
    cfg = load_config(CONFIGS / f"{name}.toml", [])
    assert cfg.model.name == name and cfg.job.device == "cuda" and cfg.compile.enable
    assert cfg.training.mixed_precision_param == "bfloat16"
    assert cfg.parallel.resolve(world).dp_shard >= 1


def test_cli_overrides_parse_types():
    cfg = load_config(None, [
        "--training.steps", "7", "--training.lr=3e-4", "--compile.enable",
        "--parallel.reshard_after_forward", "false", "--parallel.dp_shard", "-1",
        "--model.dim", "64", "--model.ffn_dim_multiplier", "1.5",
        "--compile.memory_limit_gb", "12", "--parallel.dp_mode", "hybrid_shard",
        "--job.name", "x",
    ])
    assert cfg.training.steps == 7 and isinstance(cfg.training.steps, int)
    assert cfg.training.lr == 3e-4
    assert cfg.compile.enable is True and cfg.parallel.reshard_after_forward is False
    assert cfg.parallel.dp_shard == -1 and cfg.parallel.dp_mode == "hybrid_shard"
    assert cfg.compile.memory_limit_gb == 12.0
    assert cfg.model.model_args().dim == 64 and cfg.model.model_args().ffn_dim_multiplier == 1.5
    assert cfg.job.name == "x"


def test_cli_overrides_file(tmp_path: Path):
    path = _toml(tmp_path, "[training]\nsteps = 3\nlr = 1\n")
    cfg = parse_args(["--config", path, "--training.steps", "4"])
    assert cfg.training.steps == 4 and cfg.training.lr == 1.0  # TOML int accepted as float


# "command-line override(s) => text the error must contain"
@pytest.mark.parametrize("case", [
    "--training.stepz 3 => training.stepz",
    "--trainin.steps 3 => [trainin]",
    "--training.steps three => training.steps",
    "--training.steps 1.5 => training.steps",
    "--compile.enable yes => compile.enable",
    "--parallel.dp_mode zero3 => parallel.dp_mode",
    "--compile.backend eager => compile.backend",
    "--training.mixed_precision_param fp16 => training.mixed_precision_param",
    "--training.lr 0 => training.lr",
    "--parallel.dp_shard 0 => parallel.dp_shard",
    "--model.name gpt2 => model.name",
    "--training.seq_len 4096 => training.seq_len",
    "--data.dataset /no/such/file.txt => data.dataset",
    "--training.steps => training.steps",
    "steps 3 => steps",
    "--checkpoint.resume true => checkpoint.enable",
    "--parallel.tp 3 => parallel.tp = 3 does not divide model.n_heads",
    "--parallel.tp 4 => parallel.tp = 4 does not divide model.n_kv_heads",
    "--parallel.pp 8 => model.n_layers = 4",
    "--parallel.pp 2 --model.tie_embeddings true => model.tie_embeddings",
])
def test_bad_cli_input_names_the_key(case: str):
    flags, named = case.split(" => ")
    overrides = flags.split()
    with pytest.raises(ConfigError) as info:
        load_config(None, overrides)
    assert named in str(info.value)


def test_bad_enum_lists_allowed_values():
    with pytest.raises(ConfigError) as info:
        load_config(None, ["--activation_checkpoint.mode", "some"])
    for allowed in ("'none'", "'selective'", "'full'"):
        assert allowed in str(info.value)


@pytest.mark.parametrize("text,named", [
    ("[nope]\nx = 1\n", "[nope]"),
    ("[training]\nstep = 1\n", "training.step"),
    ("[training]\nsteps = \"10\"\n", "training.steps"),
    ("[training]\nsteps = true\n", "training.steps"),
    ("[compile]\nenable = 1\n", "compile.enable"),
    ("[parallel]\ndp_mode = \"ddp\"\n", "parallel.dp_mode"),
    ("training = 3\n", "training"),
    ("[training\n", "invalid TOML"),
])
def test_bad_file_input_names_the_key(tmp_path: Path, text: str, named: str):
    with pytest.raises(ConfigError) as info:
        load_config(_toml(tmp_path, text), [])
    assert named in str(info.value)


def test_world_size_product():
    par = load_config(None, ["--parallel.tp", "2", "--parallel.pp", "2"]).parallel
    resolved = par.resolve(8)
    assert (resolved.dp_shard, resolved.dims().dp) == (2, 2)
    with pytest.raises(ConfigError, match="not divisible"):
        par.resolve(6)
    fixed = load_config(None, ["--parallel.dp_shard", "3"]).parallel
    with pytest.raises(ConfigError, match="world size is 4.*dp_shard = -1"):
        fixed.resolve(4)
    replicate = load_config(None, ["--parallel.dp_mode", "replicate"]).parallel
    with pytest.raises(ConfigError, match="dp_replicate = 4"):
        replicate.resolve(4)
    assert load_config(None, ["--parallel.dp_mode", "replicate", "--parallel.dp_shard", "1",
                              "--parallel.dp_replicate", "4"]).parallel.resolve(4).dims().dp == 4
    with pytest.raises(ConfigError, match="hybrid_shard"):
        load_config(None, ["--parallel.dp_replicate", "2"])


def test_resume_flag_is_shorthand():
    assert parse_args([]).checkpoint.resume is False
    cfg = parse_args(["--checkpoint.enable", "true", "--resume", "--training.steps", "5"])
    assert cfg.checkpoint.resume is True and cfg.training.steps == 5
    assert cfg == parse_args(["--checkpoint.enable", "true", "--checkpoint.resume", "true",
                              "--training.steps", "5"])


def test_missing_config_file_is_a_config_error(tmp_path: Path):
    with pytest.raises(ConfigError, match="no such file"):
        parse_args(["--config", str(tmp_path / "nope.toml")])


def test_mesh_rules_have_one_owner():
    """``simplefsdp.mesh.ParallelDims`` owns the size and mode rules: the config's resolve
    gives the same sizes, and the same errors in the config's key names."""
    from simplefsdp.mesh import ParallelDims

    assert ParallelDims(pp=2, tp=2).resolve(8).sizes == {
        "pp": 2, "dp_replicate": 1, "dp_shard": 2, "cp_ring": 1, "cp_ulysses": 1, "tp": 2}
    for world, flags in [(8, ["--parallel.tp", "2"]), (12, ["--parallel.pp", "2"]),
                         (4, ["--parallel.dp_replicate", "2", "--parallel.dp_mode",
                              "hybrid_shard"])]:
        par = load_config(None, flags).parallel
        dims = ParallelDims(pp=par.pp, dp_replicate=par.dp_replicate, dp_shard=par.dp_shard,
                            tp=par.tp).resolve(world)
        assert par.resolve(world).dp_shard == dims.dp_shard
    with pytest.raises(ValueError, match=r"^world size 6 is not divisible by pp \* "):
        ParallelDims(pp=4).resolve(6)
    with pytest.raises(ConfigError, match=r"^world size 6 is not divisible by parallel.pp"):
        load_config(None, ["--parallel.pp", "4"]).parallel.resolve(6)
    with pytest.raises(ValueError, match=r"^tp = 0 is out of range"):
        ParallelDims(tp=0)
    with pytest.raises(ConfigError, match=r"^parallel.tp = 0 is out of range"):
        load_config(None, ["--parallel.tp", "0"])
    with pytest.raises(ValueError, match="use mode='hybrid_shard'"):
        ParallelDims(dp_replicate=2, dp_shard=2).check_mode("fully_shard")
    ParallelDims(dp_replicate=4).check_mode("replicate")  # dp_shard = -1: checked at resolve


@pytest.mark.parametrize("flag,value,message", [
    ("ep", "2", "parallel.ep = 2 needs a mixture-of-experts model, but model.family = "
                "'llama' (model.name = 'debug') has no routed experts; pick an MoE preset "
                "('debug_moe', 'qwen3_30b_a3b', 'deepseek_v3_16b') or set parallel.ep = 1"),
    ("ep", "0", "parallel.ep = 0 is out of range: it must be a positive integer"),
])
def test_cp_and_ep_are_refused_at_load(flag, value, message):
    """ep > 1 on a dense model is refused when the config is read (before any process
    starts), naming the key and the fix; out-of-range sizes likewise (context
    parallelism's own refusals: tests/test_context_parallel.py)."""
    with pytest.raises(ConfigError) as info:
        load_config(None, [f"--parallel.{flag}", value])
    assert str(info.value) == message


def test_parallel_dims_arithmetic():
    """Degrees, strides and coordinates, against a mesh laid out by hand: 16 ranks as
    (pp 2, dp_replicate 2, dp_shard 2, tp 2), row-major (torch's init_device_mesh order:
    ``arange(16).view(2, 2, 2, 2)``)."""
    from simplefsdp.mesh import ParallelDims

    dims = ParallelDims(pp=2, dp_replicate=2, tp=2).resolve(16)
    assert (dims.dp_shard, dims.dp, dims.dp_shard_cp, dims.world_size) == (2, 4, 2, 16)
    assert {d: dims.stride(d) for d in ("tp", "dp_shard", "dp_replicate", "pp")} == {
        "tp": 1, "dp_shard": 2, "dp_replicate": 4, "pp": 8}
    # rank 13 = 1*8 + 1*4 + 0*2 + 1: stage 1, replica 1, shard 0, tp 1
    at = dims.coords(13)
    assert (at.pp, at.dp_replicate, at.dp_shard, at.tp) == (1, 1, 0, 1)
    assert (at.dp, at.dp_size, at.first, at.last) == (2, 4, False, True)
    assert not at.counts_loss and dims.coords(12).counts_loss  # tp 0 of the last stage
    assert dims.coords(2).counts_tokens and not dims.coords(1).counts_tokens  # stage 0, tp 1
    # every data-parallel index once per (pp, tp) pair: the loader's slices cover the batch
    assert sorted(dims.coords(r).dp for r in range(16)) == sorted(list(range(4)) * 4)
    # ep divides dp_shard * cp (checked before the not-implemented refusal)
    with pytest.raises(ValueError, match=r"^ep = 3 must divide dp_shard = 4 "):
        ParallelDims(dp_shard=4, ep=3)
    with pytest.raises(ValueError, match=r"^ep = 4 must divide dp_shard \* cp_ulysses = 6 "):
        ParallelDims(dp_shard=3, cp_ulysses=2, ep=4)  # the CP degree named as its config key


def test_parallel_dims_layouts():
    """The layouts of 12 ranks (the planner's candidates before its filters), against a
    count by hand: 12 = 2^2 * 3 over 4 degrees is C(5, 3) * C(4, 3) = 10 * 4 = 40 ordered
    factorizations, visited by tp, then pp, then dp_replicate."""
    from simplefsdp.mesh import ParallelDims

    got = [(d.tp, d.pp, d.dp_replicate, d.dp_shard) for d in ParallelDims.layouts(12)]
    assert len(got) == len(set(got)) == 40 and got == sorted(got)
    assert all(tp * pp * rep * shard == 12 for tp, pp, rep, shard in got)
    assert got[:4] == [(1, 1, 1, 12), (1, 1, 2, 6), (1, 1, 3, 4), (1, 1, 4, 3)]
    assert got[-1] == (12, 1, 1, 1)
    assert [(d.tp, d.pp, d.dp_replicate, d.dp_shard) for d in ParallelDims.layouts(1)] == [
        (1, 1, 1, 1)]


def test_pipeline_rules_have_one_owner():
    """``split_stage`` refuses what the config refuses, with the same message."""
    from simplefsdp.models.llama import Transformer
    from simplefsdp.parallel.pipeline import split_stage, stage_layers

    for pp, model_flags in ((8, []), (2, ["--model.tie_embeddings"])):
        with pytest.raises(ConfigError) as at_load:
            load_config(None, ["--parallel.pp", str(pp), *model_flags])
        args = load_config(None, model_flags).model.model_args()
        with pytest.raises(ConfigError) as at_split:
            split_stage(Transformer(args), pp, 0)
        assert str(at_split.value) == str(at_load.value)
    assert [stage_layers(5, 2, s) for s in (0, 1)] == [[0, 1, 2], [3, 4]]


@pytest.mark.parametrize("given,read", [
    ("reshard_after_forward = \"auto\"\n", "auto"),
    ("reshard_after_forward = true\n", True),
    ("reshard_after_forward = false\n", False),
])
def test_reshard_after_forward_reads_auto_or_bool(tmp_path: Path, given: str, read):
    path = _toml(tmp_path, "[parallel]\n" + given)
    assert load_config(path, []).parallel.reshard_after_forward == read
    assert JobConfig().parallel.reshard_after_forward == "auto"  # the default
    flag = "auto" if read == "auto" else str(read).lower()
    assert load_config(None, ["--parallel.reshard_after_forward", flag]) \
        .parallel.reshard_after_forward == read


@pytest.mark.parametrize("text,flag,expected", [
    ("reshard_after_forward = \"yes\"\n", "maybe",
     "a boolean (true/false) or an integer or one of 'auto'"),
    # an int is a group to reshard to (reshard_group.py): 1 divides nothing usefully
    ("reshard_after_forward = 1\n", "1", "lie strictly between 1 and 2"),
])
def test_reshard_after_forward_rejects_other_values(tmp_path: Path, text: str, flag: str,
                                                     expected: str):
    for load in (lambda: load_config(_toml(tmp_path, "[parallel]\n" + text), []),
                 lambda: load_config(None, ["--parallel.reshard_after_forward", flag])):
        with pytest.raises(ConfigError) as info:  # an int's divisors: once the size is known
            load().validate(world_size=2)
        message = str(info.value)
        assert "parallel.reshard_after_forward" in message
        assert expected in message, message


def _reshard_by_config(rank: int, world: int, cases: list[list[str]]) -> list[set[bool]]:
    """For each override list, the reshard_after_forward of every gathered parameter of
    a model the trainer's apply_dp builds (the config's pp is only read, never built)."""
    import simplefsdp as sf
    from simplefsdp.models.llama import ModelArgs, Transformer
    from simplefsdp.models.parallelize import apply_dp

    mesh = sf.make_mesh(dp_shard=world)
    found = []
    for overrides in cases:
        cfg = load_config(None, overrides)
        model = apply_dp(Transformer(ModelArgs(dim=16, n_layers=1, n_heads=2, vocab_size=32)),
                         mesh, cfg)
        found.append({g.reshard_after_forward for m in model.modules()
                      for g in getattr(m, "_sf_compute", {}).values()})
    return found


def test_trainer_reshards_after_forward_by_the_guides_rule():
    """auto: on without PP, off with PP (the DP-modes guide); explicit values honoured,
    with PP too. Expected values written by hand from that rule."""
    from rank_runner import run_ranks

    pp2 = ["--parallel.pp", "2"]
    cases = {(): True, tuple(pp2): False,
             ("--parallel.reshard_after_forward", "true", *pp2): True,
             ("--parallel.reshard_after_forward", "false"): False,
             ("--parallel.reshard_after_forward", "auto", *pp2): False}
    got = run_ranks(_reshard_by_config, 2, [list(c) for c in cases])[0]
    assert got == [{want} for want in cases.values()]


def test_help_prints_each_fields_meaning(capsys):
    """``--help`` of train, bench and plan prints the comment next to each field (a few
    fields checked by their text), and every field of both schemas has one."""
    from dataclasses import fields

    from simplefsdp.bench.__main__ import main as bench_main
    from simplefsdp.bench.config import BenchConfig
    from simplefsdp.config.reader import field_docs
    from simplefsdp.plan.__main__ import main as plan_main
    from simplefsdp.train.__main__ import main as train_main

    for schema in (JobConfig(), BenchConfig()):
        for section in fields(schema):
            cls = type(getattr(schema, section.name))
            docs = field_docs(cls)
            assert [f.name for f in fields(cls) if not docs.get(f.name)] == [], cls
    train_main(["--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "--parallel.dp_shard" in text and \
        "ranks each parameter is sharded over; -1: the rest of the world" in text
    assert "Continue from the newest complete checkpoint in ``folder`` (``--resume``)" in text
    bench_main(["--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "False: Inductor/AOT caches off, so compile time is cold" in text
    with pytest.raises(SystemExit):
        plan_main(["--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "--training.grad_accum_steps" in text and \
        "micro-steps (forward + backward) per optimizer step" in text
