"""Compiling generated source at run time, with a disk cache keyed by the source's hash.

CPU kernels are built into shared libraries by the system C++ compiler (``$CXX``, else ``c++``,
``g++`` or ``clang++``); CUDA kernels into cubins by NVRTC (the ``nvidia-cuda-nvrtc`` wheel that
``jax[cuda]`` installs, or a CUDA toolkit's), or by ``nvcc`` when NVRTC is not found.

The cache lives in ``$JAXDATA_CACHE_DIR`` (default ``~/.cache/jaxdata``), under ``hector/``. An
entry is ``<key>.so`` or ``<key>.cubin`` with the source beside it (``<key>.cc`` / ``<key>.cu``,
for reading) and ``<key>.sha256``, the digest of the binary: an entry whose binary does not match
its digest (a torn write, a corrupted disk) is rebuilt, never loaded; so is an entry that
matches its digest but cannot be loaded (`load` fails: a foreign or truncated binary with a
digest written for it), once: if the rebuilt binary cannot be loaded either, `CompileError`
says why. Entries are written to a temporary name and renamed into place, so concurrent
processes never see half a file.

A compiler that fails, cannot be run (``CXX=/nonexistent``) or reports success without writing
its output (``CXX=/bin/true``) raises `CompileError` naming it.
"""

from __future__ import annotations

import ctypes
import glob
import hashlib
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import warnings
from pathlib import Path

from jaxdata import timing
from jaxdata.timing import CacheDirError  # noqa: F401 - raised by cache_dir, caught by the CLI

CPU_FLAGS = ("-O3", "-march=native", "-std=c++17", "-shared", "-fPIC", "-fno-math-errno")


class CompilerNotFoundError(RuntimeError):
  """No compiler for generated kernels: the message says what to install."""


class CompileError(RuntimeError):
  """A generated kernel did not compile or load: the message names the compiler and holds its
  log (with a working compiler, a bug in jaxdata)."""


def cache_dir() -> Path:
  """$JAXDATA_CACHE_DIR/hector (default ~/.cache/jaxdata/hector), made if missing;
  CacheDirError where it cannot be (a file in its place, no permission)."""
  return timing.cache_dir("hector", "hector's kernel cache")


def _digest(data: bytes) -> str:
  return hashlib.sha256(data).hexdigest()


def _write_atomic(path: Path, data: bytes):
  fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name + ".")
  try:
    with os.fdopen(fd, "wb") as f:
      f.write(data)
    os.replace(tmp, path)
  except BaseException:
    Path(tmp).unlink(missing_ok=True)
    raise


def source_key(source: str, key_parts: tuple[str, ...]) -> str:
  """The cache key of `source` built with `key_parts`, leaving out a leading ``//`` line
  (`cached`)."""
  code = source.split("\n", 1)[1] if source.startswith("//") and "\n" in source else source
  return _digest("\0".join((code,) + key_parts).encode())[:32]


