import os
import tempfile

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # on sys.path: pytest.ini's pythonpath
SHARED_DATA = os.path.join(ROOT, "..", "shared", "data")
# pytest-xdist workers (pytest.ini: one per core) run one compute thread each, and so do the processes
# they start: two workers of two OpenMP threads each on two cores spin against each other
if os.environ.get("PYTEST_XDIST_WORKER"):
    os.environ["OMP_NUM_THREADS"] = "1"
# measurement caches (the amp recipe's dtype: auto) start empty and stay out of the user's home
os.environ.setdefault("ZOO_CACHE_DIR", tempfile.mkdtemp(prefix="zoo-cache-"))


def shared_data(name):
    """Path of a real data set in ../shared/data, or skip the test with the reason."""
    path = os.path.normpath(os.path.join(SHARED_DATA, name))
    if not os.path.isdir(path):
        pytest.skip(f"real test data not found at {path} (a fresh clone has no ../shared; see README)")
    return path

import datasets, models, recipes  # noqa: E401,E402,F401  (their modules register builders)
import torch  # noqa: E402

if os.environ.get("PYTEST_XDIST_WORKER"):
    torch.set_num_threads(1)
