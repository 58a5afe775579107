"""A pytest plugin for runs that may be killed: each failing test's report goes to the file
``$PYTEST_FAILURES_LOG`` as it arrives. Under pytest-xdist the tracebacks otherwise wait for
the closing summary, which a run cut by its timeout never prints (``device_suite.sh``).

    PYTEST_FAILURES_LOG=failures.log python -m pytest -p scripts.pytest_failures_log ...
"""
import os


def pytest_runtest_logreport(report):
    path = os.environ.get("PYTEST_FAILURES_LOG")
    if os.environ.get("PYTEST_XDIST_WORKER"):  # the controller writes what workers report
        return
    if path and report.failed:
        with open(path, "a") as f:
            f.write(f"==== {report.nodeid} ({report.when})\n{report.longreprtext}\n\n")
