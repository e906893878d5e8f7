# The two commands a newcomer runs: `make demo` and `make test`.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed-stamp

.PHONY: demo test fuzz bench lint clean

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q -e '.[dev]'
	touch $(STAMP)

demo: $(STAMP)
	$(BIN)/xla-strategies demo

test: $(STAMP)
	$(BIN)/python -m pytest -q -n 2 --dist loadfile

# Differential fuzzing, long profile: 500 random programs per pipeline.
fuzz: $(STAMP)
	XLA_STRATEGIES_FUZZ=long $(BIN)/python -m pytest -q -n 2 tests/fuzz

bench: $(STAMP)
	$(BIN)/python -m benchmarks.compile_overhead
	$(BIN)/python -m benchmarks.train_step --thresholds 262144 4194304 33554432
	$(BIN)/python -m benchmarks.gradient_sync --sweep
	$(BIN)/python -m benchmarks.input_pipeline
	$(BIN)/python -m benchmarks.pod_collectives
	JAX_PLATFORMS=cpu $(BIN)/python -m benchmarks.tpu_aot
	$(BIN)/python -m benchmarks.multi_worker
	$(BIN)/python -m benchmarks.checkpoint
	$(BIN)/python -m benchmarks.preemption
	$(BIN)/python -m benchmarks.parameter_server
	$(BIN)/python -m benchmarks.keras_fit
	$(BIN)/python -m benchmarks.torch_step

lint: $(STAMP)
	$(BIN)/ruff check .

clean:
	rm -rf $(VENV) *.egg-info
