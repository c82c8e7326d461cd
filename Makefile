# The README's two commands: `make demo` and `make test`. Both set up .venv themselves.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
# glibc hands large freed buffers back to the OS, so big activations page-fault on every step;
# these thresholds keep them in the process (see visattn/bench/__init__.py).
export MALLOC_MMAP_THRESHOLD_ := 33554432
export MALLOC_TRIM_THRESHOLD_ := 17179869184

.PHONY: demo test lint clean timm-conformance slurm-packages

$(VENV)/.stamp: pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e ".[dev]"
	$(PY) -m visattn.kernels  # compile the CPU kernels now (PyTorch fallback where no compiler)
	touch $@

demo: $(VENV)/.stamp
	$(PY) train_cls.py

test: $(VENV)/.stamp slurm-packages
	$(PY) -m pytest -q -n 2 --dist loadfile

# The cluster tests (tests/test_slurm.py) bring up a real SLURM from Debian's packages; as root the
# packages are installed here when missing, elsewhere those tests skip and say why.
slurm-packages:
	@test -x /usr/sbin/slurmctld -a -x /usr/sbin/munged || { [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null \
	  && (apt-get update -qq && apt-get install -y -qq slurm-wlm munge) >/dev/null 2>&1; } \
	  || echo "note: slurm-wlm / munge not installed: the SLURM cluster tests will skip"

lint: $(VENV)/.stamp
	$(PY) -m ruff check visattn tests train_cls.py train_dit.py

clean:
	rm -rf $(VENV) outputs multirun

# timm's own tests/test_models.py (installed version, from its sdist) on every visattn_* model
timm-conformance: $(VENV)/.stamp
	VISATTN_TIMM_CONFORMANCE=full $(PY) -m pytest -q -s -p no:cacheprovider tests/test_timm_conformance.py
