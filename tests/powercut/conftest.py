from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

from .harness import build_shim


@pytest.fixture(scope="session")
def shim() -> Path:
    """The power-cut shim, built with the machine's C compiler (CI installs one)."""
    if shutil.which("cc") is None and shutil.which("gcc") is None:
        if os.environ.get("CI"):
            pytest.fail("no C compiler: .ci/run installs gcc")
        pytest.skip("no C compiler (cc) to build the power-cut shim")
    return build_shim()
