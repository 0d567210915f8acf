# Two commands do everything on a fresh machine with Python >= 3.10:
#   make train   creates .venv, installs the project, trains with $(CONFIG) and tests the run's last checkpoint
#   make test    creates .venv, installs the project with its dev extras, runs the whole suite
#   make test-fast   the inner loop: the suite without the tests marked slow (multi-process or multi-epoch runs)
PYTHON ?= python3
VENV ?= .venv
CONFIG ?= configs/quickstart.yaml
ARGS ?=
TEST_WORKERS ?= 2
BIN := $(VENV)/bin

.PHONY: train test test-fast lint format clean

$(BIN)/python:
	$(PYTHON) -c 'import sys; sys.exit("Python >= 3.10 is required, found " + sys.version.split()[0]) if sys.version_info < (3, 10) else None'
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip

$(VENV)/.installed: $(BIN)/python setup.cfg pyproject.toml
	$(BIN)/python -m pip install --quiet -e ".[tensorboard,plot]"  # what the README's next steps use: TensorBoard, cli.py plot
	touch $@

$(VENV)/.installed-dev: $(BIN)/python setup.cfg pyproject.toml
	$(BIN)/python -m pip install --quiet -e ".[dev]"
	touch $@ $(VENV)/.installed

# fit, then the test set on the run's last checkpoint (the figure the README quotes); TEST=0 leaves the test out
TEST ?= 1
train: $(VENV)/.installed
	$(BIN)/python cli.py fit --config $(CONFIG) $(ARGS)
ifneq ($(TEST),0)
	$(BIN)/python cli.py test --config $(CONFIG) $(ARGS) --ckpt_path last
endif

# Independent tests run side by side in $(TEST_WORKERS) pytest-xdist workers; tests that share cached training
# runs stay on one worker (tests/conftest.py). TEST_WORKERS=0 runs everything in one process.
test: $(VENV)/.installed-dev
	$(BIN)/python -m pytest -n $(TEST_WORKERS) --dist loadgroup $(ARGS)

test-fast: $(VENV)/.installed-dev
	$(BIN)/python -m pytest -n $(TEST_WORKERS) --dist loadgroup -m "not slow" $(ARGS)

lint: $(VENV)/.installed-dev
	$(BIN)/ruff check app examples tests bench cli.py
	$(BIN)/ruff format --check app examples tests bench cli.py

format: $(VENV)/.installed-dev
	$(BIN)/ruff check --fix app examples tests bench cli.py
	$(BIN)/ruff format app examples tests bench cli.py

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache *.egg-info
