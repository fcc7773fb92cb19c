"""Fused sorting-network kernels: one C function per (participants, window), generated, compiled
on first use with the system C compiler and loaded with ctypes.

``kernel_source(p, k)`` writes ``networks.window_network(p, k)`` out as straight-line C: per
column, the p values are loaded as int32 total-order keys (``kernels.order_keys``), the
comparators run on them in registers, and the window k..p-k-1 is turned back into floats,
summed in ascending order in fp32 and divided by its length, exactly the numpy path's
operations (no -ffast-math), so the bits are the same. The compiler vectorises the column
loop; one pass reads each row once.

Builds go to ``$MPIFL_CACHE_DIR`` (else ``$XDG_CACHE_HOME/mpifl`` or ``~/.cache/mpifl``), keyed
by the source, the compiler and the CPU's feature flags (``-march=native``: a login node's
build never runs on a compute node of another kind). Without a compiler, beyond
``MAX_PARTICIPANTS``, or with ``MPIFL_NATIVE=0``, the numpy network runs instead: the same
bits, slower.
"""
from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import shlex
import subprocess
from _ctypes import CFuncPtr as Kernel  # a loaded C function: the class ctypes keeps as its private _CFuncPtr
from pathlib import Path

import numpy as np
import torch

from mpifl.aggregation.networks import window_network
from mpifl.caches import cache_dir

log = logging.getLogger(__name__)

MAX_PARTICIPANTS = 64  # beyond this the unrolled network would be thousands of lines: numpy runs instead
ROW_TYPES = {torch.float32: ("fp32", "uint32_t", ""), torch.bfloat16: ("bf16", "uint16_t", " << 16")}

_PRELUDE = """#include <stdint.h>
#include <string.h>

static inline int32_t key_of(uint32_t bits) {  /* kernels.order_keys */
    int32_t b = (int32_t)bits;
    return (int32_t)((uint32_t)(b ^ ((b >> 31) & 0x7FFFFFFF)) - 0x7FFFFFu);
}

static inline float float_of(int32_t key) {  /* kernels.key_bits */
    int32_t b = (int32_t)((uint32_t)key + 0x7FFFFFu);
    b ^= (b >> 31) & 0x7FFFFFFF;
    float f;
    memcpy(&f, &b, sizeof f);
    return f;
}
"""


def kernel_source(p: int, k: int, network: tuple[tuple[int, int, bool, bool], ...]) -> str:
    """C source of ``trimmed_mean_fp32`` and ``trimmed_mean_bf16``: out[c] = the mean of sorted values
    k..p-k-1 of column first + c of the p rows, for c < n, through ``network`` (i, j, low, high)."""
    m = p - 2 * k
    body = []
    for i, j, low, high in network:
        pair = f"v{i} < v{j}"
        if low and high:
            body.append(f"{{ int32_t lo = {pair} ? v{i} : v{j}; v{j} = {pair} ? v{j} : v{i}; v{i} = lo; }}")
        elif low:
            body.append(f"v{i} = {pair} ? v{i} : v{j};")
        elif high:
            body.append(f"v{j} = {pair} ? v{j} : v{i};")
    window = [f"float_of(v{r})" for r in range(k, p - k)]
    result = window[0] if m == 1 else f"({' + '.join(window)}) / {m}.0f"  # C's + is left to right
    functions = []
    for name, word, widen in ROW_TYPES.values():
        rows = "\n".join(f"    const {word} *restrict r{i} = (const {word} *)rows[{i}] + first;" for i in range(p))
        load = " ".join(f"int32_t v{i} = key_of((uint32_t)r{i}[c]{widen});" for i in range(p))
        functions.append(f"""
void trimmed_mean_{name}(const void *const *rows, int64_t first, int64_t n, float *restrict out) {{
{rows}
    for (int64_t c = 0; c < n; c++) {{
        {load}
        {chr(10).join('        ' + line for line in body).lstrip()}
        out[c] = {result};
    }}
}}
""")
    return _PRELUDE + "".join(functions)


@functools.cache
def kernel(p: int, k: int, dtype: torch.dtype) -> Kernel | None:
    """The compiled kernel for p rows of ``dtype`` and window k, built now if this machine has none
    cached; None where there can be none (then the numpy network runs)."""
    if dtype not in ROW_TYPES or not 1 <= p <= MAX_PARTICIPANTS or os.environ.get("MPIFL_NATIVE", "1") == "0":
        return None
    try:
        lib = ctypes.CDLL(str(_built(kernel_source(p, k, window_network(p, k)), cache_dir())))
    except (OSError, subprocess.SubprocessError) as err:
        _warn_once(str(err).strip().splitlines()[-1] if str(err).strip() else type(err).__name__)
        return None
    fn = getattr(lib, f"trimmed_mean_{ROW_TYPES[dtype][0]}")
    fn.argtypes = [ctypes.POINTER(ctypes.c_void_p), ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p]
    fn.restype = None
    return fn


def trimmed_mean(out: np.ndarray, rows: list[torch.Tensor], first: int, k: int) -> bool:
    """Out (fp32, contiguous, n values) = the trimmed mean of columns first..first+n of ``rows``
    (contiguous CPU rows of one dtype); False, with nothing written, where no kernel can be had."""
    dtype = rows[0].dtype
    if not all(r.dtype == dtype and r.device.type == "cpu" and r.is_contiguous() for r in rows):
        return False
    fn = kernel(len(rows), k, dtype)
    if fn is None:
        return False
    fn((ctypes.c_void_p * len(rows))(*(row.data_ptr() for row in rows)), first, out.size, out.ctypes.data)
    return True


@functools.cache
def _warn_once(reason: str) -> None:
    log.warning("robust aggregation runs the numpy sorting network (the same bits, slower): no native kernel "
                "could be built or loaded (%s); MPIFL_NATIVE=0 silences this", reason)


def _built(source: str, folder: Path) -> Path:
    """The cached shared library of ``source`` for this compiler and CPU, compiled (atomically) if missing."""
    compiler = shlex.split(os.environ.get("CC", "cc"))
    flags = ["-O3", "-march=native", "-fPIC", "-shared", "-std=c11"]
    key = hashlib.sha256(source.encode() + " ".join(compiler + flags).encode() + _cpu_identity()).hexdigest()[:20]
    path = folder / f"sortnet-{key}.so"
    if path.exists():
        return path
    folder.mkdir(parents=True, exist_ok=True)
    source_path = folder / f".sortnet-{key}.{os.getpid()}.c"  # kept beside the build for reading
    partial = folder / f".{path.name}.{os.getpid()}"
    source_path.write_text(source)
    try:
        for attempt in (flags, [f for f in flags if f != "-march=native"]):  # some compilers lack -march=native
            done = subprocess.run(compiler + attempt + ["-o", str(partial), str(source_path)],
                                  capture_output=True, text=True, timeout=300)
            if done.returncode == 0:
                os.replace(source_path, path.with_suffix(".c"))
                os.replace(partial, path)  # processes building at once each publish a whole file
                return path
        raise OSError(f"{' '.join(compiler)} failed on the generated kernel: {done.stderr.strip() or done.returncode}")
    finally:
        source_path.unlink(missing_ok=True)  # a failed build leaves nothing behind


def _cpu_identity() -> bytes:
    """The CPU's model and feature flags (Linux), else the platform's name: part of the cache key."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
        wanted = [line for line in lines if line.split(":")[0].strip() in ("flags", "Features", "model name")]
        return "\n".join(dict.fromkeys(wanted)).encode()
    except OSError:
        return (platform.processor() + platform.machine()).encode()
