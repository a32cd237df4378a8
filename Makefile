# The commands of the README:
#   make demo   set up, then run the main job end to end on the embedded MLflow store
#   make test   set up, then run the whole test suite (CI runs this)
#   make test-fast  the quick loop: the suite without the slow and integration tests
#   make test-window  the low end of the supported window (constraints/window-low.txt) in its own
#                     virtualenv: the tests that touch transformers, peft and trl (a few minutes)
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.gradian-installed
DEMO_DIR ?= .demo
WINDOW_VENV ?= .venv-window
WINDOW_PY := $(WINDOW_VENV)/bin/python
WINDOW_STAMP := $(WINDOW_VENV)/.gradian-installed
#: what depends on the transformers/peft/trl versions: gradient capture against loop gradients,
#: EK-FAC, DataInf, tokenization and chat templates, model loading, the tinyworld build, training
#: with the hf and trl backends, run folders and the MLflow callback
WINDOW_TESTS := tests/test_grads.py tests/test_ekfac.py tests/test_engines.py tests/test_data.py \
	tests/test_long_conversations.py tests/test_evaluate_models.py tests/test_inputs.py \
	tests/test_tinyworld.py tests/test_train.py tests/test_train_cli.py tests/test_run_folders.py \
	tests/test_runs.py tests/test_callback.py tests/test_cli_basic.py tests/test_transformers_compat.py

.PHONY: setup test test-fast test-window demo clean

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

$(WINDOW_STAMP): pyproject.toml constraints/window-low.txt constraints/torch-cpu.txt
	test -x $(WINDOW_PY) || $(PYTHON) -m venv $(WINDOW_VENV)
	$(WINDOW_PY) -m pip install --quiet --upgrade pip
	# CPU torch first, as for $(VENV)
	$(WINDOW_PY) -m pip install --quiet -r constraints/torch-cpu.txt
	$(WINDOW_PY) -m pip install --quiet -c constraints/window-low.txt -e '.[dev,cluster]'
	@if $(WINDOW_PY) -m pip show torchvision >/dev/null 2>&1; then \
		echo "torchvision got installed; it breaks transformers beside the CPU torch" >&2; exit 1; fi
	touch $(WINDOW_STAMP)

test: setup
	$(PY) -m pytest -q

test-fast: setup
	$(PY) -m pytest -q -m "not slow and not integration"

test-window: $(WINDOW_STAMP)
	$(WINDOW_PY) -m pytest -q -p no:cacheprovider -m "not integration" $(WINDOW_TESTS)

demo: setup
	GRADIAN_DEMO_DIR=$(DEMO_DIR) bash scripts/demo.sh

clean:
	rm -rf $(VENV) $(WINDOW_VENV) $(DEMO_DIR) .pytest_cache
