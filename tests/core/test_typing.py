"""mypy (strict, configured in pyproject.toml) runs clean on the package."""
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_mypy_clean() -> None:
    r = subprocess.run([sys.executable, "-m", "mypy", "--config-file",
                        os.path.join(ROOT, "pyproject.toml")],
                       cwd=ROOT, capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr
