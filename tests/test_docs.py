"""The documentation stays true: what README.md, docs/ and the configs' comments tell a
user to run is run here, as far as it can be without training.

* Every ``python -m simplefsdp.train`` / ``torchrun ... -m simplefsdp.train`` command (and
  ``bash scripts/train.sh ...``, whose arguments go to the trainer) is run with
  ``--check --world-size N``, N = its ``--nproc-per-node`` x ``--nnodes`` (1 without
  torchrun): keys, values, the parallel sizes against N, data and model paths. A
  documented configuration error (a ``$ command`` line followed by its output) must
  print exactly the documented lines instead.
* Every ``simplefsdp.plan`` / ``simplefsdp.bench`` (and its tools') command: each flag
  is one its ``--help`` lists; the planner's trainer keys pass ``--check`` at ``--gpus``
  processes, the benchmark's whole command line its own config reader.
* Every repository path the docs name exists (files, folders, ``tests/x.py::test_y``
  functions, modules named relative to ``simplefsdp/``, links and their anchors).
* docs/config_reference.md is what ``scripts/config_reference.py`` writes now.

All commands are checked in ONE subprocess (``_DRIVER``), through the modules' command
lines (``runpy``), in a scratch folder holding the files the examples name (a corpus, a
tokenizer, a Hugging Face model folder), so nothing the checks write lands in the repo.
docs/measurements/ is a dated record of past runs: only its links are checked.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = sorted([ROOT / "README.md", *(ROOT / "docs").rglob("*.md")])
HISTORY = ROOT / "docs" / "measurements"
GENERATED = ROOT / "docs" / "config_reference.md"
CONFIG_COMMENTS = sorted((ROOT / "configs").glob("*.toml"))
SHELL_BLOCK = re.compile(r"^```(bash|sh|shell|console|)\n(.*?)^```", re.S | re.M)
REPO_PATH = re.compile(r"(?<![\w/.-])((?:simplefsdp|configs|scripts|tests|docs|\.ci)/"
                       r"[\w.*/-]*[\w*/])(::\w+)?")
PACKAGE_PATH = re.compile(r"(?<![\w/.-])((?:compiler|models|plan|hf|parallel|train|corpus|"
                          r"bench|config)/[\w/]+\.py)\b")
LINK = re.compile(r"\]\(([^)\s]+)\)")
COMMAND_WORDS = ("python ", "torchrun ", "bash ")


@dataclass
class Command:
    where: str          # file:line, for the failure message
    words: list[str]    # the command, shell-split
    output: list[str]   # documented output lines that follow a `$ command` line


def _commands_in_text(text: str, where: str) -> list[Command]:
    """Shell commands of the fenced blocks and the inline code spans of ``text``."""
    found = []
    for block in SHELL_BLOCK.finditer(text):
        first = text[:block.start(2)].count("\n") + 1
        lines = block.group(2).replace("\\\n", " \\\n").split("\n")
        joined: list[tuple[int, str]] = []  # (line number, line), continuations joined
        for i, line in enumerate(lines):
            if joined and joined[-1][1].rstrip().endswith("\\"):
                joined[-1] = (joined[-1][0], joined[-1][1].rstrip()[:-1] + " " + line.strip())
            else:
                joined.append((first + i, line))
        for k, (line_no, line) in enumerate(joined):
            prompt = line.startswith("$ ")
            if not (prompt or line.startswith(COMMAND_WORDS)):
                continue  # output, Python, TOML: not a command
            output = []
            if prompt:
                for _, after in joined[k + 1:]:
                    if after.startswith("$ ") or not after.strip():
                        break
                    output.append(after)
            found.append(Command(f"{where}:{line_no}",
                                 shlex.split(line[2:] if prompt else line, comments=True),
                                 output))
    for span in re.finditer(r"`((?:python -m simplefsdp|torchrun )[^`]*)`", text):
        line_no = text[:span.start()].count("\n") + 1
        found.append(Command(f"{where}:{line_no}", shlex.split(span.group(1)), []))
    return [c for c in found if c.words]


def _config_comment_commands(path: Path) -> list[Command]:
    """The commands a config's comment shows (``#   torchrun ...`` lines)."""
    lines = [line[1:].strip() for line in path.read_text().splitlines() if line.startswith("#")]
    text = "```bash\n" + "\n".join(lines) + "\n```\n"
    return [c for c in _commands_in_text(text, path.name)
            if c.words[0] in ("torchrun", "python")]


def all_commands() -> list[Command]:
    found = []
    for doc in DOCS:
        if HISTORY in doc.parents or doc == GENERATED:
            continue
        found += _commands_in_text(doc.read_text(), str(doc.relative_to(ROOT)))
    for config in CONFIG_COMMENTS:
        found += _config_comment_commands(config)
    return found


