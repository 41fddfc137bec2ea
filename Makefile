# Every target installs what it needs first, so each works on a fresh machine.
PYTHON ?= python3
TORCH_CPU_VERSION ?= 2.13.0
# One megatron-core for CPU and GPU. 0.17-0.19.2 ship only a cp312 wheel (Requires-Python >= 3.12,
# no sdist) while its sources run on 3.11, so on Python 3.11 the pure-Python wheel is placed into
# site-packages as pip would for 3.12 (--python-version 3.12 --target); README "Tensor parallelism".
MEGATRON_CORE_VERSION ?= 0.19.2
SITE_PACKAGES = $(shell $(PYTHON) -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
# The trainers harts.integrations plugs into, at the versions its tests hold it to. --no-deps: what
# they need beyond these is installed by .[dev] already (pandas via ortools, fsspec/jinja2 via torch).
FRAMEWORK_PACKAGES ?= trl==1.16.0 accelerate==1.16.0 datasets==5.2.0 dill==0.4.1 multiprocess==0.70.19 xxhash==4.1.0 psutil==7.2.2

.PHONY: setup demo test bench-cpu

setup:
	@$(PYTHON) -c "import torch" 2>/dev/null || $(PYTHON) -m pip install -q "torch==$(TORCH_CPU_VERSION)"
	@$(PYTHON) -m pip install -q -e ".[dev]"
	@$(PYTHON) -c "import importlib.metadata as m, sys; sys.exit(m.version('megatron-core') != '$(MEGATRON_CORE_VERSION)')" 2>/dev/null || \
		$(PYTHON) -m pip install -q --no-deps --only-binary=:all: --python-version 3.12 --ignore-requires-python \
			--upgrade --target "$(SITE_PACKAGES)" "megatron-core==$(MEGATRON_CORE_VERSION)"
	@$(PYTHON) -m pip install -q --no-deps $(FRAMEWORK_PACKAGES)

demo: setup
	$(PYTHON) -m harts run

test: setup
	$(PYTHON) -m pytest -q

bench-cpu: setup
	$(PYTHON) benchmarks/bench_planner.py --scale 0.25 --steps 3
