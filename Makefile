# Two commands do all the set-up on a fresh machine:
#   make book   create .venv if missing, install everything, build the site into _build/html
#   make test   the same set-up, then every test: unit tests, strict nbval on every chapter, the site check
SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: help install book test unit nbval nbval-loaded outputs budgets gpu-check binder-check student nbgrader clean

help:
	@echo "make book | test | nbval-loaded | outputs | budgets | student | nbgrader | gpu-check | binder-check | clean"

$(PY):
	$(PYTHON) -m venv $(VENV)

# Re-install only when the requirements or the package metadata change.
$(STAMP): requirements.txt pyproject.toml | $(PY)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -r requirements.txt
	$(PY) -m pip install --quiet --no-deps -e .
	touch $(STAMP)

install: $(STAMP)

book: $(STAMP)
	$(VENV)/bin/jupyter-book build . --all -n -W --keep-going
	@echo "The site is in $(CURDIR)/_build/html (open _build/html/index.html)"

# Unit tests, strict nbval (every output compared cell by cell; the lax mode is never used) and the site check.
test: $(STAMP)
	$(PY) -m pytest tests chapters --nbval --nbval-current-env \
		--nbval-sanitize-with tests/nbval_sanitize.cfg -p no:cacheprovider

unit: $(STAMP)
	$(PY) -m pytest tests -p no:cacheprovider -m "not site"

nbval: $(STAMP)
	$(PY) -m pytest chapters --nbval --nbval-current-env --nbval-sanitize-with tests/nbval_sanitize.cfg \
		-p no:cacheprovider

# Strict nbval on every chapter with both cores kept busy, three runs in a row: timing asserts must survive load.
nbval-loaded: $(STAMP)
	PY=$(PY) bash scripts/loaded_nbval.sh 3

# The only way stored outputs are regenerated: headless execution in place, widget state stored.
outputs: $(STAMP)
	$(PY) scripts/execute_notebooks.py

# Time and peak memory of every chapter (executes without writing).
budgets: $(STAMP)
	$(PY) scripts/execute_notebooks.py --check

# The student edition: solutions removed, exercise outputs cleared; notebooks and a site without solutions.
student: $(STAMP)
	$(PY) -m gradaccum.book.course student --out _build/student/book
	$(VENV)/bin/jupyter-book build _build/student/book --path-output _build/student --all -n -W --keep-going
	@echo "Student notebooks: $(CURDIR)/_build/student/book/chapters; student site: $(CURDIR)/_build/student/_build/html"

# nbgrader source notebooks (one assignment per chapter) under _build/nbgrader/source.
nbgrader: $(STAMP)
	$(PY) -m gradaccum.book.course nbgrader --out _build/nbgrader

# Run every chapter on a CUDA GPU; where there is none, on the CPU, and it says so. Uses the project's .venv when
# there is one (a GPU machine without Jupyter can use any Python with torch: make gpu-check PYTHON=python3).
GPU_PY = $(if $(wildcard $(PY)),$(PY),$(PYTHON))
gpu-check:
	@dev=$${GRADACCUM_DEVICE:-$$($(GPU_PY) -c "import torch; print('cuda' if torch.cuda.is_available() else 'cpu')")}; \
	if [ "$$dev" = cpu ]; then echo "gpu-check: no CUDA device here: running every chapter on the CPU instead"; fi; \
	GRADACCUM_DEVICE=$$dev PYTHONPATH=$(CURDIR)/src $(GPU_PY) scripts/gpu_check.py

# Install from binder/ alone into a fresh virtual environment and run one chapter there.
binder-check:
	bash scripts/binder_check.sh

clean:
	rm -rf _build
