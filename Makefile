# make test: the test suite on CPU.  make run: every notebook headless in its default
# configuration (make run-all: every configuration of notebooks/runs.yaml), into a new run
# folder build/runs/<stamp>/ and build/index.html; an unchanged notebook is not executed
# again (build/cache/, tools/run_cache.py).  make check-site: build/ in a headless
# Chromium (Debian's `chromium`; no browser download).
# make lab: JupyterLab on this checkout, the .py notebooks opening as notebooks.
# All build .venv/ from pyproject.toml at the exact versions of constraints.txt (Python 3.11
# + pip: the package editable with its extras; tools/pins.py writes constraints.txt), and
# refresh it only when one of them changed.
PYTHON ?= python3.11
VENV := .venv
PY := $(VENV)/bin/python

# Everything here runs on the CPU; without these libtpu prints host-discovery errors.
export JAX_PLATFORMS := cpu
export TPU_SKIP_MDS_QUERY := 1
# Profiler captures (mk.measure.profiling.PROFILES) land in this checkout's profiles/.
export MK_PROFILES := $(CURDIR)/profiles

.PHONY: test test-slow test-tpu mutate run run-all check-site lab clean clean-runs

# loadgroup: tests marked xdist_group share one worker (and its module fixtures).
test: $(VENV)/.stamp-test
	$(PY) -m pytest -n 2 --dist loadgroup --durations=60 tests/

# The tests marked slow (minutes each in interpret mode), which `make test` leaves out,
# then the mutation score.
test-slow: $(VENV)/.stamp-test
	$(PY) -m pytest -n 2 -m slow tests/
	$(MAKE) mutate

# The hardware tier on a TPU machine (tests/test_tpu.py), in one process: one program holds
# the chip. Writes data/measured/<chip>-exact.json.
test-tpu: $(VENV)/.stamp-test
	env -u JAX_PLATFORMS -u TPU_SKIP_MDS_QUERY MK_TPU=1 $(PY) -m pytest -p no:xdist -m tpu tests/test_tpu.py

# Realistic bugs planted one at a time in a copy of the checkout, each against the tests
# CI runs (tools/mutate.py's list; hours on 2 cores): prints caught / survived per mutant.
mutate: $(VENV)/.stamp-test
	$(PY) tools/mutate.py

# Configurations per notebook: notebooks/runs.yaml. Earlier runs are kept, never overwritten.
run: $(VENV)/.stamp
	$(PY) tools/run_notebooks.py --out build

run-all: $(VENV)/.stamp
	$(PY) tools/run_notebooks.py --out build --all

check-site: $(VENV)/.stamp-test
	$(PY) tools/check_site.py build

# jupytext.toml pairs each .py with its .ipynb; saving in Lab writes both (with outputs in
# the .ipynb: the pre-commit hooks of .pre-commit-config.yaml strip them before a commit).
# Jupyter refuses root unless told (CI and these machines run as root).
lab: $(VENV)/.stamp
	$(VENV)/bin/jupyter lab --ServerApp.root_dir=$(CURDIR) $(if $(filter 0,$(shell id -u)),--allow-root)

# The python3 kernelspec written into the venv makes papermill start this venv's python;
# the Lab settings written into it open a .py file as a notebook (jupytext).
LAB_SETTINGS := $(VENV)/share/jupyter/lab/settings
# Two makes at once (two `make run`s, say) build the venv one after the other: each rule
# re-runs itself under a lock file, where the second finds it up to date.
ifeq ($(VENV_LOCKED),)
$(VENV)/.stamp $(VENV)/.stamp-test:
	flock $(VENV).lock $(MAKE) --no-print-directory VENV_LOCKED=1 $@
endif

$(VENV)/.stamp: pyproject.toml constraints.txt tools/jupyterlab-overrides.json
ifneq ($(VENV_LOCKED),)
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q -c constraints.txt -e '.[notebooks,profile,docs]'
	$(PY) -m ipykernel install --sys-prefix --name python3
	mkdir -p $(LAB_SETTINGS)
	cp tools/jupyterlab-overrides.json $(LAB_SETTINGS)/overrides.json
	touch $@
endif

$(VENV)/.stamp-test: $(VENV)/.stamp
ifneq ($(VENV_LOCKED),)
	$(PY) -m pip install -q -c constraints.txt -e '.[notebooks,profile,docs,test]'
	touch $@
endif

# Removes test caches and build/ except the runs (build/runs/, each make run's results);
# `make clean-runs` removes those too. Leaves .venv/ alone (minutes to rebuild); `rm -rf
# .venv` for a fresh one.
clean:
	rm -rf .pytest_cache .hypothesis build/index.html build/cache

clean-runs: clean
	rm -rf build
