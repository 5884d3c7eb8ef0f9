import json
import os
import tempfile

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # on sys.path: pytest.ini's pythonpath
SHARED_DATA = os.path.join(ROOT, "..", "shared", "data")
# pytest-xdist workers (one more than the cores: pytest_xdist_auto_num_workers below) run one compute thread
# each, and so do the processes they start: two workers of two OpenMP threads each on two cores spin
# against each other
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


def pytest_xdist_auto_num_workers(config):
    """-n auto: one worker more than the cores. Many tests wait on processes they started (torchrun agents
    meeting, a rendezvous timing out, trials of a study) with a core idle: on 2 cores 3 workers ran the suite
    in 14.5 minutes and 1,642 CPU seconds, 2 workers in 17 (1,794), the same tests (--maxprocesses caps it)."""
    return len(os.sched_getaffinity(0)) + 1


@pytest.fixture(scope="session")
def real_outputs(tmp_path_factory):
    """What the project's own commands write (reports, a checkpoint, an export, a doctor report), for the
    tests of their readers: each made on first use, once per pytest process (tests/real_outputs.py)."""
    return RealOutputs(tmp_path_factory.mktemp("real_outputs"))


# make test's workers take whole files in collection order: the longest files first, so that no worker is
# left running a long file alone at the end. The seconds of each file (setup, call and teardown of its
# tests, summed) are measured: tests/durations.json, written by `make test-durations` (--write-durations).
# Only an order: a file not listed there runs after those listed, in pytest's order.
DURATIONS = os.path.join(ROOT, "tests", "durations.json")


def pytest_addoption(parser):
    parser.addoption("--write-durations", action="store_true",
                     help=f"write each test file's measured seconds to {os.path.relpath(DURATIONS, ROOT)} "
                          "(merged with the files not run)")


def read_durations():
    if not os.path.exists(DURATIONS):
        return {}
    with open(DURATIONS) as f:
        return json.load(f)


def pytest_collection_modifyitems(config, items):
    seconds = read_durations()
    items.sort(key=lambda item: -seconds.get(os.path.basename(str(item.fspath)), -1.0))  # stable: order kept within


class FileSeconds:
    """Sums the seconds of each test file's reports (on the xdist controller: the workers' reports)."""

    def __init__(self):
        self.seconds = {}

    def pytest_runtest_logreport(self, report):
        name = os.path.basename(report.nodeid.split("::")[0])
        self.seconds[name] = self.seconds.get(name, 0.0) + report.duration

    def pytest_sessionfinish(self, session):
        merged = {**read_durations(), **{k: round(v, 1) for k, v in self.seconds.items()}}
        with open(DURATIONS, "w") as f:
            json.dump(dict(sorted(merged.items())), f, indent=0)
            f.write("\n")


def pytest_configure(config):
    if config.getoption("--write-durations") and not os.environ.get("PYTEST_XDIST_WORKER"):
        config.pluginmanager.register(FileSeconds(), "file-seconds")
