"""``metrics.wandb = true``: an offline Weights & Biases run holds metrics.csv's rows.

The run (2 gloo ranks, FSDP, validation on so that the sparse val columns travel too)
logs offline (``WANDB_MODE=offline``, no network) into its output folder. The test
reads wandb's own record of the run, the ``run-<id>.wandb`` file, with a reader written
here (the file is a LevelDB-style log of wandb's protobuf ``Record`` messages), and
compares every logged history row with the row of ``metrics.csv`` at the same step:
the same keys and the same values, exactly (both are the float the trainer computed,
through text that round-trips a float64).
"""

from __future__ import annotations

import csv
import json
import os
import struct
import sys
from pathlib import Path

from rank_runner import run_ranks

ARGV = ["--model.dim", "32", "--model.n_layers", "2", "--model.n_heads", "4",
        "--model.n_kv_heads", "2", "--training.seq_len", "32", "--training.batch_size", "4",
        "--training.steps", "4", "--metrics.log_every", "2", "--metrics.wandb", "true",
        "--validation.enable", "true", "--validation.every", "3", "--validation.steps", "1",
        "--job.name", "tracked"]


def _train(rank: int, world: int, argv: list[str], hide_wandb: bool = False) -> str:
    from simplefsdp.errors import ConfigError
    from simplefsdp.train.__main__ import main

    os.environ.update(WANDB_MODE="offline", WANDB_SILENT="true")
    if hide_wandb:
        sys.modules["wandb"] = None  # import wandb raises ImportError
    try:
        main(argv)
    except ConfigError as e:
        return str(e)
    return "ran"


def wandb_records(path: Path):
    """The protobuf records of a ``.wandb`` file: a 7-byte header (``:W&B``, magic,
    version), then 32 KiB blocks of records (CRC32C, length, type: FULL 1, FIRST 2,
    MIDDLE 3, LAST 4) as LevelDB's log writes them; a block's tail under 7 bytes is
    padding."""
    from wandb.proto import wandb_internal_pb2

    data, block = path.read_bytes(), 32768
    assert data[:4] == b":W&B"
    pos, pending = 7, b""
    while pos + 7 <= len(data):
        if block - pos % block < 7:
            pos += block - pos % block
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        pending += data[pos + 7:pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):  # a whole record, or its last fragment
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            pending = b""
            yield record


def test_offline_history_equals_metrics_csv(tmp_path):
    out = tmp_path / "run"
    assert run_ranks(_train, 2, [*ARGV, "--metrics.output_dir", str(out)]) == ["ran"] * 2
    files = list(out.glob("wandb/offline-run-*/run-*.wandb"))
    assert len(files) == 1  # one run, from rank 0 only
    history, config = [], {}
    for record in wandb_records(files[0]):
        kind = record.WhichOneof("record_type")
        if kind == "history":
            row = {item.key or "/".join(item.nested_key): json.loads(item.value_json)
                   for item in record.history.item}
            history.append({k: v for k, v in row.items() if not k.startswith("_")}
                           | {"step": row["_step"]})
        elif kind == "run":
            config = {i.key: json.loads(i.value_json) for i in record.run.config.update}
            assert record.run.display_name == "tracked"
    rows = list(csv.DictReader(open(out / "metrics.csv")))
    expected = [{k: float(v) if k != "step" else int(v) for k, v in r.items() if v != ""}
                for r in rows]
    assert [r["step"] for r in expected] == [2, 3, 4]  # log_every 2, validation at 3
    assert "val_loss" in expected[1] and "val_loss" not in expected[0]
    assert history == expected
    assert config["training"]["steps"] == 4 and config["validation"]["every"] == 3
    assert config["metrics"]["wandb"] is True


def test_missing_wandb_is_refused_at_start(tmp_path):
    out = tmp_path / "run"
    error = run_ranks(_train, 1, [*ARGV, "--metrics.output_dir", str(out)], True)[0]
    assert "metrics.wandb = true (Weights & Biases) needs the package 'wandb'" in error
    assert "pip install wandb" in error
    assert not (out / "metrics.csv").exists()