def cached(key_parts: tuple[str, ...], suffix: str, source: str, build, load=None) -> Path:
  """The cached binary for `source`, building it with `build(source_path, out_path)` if absent or
  corrupt. `key_parts` identify everything else that shapes the binary (compiler, flags, arch).
  `load(path)`, if given, loads the binary; an entry found on disk that fails to load is rebuilt
  once, and a fresh build that fails to load raises `CompileError`.

  The key leaves out a leading ``//`` comment line: generated kernels name their instance there
  with IR value ids (``%98``), which depend on the order a process traced its layers in, so the
  same kernel would otherwise be rebuilt whenever a program is planned in another order."""
  key = source_key(source, key_parts)
  d = cache_dir()
  binary, digest = d / f"{key}{suffix}", d / f"{key}.sha256"
  if binary.exists() and digest.exists():
    if _digest(binary.read_bytes()) == digest.read_text().strip():
      try:
        if load is not None:
          load(binary)
        return binary
      except (OSError, RuntimeError) as e:
        warnings.warn(
          f"jaxdata.hector: cache entry {binary} cannot be loaded ({e}); rebuilding it",
          stacklevel=3,
        )
    else:
      warnings.warn(f"jaxdata.hector: cache entry {binary} is corrupt; rebuilding it", stacklevel=3)
  src_path = d / f"{key}{'.cu' if suffix == '.cubin' else '.cc'}"
  _write_atomic(src_path, source.encode())
  with tempfile.TemporaryDirectory(dir=d) as tmp:
    out = Path(tmp) / f"kernel{suffix}"
    build(src_path, out)
    if not out.is_file() or out.stat().st_size == 0:
      raise CompileError(
        f"jaxdata.hector: the compiler reported success on {src_path} but wrote "
        f"no {suffix} file ({getattr(build, 'compiler', 'the compiler')})"
      )
    data = out.read_bytes()
  _write_atomic(binary, data)
  _write_atomic(digest, _digest(data).encode())
  if load is not None:
    try:
      load(binary)
    except (OSError, RuntimeError) as e:
      raise CompileError(
        f"jaxdata.hector: {binary}, freshly built from {src_path} by "
        f"{getattr(build, 'compiler', 'the compiler')}, cannot be loaded: {e}"
      ) from e
  return binary


def _run_compiler(cmd: list[str], src: Path):
  """Runs a compiler command; CompileError naming the compiler if it cannot run or fails."""
  try:
    proc = subprocess.run(cmd, capture_output=True, text=True)
  except OSError as e:
    raise CompileError(f"jaxdata.hector: cannot run the compiler {cmd[0]!r}: {e}") from e
  if proc.returncode != 0:
    raise CompileError(
      f"generated kernel {src} failed to compile with {cmd[0]}:\n"
      f"{' '.join(cmd)}\n{proc.stderr[-4000:]}"
    )


# ----------------------------------------------------------------------------- CPU
def cxx() -> str:
  """The C++ compiler: ``$CXX`` when set (CompileError if it is not an executable), else the
  first of c++, g++, clang++ on PATH."""
  named = os.environ.get("CXX")
  if named:
    found = shutil.which(named)
    if found is None:
      raise CompileError(
        f"jaxdata.hector: $CXX={named!r} is not an executable C++ compiler; "
        "point $CXX at one, or unset it to use c++, g++ or clang++ from PATH"
      )
    return found
  for name in ("c++", "g++", "clang++"):
    found = shutil.which(name)
    if found:
      return found
  raise CompilerNotFoundError(
    "jaxdata.hector compiles its CPU kernels at run time and found no C++ compiler: install one "
    "(e.g. `apt install g++` or `conda install gxx`) or point $CXX at it."
  )


def _cpu_identity() -> tuple[str, ...]:
  """What shapes a CPU binary besides its source: the flags and, for -march=native, the CPU.
  (Not the compiler: an entry found on disk needs no compiler at all.)"""
  cpu = platform.processor() or platform.machine()
  try:  # -march=native: the binary belongs to this CPU model
    with open("/proc/cpuinfo") as f:
      cpu = next((line for line in f if line.startswith("model name")), cpu)
  except OSError:
    pass
  return (cpu,) + CPU_FLAGS


def compile_cpu(source: str, load=None) -> Path:
  """Path of a shared library built from `source` (cached; `load` as in `cached`)."""

  def build(src: Path, out: Path):
    build.compiler = cxx()
    _run_compiler([build.compiler, *CPU_FLAGS, str(src), "-o", str(out)], src)

  return cached(_cpu_identity(), ".so", source, build, load)


