"""The bad inputs of docs/errors.md's table (tests/bad_inputs.py) that a job's driver finds once
connected to Ray, before any work: `python -m jobs.<job>` connected to this process's Ray
instance, as a job's driver is to its cluster, ends in the documented exit code and one
`error:` line, no traceback."""

from __future__ import annotations

import os
import re

import pytest
import ray
from bad_inputs import CASES, run_module

pytestmark = pytest.mark.usefixtures("ray_in_process")


@pytest.mark.parametrize("case", [c for c in CASES if c.on_cluster], ids=lambda c: c.what)
def test_a_bad_input_found_on_the_driver_ends_in_one_error_line(case, tmp_path, tiny_dataset):
    env = os.environ | {"RAY_ADDRESS": ray.get_runtime_context().gcs_address}
    for argv in case.cli(tmp_path, tiny_dataset):
        proc = run_module(argv, env)
        assert proc.returncode == case.exit_code, (argv, proc.stdout, proc.stderr)
        # Ray logs its connection to stderr first; the job's own line is the last.
        *_, last = proc.stderr.splitlines()
        assert re.match(f"error: {case.pattern()}", last), (argv, proc.stderr)
        assert "Traceback" not in proc.stdout + proc.stderr, argv
