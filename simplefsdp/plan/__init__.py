"""The planner: predict per-GPU memory and speed of a training config on N GPUs from
one CPU process (``python -m simplefsdp.plan``; see ``predict`` and ``search``)."""

from __future__ import annotations

import multiprocessing

from .predict import Prediction, predict

__all__ = ["Prediction", "predict", "predict_isolated"]


def predict_isolated(cfg, gpus: int, gpu: str = "h100-sxm",
                     gpus_per_node: int = 8) -> Prediction:
    """``predict`` in a fresh process: the planner's fake process group must not meet
    the caller's (a benchmark or a test that has its own, or will create one)."""
    with multiprocessing.get_context("spawn").Pool(1) as pool:
        prediction = pool.apply(predict, (cfg, gpus, gpu, gpus_per_node))
        pool.close()  # the worker exits on its own, so its semaphores are released
        pool.join()   # (terminate() would kill it first; see plan/bench.py)
    return prediction
