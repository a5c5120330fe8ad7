"""The benchmark analysers' tests run them as `python3 -m pvsched_bench
COMMAND`, the way pvsched-bench and the docs do: with the repository's
python/ directory on PYTHONPATH."""

import os
from pathlib import Path

import pytest

PYTHON = Path(__file__).resolve().parents[2] / "python"


@pytest.fixture(autouse=True)
def pythonpath(monkeypatch):
    path = os.environ.get("PYTHONPATH")
    monkeypatch.setenv("PYTHONPATH", f"{PYTHON}{os.pathsep}{path}" if path else str(PYTHON))
