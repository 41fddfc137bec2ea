# Every target installs what it needs first, so each works on a fresh machine.
PYTHON ?= python3
TORCH_CPU_VERSION ?= 2.13.0

.PHONY: setup demo test bench-cpu

setup:
	@$(PYTHON) -c "import torch" 2>/dev/null || $(PYTHON) -m pip install -q "torch==$(TORCH_CPU_VERSION)"
	@$(PYTHON) -m pip install -q -e ".[dev]"

demo: setup
	$(PYTHON) -m harts run

test: setup
	$(PYTHON) -m pytest -q

bench-cpu: setup
	$(PYTHON) benchmarks/bench_planner.py --scale 0.25 --steps 3
