"""`--dist loadgroup` (setup.cfg) sends the tests of one `xdist_group` to one worker, so that a merged step or a
shared bundle is built once per run: tests/conftest.py's hook gives each item its '@group' nodeid suffix, which
pytest-xdist 3.8's own hook no longer manages under pytest 9.2. Without it every group was split over both
workers and each built the group's step (twice the PoCL builds of the suite's merged steps)."""

from __future__ import annotations

import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

GROUPED = '''
import os
import pytest

@pytest.mark.xdist_group("shared")
@pytest.mark.parametrize("index", range(8))
def test_grouped(index):
    with open(os.path.join(os.environ["GROUP_LOG"], f"grouped{index}"), "w") as log:
        log.write(os.environ["PYTEST_XDIST_WORKER"])

@pytest.mark.parametrize("index", range(8))
def test_free(index):
    pass
'''


def test_a_groups_tests_run_on_one_worker(tmp_path) -> None:
    (tmp_path / "test_grouped.py").write_text(GROUPED)
    (tmp_path / "conftest.py").write_text("from tests.conftest import pytest_collection_modifyitems  # noqa: F401\n")
    log = tmp_path / "log"
    log.mkdir()
    env = {**os.environ, "PYTHONPATH": ROOT, "GROUP_LOG": str(log)}
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-n", "2", "--dist",
                           "loadgroup", str(tmp_path)], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    workers = {(log / f"grouped{i}").read_text() for i in range(8)}
    assert len(workers) == 1, workers
