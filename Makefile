# Two commands do all the set-up on a fresh machine:
#   make book   create .venv if missing, install the site tools (no torch), build the site into _build/html
#   make test   the same set-up, then every test: unit tests, strict nbval on every chapter, the site and browser
#               checks, nbgrader on every chapter's exercises
SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
SITE_STAMP := $(VENV)/.site-installed
# Bytecode for everything installed, compiled on every core at once: pip compiles one file at a time (a fresh
# install of requirements.txt took 2 min 39 s here; without pip's compiling, 56 s, and this step 60 s on 2 cores).
# Where PYTHONDONTWRITEBYTECODE is set, nothing else would ever write it, and every process would compile what it
# imports again (the package in src/ too, installed editable). Files that are not Python 3.11 (torch ships a 3.12
# test file) are skipped quietly, as pip skips them.
COMPILE = -$(PY) -m compileall -q -q -j 0 src $$($(PY) -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")

.PHONY: help install book test study unit unit-all lint nbval nbval-loaded portability outputs budgets gpu-check binder-check student kernel nbgrader dist clean

# `make help` prints every target with the text after its `##`.
help: ## this list
	@grep -E '^[a-z-]+:.*## ' $(MAKEFILE_LIST) | sed -E 's/^([a-z-]+):.*## (.*)/\1\t\2/' | \
		awk -F'\t' '{printf "  make %-13s %s\n", $$1, $$2}'

$(PY):
	$(PYTHON) -m venv $(VENV)

# The site's build needs only requirements-site.txt (no torch): the site is built from stored outputs.
$(SITE_STAMP): requirements-site.txt | $(PY)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet --no-compile -r requirements-site.txt
	$(COMPILE)
	touch $(SITE_STAMP)

# Everything (tests, execution, the package): re-installed only when the requirements or the package change.
$(STAMP): requirements.txt requirements-site.txt requirements-dist.txt pyproject.toml | $(PY)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet --no-compile -r requirements.txt
	$(PY) -m pip install --quiet --no-deps -e .
	$(COMPILE)
	touch $(STAMP) $(SITE_STAMP)

install: $(STAMP) ## create .venv and install the pinned stack and the package (editable)

book: $(SITE_STAMP) ## build the site from the stored outputs into _build/html (installs no torch)
	$(VENV)/bin/jupyter-book build . --all -n -W --keep-going
	@echo "The site is in $(CURDIR)/_build/html (open _build/html/index.html)"

# Every test once: lint and types (tests/test_lint.py runs `make lint`'s tools), package tests, shown
# commands, a fresh torch-only install, the site and the browser, and strict nbval (every output compared cell by
# cell; the lax mode is never used; each chapter runs once).
# Two workers (pytest-xdist), each test file whole on one worker (--dist loadfile): a notebook's cells run in order
# in one kernel, and the timing asserts are the ones `make nbval-loaded` checks under load (chapter 5's timing cell
# never runs beside an eight-process job: conftest.py). Lint runs beside the tests instead of before them (mypy
# alone takes 1.5 min with no cache).
# Chapter 5 runs last, alone: its timing cell measures what no_sync() saves on this machine's two cores, and a test
# on the other worker (a two-process study, a DDP job) moved the measured saving out of the cost model's 2× band.
test: $(STAMP) ## every test: lint + types, unit, commands, fresh install, site + browser, strict nbval
	$(PY) -m pytest tests chapters --nbval --nbval-current-env --ignore=chapters/05_no_sync.ipynb \
		--nbval-sanitize-with tests/nbval_sanitize.cfg -p no:cacheprovider -n 2 --dist loadfile -m "not study"
	$(PY) -m pytest chapters/05_no_sync.ipynb --nbval --nbval-current-env \
		--nbval-sanitize-with tests/nbval_sanitize.cfg -p no:cacheprovider

# The recorded training studies that chapters read (chapter 2's), trained again: minutes each, so not in `make test`;
# .ci/run runs them after it, the two on two workers.
study: $(STAMP) ## retrain the recorded studies the chapters read and check them against the record
	$(PY) -m pytest tests -p no:cacheprovider -n 2 -m study

# The package's tests only (core, checker, book layer): no notebook run, no site build, no shown command, no new
# virtual environment, no lint. `make unit` also leaves out the tests marked slow (over 5 s each on the 2-core
# machine: studies on other seeds, runs in several processes, subprocess round trips); `make unit-all` keeps them.
# Both on two workers (pytest-xdist, tests spread one by one); `make test` runs every one of them too.
UNIT_MARKS := not site and not commands and not install and not nbgrader and not lint
unit: $(STAMP) ## the package's fast tests on two workers, slow ones left out (under 2 minutes on 2 cores)
	$(PY) -m pytest tests -p no:cacheprovider -n 2 -m "not slow and $(UNIT_MARKS)"

unit-all: $(STAMP) ## the package's tests on two workers, slow ones included (no notebook, site, command or install)
	$(PY) -m pytest tests -p no:cacheprovider -n 2 -m "$(UNIT_MARKS)"

# actionlint checks the GitHub workflows in .github/workflows (it finds them from the repository root).
# ruff's rules include McCabe complexity 12 in src (pyproject.toml); the formatter checks the tests, the chapters and
# the package (line length 120, 80 in chapters/: chapters/ruff.toml); scripts/check_sizes.py holds src's functions to
# 60 lines and modules to 500, as formatted (a module or function the formatter lengthens past them is split by what
# it does).
lint: $(STAMP) ## ruff (rules, complexity, formatting), sizes, mypy, the layering contract, actionlint (workflows)
	$(VENV)/bin/ruff check src tests scripts benchmarks chapters conftest.py
	$(VENV)/bin/ruff format --check tests chapters src
	$(VENV)/bin/python scripts/check_sizes.py
	$(VENV)/bin/mypy
	$(VENV)/bin/lint-imports --no-cache
	$(VENV)/bin/actionlint

nbval: $(STAMP) ## strict nbval on every chapter only
	$(PY) -m pytest chapters --nbval --nbval-current-env --nbval-sanitize-with tests/nbval_sanitize.cfg \
		-p no:cacheprovider

# Strict nbval on every chapter with both cores kept busy, three runs in a row: timing asserts must survive load.
nbval-loaded: $(STAMP) ## strict nbval three times with every core kept busy
	PY=$(PY) bash scripts/loaded_nbval.sh 3

# Strict nbval on every chapter under two other CPU kernel paths (ATen's generic kernels; an AVX2 processor's
# ATen, oneDNN and MKL paths): every stored output and assert must hold on them too. .ci/run runs it after make test.
portability: $(STAMP) ## strict nbval on every chapter under two other CPU kernel paths (generic, AVX2)
	PY=$(PY) bash scripts/portability.sh

# The only way stored outputs are regenerated: headless execution in place, widget state stored.
outputs: $(STAMP) ## re-execute every chapter in place and store its outputs
	$(PY) scripts/execute_notebooks.py

# Time and peak memory of every chapter (executes without writing).
budgets: $(STAMP) ## time and peak memory of every chapter (nothing written)
	$(PY) scripts/execute_notebooks.py --check

# The student material: where it is published (STUDENT_REPO, STUDENT_BRANCH; without them a placeholder, and the
# command says so) and what it installs (STUDENT_PACKAGE, a pip requirement for gradaccum[book]; by default the
# package the student edition carries, from STUDENT_REPO). Never the book's repository: it holds the solutions.
STUDENT_ARGS = $(if $(STUDENT_REPO),--repository $(STUDENT_REPO)) $(if $(STUDENT_BRANCH),--branch $(STUDENT_BRANCH)) \
	$(if $(STUDENT_PACKAGE),--package "$(STUDENT_PACKAGE)")

# The student edition: solutions removed, exercise outputs cleared; notebooks and a site without solutions
# (COURSE_MODE=1: the checkers' feedback without expected values).
student: $(STAMP) ## the student edition: notebooks and site without solutions (STUDENT_REPO=..., COURSE_MODE=1)
	$(PY) -m gradaccum.book.course student --out _build/student/book $(STUDENT_ARGS) $(if $(COURSE_MODE),--course-mode)
	$(VENV)/bin/jupyter-book build _build/student/book --path-output _build/student --all -n -W --keep-going
	@echo "Student notebooks: $(CURDIR)/_build/student/book/chapters; student site: $(CURDIR)/_build/student/_build/html"

# The book's environment as a Jupyter kernel named gradaccum: the kernel nbgrader grades the course's notebooks in.
kernel: $(STAMP) ## install the book's environment as the Jupyter kernel "gradaccum" (the grading kernel)
	$(PY) -m ipykernel install --sys-prefix --name gradaccum --display-name "Python 3 (Gradient Accumulation, Correctly)"

# An nbgrader course folder (config + one assignment per chapter) under _build/nbgrader.
nbgrader: kernel ## nbgrader course folder under _build/nbgrader (source notebooks, config), grading kernel installed
	$(PY) -m gradaccum.book.course nbgrader --out _build/nbgrader $(STUDENT_ARGS)
	@echo "Course folder: $(CURDIR)/_build/nbgrader (run nbgrader there with $(VENV)/bin on PATH)"

# Run every chapter on a CUDA GPU; where there is none, on the CPU, and it says so. Uses the project's .venv when
# there is one (a GPU machine without Jupyter can use any Python with torch: make gpu-check PYTHON=python3).
GPU_PY = $(if $(wildcard $(PY)),$(PY),$(PYTHON))
gpu-check: ## every chapter on a CUDA GPU (on the CPU, with a notice, where there is none)
	@dev=$${GRADACCUM_DEVICE:-$$($(GPU_PY) -c "import torch; print('cuda' if torch.cuda.is_available() else 'cpu')")}; \
	if [ "$$dev" = cpu ]; then echo "gpu-check: no CUDA device here: running every chapter on the CPU instead"; fi; \
	GRADACCUM_DEVICE=$$dev PYTHONPATH=$(CURDIR)/src $(GPU_PY) scripts/gpu_check.py

# Install from binder/ alone into a fresh virtual environment and run one chapter there.
binder-check: ## install from binder/ alone into a fresh venv and run one chapter
	bash scripts/binder_check.sh

# The wheel and the sdist, into dist/ (emptied first: release.yml publishes everything in it). Needs only
# requirements-dist.txt (no torch): `python -m build` makes the sdist, then the wheel from the sdist, each in an
# isolated environment with pyproject.toml's build requirements. tests/test_release.py runs this target and installs
# the wheel into a fresh environment holding torch alone.
dist: | $(PY) ## build the wheel and the sdist into dist/ (what release.yml publishes; installs no torch)
	$(PY) -m pip install --quiet -r requirements-dist.txt
	rm -rf dist
	$(PY) -m build --outdir dist .

clean: ## remove _build
	rm -rf _build
