# The two commands a newcomer runs: `make demo` and `make test`.
# Two tested JAX releases, one environment each: the newest (JAX 0.12 on Python 3.12),
# which every target below uses, and the oldest pyproject.toml allows (JAX 0.10.2 on
# Python 3.11), which `make test-oldest-jax` runs the whole suite on.
PYTHON ?= $(shell tools/find-python 3.12)
OLDEST_PYTHON ?= $(shell tools/find-python 3.11)
VENV := .venv
BIN := $(VENV)/bin
# `make demo` installs what the demo needs (the package, flax and optax); `make test` adds
# the dev extras (torch, Keras, libtpu, Ray: several GB) to the same environment.
DEMO_STAMP := $(VENV)/.demo-stamp
STAMP := $(VENV)/.installed-stamp
OLDEST_VENV := .venv-oldest-jax
OLDEST_STAMP := $(OLDEST_VENV)/.installed-stamp
CORPUS_VENV := .venv-corpus
CORPUS_STAMP := $(CORPUS_VENV)/.installed-stamp
CORPUS_MODELS := gemma3-1b keras-hub-gpt2-medium keras-hub-llama3.2-1b
MAXTEXT_VENV := .venv-maxtext
MAXTEXT_STAMP := $(MAXTEXT_VENV)/.installed-stamp
# The suite in parts: `make test` runs most of it on two test workers; `make test-slow`
# the long end-to-end cases (tests/conftest.py lists them), then the parameter-server
# tests by themselves (Ray's task processes start 5x slower beside a busy test worker).
RUN_ALONE := tests/test_parameter_server.py
PARALLEL = $(1) -m pytest -q -n 2 --dist loadfile -m "$(2)" --ignore=$(RUN_ALONE)
ALONE = $(1) -m pytest -q $(RUN_ALONE)

.PHONY: demo test test-slow test-oldest-jax fuzz bench bench-corpus lint clean

$(STAMP): pyproject.toml tools/make-venv
	tools/make-venv $(VENV) "$(PYTHON)"
	touch $(DEMO_STAMP)

$(DEMO_STAMP): pyproject.toml tools/make-venv
	EXTRAS=examples STAMP_FILE=.demo-stamp tools/make-venv $(VENV) "$(PYTHON)"

# Models others wrote (keras-hub, DeepMind's gemma), for `make bench-corpus` only.
$(CORPUS_STAMP): pyproject.toml constraints/corpus.txt tools/make-corpus-venv tools/make-venv
	tools/make-corpus-venv $(CORPUS_VENV) "$(PYTHON)"

# MaxText 0.2.5 and its pinned dependencies, for `make bench-corpus` only.
$(MAXTEXT_STAMP): pyproject.toml tools/make-maxtext-venv
	tools/make-maxtext-venv $(MAXTEXT_VENV) "$(PYTHON)"

$(OLDEST_STAMP): pyproject.toml tools/make-venv constraints/oldest-jax.txt
	tools/make-venv $(OLDEST_VENV) "$(OLDEST_PYTHON)" -c constraints/oldest-jax.txt

demo: $(DEMO_STAMP)
	$(BIN)/xla-strategies demo

test: $(STAMP)
	$(call PARALLEL,$(BIN)/python,not slow)

# What `make test` leaves out; CI runs it after `make test`.
test-slow: $(STAMP)
	$(call PARALLEL,$(BIN)/python,slow) && $(call ALONE,$(BIN)/python)

# The whole suite again on the oldest supported JAX, slow cases included; CI runs it last.
test-oldest-jax: $(OLDEST_STAMP)
	$(call PARALLEL,$(OLDEST_VENV)/bin/python,slow or not slow) && $(call ALONE,$(OLDEST_VENV)/bin/python)

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
	JAX_PLATFORMS=cpu $(BIN)/python -m benchmarks.tpu_ablation
	JAX_PLATFORMS=cpu $(BIN)/python -m benchmarks.tpu_options --model llama2-7b --topology v5e-256 --variant d --sets none cf-all-reduce
	JAX_PLATFORMS=cpu $(BIN)/python -m benchmarks.tpu_collective_spellings --topology v5e-256 --options none async-permute
	JAX_PLATFORMS=cpu $(BIN)/python -m benchmarks.tpu_collective_spellings --collective all-gather --topology v5e-256
	JAX_PLATFORMS=cpu $(BIN)/python -m benchmarks.tpu_collective_spellings --collective all-gather --topology v5p-512
	JAX_PLATFORMS=cpu $(BIN)/python -m benchmarks.tpu_collective_spellings --collective all-gather --topology v6e-256
	JAX_PLATFORMS=cpu $(BIN)/python -m benchmarks.gpu_aot
	$(BIN)/python -m benchmarks.multi_worker
	$(BIN)/python -m benchmarks.checkpoint
	$(BIN)/python -m benchmarks.preemption
	$(BIN)/python -m benchmarks.parameter_server
	$(BIN)/python -m benchmarks.keras_fit
	$(BIN)/python -m benchmarks.torch_step
	$(BIN)/python -m benchmarks.torch_lr_schedule

# The TPU table's rows of models others wrote: plain JAX and Hugging Face's PyTorch models
# (here), keras-hub and gemma (their own environment), ours beside plain jax.jit on
# v5e-256, some on v5p-512 and a DGX H100 node (hours on two cores); MaxText's model under
# our strategy beside MaxText's trainer.
bench-corpus: $(STAMP) $(CORPUS_STAMP) $(MAXTEXT_STAMP)
	JAX_PLATFORMS=cpu $(BIN)/python -m benchmarks.tpu_aot --models gpt2-medium-plain \
		gpt2-medium-plain-cast hf-gpt2-medium hf-llama3.2-1b --topologies v5e-256 --variants a c
	JAX_PLATFORMS=cpu $(BIN)/python -m benchmarks.tpu_aot --models llama2-7b-plain \
		--topologies v5e-256 --variants c d
	JAX_PLATFORMS=cpu KERAS_BACKEND=jax $(CORPUS_VENV)/bin/python -m benchmarks.tpu_aot \
		--models $(CORPUS_MODELS) --topologies v5e-256 v5p-512 --variants a c
	JAX_PLATFORMS=cpu $(BIN)/python -m benchmarks.tpu_aot --models gpt2-medium-plain \
		hf-gpt2-medium hf-llama3.2-1b --topologies v5p-512 --variants a c
	$(BIN)/python -m benchmarks.gpu_aot --models gpt2-medium-plain hf-gpt2-medium
	JAX_PLATFORMS=cpu $(MAXTEXT_VENV)/bin/python -m benchmarks.tpu_aot \
		--models maxtext-llama2-7b --topologies v5e-256 v5p-512 --variants a d
	JAX_PLATFORMS=cpu $(MAXTEXT_VENV)/bin/python -m benchmarks.maxtext_stages
	mkdir -p benchmarks/results/hlo && for t in v5e-256 v5p-512; do JAX_PLATFORMS=cpu \
		$(MAXTEXT_VENV)/bin/python benchmarks/maxtext_aot.py \
		benchmarks/results/hlo/maxtext-llama2-7b-$$t.hlo.txt --topology $$t; done

lint: $(STAMP)
	$(BIN)/ruff check .

clean:
	rm -rf $(VENV) $(OLDEST_VENV) $(CORPUS_VENV) $(MAXTEXT_VENV) *.egg-info
