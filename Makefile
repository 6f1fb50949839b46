# Every target sets itself up: a fresh clone needs only python3 (>= 3.10) and make.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed
LOCK   := requirements/cluster.lock

.PHONY: install lock platforms demo test test-unit test-deploy lint format docs bench bench-gpu bench-scale clean

install: $(STAMP)

# The locked versions first, as on every cluster node; the bundle's own install then finds them
# there and keeps them, adding only what the dev and docs extras need beside them.
$(STAMP): pyproject.toml $(wildcard requirements/*.txt) $(LOCK)
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet --require-hashes -r $(LOCK)
	$(PY) -m pip install --quiet -e '.[dev,docs]'
	touch $@

## requirements/cluster.lock from requirements/cluster.txt (uv; the exact command is in its
## header), keeping the locked versions that still fit; `make lock UPGRADE=1`: the newest.
lock: $(STAMP)
	$(PY) -m scripts.lock $(if $(UPGRADE),--upgrade)

## platforms/: the Anyscale and KubeRay files and the Dockerfile, rendered from a values file
## (default platforms/values.yaml, the documented example; docs/platforms.md):
## `make platforms VALUES=team.yaml OUT=~/ray-cv-platforms`.
VALUES ?= platforms/values.yaml
OUT    ?= platforms
platforms: $(STAMP)
	$(PY) -m scripts.platforms --values $(VALUES) --out $(OUT)

## Start a local Ray cluster, submit the jobs to it with `ray job submit`, stop it.
demo: $(STAMP)
	$(PY) -m scripts.demo

## The suite in tiers (docs/development.md): tests/unit (no Ray), tests/ray (Ray in the test
## process), tests/jobs (`ray start` clusters and `ray job submit`), in WORKERS processes; a
## module's tests run in one process, which makes its fixtures once.
WORKERS ?= 3
test: $(STAMP)
	$(PY) -m pytest -n $(WORKERS) --dist loadgroup --max-worker-restart 2 tests/jobs tests/ray tests/unit

## The inner loop: the tests that start no Ray, in about two minutes.
test-unit: $(STAMP)
	$(PY) -m pytest -n 2 tests/unit

## The deployment paths for real: `ray up` of cluster-onprem.yaml over SSH on loopback addresses
## (needs root: it runs sshd, and apt-get installs openssh-server and rsync where missing), Airflow 3
## (its own .venv-airflow, built on first use) running the example DAG, and the `anyscale` package's
## models loading the Anyscale files (its own venv).
test-deploy: $(STAMP)
	$(PY) -m pytest tests/deploy

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
	$(PY) -m bench.loader_cores
	$(PY) -m bench.train_throughput --repeat 3
	$(PY) -m bench.infer_throughput
	$(PY) -m bench.serve
	$(PY) -m bench.export
	$(PY) -m bench.decode_memory
	$(PY) -m bench.checkpoint_steps --rounds 3
	$(PY) -m bench.checkpoint_steps --rounds 3 --device-step 0.25
	$(PY) -m bench.startup --repeat 3
	$(PY) -m bench.tune_sweep

## What a GPU answers, in one command (bench/README.md): the gpu tests, training images/s per
## model against its limit, inference, JPEG decode; about 8 min on one H100. Without a GPU, the
## same paths at CPU sizes in about 2 min (CI runs that).
bench-gpu: $(STAMP)
	$(PY) -m bench.gpu

## The same at the dataset sizes users have (1k, 10k, 100k images; local disk and S3): about an hour.
bench-scale: $(STAMP)
	$(PY) -m bench.loader --sizes 1000 10000 100000
	$(PY) -m bench.scale --sizes 1000 10000 100000
	$(PY) -m bench.infer_scale

clean:
	rm -rf outputs bench/results site .pytest_cache .ruff_cache
