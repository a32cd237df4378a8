# The commands of the README:
#   make demo   set up, then run the main job end to end on the embedded MLflow store
#   make test   set up, then run the whole test suite (CI runs this)
#   make test-fast  the quick loop: the suite without the slow and integration tests
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.gradian-installed
DEMO_DIR ?= .demo

.PHONY: setup test test-fast demo clean

$(STAMP): pyproject.toml constraints/constraints.txt constraints/torch-cpu.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	# CPU torch first: a bare torch requirement could otherwise pull a multi-GB CUDA build.
	$(PY) -m pip install --quiet -r constraints/torch-cpu.txt
	$(PY) -m pip install --quiet -c constraints/constraints.txt -e '.[dev,cluster]'
	@if $(PY) -m pip show torchvision >/dev/null 2>&1; then \
		echo "torchvision got installed; it breaks transformers beside the CPU torch" >&2; exit 1; fi
	# Headless Chromium for the report's browser test (Debian package; best effort off Debian).
	@command -v chromium >/dev/null 2>&1 || { command -v apt-get >/dev/null 2>&1 && [ "$$(id -u)" = 0 ] && \
		(apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null) \
		|| echo "chromium not installed: the report's browser test will be skipped"; }
	touch $(STAMP)

setup: $(STAMP)

test: setup
	$(PY) -m pytest -q

test-fast: setup
	$(PY) -m pytest -q -m "not slow and not integration"

demo: setup
	GRADIAN_DEMO_DIR=$(DEMO_DIR) bash scripts/demo.sh

clean:
	rm -rf $(VENV) $(DEMO_DIR) .pytest_cache
