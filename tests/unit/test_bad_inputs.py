"""Every bad input of docs/errors.md's table (tests/bad_inputs.py) without Ray: the library call
its job makes gives the documented exit code and `error:` line; its command line ends, before
any Ray call, in that code and one line; the cases that run as jobs name a test that asserts
their message; and the table matches the docs' rows in order."""

from __future__ import annotations

import ast
import os
import re

import pytest
from bad_inputs import CASES, run_module
from helpers import errors_table

from harness.cluster import BUNDLE_ROOT
from pipeline.core import storage
from pipeline.core.errors import EXIT_CODES, failure


@pytest.mark.parametrize("case", [c for c in CASES if c.run], ids=lambda c: c.what)
def test_a_bad_input_gets_its_exit_code_and_message(case, tmp_path, tiny_dataset, monkeypatch):
    monkeypatch.setattr(storage, "FIRST_WAIT_S", 0.01)
    with pytest.raises(Exception) as raised:
        case.run(tmp_path, tiny_dataset)
    # What every job's and the chain's main make of it: the exit code and the `error:` line.
    assert failure(raised.value) is not None, raised.value  # else a traceback and exit 1
    code, line = failure(raised.value)
    assert code == case.exit_code
    assert re.match(case.pattern(), line), line


@pytest.mark.parametrize(
    "case", [c for c in CASES if c.cli and not c.on_cluster], ids=lambda c: c.what
)
def test_a_bad_input_on_the_command_line_ends_in_one_error_line(case, tmp_path, tiny_dataset):
    for argv in case.cli(tmp_path, tiny_dataset):
        proc = run_module(argv, os.environ)
        assert proc.returncode == case.exit_code, (argv, proc.stdout, proc.stderr)
        assert re.fullmatch(f"error: {case.pattern()}.*\n", proc.stderr), (argv, proc.stderr)


@pytest.mark.parametrize("case", [c for c in CASES if c.test], ids=lambda c: c.what)
def test_a_bad_input_run_as_a_job_is_asserted_by_the_test_named(case):
    path, _, name = case.test.partition("::")
    source = (BUNDLE_ROOT / path).read_text()
    (test,) = [
        node
        for node in ast.parse(source).body
        if isinstance(node, ast.FunctionDef) and node.name == name
    ]
    body = ast.get_source_segment(source, test)
    # The message's fixed words appear in what that test asserts.
    for words in re.split(r"<[^>]+>", case.message):
        assert words.strip() in body, (case.test, words)


def test_the_docs_table_lists_every_case():
    expected = [(c.what, c.exit_code, c.message.split("\n")[0]) for c in CASES]
    assert errors_table("Bad input, exit codes and messages") == expected
    assert len(CASES) >= 15


def test_exit_codes_are_the_documented_ones():
    assert sorted(EXIT_CODES.values()) == [1, 2, 3]
    assert {c.exit_code for c in CASES} == {1, 2, 3}
