"""Build a C kernel for this very CPU once, cache the shared library, load it with ctypes.

The source (with the headers beside it, ``vec.h``) is compiled with the system C compiler (``$CC``,
else ``cc``) for the host's instruction set (``-march=native``; ``$SIDECAR_CPU_ARCH_FLAGS`` replaces that, e.g.
``-mavx2 -mfma`` builds a kernel's AVX2 path on an AVX-512 machine) with OpenMP. The library
is cached under ``$SIDECAR_HOME/kernels/`` keyed by the source and headers, the flags, the compiler and
the CPU's feature flags, so a machine with another CPU builds its own. Concurrent first uses
build once under a file lock. Anything that fails (no compiler, no OpenMP, a compile
error) returns None with the reason, and the caller keeps its torch path.

Each wrapper module declares its kernel once as a ``Kernel``: the source's name and the C signatures of
the functions it exports (``P`` a tensor's ``data_ptr()``, ``I`` an int, ``F`` a float, an ``Args`` subclass a
pointer to that argument struct: an entry point of more than a few parameters takes one). The library's
attribute for each is a ``KernelFunction``: the ctypes function, and the hook through which a decode step's
calls are recorded for replay from C (``replay.py``) while a recorder is installed (``set_recorder``); a
recorder answering true plans the step instead: the call is noted and not made.
"""

from __future__ import annotations

import ctypes
import fcntl
import hashlib
import logging
import os
import shutil
import subprocess
import threading
from pathlib import Path
from typing import Callable, Optional, Sequence

log = logging.getLogger("sidecar.kernels")

FLAGS = (
    "-O3",
    "-fopenmp",
    "-shared",
    "-fPIC",
    "-fno-math-errno",
    "-ffp-contract=off",
)  # fma only where written
P = ctypes.c_void_p
I = ctypes.c_int
F = ctypes.c_float
_loaded: dict[str, Optional[ctypes.CDLL]] = {}
_reasons: dict[str, str] = {}
_recording = threading.local()  # .recorder: the calling thread's, when set


def set_recorder(recorder: Optional[Callable[["KernelFunction", tuple], bool]]) -> None:
    """While set, every kernel call the calling thread makes (through any ``Kernel``'s library) is passed to
    ``recorder(function, args)`` before it runs; other threads' calls are not, nor calls without arguments (a
    library's answers about itself -- what it was built with, what the CPU grants it -- which read no step's
    buffers and must answer as themselves while a step is recorded or planned). Where the recorder returns true
    the call is not made (a plan's pass: nothing is computed) and returns 0 (None for a void function), as
    a call that succeeded. None stops that."""
    _recording.recorder = recorder


class Args(ctypes.Structure):
    """Base of the ctypes mirrors of the kernels' argument structs. A subclass names its C typedef in ``c_name``;
    every library taking it exports ``int <c_name>_size(void)``, checked against the mirror's size at load. Its
    pointer fields are ``ctypes.c_void_p`` (a replay relocates those that point into a step's own tensors), its
    other fields plain values. A function declared with it takes an instance (passed by reference)."""

    c_name = ""


class KernelFunction:
    """One exported C function as its wrappers call it: ``self(*args)`` calls the ctypes function (and hands
    the call to the recorder, when one is set). ``address``, ``argtypes`` and ``restype`` describe it for a
    replay."""

    __slots__ = ("function", "name", "argtypes", "restype", "address")

    def __init__(self, function, name: str, argtypes: Sequence[type], restype: Optional[type]) -> None:
        self.function, self.name = function, name
        self.argtypes, self.restype = tuple(argtypes), restype
        self.address = ctypes.cast(function, ctypes.c_void_p).value

    def __call__(self, *args):
        recorder = getattr(_recording, "recorder", None) if args else None  # a query is never recorded
        if recorder is not None and recorder(self, args):  # a planning pass: noted, not made
            return None if self.restype is None else 0
        return self.function(*args)


def enabled() -> bool:
    return os.environ.get("SIDECAR_CPU_KERNELS", "1").strip().lower() not in ("0", "false", "no", "off")


def arch_flags() -> tuple[str, ...]:
    return tuple(os.environ.get("SIDECAR_CPU_ARCH_FLAGS", "").split()) or ("-march=native",)


