"""Serial tests of CUDA-awareness detection and device plumbing that need no GPU."""

from __future__ import annotations

import numpy as np
import pytest

from mpi_allreduce import backend, config


@pytest.fixture
def env(monkeypatch):
    def set_(value):
        if value is None:
            monkeypatch.delenv(config.CUDA_AWARE_ENV, raising=False)
        else:
            monkeypatch.setenv(config.CUDA_AWARE_ENV, value)
        config.refresh()
    yield set_
    monkeypatch.delenv(config.CUDA_AWARE_ENV, raising=False)
    config.refresh()


@pytest.mark.parametrize("value,expected", [("1", True), ("yes", True), ("0", False), ("off", False)])
def test_environment_forces_the_gpu_path(env, value, expected):
    env(value)
    aware, why = backend.cuda_aware_support()
    assert aware is expected
    assert f"forced by {config.CUDA_AWARE_ENV}={value}" in why


def test_detection_asks_the_loaded_mpi_library(env):
    """The PyPI Open MPI is built without CUDA: its MPIX query must say 0."""
    env(None)
    aware, why = backend.cuda_aware_support()
    from mpi4py import MPI

    if "Open MPI" in MPI.Get_library_version():
        assert aware is False
        assert "MPIX_Query_cuda_support() returned 0" in why
    else:
        assert isinstance(aware, bool) and why


def test_numpy_is_the_host_backend():
    a = np.zeros(3)
    assert backend.backend_for(a).name == "numpy"
    assert backend.as_array([1, 2]).dtype.kind == "i"
    assert backend.to_device(a, "cpu") is a
    with pytest.raises(TypeError, match="expected an array or a buffer"):
        backend.as_array(object())


def test_cpu_device_selection_and_unknown_device():
    from mpi4py import MPI

    assert backend.select_device(MPI.COMM_SELF, "cpu") == "cpu"
    with pytest.raises(ValueError, match="unknown device"):
        backend.select_device(MPI.COMM_SELF, "tpu")


def test_a_device_array_without_cupy_is_refused(monkeypatch):
    class Foreign:
        __cuda_array_interface__ = {"shape": (3,), "typestr": "<f4", "data": (0, False),
                                    "version": 3}

    if backend._cupy() is not None:
        pytest.skip("cupy is installed here")
    monkeypatch.setattr(backend, "_cuda_driver", lambda: True)  # a machine with a GPU
    with pytest.raises(TypeError, match="cupy is not installed"):
        backend.as_array(Foreign())


def test_a_cuda_array_interface_over_host_memory_is_viewed(monkeypatch):
    """Without a CUDA driver no pointer can be device memory: an object
    exposing host memory through the CUDA array interface (as mpi4py's
    tests' fake GPU arrays do) is viewed in place, so results land in it."""
    host = np.arange(4, dtype=np.float32)

    class Fake:
        __cuda_array_interface__ = {"shape": (4,), "typestr": "<f4", "version": 3,
                                    "data": (host.ctypes.data, False)}

    monkeypatch.setattr(backend, "_cuda_driver", lambda: False)
    if backend._cupy() is not None:
        pytest.skip("cupy is installed here")
    view = backend.as_array(Fake())
    view[...] = 7
    assert (host == 7).all()
