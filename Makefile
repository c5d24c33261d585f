# make lab   : set up .venv and run the lab end to end on this machine's default profile
# make test  : set up .venv with the test extras and run the whole suite
SHELL := /bin/bash
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
# Without an NVIDIA GPU, pin the CPU build of torch (and its Triton) through a constraints file;
# with one, torch stays as pyproject leaves it (unpinned).
HAS_GPU := $(shell nvidia-smi -L >/dev/null 2>&1 && echo 1)
CONSTRAINTS := $(if $(HAS_GPU),,-c constraints/cpu.txt)
DEPS := pyproject.toml constraints/cpu.txt

.PHONY: lab test venv clean-venv

$(PY):
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip

$(VENV)/.lab-installed: $(PY) $(DEPS)
	$(PY) -m pip install -q $(CONSTRAINTS) -e .
	touch $@

$(VENV)/.test-installed: $(PY) $(DEPS)
	$(PY) -m pip install -q $(CONSTRAINTS) -e '.[test]'
	touch $@ $(VENV)/.lab-installed

venv: $(VENV)/.lab-installed

lab: $(VENV)/.lab-installed
	$(VENV)/bin/labkit run

test: $(VENV)/.test-installed
	@# Chromium for the browser tests (tests/test_browser.py), from apt, when missing and when this
	@# user is root or has passwordless sudo. Never fails the make: without it those tests skip, saying why.
	@if [ -x /usr/bin/chromium ]; then :; \
	elif ! command -v apt-get >/dev/null 2>&1; then \
	  echo "chromium: no /usr/bin/chromium and no apt-get; the browser tests will skip"; \
	else \
	  if [ "$$(id -u)" = 0 ]; then SUDO=; \
	  elif command -v sudo >/dev/null 2>&1 && sudo -n true 2>/dev/null; then SUDO="sudo -n"; \
	  else SUDO=none; fi; \
	  if [ "$$SUDO" = none ]; then \
	    echo "chromium: no /usr/bin/chromium, and installing it needs root or passwordless sudo; the browser tests will skip"; \
	  else \
	    echo "chromium: installing it with apt-get for the browser tests"; \
	    $$SUDO env DEBIAN_FRONTEND=noninteractive apt-get update -qq \
	      && $$SUDO env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends chromium >/dev/null \
	      || echo "chromium: apt-get could not install it; the browser tests will skip"; \
	  fi; \
	fi
	MPLBACKEND=agg $(PY) -m pytest

clean-venv:
	rm -rf $(VENV)
