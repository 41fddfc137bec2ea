# Every target installs what it needs first, so each works on a fresh machine.
PYTHON ?= python3
TORCH_CPU_VERSION ?= 2.13.0
# One megatron-core for CPU and GPU. 0.17-0.19.2 ship only a cp312 wheel (Requires-Python >= 3.12,
# no sdist) while its sources run on 3.11, so on Python 3.11 the pure-Python wheel is placed into
# site-packages as pip would for 3.12 (--python-version 3.12 --target); README "Tensor parallelism".
MEGATRON_CORE_VERSION ?= 0.19.2
SITE_PACKAGES = $(shell $(PYTHON) -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
# The trainers harts.integrations plugs into, at the versions its tests hold it to, installed --no-deps:
# their own requirements pin torch / transformers ranges HARTS does not use (verl 0.9.1 wants torch < 2.11),
# so only the modules their trainers, engines, losses and data classes import come along (pandas via
# ortools, fsspec/jinja2 via torch are in .[dev] already).
TRL_PACKAGES = trl==1.16.0 accelerate==1.16.0 datasets==5.2.0 dill==0.4.1 multiprocess==0.70.19 xxhash==4.1.0 psutil==7.2.2
VERL_PACKAGES = verl==0.9.1 tensordict==0.10.0 pyvers==0.2.3 ray==2.60.0 msgpack==1.2.4 codetiming==1.4.0 \
	omegaconf==2.4.0 antlr4-python3-runtime==4.13.2 peft==0.21.2
AREAL_PACKAGES = areal==1.0.4 hydra-core==1.4.0.dev1 aiohttp==3.14.5 multidict==7.2.1 yarl==1.25.1 propcache==0.5.4 \
	aiohappyeyeballs==2.7.1 aiosignal==1.4.0 frozenlist==1.8.0 httpx==0.28.1 colorlog==6.12.0 tenacity==9.2.1 \
	torchdata==0.11.0 lark==1.3.1 uvloop==0.23.0 numba==0.68.1 llvmlite==0.50.0 einops==0.8.2 aiofiles==25.1.0 \
	openai==3.51.0 jiter==0.19.0 swanlab==0.10.3 pyroaring==1.2.0 watchdog==7.1.0 pyecharts==2.1.0 simplejson==4.3.0 \
	prettytable==3.18.0 trackio==0.43.0 gradio-client==2.7.2 uvicorn==0.54.0 starlette==1.10.0 wandb==0.31.0 \
	platformdirs==4.14.5 opentelemetry-api==1.45.2 opentelemetry-sdk==1.45.2 tensorboardX==2.6.5 tabulate==0.10.0 \
	pybase64==1.5.1
FRAMEWORK_PACKAGES ?= $(TRL_PACKAGES) $(VERL_PACKAGES) $(AREAL_PACKAGES)
# What those modules import beyond .[dev] on a fresh machine (found in a clean venv), installed with their
# own dependencies: none of them pulls torch or transformers.
FRAMEWORK_IMPORTS ?= orjson==3.13.0 requests==2.34.2 jsonschema==4.26.0 cloudpickle==3.1.3 flask==3.1.3 sniffio==1.3.1 \
	pydantic-settings==2.16.3

.PHONY: setup demo test bench-cpu

setup:
	@$(PYTHON) -c "import torch" 2>/dev/null || $(PYTHON) -m pip install -q "torch==$(TORCH_CPU_VERSION)"
	@$(PYTHON) -m pip install -q -e ".[dev]"
	@$(PYTHON) -c "import importlib.metadata as m, sys; sys.exit(m.version('megatron-core') != '$(MEGATRON_CORE_VERSION)')" 2>/dev/null || \
		$(PYTHON) -m pip install -q --no-deps --only-binary=:all: --python-version 3.12 --ignore-requires-python \
			--upgrade --target "$(SITE_PACKAGES)" "megatron-core==$(MEGATRON_CORE_VERSION)"
	@$(PYTHON) -m pip install -q --no-deps $(FRAMEWORK_PACKAGES)
	@$(PYTHON) -m pip install -q $(FRAMEWORK_IMPORTS)

demo: setup
	$(PYTHON) -m harts run

test: setup
	$(PYTHON) -m pytest -q

bench-cpu: setup
	$(PYTHON) benchmarks/bench_planner.py --scale 0.25 --steps 3