# ----------------------------------------------------------------------------- CUDA
def _nvrtc_candidates() -> list[str]:
  out = []
  for entry in sys.path:  # pip wheels: nvidia/cu13/lib, nvidia/cuda_nvrtc/lib
    out += sorted(glob.glob(os.path.join(entry, "nvidia", "*", "lib", "libnvrtc.so*")))
  out += [p for p in ("libnvrtc.so", "libnvrtc.so.13", "libnvrtc.so.12")]
  home = os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH") or "/usr/local/cuda"
  out += sorted(glob.glob(os.path.join(home, "lib64", "libnvrtc.so*")))
  return [p for p in out if "builtins" not in p and "alt" not in os.path.basename(p)]


_NVRTC = None


def nvrtc():
  """The NVRTC library (ctypes), or None when none can be loaded."""
  global _NVRTC
  if _NVRTC is None:
    _NVRTC = False
    for path in _nvrtc_candidates():
      try:
        lib = ctypes.CDLL(path)
        lib.nvrtcGetErrorString.restype = ctypes.c_char_p
        _NVRTC = lib
        break
      except OSError:
        continue
  return _NVRTC or None


def _nvrtc_version(lib) -> str:
  major, minor = ctypes.c_int(), ctypes.c_int()
  lib.nvrtcVersion(ctypes.byref(major), ctypes.byref(minor))
  return f"{major.value}.{minor.value}"


def _nvrtc_build(lib, arch: int):

  def build(src: Path, out: Path):
    prog = ctypes.c_void_p()
    build.compiler = "NVRTC"

    def check(status, what):
      if status != 0:
        raise CompileError(f"NVRTC {what}: {lib.nvrtcGetErrorString(status).decode()}")

    check(
      lib.nvrtcCreateProgram(
        ctypes.byref(prog), src.read_bytes(), str(src).encode(), 0, None, None
      ),
      "create",
    )
    try:
      opts = [f"--gpu-architecture=sm_{arch}".encode(), b"--std=c++17", b"-default-device"]
      status = lib.nvrtcCompileProgram(prog, len(opts), (ctypes.c_char_p * len(opts))(*opts))
      if status != 0:
        size = ctypes.c_size_t()
        lib.nvrtcGetProgramLogSize(prog, ctypes.byref(size))
        log = ctypes.create_string_buffer(size.value)
        lib.nvrtcGetProgramLog(prog, log)
        raise CompileError(
          f"generated kernel {src} failed to compile with NVRTC:\n"
          f"{log.value.decode(errors='replace')[-4000:]}"
        )
      size = ctypes.c_size_t()
      check(lib.nvrtcGetCUBINSize(prog, ctypes.byref(size)), "cubin size")
      image = ctypes.create_string_buffer(size.value)
      check(lib.nvrtcGetCUBIN(prog, image), "cubin")
      out.write_bytes(image.raw)
    finally:
      lib.nvrtcDestroyProgram(ctypes.byref(prog))

  return build


def _nvcc_build(nvcc: str, arch: int):

  def build(src: Path, out: Path):
    build.compiler = nvcc
    _run_compiler(
      [
        nvcc,
        "-cubin",
        f"-arch=sm_{arch}",
        "-std=c++17",
        "-O3",
        "-x",
        "cu",
        str(src),
        "-o",
        str(out),
      ],
      src,
    )

  return build


def compile_cuda(source: str, arch: int, load=None) -> Path:
  """Path of a cubin for compute capability `arch` (e.g. 90) built from `source` (cached;
  `load` as in `cached`)."""
  lib = nvrtc()
  if lib is not None:
    return cached(
      ("nvrtc", _nvrtc_version(lib), str(arch)), ".cubin", source, _nvrtc_build(lib, arch), load
    )
  nvcc = shutil.which("nvcc")
  if nvcc is not None:
    return cached(("nvcc", nvcc, str(arch)), ".cubin", source, _nvcc_build(nvcc, arch), load)
  raise CompilerNotFoundError(
    "jaxdata.hector compiles its CUDA kernels at run time and found neither NVRTC nor nvcc: "
    "install the NVRTC wheel (`pip install nvidia-cuda-nvrtc`, which `jax[cuda13]` brings) or "
    "a CUDA toolkit, or set CUDA_HOME."
  )
