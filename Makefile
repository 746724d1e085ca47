# make test: the test suite on CPU.  make run: every notebook headless, into a new run
# folder build/runs/<stamp>/ and build/index.html.  make check-site: build/ in a headless
# Chromium (Debian's `chromium`; no browser download).
# Both build .venv/ from the pinned requirements (Python 3.11 + pip) and refresh it only
# when a requirements file or pyproject.toml changed.
PYTHON ?= python3.11
VENV := .venv
PY := $(VENV)/bin/python

# Everything here runs on the CPU; without these libtpu prints host-discovery errors.
export JAX_PLATFORMS := cpu
export TPU_SKIP_MDS_QUERY := 1

.PHONY: test test-slow run check-site clean clean-runs

# loadgroup: tests marked xdist_group share one worker (and its module fixtures).
test: $(VENV)/.stamp-test
	$(PY) -m pytest -n 2 --dist loadgroup tests/

# The tests marked slow (minutes each in interpret mode), which `make test` leaves out.
test-slow: $(VENV)/.stamp-test
	$(PY) -m pytest -n 2 -m slow tests/

# Configurations per notebook: notebooks/runs.yaml. Earlier runs are kept, never overwritten.
run: $(VENV)/.stamp
	$(PY) tools/run_notebooks.py --out build

check-site: $(VENV)/.stamp-test
	$(PY) tools/check_site.py build

# The python3 kernelspec written into the venv makes papermill start this venv's python.
$(VENV)/.stamp: requirements.txt pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q -r requirements.txt
	$(PY) -m pip install -q -e .
	$(PY) -m ipykernel install --sys-prefix --name python3
	touch $@

$(VENV)/.stamp-test: $(VENV)/.stamp requirements-test.txt
	$(PY) -m pip install -q -r requirements-test.txt
	touch $@

# Removes test caches and build/ except the runs (build/runs/, each make run's results);
# `make clean-runs` removes those too. Leaves .venv/ alone (minutes to rebuild); `rm -rf
# .venv` for a fresh one.
clean:
	rm -rf .pytest_cache .hypothesis build/index.html build/_static

clean-runs: clean
	rm -rf build
