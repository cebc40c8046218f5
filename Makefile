PYTHON ?= python3
PIP := $(PYTHON) -m pip
# A torch that is importable and >= 2.5 is kept as it is; otherwise the pinned CPU build is installed.
TORCH_PIN ?= torch==2.13.0

.PHONY: setup setup-dev demo test lint bench clean

setup:
	@$(PYTHON) scripts/has_torch.py || $(PIP) install "$(TORCH_PIN)"
	$(PIP) install -q -e ".[examples]"

setup-dev:
	@$(PYTHON) scripts/has_torch.py || $(PIP) install "$(TORCH_PIN)"
	$(PIP) install -q -e ".[dev]"

demo: setup
	$(PYTHON) examples/sinusoid.py --iterations 4000 --plot examples/out/sinusoid_demo.png

test: setup-dev
	$(PYTHON) -m pytest -q

lint: setup-dev
	$(PYTHON) -m ruff check funcmeta tests examples benchmarks scripts
	$(PYTHON) -m ruff format --check funcmeta tests examples benchmarks scripts

bench: setup-dev
	$(PIP) install -q -e ".[dev,bench]"
	$(PYTHON) benchmarks/overhead.py
	$(PYTHON) benchmarks/memory.py
	$(PYTHON) benchmarks/tasks.py
	$(PYTHON) benchmarks/vmap_grad_pitfall.py
	$(PYTHON) benchmarks/ddp_check.py
	$(PYTHON) benchmarks/peers.py

clean:
	rm -rf build *.egg-info .pytest_cache .ruff_cache
