# Every target sets itself up: a fresh clone needs only python3 (>= 3.10) and make.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed

.PHONY: install demo test test-fast test-deploy lint format docs bench bench-scale clean

install: $(STAMP)

$(STAMP): pyproject.toml $(wildcard requirements/*.txt)
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e '.[dev,docs]'
	touch $@

## Start a local Ray cluster, submit the jobs to it with `ray job submit`, stop it.
demo: $(STAMP)
	$(PY) -m scripts.demo

## The whole suite: unit tests and jobs on real local Ray clusters, two modules at a time (the
## cluster tests mostly wait); a module runs whole in one process, with its fixtures made once.
test: $(STAMP)
	$(PY) -m pytest -n 2 --dist loadscope

## Unit tests only (no `ray start` clusters).
test-fast: $(STAMP)
	$(PY) -m pytest -m "not slow"

## The deployment paths for real: `ray up` of cluster-onprem.yaml over SSH on loopback addresses
## (needs root: it runs sshd, and apt-get installs openssh-server and rsync where missing), and
## Airflow 3 (its own .venv-airflow, built on first use) running the example DAG.
test-deploy: $(STAMP)
	$(PY) -m pytest -m deploy

lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

format: $(STAMP)
	$(VENV)/bin/ruff check --fix .
	$(VENV)/bin/ruff format .

## The docs site (mkdocs.yml, docs/) into site/; strict: a broken link or a page left out of nav fails.
docs: $(STAMP)
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs build --strict --site-dir site

## Benchmarks, each against its plain alternative in the same run; results in bench/results/.
bench: $(STAMP)
	$(PY) -m bench.preprocess_throughput
	$(PY) -m bench.loader
	$(PY) -m bench.train_throughput --repeat 3
	$(PY) -m bench.infer_throughput
	$(PY) -m bench.serve
	$(PY) -m bench.startup --repeat 3

## The same at the dataset sizes users have (1k, 10k, 100k images; local disk and S3): about an hour.
bench-scale: $(STAMP)
	$(PY) -m bench.loader --sizes 1000 10000 100000
	$(PY) -m bench.scale --sizes 1000 10000 100000
	$(PY) -m bench.infer_scale

clean:
	rm -rf outputs bench/results site .pytest_cache .ruff_cache
