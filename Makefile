# Every target installs what it needs first, so each works on a fresh machine.
PYTHON ?= python3
TORCH_CPU_VERSION ?= 2.13.0
# The trainers harts.integrations plugs into, at the versions its tests hold it to. --no-deps: what
# they need beyond these is installed by .[dev] already (pandas via ortools, fsspec/jinja2 via torch).
FRAMEWORK_PACKAGES ?= trl==1.16.0 accelerate==1.16.0 datasets==5.2.0 dill==0.4.1 multiprocess==0.70.19 xxhash==4.1.0 psutil==7.2.2

.PHONY: setup demo test bench-cpu

setup:
	@$(PYTHON) -c "import torch" 2>/dev/null || $(PYTHON) -m pip install -q "torch==$(TORCH_CPU_VERSION)"
	@$(PYTHON) -m pip install -q -e ".[dev]"
	@$(PYTHON) -m pip install -q --no-deps $(FRAMEWORK_PACKAGES)

demo: setup
	$(PYTHON) -m harts run

test: setup
	$(PYTHON) -m pytest -q

bench-cpu: setup
	$(PYTHON) benchmarks/bench_planner.py --scale 0.25 --steps 3
