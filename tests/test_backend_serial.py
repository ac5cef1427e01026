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


class _TwoLaneProducer:
    """A CPU DLPack producer (legacy capsule) that describes its complex
    elements as mpi4py does for complex long double: two lanes of the float."""

    def __init__(self, array: np.ndarray):
        import ctypes

        self.array = array
        self.shape = (ctypes.c_int64 * 1)(array.size)
        real = array.dtype.itemsize // 2
        self.tensor = backend._DLTensor(
            data=array.ctypes.data, device_type=1, device_id=0, ndim=1,
            dtype=backend._DLDataType(code=2, bits=8 * real, lanes=2),
            shape=self.shape, strides=None, byte_offset=0)
        # DLManagedTensor: the DLTensor, then manager_ctx and deleter (both unused here)
        self.managed = (ctypes.c_byte * (ctypes.sizeof(self.tensor) + 16))()
        ctypes.memmove(self.managed, ctypes.addressof(self.tensor), ctypes.sizeof(self.tensor))
        new = ctypes.pythonapi.PyCapsule_New
        new.restype, new.argtypes = ctypes.py_object, [ctypes.c_void_p, ctypes.c_char_p,
                                                       ctypes.c_void_p]
        self.capsule = new(ctypes.addressof(self.managed), b"dltensor", None)

    def __dlpack__(self, stream=None):  # before DLPack 1.0: no max_version
        return self.capsule

    def __dlpack_device__(self):
        return (1, 0)


@pytest.mark.parametrize("dtype", [np.complex64, np.complex128, np.clongdouble],
                         ids=["complex64", "complex128", "clongdouble"])
def test_complex_as_two_float_lanes_is_read_as_complex(dtype):
    """mpi4py hands complex long double over DLPack as (float, 128 bits, 2
    lanes); it is read as that complex type, viewing the same memory, not
    as opaque 32-byte items."""
    data = (np.arange(5) + 1j * np.arange(5, 10)).astype(dtype)
    view = backend.as_array(_TwoLaneProducer(data))
    assert view.dtype == np.dtype(dtype)
    np.testing.assert_array_equal(view, data)
    view[0] = 7 - 7j
    assert data[0] == 7 - 7j


def _views(base):
    """Views of one buffer: slices, reversed and strided ones, 2-D ones, empty ones."""
    flat = base.reshape(-1)
    grid = base.reshape(6, 8)
    return [flat, flat[:5], flat[5:], flat[::2], flat[1::2], flat[::-1], flat[40:2:-3],
            flat[10:10], grid[1:3], grid[:, 2], grid[::-2, ::3], grid.T, grid[2:5, 1:4][::-1]]


def test_byte_bounds_are_numpys_and_say_when_views_may_overlap():
    """The device arrays' cheap overlap test (before cupy's exact one, which
    costs a third of a millisecond on a GPU), on numpy views of one buffer
    whose bounds numpy knows: the same bounds as numpy's, and overlap exactly
    where numpy's bounds test says so."""
    try:
        from numpy.lib.array_utils import byte_bounds as numpys
    except ImportError:  # numpy 1
        numpys = np.byte_bounds
    base = np.arange(48.0)
    views = _views(base)

    def bounds(a):
        return backend.byte_bounds(a.__array_interface__["data"][0], a.shape, a.strides,
                                   a.itemsize)
    for a in views:
        if a.size:
            assert bounds(a) == numpys(a)
        else:
            assert bounds(a)[0] == bounds(a)[1]
        for b in views:
            assert backend.bounds_overlap(bounds(a), bounds(b)) == np.may_share_memory(a, b), \
                (a.strides, b.strides)
    assert not backend.bounds_overlap(bounds(base), bounds(np.arange(48.0)))
