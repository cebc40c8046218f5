PYTHON ?= python3
PIP := $(PYTHON) -m pip
# A torch that is importable and >= 2.5 is kept as it is; otherwise the pinned CPU build is installed.
TORCH_PIN ?= torch==2.13.0
# The torch range the package claims, verified by `make test-matrix`: the floor (the last patch
# of the oldest release claimed), one release in between and the newest release.
TORCH_FLOOR ?= 2.5.1
TORCH_MIDDLE ?= 2.10.0
TORCH_NEWEST ?= 2.15.0
# Each capability's exactness tests on the torch of its floor (docs/torch-versions.md): CI runs
# them (make test-floors). The core and its refusals on the package's floor; checkpoint_steps
# from 2.8; the sharded runtime from 2.11.
FLOOR_TESTS_2.5.1 := tests/core/test_capabilities.py tests/core/test_torch_version.py \
	tests/checkpoint/test_engine.py tests/inner/test_adapt.py tests/inner/test_tasks.py
FLOOR_TESTS_2.8.0 := tests/core/test_capabilities.py tests/checkpoint/test_engine.py \
	tests/checkpoint/test_redone_step_losses.py
FLOOR_TESTS_2.11.0 := tests/core/test_capabilities.py tests/distributed/test_on_shards.py \
	tests/distributed/test_linear_cross_entropy.py \
	"tests/distributed/test_sharded.py::test_sharded_meta_gradients_equal_the_unsharded_run"

# pytest-xdist workers for the suite (one per core; each computes on one thread, tests/conftest.py)
TEST_WORKERS ?= auto

.PHONY: setup setup-dev demo test test-slow test-matrix test-floors lint docs bench omniglot gpu-check clean

setup:
	@$(PYTHON) scripts/has_torch.py || $(PIP) install "$(TORCH_PIN)"
	$(PIP) install -q -e ".[examples]"

setup-dev:
	@$(PYTHON) scripts/has_torch.py || $(PIP) install "$(TORCH_PIN)"
	$(PIP) install -q -e ".[dev]"

demo: setup
	$(PYTHON) examples/sinusoid.py --iterations 4000 --plot examples/out/sinusoid_demo.png

# The suite without the tests marked slow (long end-to-end runs, soak and peer-failure tests,
# real compiles); `make test-slow` runs those. CI runs both.
test: setup-dev
	$(PYTHON) -m pytest -q -n $(TEST_WORKERS) --dist loadgroup -m "not slow"

test-slow: setup-dev
	$(PYTHON) -m pytest -q -n $(TEST_WORKERS) --dist loadgroup -m slow --durations=8

# The suite on the oldest torch we claim, one in between and the newest release, each in its
# own environment under .matrix/ (about 6 GB each: PyPI's torch wheels carry CUDA libraries),
# then docs/torch-versions.md from every run there (scripts/torch_matrix.py).
test-matrix:
	bash scripts/test_matrix.sh $(TORCH_FLOOR) $(TORCH_MIDDLE) $(TORCH_NEWEST)
	$(PYTHON) scripts/torch_matrix.py

# Each capability's exactness tests at its floor, each torch in its .matrix/ environment; every
# floor runs, and the target fails if any of them failed.
test-floors:
	@status=0; \
	MATRIX_PYTEST='$(FLOOR_TESTS_2.5.1)' MATRIX_JUNIT=floors.xml bash scripts/test_matrix.sh 2.5.1 || status=1; \
	MATRIX_PYTEST='$(FLOOR_TESTS_2.8.0)' MATRIX_JUNIT=floors.xml bash scripts/test_matrix.sh 2.8.0 || status=1; \
	MATRIX_PYTEST='$(FLOOR_TESTS_2.11.0)' MATRIX_JUNIT=floors.xml bash scripts/test_matrix.sh 2.11.0 || status=1; \
	exit $$status

# The documentation with the API reference generated from the docstrings; warnings are errors.
docs: setup-dev
	$(PYTHON) -m sphinx -W --keep-going -b html -q docs docs/_build/html
	@echo "docs/_build/html/index.html"

# Lint includes the docs: every cross-reference resolves (nitpicky), warnings are errors.
lint: setup-dev
	$(PYTHON) -m ruff check funcmeta tests examples benchmarks scripts docs/conf.py
	$(PYTHON) scripts/check_layers.py
	$(PYTHON) -m mypy
	$(PYTHON) scripts/check_type_errors.py
	$(PYTHON) -m ruff format --check funcmeta tests examples benchmarks scripts docs/conf.py
	$(PYTHON) -m sphinx -n -W --keep-going -b dummy -q -d docs/_build/doctrees docs docs/_build/lint

bench: setup-dev
	$(PIP) install -q -e ".[dev,bench]"
	PYTHON=$(PYTHON) bash benchmarks/peers/build_learn2learn.sh || echo "learn2learn not built: peers/peers.py runs without it"
	$(PYTHON) benchmarks/speed/overhead.py
	$(PYTHON) benchmarks/memory/memory.py --repeats 2 --plot docs/img/memory_cpu.png
	$(PYTHON) benchmarks/peers/checkpoint_jax.py
	$(PYTHON) benchmarks/memory/bert_meta.py
	$(PYTHON) benchmarks/memory/decoder_meta.py
	$(PYTHON) benchmarks/speed/tasks.py --repeats 5
	$(PYTHON) benchmarks/speed/sequence_tasks.py --repeats 3
	$(PYTHON) benchmarks/speed/recurrent_evaluation.py
	$(PYTHON) benchmarks/checks/vmap_grad_pitfall.py
	$(PYTHON) benchmarks/checks/ddp_check.py
	$(PYTHON) benchmarks/peers/peers.py
	$(PYTHON) benchmarks/checks/learned_optimizer.py
	$(PYTHON) benchmarks/speed/snapshot.py
	$(PYTHON) benchmarks/speed/compiled.py
	$(PYTHON) benchmarks/speed/compiled_overhead.py

# Every CUDA test and the CUDA benchmarks on one GPU, and the tables for benchmarks/RESULTS.md
# (benchmarks/out/gpu_check.md); installs nothing from the network. Without a GPU it says so.
gpu-check:
	PYTHON=$(PYTHON) bash scripts/gpu_check.sh

# Every recipe on Omniglot's official one-shot benchmark (about 72 minutes on 2 CPU cores); the
# official files are downloaded into data/omniglot and verified, or read there if present.
omniglot: setup
	$(PYTHON) examples/omniglot.py --data data/omniglot --download --budget 240 --plot docs/img/omniglot_budget.png

clean:
	rm -rf build *.egg-info .pytest_cache .ruff_cache docs/_build
