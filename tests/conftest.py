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
from real_outputs import RealOutputs  # noqa: E402

if os.environ.get("PYTEST_XDIST_WORKER"):
    torch.set_num_threads(1)


@pytest.fixture(scope="session")
def real_outputs(tmp_path_factory):
    """What the project's own commands write (reports, a checkpoint, an export, a doctor report), for the
    tests of their readers: each made on first use, once per pytest process (tests/real_outputs.py)."""
    return RealOutputs(tmp_path_factory.mktemp("real_outputs"))


# make test's workers take whole files in collection order: the longest files first (measured under
# xdist), so that no worker is left running a long file alone at the end. Only an order: a file not
# listed runs after these, in pytest's order.
LONGEST_FIRST = ["test_export.py", "test_distributed_lifecycle.py", "test_world_size.py", "test_artifact_security.py",
                 "test_classification.py", "test_detection_train.py", "test_detection_models.py", "test_engine.py",
                 "test_budget.py", "test_panoptic_train.py", "test_new_family.py", "test_distributed.py"]


def pytest_collection_modifyitems(config, items):
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(os.path.basename(str(item.fspath)), len(rank)))  # stable: order kept within
