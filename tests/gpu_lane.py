"""pytest plugin of the GPU test lane (``scripts/run_gpu_tests.sh`` loads it with ``-p gpu_lane``).

In this lane a missing prerequisite is a failure, not a skip: the session stops at the start (exit 1, one line)
when no CUDA device is visible or ``triton`` / ``fla`` (FLA's KDA ops) does not import, and a test marked ``gpu``
that skips anyway (an ``importorskip``, a ``skipif``) is reported as failed with the skip's reason. ``xfail`` marks
keep their meaning."""

from __future__ import annotations

import pytest

PREREQUISITES = (("triton", "triton"), ("fla.ops.kda", "flash-linear-attention / fla-core"))


def missing_prerequisites() -> list:
    """One phrase per prerequisite of the GPU lane that this process lacks (empty: all there)."""
    import importlib

    import torch

    missing = []
    if not torch.cuda.is_available():
        missing.append("no CUDA device visible to torch")
    for module, package in PREREQUISITES:
        try:
            importlib.import_module(module)
        except Exception as e:  # noqa: BLE001 - any import failure counts as missing
            missing.append(f"'import {module}' failed ({type(e).__name__}: {str(e).splitlines()[0][:120]}); "
                           f"install {package}")
    return missing


def pytest_sessionstart(session):
    missing = missing_prerequisites()
    if missing:
        pytest.exit("GPU test lane: " + "; ".join(missing), returncode=1)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    if report.skipped and item.get_closest_marker("gpu") is not None and not hasattr(report, "wasxfail"):
        reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
        report.outcome = "failed"
        report.longrepr = f"skipped in the GPU lane, which counts that as a failure: {reason}"