def _value(words: list[str], *names: str) -> str | None:
    for i, word in enumerate(words):
        name, eq, value = word.partition("=")
        if name in names:
            return value if eq else words[i + 1]
    return None


def _module_and_args(words: list[str]) -> tuple[str, list[str], int] | None:
    """(module, its arguments, the processes it runs on) of a python/torchrun command,
    None for other commands (pip, git, sbatch, ...)."""
    if words[:2] == ["bash", "scripts/train.sh"]:  # the trainer on 2 processes
        return "simplefsdp.train", ["--config", "configs/debug.toml", *words[2:]], 2
    if words[0] == "torchrun" and "-m" in words:
        launch, at = words[1:words.index("-m")], words.index("-m")
        nproc = _value(launch, "--nproc-per-node", "--nproc_per_node") or "1"
        nnodes = (_value(launch, "--nnodes") or "1").split(":")[-1]
        return words[at + 1], words[at + 2:], int(nproc) * int(nnodes)
    if words[:2] == ["python", "-m"]:
        return words[2], words[3:], 1
    return None


def _jobs(commands: list[Command]) -> tuple[list[dict], list[str]]:
    """What the driver runs for each command, and the help texts it needs."""
    jobs, helps = [], set()
    for command in commands:
        try:
            found = _command_jobs(command, helps)
        except (ValueError, TypeError, IndexError) as e:  # "--world-size N", a lone flag
            found = [{"where": command.where, "module": " ".join(command.words[:3]),
                      "args": command.words[3:], "output": [], "kind": "bad",
                      "reason": f"not a runnable command ({e})"}]
        jobs += found
    return jobs, sorted(helps)


def _command_jobs(command: Command, helps: set[str]) -> list[dict]:
    """The driver's jobs for one command (none for commands of other programs)."""
    jobs: list[dict] = []
    parsed = _module_and_args(command.words)
    if parsed is None or not parsed[0].startswith("simplefsdp"):
        return jobs
    module, args, world = parsed
    job = {"where": command.where, "module": module, "args": args,
           "output": command.output}
    if module == "simplefsdp.train":
        if "--help" in args:
            return jobs
        if "--check" in args:  # its own world size
            world = int(_value(args, "--world-size") or 1)
            args = [a for i, a in enumerate(args) if a != "--check" and not (
                a.startswith("--world-size") or (i and args[i - 1] == "--world-size"))]
        jobs.append({**job, "kind": "train", "args": args, "world": world})
    elif module == "simplefsdp.plan" and "--gpus" in args:
        helps.add(module)
        gpus = int(_value(args, "--gpus"))
        plan_flags = [a for a in args if a.startswith("--") and "." not in a]
        trainer = []
        skip_value = {"--gpus", "--gpu", "--json", "--png", "--top", "--keep", "--workers",
                      "--gpus-per-node", "--free"}
        i = 0
        while i < len(args):
            if args[i] in skip_value:
                i += 2
            elif args[i] in ("--search", "--auto"):
                i += 1
            else:
                trainer.append(args[i])
                i += 1
        jobs.append({**job, "kind": "flags", "flags": plan_flags,
                     "gpu": _value(args, "--gpu")})
        jobs.append({**job, "kind": "train", "args": trainer, "world": gpus})
    else:  # the benchmark and the tools: flags its --help lists
        helps.add(module)
        flags = [a.partition("=")[0] for a in args if a.startswith("--") and a != "--help"]
        jobs.append({**job, "kind": "flags", "flags": flags})
        if module == "simplefsdp.bench" and not {"--help", "--list"} & set(args):
            jobs.append({**job, "kind": "bench", "world": world if world > 1 else 2})
    return jobs


# Runs in one fresh interpreter: every module through its command line (runpy), its exit
# status and output captured; the benchmark's arguments through its config reader (running
# its command line would benchmark).
_DRIVER = r"""
import contextlib, io, json, os, runpy, sys
jobs, helps = json.load(sys.stdin)

def run_module(module, argv, env=None):
    out = io.StringIO()
    saved_argv, saved_env = sys.argv, dict(os.environ)
    sys.argv = [module, *argv]
    os.environ.update(env or {})
    status = 0
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
            runpy.run_module(module, run_name="__main__", alter_sys=False)
    except SystemExit as e:
        status = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    except Exception as e:
        status, _ = 1, out.write(f"{type(e).__name__}: {e}")
    finally:
        sys.argv = saved_argv
        os.environ.clear()
        os.environ.update(saved_env)
    return status, out.getvalue()

results = {"help": {m: run_module(m, ["--help"])[1] for m in helps}, "jobs": []}
for job in jobs:
    if job["kind"] == "train":
        got = run_module("simplefsdp.train",
                         ["--check", "--world-size", str(job["world"]), *job["args"]])
    elif job["kind"] == "bench":
        from simplefsdp.bench.config import parse_args
        try:
            parse_args(job["args"], job["world"])
            got = (0, "")
        except Exception as e:
            got = (1, f"{type(e).__name__}: {e}")
    else:
        got = (0, "")
    results["jobs"].append(got)
print(json.dumps(results))
"""


