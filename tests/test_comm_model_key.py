"""``compile.comm_model``: what auto bucketing plans with when it is not calibrated here.

"fabric" plans on the fabric table's figures and a file pins a calibration's; neither
times a collective, so neither writes a calibration to the cache. Checked on 2 gloo
ranks through the trainer (the key's only way in), against the figures each source
must give; bad values fail at config time, naming the key.
"""

from __future__ import annotations

import json

import pytest
from rank_runner import run_ranks

from simplefsdp.compiler.cost.comm import CommModel, default_comm_model
from simplefsdp.config import ConfigError, load_config
from simplefsdp.models.parallelize import pinned_comm_model

TINY = ["--model.n_layers", "2", "--training.steps", "1", "--training.batch_size", "2",
        "--training.seq_len", "32", "--compile.enable", "true", "--compile.backend",
        "aot_eager", "--compile.bucketing", "auto", "--metrics.log_every", "1"]
# A pinned calibration no machine would measure: a collective costs 50 ms whatever its
# size, so the file's figures (not the fabric table's) must reach the reports.
PINNED = CommModel(all_gather=(0.05, 0.0), reduce_scatter=(0.05, 0.0),
                   all_reduce=(0.1, 0.0), hidden_fraction=0.0, world_size=2,
                   source="calibrated")


def _write(path, payload) -> str:
    path.write_text(json.dumps(payload))
    return str(path)


def _plans_with(rank: int, world: int, cache: str, pinned: str, out: str) -> dict:
    import os

    import torch._dynamo

    from simplefsdp.train.__main__ import main
    from simplefsdp.train.console import CompileReports

    os.environ["SIMPLEFSDP_CACHE_DIR"] = cache
    found = {}
    for source in ("fabric", pinned):
        torch._dynamo.reset()
        with CompileReports() as reports:
            losses = main([*TINY, "--compile.comm_model", source,
                           "--metrics.output_dir", f"{out}/{len(found)}"]).losses
        found[source] = {"losses": losses,
                         "models": [r.comm_model for r in reports.reports],
                         "exposed": [r.estimated_exposed_s for r in reports.reports]}
    return found


def test_fabric_and_a_pinned_file_plan_without_calibrating(tmp_path):
    cache = tmp_path / "cache"
    cache.mkdir()
    # a cache file as get_comm_model writes one ("key", "model", ...): the format the
    # key documents
    pinned = _write(tmp_path / "pinned.json", {"key": {"world_size": 2},
                                               "model": PINNED.to_dict()})
    ranks = run_ranks(_plans_with, 2, str(cache), pinned, str(tmp_path / "out"))
    assert ranks[0] == ranks[1], "the ranks planned with different figures"
    fabric, filed = ranks[0]["fabric"], ranks[0][pinned]
    expected = default_comm_model(2).to_dict()
    assert fabric["models"] and all(m == expected for m in fabric["models"])
    want = PINNED.to_dict() | {"source": f"file:{pinned}"}
    assert filed["models"] and all(m == want for m in filed["models"])
    # 50 ms per collective, nothing hidden: the estimate is the file's, not the table's
    assert min(filed["exposed"]) >= 0.05 > max(fabric["exposed"])
    # only bucket boundaries differ between the two plans: the same arithmetic
    assert filed["losses"] == fabric["losses"]
    assert not list(cache.glob("comm_model_*.json")), "a collective was calibrated"


@pytest.mark.quick
def test_bad_values_name_the_key(tmp_path):
    missing = str(tmp_path / "nope.json")
    for value, says in ((missing, "No such file"),
                        (_write(tmp_path / "text.json", "x"), "holds no comm model"),
                        (_write(tmp_path / "half.json", {"model": {"all_gather": [0, 0]}}),
                         "holds no comm model")):
        with pytest.raises(ConfigError, match="compile.comm_model") as e:
            load_config(None, ["--compile.comm_model", value])
        assert says in str(e.value)
    (tmp_path / "broken.json").write_text("{")
    with pytest.raises(ConfigError, match="is not JSON"):
        load_config(None, ["--compile.comm_model", str(tmp_path / "broken.json")])
    # a file calibrated on 2 ranks, used by a 1-process job: refused when the backend
    # meets its world, with the way out
    pinned = _write(tmp_path / "two.json", PINNED.to_dict())
    assert load_config(None, ["--compile.comm_model", pinned]).compile.comm_model == pinned
    with pytest.raises(ConfigError, match="calibrated on 2 ranks, this job runs 1"):
        pinned_comm_model(pinned)
