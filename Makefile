# Two commands do everything on a fresh machine with Python 3.11:
#   make demo   create .venv, install the pinned requirements, train a detector on the built-in
#               shapes data (a real COCO data set written to data/shapes) and print its mAP report
#   make test   the whole test suite (same venv); make test-fast: the unit tests, under 2 minutes
PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.requirements-$(shell sha256sum requirements.txt | cut -c1-16)
DEMO_CONFIG ?= configs/shapes_demo.yaml
DEMO_DIR ?= runs/shapes_demo

.PHONY: demo test test-fast test-durations venv clean

venv: $(STAMP)

# Reinstalled only when requirements.txt changes: the stamp carries its hash (not its mtime, so a
# fresh clone reuses a cached venv).
$(STAMP):
	@command -v $(PYTHON) >/dev/null || { echo "error: $(PYTHON) not found (set PYTHON=...)"; exit 1; }
	rm -rf $(VENV)
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -r requirements.txt
	touch $@

demo: $(STAMP)
	$(PY) train.py --config $(DEMO_CONFIG) --output-dir $(DEMO_DIR)
	$(PY) evaluate.py --config $(DEMO_CONFIG) --checkpoint $(DEMO_DIR)/best.pt --report-dir $(DEMO_DIR)/report
	@echo "TensorBoard logs: $(DEMO_DIR)  (view with: $(VENV)/bin/tensorboard --logdir runs)"
	@echo "The evaluation report: $(DEMO_DIR)/report/report.html  (open it in a browser; docs/evaluation.md says what it shows)"

# pytest-xdist workers: one more than the cores (tests/conftest.py says why; at most 4), whole test files per
# worker (module fixtures built once)
PYTEST_ARGS ?= -n auto --maxprocesses 4 --dist loadfile

# the tests' tiers (pytest.ini's markers): make test runs them all and lists the 20 slowest; make test-fast
# leaves out those marked slow, distributed (torchrun), process (signals, kill -9) and browser
FAST_MARKERS ?= not slow and not distributed and not process and not browser

test: $(STAMP)
	$(PY) -m pytest $(PYTEST_ARGS) --durations=20

test-fast: $(STAMP)
	$(PY) -m pytest $(PYTEST_ARGS) -m "$(FAST_MARKERS)"

# the whole suite, writing each file's seconds to tests/durations.json (the order make test runs files in)
test-durations: $(STAMP)
	$(PY) -m pytest $(PYTEST_ARGS) --durations=20 --write-durations

clean:
	rm -rf runs
