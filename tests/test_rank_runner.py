"""The rank runner itself: ranks are forked from a preloaded server, yet each sees the
caller's environment and folder and writes to the caller's stdout and stderr, as a
spawned rank would."""

import datetime
import os

import pytest
from rank_runner import run_ranks


def _report(rank: int, world: int, speak: bool) -> tuple[str | None, int, str]:
    import torch.distributed as dist

    if speak:
        print(f"stdout of rank {rank}", flush=True)
        os.write(2, f"stderr of rank {rank}\n".encode())
    return os.environ.get("RANK_RUNNER_PROBE"), dist.get_world_size(), os.getcwd()


@pytest.mark.quick
def test_ranks_see_the_callers_environment_folder_and_output(monkeypatch, capfd, tmp_path):
    # the server starts (if no test started it) outside this test's capture, and with
    # the probe set: neither may leak into the ranks below
    monkeypatch.setenv("RANK_RUNNER_PROBE", "at start")
    started_in = os.getcwd()
    with capfd.disabled():
        assert run_ranks(_report, 1, False) == [("at start", 1, started_in)]
    monkeypatch.setenv("RANK_RUNNER_PROBE", "changed")
    monkeypatch.chdir(tmp_path)
    assert run_ranks(_report, 2, True) == [("changed", 2, str(tmp_path))] * 2
    monkeypatch.delenv("RANK_RUNNER_PROBE")
    assert run_ranks(_report, 1, False) == [(None, 1, str(tmp_path))]
    out, err = capfd.readouterr()
    for rank in (0, 1):
        assert f"stdout of rank {rank}" in out and f"stderr of rank {rank}" in err


def _tensor(rank: int, world: int):
    import torch

    return {"x": torch.arange(1000.0) + rank}


@pytest.mark.quick
def test_a_returned_tensor_outlives_its_rank():
    # The rank has exited before its result is read: the tensor's data must travel in the
    # message, not as shared memory served by the rank process.
    import pickle

    import rank_runner
    import torch

    ctx = rank_runner._context()
    queue = ctx.Queue()
    store = rank_runner.host_store(1, datetime.timedelta(seconds=60))
    proc = ctx.Process(target=rank_runner._worker,
                       args=(_tensor, 0, 1, store.port, dict(os.environ),
                             (), (), queue))
    proc.start()
    proc.join(timeout=300)
    assert proc.exitcode == 0
    rank, status, payload = queue.get(timeout=60)
    assert (rank, status) == (0, "ok"), payload
    assert torch.equal(pickle.loads(payload)["x"], torch.arange(1000.0))


def _sees_a_gpu(rank: int, world: int) -> tuple[str | None, bool]:
    import torch

    return os.environ.get("CUDA_VISIBLE_DEVICES"), torch.cuda.is_available()


@pytest.mark.quick
def test_ranks_and_their_server_never_see_a_gpu(monkeypatch):
    # set for the caller (as on a GPU host): the ranks and the server hide it all the same
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0")
    assert run_ranks(_sees_a_gpu, 2) == [("", False)] * 2
    assert os.environ["CUDA_VISIBLE_DEVICES"] == "0"  # the caller's own is left as it was
    import multiprocessing.forkserver as forkserver

    pid = forkserver._forkserver._forkserver_pid
    with open(f"/proc/{pid}/environ", "rb") as f:
        server_env = f.read().split(b"\0")
    assert b"CUDA_VISIBLE_DEVICES=" in server_env, "the server started with a GPU visible"


@pytest.mark.quick
def test_a_test_not_marked_many_ranks_starts_at_most_two(request):
    """The suite's two workers (conftest.py): this test's file is its group, and more than
    2 ranks from it fail before any rank starts, naming the test and the fix."""
    assert request.node.get_closest_marker("xdist_group").args == ("test_rank_runner",)
    assert run_ranks(_report, 2, False)[0][1] == 2
    with pytest.raises(RuntimeError, match=r"test_a_test_not_marked_many_ranks_starts_at_most_"
                       r"two\S* starts 3 ranks, more than 2: mark it many_ranks"):
        run_ranks(_report, 3, False)


@pytest.mark.quick
@pytest.mark.many_ranks
def test_a_many_ranks_test_starts_more(request):
    assert request.node.get_closest_marker("xdist_group").args == ("many_ranks",)
    assert run_ranks(_report, 3, False)[0][1] == 3