def _cpu_flags() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as fh:
            for line in fh:
                if line.startswith("flags"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return ""


def _build(source: Path, out: Path, cc: str, flags: tuple[str, ...]) -> None:
    tmp = out.with_suffix(f".{os.getpid()}.tmp")
    cmd = [cc, *flags, str(source), "-o", str(tmp), "-lm"]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    if res.returncode != 0:
        tmp.unlink(missing_ok=True)
        raise RuntimeError(f"{' '.join(cmd)} failed: {res.stderr.strip()[-500:]}")
    os.replace(tmp, out)


def _configure(lib: ctypes.CDLL, configure: Optional[Callable[[ctypes.CDLL], None]]) -> ctypes.CDLL:
    if configure is not None and not getattr(lib, "_sidecar_configured", False):
        configure(lib)
        lib._sidecar_configured = True
    return lib


def load(name: str, configure: Optional[Callable[[ctypes.CDLL], None]] = None) -> Optional[ctypes.CDLL]:
    """The compiled library for ``kernels/<name>.c``, or None (see ``reason(name)``). ``configure`` runs
    once on a library (argument types, values asked of it once) before anyone gets it."""
    if name in _loaded:
        lib = _loaded[name]
        if lib is not None:
            _configure(lib, configure)
        return lib
    flags = (*FLAGS, *arch_flags())
    lib = None
    try:
        if not enabled():
            raise RuntimeError("switched off by SIDECAR_CPU_KERNELS=0")
        cc = os.environ.get("CC") or "cc"
        cc_path = shutil.which(cc)
        if cc_path is None:
            raise RuntimeError(f"no C compiler ({cc}) on PATH")
        source = Path(__file__).with_name(f"{name}.c")
        headers = [h.read_text() for h in sorted(source.parent.glob("*.h"))]  # what the sources include
        key = hashlib.sha256(
            "\0".join([source.read_text(), *headers, " ".join(flags), cc_path, _cpu_flags()]).encode()
        ).hexdigest()[:16]
        from sidecar.model.demo import sidecar_home

        out = sidecar_home() / "kernels" / f"{name}-{key}.so"
        out.parent.mkdir(parents=True, exist_ok=True)
        if not out.exists():
            with open(out.parent / f".{out.name}.lock", "w") as lock:
                fcntl.flock(lock, fcntl.LOCK_EX)
                if not out.exists():
                    _build(source, out, cc_path, flags)
        lib = _configure(ctypes.CDLL(str(out)), configure)
    except (OSError, RuntimeError, subprocess.SubprocessError, AttributeError) as exc:
        lib = None
        _reasons[name] = str(exc)
        log.info("CPU kernel %s not used (torch path instead): %s", name, exc)
    _loaded[name] = lib
    return lib


def reason(name: str) -> str:
    """Why ``load(name)`` returned None ('' when it did not)."""
    return _reasons.get(name, "")


class Kernel:
    """``kernels/<name>.c`` as its wrapper sees it: ``signatures`` maps each exported function to its
    (argument types, result type); ``setup`` runs once on the loaded library after they are set (values
    asked of the library once, e.g. what the build supports)."""

    def __init__(
        self,
        name: str,
        signatures: dict[str, tuple[Sequence[type], Optional[type]]],
        setup: Optional[Callable[[ctypes.CDLL], None]] = None,
    ) -> None:
        self.name = name
        self._signatures = signatures
        self._setup = setup

    def _configure(self, lib: ctypes.CDLL) -> None:
        for fn, (argtypes, restype) in self._signatures.items():
            func = getattr(lib, fn)
            func.argtypes = [ctypes.POINTER(t) if _is_args(t) else t for t in argtypes]
            func.restype = restype
            for t in filter(_is_args, argtypes):
                size = getattr(lib, f"{t.c_name}_size")
                size.restype = ctypes.c_int
                if size() != ctypes.sizeof(t):
                    raise RuntimeError(f"{t.c_name}: {size()} bytes in C, {ctypes.sizeof(t)} in its mirror")
            setattr(lib, fn, KernelFunction(func, fn, argtypes, restype))
        if self._setup is not None:
            self._setup(lib)

    def lib(self) -> Optional[ctypes.CDLL]:
        """The configured library, or None (``reason(name)`` says why)."""
        return load(self.name, self._configure)

    def available(self) -> bool:
        return self.lib() is not None


def _is_args(kind: type) -> bool:
    return isinstance(kind, type) and issubclass(kind, Args)


def _dropped() -> None:
    return None


class LayerView:
    """Base of the kernels' checked views of a layer's operands (``int4_gemv.Layer``, ``int8_gemv.Layer``,
    ``bf16_gemv.TiledLayer``): a copy or pickle of the module holding one drops it (it holds a C function),
    and the copy builds its own over its own buffers."""

    __slots__ = ()

    def __reduce__(self):
        return (_dropped, ())