def _scratch_files(folder: Path) -> None:
    """The files the docs' examples name, in the folder the checks run in."""
    (folder / "configs").symlink_to(ROOT / "configs")
    corpus = folder / "my_corpus"
    corpus.mkdir()
    docs = [{"text": f"document {i}: the quick brown fox jumps over the lazy dog"}
            for i in range(64)]
    (corpus / "part-0.jsonl").write_text("".join(json.dumps(d) + "\n" for d in docs))
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE(unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel()
    tokenizer.train_from_iterator([d["text"] for d in docs], trainers.BpeTrainer(
        vocab_size=300, special_tokens=["<unk>", "<|endoftext|>"]))
    (folder / "my_tokenizer").mkdir()
    tokenizer.save(str(folder / "my_tokenizer" / "tokenizer.json"))
    from transformers import LlamaConfig, LlamaForCausalLM

    model = LlamaForCausalLM(LlamaConfig(
        vocab_size=512, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024))
    model.save_pretrained(folder / "my_model")
    tokenizer.save(str(folder / "my_model" / "tokenizer.json"))


def check_commands(commands: list[Command], scratch: Path) -> list[str]:
    """Every problem found with ``commands`` (empty: all good)."""
    jobs, helps = _jobs(commands)
    env = dict(os.environ, OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(var, None)
    done = subprocess.run([sys.executable, "-c", _DRIVER], input=json.dumps([jobs, helps]),
                          cwd=scratch, env=env, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    results = json.loads(done.stdout.strip().splitlines()[-1])
    problems = []
    for job, (status, said) in zip(jobs, results["jobs"], strict=True):
        shown = f"{job['where']}: {job['module']} {' '.join(job['args'])}"
        if job["kind"] == "bad":
            problems.append(f"{shown}\n  {job['reason']}")
        elif job["kind"] == "flags":
            listed = results["help"][job["module"]]
            unknown = [f for f in job["flags"] if not re.search(
                rf"(?<![\w.-]){re.escape(f)}(?![\w-])", listed)]
            if unknown:
                problems.append(f"{shown}\n  flags its --help does not list: {unknown}")
            if job.get("gpu") and job["gpu"] not in listed:
                problems.append(f"{shown}\n  --gpu {job['gpu']} is not a known profile")
        elif job["output"]:  # a documented failure: exactly these lines
            missing = [line for line in job["output"] if line not in said.splitlines()]
            if status == 0 or missing:
                problems.append(f"{shown}\n  documented {job['output']}, got (exit "
                                f"{status}): {said.strip()}")
        elif status != 0:
            problems.append(f"{shown}\n  exit {status}: {said.strip()[-800:]}")
    return problems


def _anchors(doc: Path) -> set[str]:
    """GitHub's anchors of a markdown file's headings."""
    heads = re.findall(r"^#+ (.+)$", doc.read_text(), re.M)
    return {re.sub(r"[^\w\- ]", "", h.strip().lower()).replace(" ", "-") for h in heads}


def missing_paths(doc: Path, text: str) -> list[str]:
    """Repository paths, package modules and links in ``text`` that do not exist."""
    problems = []
    history = HISTORY in doc.parents
    names = [] if history else [(m.group(1), m.group(2)) for m in REPO_PATH.finditer(text)]
    names += [] if history else [(f"simplefsdp/{m.group(1)}", None)
                                 for m in PACKAGE_PATH.finditer(text)]
    for name, test in names:
        name = name.rstrip(".")
        hits = sorted(ROOT.glob(name)) if "*" in name else [ROOT / name]
        if not hits or not hits[0].exists():
            problems.append(f"{doc.name}: {name} does not exist")
        elif test and not re.search(rf"def {test[2:]}\b", hits[0].read_text()):
            problems.append(f"{doc.name}: {name} has no {test[2:]}")
    for target in LINK.findall(text):
        if re.match(r"[a-z]+:", target):  # https:, mailto:
            continue
        path, _, anchor = target.partition("#")
        linked = (doc.parent / path).resolve() if path else doc
        if not linked.exists():
            problems.append(f"{doc.name}: link {target} leads nowhere")
        elif anchor and linked.suffix == ".md" and anchor not in _anchors(linked):
            problems.append(f"{doc.name}: link {target}: no such heading")
    return problems


# ------------------------------------------------------------------------------ tests
@pytest.fixture(scope="module")
def scratch(tmp_path_factory):
    folder = tmp_path_factory.mktemp("docs_commands")
    _scratch_files(folder)
    return folder


def test_every_documented_command_passes_its_check(scratch):
    commands = all_commands()
    jobs, _ = _jobs(commands)
    # the docs do show commands of every kind (an extraction that found none would pass)
    kinds = {(j["module"], j["kind"]) for j in jobs}
    for expected in [("simplefsdp.train", "train"), ("simplefsdp.plan", "flags"),
                     ("simplefsdp.bench", "bench"), ("simplefsdp.calibrate", "flags")]:
        assert expected in kinds, (expected, kinds)
    assert sum(1 for j in jobs if j["kind"] == "train") >= 30, len(jobs)
    assert any(j["output"] for j in jobs)  # the README's documented configuration error
    assert any(j["world"] == 16 for j in jobs if j["kind"] == "train")  # 2 nodes x 8
    problems = check_commands(commands, scratch)
    assert not problems, "\n".join(problems)


@pytest.mark.quick
def test_every_path_the_docs_name_exists():
    problems = []
    for doc in [*DOCS, ROOT / "CONTRIBUTING.md", ROOT / "CHANGELOG.md",
                ROOT / "scripts" / "README.md"]:
        problems += missing_paths(doc, doc.read_text())
    for config in CONFIG_COMMENTS:
        problems += missing_paths(config, config.read_text())
    assert not problems, "\n".join(problems)


def test_config_reference_is_current(monkeypatch):
    """docs/config_reference.md is what ``scripts/config_reference.py`` writes now: its
    ``render`` run in this process, each help text taken from its command's ``main`` (what
    ``python -m <module> --help`` prints) instead of the script's fresh interpreter per
    command (three torch imports for two help texts)."""
    import contextlib
    import importlib.util
    import io

    from simplefsdp.bench.__main__ import main as bench_main
    from simplefsdp.train.__main__ import main as train_main

    spec = importlib.util.spec_from_file_location("config_reference",
                                                  ROOT / "scripts" / "config_reference.py")
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    mains = {"simplefsdp.train": train_main, "simplefsdp.bench": bench_main}

    def help_text(module: str) -> str:
        printed = io.StringIO()
        with contextlib.redirect_stdout(printed):
            mains[module](["--help"])
        return printed.getvalue()

    monkeypatch.setattr(script, "help_text", help_text)
    assert script.render() == GENERATED.read_text(), \
        "docs/config_reference.md is out of date: run python scripts/config_reference.py"


@pytest.mark.quick
def test_readme_is_short_and_undated():
    lines = (ROOT / "README.md").read_text().splitlines()
    assert len(lines) <= 200, len(lines)
    dated = [line for line in lines if re.search(r"\b20\d\d-\d\d-\d\d\b", line)]
    assert not dated, dated


# --------------------------------------------- the checks above catch a broken doc
def test_a_wrong_key_a_missing_file_and_a_bad_flag_are_caught(scratch):
    text = """```bash
torchrun --standalone --nproc-per-node 4 -m simplefsdp.train --config configs/debug.toml \\
    --parallel.tp 2 --trainig.steps 5
python -m simplefsdp.train --config configs/nothere.toml
python -m simplefsdp.plan --config configs/llama3_8b.toml --gpus 8 --gpu h100-96gb --fast
python -m simplefsdp.bench --bench.stepz 3
```
"""
    problems = check_commands(_commands_in_text(text, "doc.md"), scratch)
    by_line: dict[str, str] = {}
    for problem in problems:  # a line may fail more than one check (flags and values)
        where = problem.split(": ", 1)[0]
        by_line[where] = by_line.get(where, "") + problem
    assert sorted(by_line) == ["doc.md:2", "doc.md:4", "doc.md:5", "doc.md:6"], problems
    for where, word in [("doc.md:2", "trainig"), ("doc.md:4", "nothere.toml"),
                        ("doc.md:5", "--fast"), ("doc.md:6", "stepz")]:
        assert word in by_line[where], (where, by_line[where])
    bad_paths = missing_paths(ROOT / "docs" / "x.md", "see `scripts/nothere.sh`, "
                              "`tests/test_docs.py::test_nothing` and [here](nowhere.md)")
    assert len(bad_paths) == 3, bad_paths
