"""Submit the bundle's jobs to a Ray cluster in order: the chain a scheduler runs.

    python -m jobs.submit --address http://127.0.0.1:8265 --root s3://bucket/ray-cv all
    python -m jobs.submit --address ... --root ... --set train.epochs=20 train
    python -m jobs.submit --address ... --root ... --recipe finetune all
    python -m jobs.submit --address ... --root ... export
    python -m jobs.submit --address ... --root ... --profile demo tune
    python -m jobs.submit --address ... --root ... --check all
    python -m jobs.submit --address ... --root ... --py-module ~/src/mynet \
        --set train.model.name=mynet:build all

Every job goes to the cluster with runtime_env.yaml, as `ray job submit` sends it; its log is
streamed here; `--py-module PATH` adds the user's own package (a folder, a .whl or a URI) to
every job's runtime env as `py_modules`, which Ray uploads with the job. Paths come from
`--root`: the dataset at <root>/dataset, training runs under <root>/runs (the run named by
the train config), predictions at <root>/predictions/<run name> (of another input than the
dataset's val split: at <run name>-<input name>[-<split>]-<hash of the input>), the export of the
run's best checkpoint at <root>/runs/<run name>/export/<checkpoint name>.
`--recipe NAME` layers configs/recipes/NAME.yaml over the train step's config.
`all` runs preprocess, train and infer; export and tune (a sweep of the train job, its trials
runs under <root>/runs/<sweep name>; docs/tune.md) run only when named. `check`, the cluster
check of the train step's config with storage <root> and the dataset at <root>/dataset
(docs/check.md), runs when named, or first with `--check`, before the steps named.
So each step can be retried on its own: preprocessing is a no-op when its dataset is up to date,
training resumes its run or says it is complete, inference replaces its output, and an export
already there is left as it is. Run as
`all`, training reads the dataset version the preprocess step left current; run alone, the
newest (`--set train.dataset_version=...` pins one). Inference and export of the run's own
dataset read the version the run was trained on, however they are run; inference of other
images (`--set infer.input=s3://.../photos`) reads them as they are.

Only a job that SUCCEEDED counts: `ray job submit` itself exits 0 for a job that was stopped.
A cluster that cannot take a job yet is tried again for `--submit-timeout-s` (60 s); a job
whose log stream drops is followed again from where it stopped, and its end read from its status,
while the cluster answers within `--reconnect-timeout-s` (300 s) (pipeline/chain/follow.py).

Exit codes: 0 every step succeeded; the failed job's own exit code (1 unusable input, 2 invalid
config, 3 the cluster could not do it; 1 when the job died without one); 3 also when the cluster
did not take a job or answered nothing for those times; 4 the job was stopped (`ray job stop`)
or this command interrupted (SIGTERM, Ctrl-C), which from the request that submits a job on
stops that job too; 2 an invalid config or argument here, before anything is submitted.
"""

from __future__ import annotations

import sys

from pipeline.chain.cli import chain_parser, run


def main(argv: list[str] | None = None) -> int:
    """Run the step `argv` (the command line's by default) names; the chain's exit code."""
    return run(chain_parser(__doc__).parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
