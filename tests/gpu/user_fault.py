"""One user-caused GPU fault, in this process, on purpose: the process is expected to crash.

    python3 tests/gpu/user_fault.py oob|trap

oob: a kernel writes 1 TiB past the end of a plain 4 MiB device allocation (cudaMalloc through CuPy's pool, never
managed memory). The driver logs Xid 31 (MMU fault) and the process gets an illegal-address error.
trap: a kernel executes `trap`; the driver logs Xid 43 (seen on an H200).

Backends, first that compiles and launches: CuPy's RawModule (NVRTC), then Numba (oob only). Prints
`LAUNCHED <backend> <mode>` on stderr just before it synchronises, and `FAULT <exception>: <message>` when the
synchronisation fails. Exit status: 1 after a fault (the expected outcome), 3 when the kernel ran and nothing failed
(no fault happened), 4 when no backend could compile and launch a kernel, 2 for a bad argument.
Used by tests/gpu/check_real_gpu.py; imports nothing of ours.
"""

from __future__ import annotations

import os
import sys

ALLOCATION_FLOATS = 1 << 20  # 4 MiB
OUT_OF_RANGE_BYTES = 1 << 40  # 1 TiB past the allocation: nothing of this process is mapped there

CUDA_SOURCE = r"""
extern "C" __global__ void write_far(float* p, unsigned long long offset) {
    p[offset + threadIdx.x] = 1.0f;
}
extern "C" __global__ void trap_now(float* p) {
    p[threadIdx.x] = 2.0f;
    __trap();
}
"""


def say(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def faulted(exc: BaseException) -> None:
    say(f"FAULT {type(exc).__module__}.{type(exc).__name__}: {exc}")
    os._exit(1)  # skip the library's teardown of a context that is gone: the fault is what was wanted


def with_cupy(mode: str) -> None:
    import cupy as cp

    module = cp.RawModule(code=CUDA_SOURCE)
    buffer = cp.zeros(ALLOCATION_FLOATS, dtype=cp.float32)
    cp.cuda.runtime.deviceSynchronize()
    if mode == "oob":
        kernel = module.get_function("write_far")
        args: tuple[object, ...] = (buffer, cp.uint64(OUT_OF_RANGE_BYTES // 4))
    else:
        kernel = module.get_function("trap_now")
        args = (buffer,)
    say(f"LAUNCHED cupy {mode} device={cp.cuda.runtime.getDeviceProperties(0)['name'].decode()}")
    try:
        kernel((1,), (32,), args)
        cp.cuda.runtime.deviceSynchronize()
    except Exception as exc:
        faulted(exc)


def with_numba(mode: str) -> None:
    if mode != "oob":
        raise RuntimeError("numba: only oob")
    import numpy as np
    from numba import cuda

    @cuda.jit
    def write_far(p, offset):
        p[offset + cuda.threadIdx.x] = 1.0

    buffer = cuda.device_array(ALLOCATION_FLOATS, dtype=np.float32)
    write_far[1, 1](buffer, np.int64(0))  # compile and run once in range
    cuda.synchronize()
    say(f"LAUNCHED numba {mode}")
    try:
        write_far[1, 32](buffer, np.int64(OUT_OF_RANGE_BYTES // 4))
        cuda.synchronize()
    except Exception as exc:
        faulted(exc)


def main() -> int:
    mode = sys.argv[1] if len(sys.argv) > 1 else "oob"
    if mode not in ("oob", "trap"):
        say(f"unknown mode {mode!r} (oob or trap)")
        return 2
    for backend in (with_cupy, with_numba):
        try:
            backend(mode)
        except Exception as exc:  # this backend could not compile or launch: try the next
            say(f"BACKEND {backend.__name__} unusable: {type(exc).__name__}: {exc}")
            continue
        say(f"NO FAULT: the {mode} kernel ran through {backend.__name__} and nothing failed")
        return 3
    say("NO BACKEND: neither CuPy nor Numba could compile and launch a kernel")
    return 4


if __name__ == "__main__":
    sys.exit(main())
