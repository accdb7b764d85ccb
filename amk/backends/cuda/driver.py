"""The few CUDA driver calls the runtime needs, each with its return code checked.

Works with cuda-bindings 12.x and 13.x (``cuda.bindings.driver``; the pre-12.6 ``cuda.cuda``
layout is a fallback). Every failure raises BackendUnavailable naming the call.
"""
from __future__ import annotations

import ctypes

from amk.errors import BackendUnavailable


def _drv():
    try:
        from cuda.bindings import driver
    except ImportError:
        try:
            from cuda import cuda as driver
        except ImportError as e:
            raise BackendUnavailable("the CUDA backend needs cuda-python: pip install cuda-bindings") from e
    return driver


def check(ret, what: str):
    """Unpack a driver call's (CUresult, *values) and raise on any error."""
    err, rest = (ret[0], ret[1:]) if isinstance(ret, tuple) else (ret, ())
    if int(err) != 0:
        drv = _drv()
        try:
            _, msg = drv.cuGetErrorString(err)
            msg = msg.decode() if isinstance(msg, bytes) else str(msg)
        except Exception:
            msg = "?"
        raise BackendUnavailable(f"CUDA driver call {what} failed: {err} ({msg})")
    if not rest:
        return None
    return rest[0] if len(rest) == 1 else rest


class Kernel:
    """A loaded CUBIN's entry point, launchable on any stream (and inside graph capture)."""

    def __init__(self, cubin: bytes, name: str, device_index: int, dyn_smem: int):
        drv = _drv()
        self._drv = drv
        check(drv.cuInit(0), "cuInit")
        ctx = check(drv.cuCtxGetCurrent(), "cuCtxGetCurrent")
        if ctx is None or int(ctx) == 0:       # torch has not made its context current here yet
            dev = check(drv.cuDeviceGet(device_index), "cuDeviceGet")
            ctx = check(drv.cuDevicePrimaryCtxRetain(dev), "cuDevicePrimaryCtxRetain")
            check(drv.cuCtxSetCurrent(ctx), "cuCtxSetCurrent")
        self.module = check(drv.cuModuleLoadData(cubin), "cuModuleLoadData")
        self.func = check(drv.cuModuleGetFunction(self.module, name.encode()), "cuModuleGetFunction")
        attr = drv.CUfunction_attribute.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES
        check(drv.cuFuncSetAttribute(self.func, attr, dyn_smem), "cuFuncSetAttribute(max dynamic smem)")
        # all of the SM's unified L1/smem as shared memory: two CTAs per SM must both fit
        carve = drv.CUfunction_attribute.CU_FUNC_ATTRIBUTE_PREFERRED_SHARED_MEMORY_CARVEOUT
        check(drv.cuFuncSetAttribute(self.func, carve, 100), "cuFuncSetAttribute(smem carveout)")
        self.dyn_smem = dyn_smem
        self._last_args, self._last_stream = None, None
        dev = check(drv.cuDeviceGet(device_index), "cuDeviceGet")
        self.sm_count = int(check(drv.cuDeviceGetAttribute(
            drv.CUdevice_attribute.CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT, dev), "cuDeviceGetAttribute"))
        regs = drv.CUfunction_attribute.CU_FUNC_ATTRIBUTE_NUM_REGS
        self.num_regs = int(check(drv.cuFuncGetAttribute(regs, self.func), "cuFuncGetAttribute(regs)"))
        local = drv.CUfunction_attribute.CU_FUNC_ATTRIBUTE_LOCAL_SIZE_BYTES
        self.local_bytes = int(check(drv.cuFuncGetAttribute(local, self.func), "cuFuncGetAttribute(local)"))

    def occupancy(self, threads: int) -> int:
        return int(check(self._drv.cuOccupancyMaxActiveBlocksPerMultiprocessor(
            self.func, threads, self.dyn_smem), "cuOccupancyMaxActiveBlocksPerMultiprocessor"))

    def launch(self, grid: int, threads: int, stream_handle: int, arg_bytes: bytes) -> None:
        # The ctypes argument block and the stream object are rebuilt only when they change:
        # cuLaunchKernel copies the arguments at the call, so reusing the block is safe.
        if self._last_args is not arg_bytes:
            buf = ctypes.create_string_buffer(arg_bytes, len(arg_bytes))
            params = (ctypes.c_void_p * 1)(ctypes.addressof(buf))
            self._arg_block = (buf, params, ctypes.addressof(params))
            self._last_args = arg_bytes
        if self._last_stream != stream_handle:
            self._stream = self._drv.CUstream(stream_handle)
            self._last_stream = stream_handle
        check(self._drv.cuLaunchKernel(self.func, grid, 1, 1, threads, 1, 1, self.dyn_smem,
                                       self._stream, self._arg_block[2], 0), "cuLaunchKernel")
