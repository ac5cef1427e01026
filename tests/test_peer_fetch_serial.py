"""Fetching mpi4py's tests: once, in the serial session; a failure leaves
a reason the MPI runs skip with, never an abort."""

from __future__ import annotations

import subprocess

from . import mpi4py_suite


def test_a_failed_download_is_recorded_and_skipped_with_its_reason(tmp_path, monkeypatch):
    monkeypatch.setattr(mpi4py_suite, "ROOT", tmp_path)

    def offline(*args, **kwargs):
        raise subprocess.CalledProcessError(1, args[0], stderr="ERROR: No matching distribution")
    monkeypatch.setattr(mpi4py_suite.subprocess, "run", offline)
    path, why = mpi4py_suite.fetch()
    assert path is None and "No matching distribution" in why
    # what an MPI run sees, without touching the network
    assert mpi4py_suite.suite_dir() == (None, why)


def test_a_download_that_outlasts_its_limit_is_recorded(tmp_path, monkeypatch):
    monkeypatch.setattr(mpi4py_suite, "ROOT", tmp_path)

    def slow(*args, **kwargs):
        raise subprocess.TimeoutExpired(args[0], kwargs["timeout"])
    monkeypatch.setattr(mpi4py_suite.subprocess, "run", slow)
    path, why = mpi4py_suite.fetch()
    assert path is None and f"over {mpi4py_suite.FETCH_TIMEOUT} s" in why
    assert mpi4py_suite.suite_dir()[1] == why


def test_not_fetched_says_how(tmp_path, monkeypatch):
    monkeypatch.setattr(mpi4py_suite, "ROOT", tmp_path)
    path, why = mpi4py_suite.suite_dir()
    assert path is None and "test_launch.py" in why
