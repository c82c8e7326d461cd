# The README's two commands: `make demo` and `make test`. Both set up .venv themselves.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
# glibc hands large freed buffers back to the OS, so big activations page-fault on every step;
# these thresholds keep them in the process (see visattn/bench/__init__.py).
export MALLOC_MMAP_THRESHOLD_ := 33554432
export MALLOC_TRIM_THRESHOLD_ := 17179869184

.PHONY: demo test lint clean timm-conformance

$(VENV)/.stamp: pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e ".[dev]"
	touch $@

demo: $(VENV)/.stamp
	$(PY) train_cls.py

test: $(VENV)/.stamp
	$(PY) -m pytest -q -n 2 --dist loadfile

lint: $(VENV)/.stamp
	$(PY) -m ruff check visattn tests train_cls.py train_dit.py

clean:
	rm -rf $(VENV) outputs multirun

# timm's own tests/test_models.py (installed version, from its sdist) on every visattn_* model
timm-conformance: $(VENV)/.stamp
	VISATTN_TIMM_CONFORMANCE=full $(PY) -m pytest -q -s -p no:cacheprovider tests/test_timm_conformance.py
