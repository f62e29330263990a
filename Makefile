# The two commands of the README:
#   make demo   install ringcore in .venv and run a real allreduce across 4 local processes
#   make test   install the test dependencies in .venv and run the whole suite
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
NP     ?= 4

.PHONY: demo test lint bench clean

demo: $(VENV)/.installed
	$(BIN)/ringcore-run -np $(NP) $(BIN)/python examples/allreduce_demo.py

test: $(VENV)/.installed-test
	$(BIN)/python -m pytest $(PYTEST_ARGS)

lint: $(VENV)/.installed-test
	$(BIN)/ruff check ringcore bench bindings tests examples
	$(BIN)/ruff format --check ringcore bench bindings tests examples

bench: $(VENV)/.installed-test
	$(BIN)/ringcore-bench --np $(NP) -b 4K -e 256M -f 4 -c 1

$(VENV)/.installed: pyproject.toml setup.py
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -e .
	touch $@

# torch (CPU) adds the torch-tensor, ringcore.torch and torchrun tests; without it they skip.
$(VENV)/.installed-test: $(VENV)/.installed
	$(BIN)/pip install -q -e '.[test,ray]'
	$(BIN)/pip install -q torch==2.13.0 || echo "torch==2.13.0 not installed: torch tests will be skipped"
	$(BIN)/pip install -q mpi4py || echo "mpi4py not installed: the Open MPI bench test will be skipped"
	touch $@

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache
