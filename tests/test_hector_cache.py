"""hector's kernel cache and compiler errors: entries that pass their digest but cannot be loaded
are rebuilt once; compilers that fail, cannot run or write nothing give a `CompileError` naming
the compiler."""

import os
import re
import subprocess
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from isolation import run_isolated
from test_hector import random_graph, reference_message

from jaxdata import _xla_ffi as ext
from jaxdata import hector
from jaxdata.hector import compiler


def _case():
  rng = np.random.default_rng(11)
  g = random_graph(rng, n=20, e=80, r=3, empty_relations=())
  x = rng.standard_normal((g.num_nodes, 6)).astype(np.float32)
  w = rng.standard_normal((g.num_relations, 6, 5)).astype(np.float32)
  return g, x, w


def run_rgcn():
  """In a fresh process (no kernel loaded yet): RGCN's forward, and the warnings it gave."""
  g, x, w = _case()
  with warnings.catch_warnings(record=True) as seen:
    warnings.simplefilter("always")
    out = np.asarray(
      hector.rgcn_message(hector.GraphArrays.from_graph(g), jnp.asarray(x), jnp.asarray(w))
    )
  return out, [str(m.message) for m in seen]


def _foreign_library(tmp_path) -> bytes:
  """A valid shared library without the kernel's symbol."""
  src = tmp_path / "foreign.cc"
  src.write_text('extern "C" int something_else() { return 7; }\n')
  subprocess.run(
    [compiler.cxx(), "-shared", "-fPIC", str(src), "-o", str(tmp_path / "f.so")], check=True
  )
  return (tmp_path / "f.so").read_bytes()


@pytest.mark.parametrize("damage", ["truncated", "foreign"])
def test_entry_that_passes_its_digest_but_cannot_load_is_rebuilt(tmp_path, damage):
  cache = tmp_path / "cache"
  env = {"JAXDATA_CACHE_DIR": str(cache), "JAX_PLATFORMS": "cpu"}  # CPU kernels: .so entries
  first, _ = run_isolated(run_rgcn, env=env)
  entries = sorted((cache / "hector").glob("*.so"))
  assert entries
  foreign = _foreign_library(tmp_path)
  for so in entries:
    data = so.read_bytes()[:200] if damage == "truncated" else foreign
    so.write_bytes(data)
    so.with_suffix(".sha256").write_text(compiler._digest(data))
  again, seen = run_isolated(run_rgcn, env=env)
  assert any("cannot be loaded" in m and "rebuilding" in m for m in seen), seen
  np.testing.assert_array_equal(again, first)
  g, x, w = _case()
  np.testing.assert_allclose(again, reference_message(g, x, w), rtol=1e-5, atol=1e-5)
  for so in entries:  # the rebuilt entries are kernels again, with their digests
    assert so.read_bytes() != foreign and len(so.read_bytes()) > 200
    assert compiler._digest(so.read_bytes()) == so.with_suffix(".sha256").read_text()


def _unique_source(tag: str) -> str:
  return f'// {tag}\nextern "C" int jaxdata_hector_kernel() {{ return {abs(hash(tag)) % 1000}; }}\n'


def _script(tmp_path, body: str) -> str:
  path = tmp_path / "fake-c++"
  path.write_text("#!/bin/sh\n" + body)
  path.chmod(0o755)
  return str(path)


def test_rebuilt_entry_that_still_cannot_load_raises_compile_error(tmp_path, monkeypatch):
  """A 'compiler' that writes garbage: the rebuilt binary fails to load too -> CompileError."""
  monkeypatch.setenv("JAXDATA_CACHE_DIR", str(tmp_path / "cache"))
  fake = _script(tmp_path, 'while [ $# -gt 1 ]; do shift; done; echo garbage > "$1"\n')
  monkeypatch.setenv("CXX", fake)
  kid = int.from_bytes(os.urandom(7), "little")
  load = lambda path: ext.hector_load_cpu_kernel(kid, str(path), "jaxdata_hector_kernel")  # noqa
  with pytest.raises(compiler.CompileError, match=f"{re.escape(fake)}.*cannot be loaded"):
    compiler.compile_cpu(_unique_source(str(tmp_path)), load=load)
  # and through a layer: the lowering reports it as a CompileError, not a dlopen error
  g = random_graph(np.random.default_rng(3), n=9, e=20, r=2, empty_relations=())
  with jax.default_device(jax.devices("cpu")[0]):  # the CPU kernels are what $CXX builds
    with pytest.raises(compiler.CompileError, match="cannot be loaded"):
      hector.rgcn_message(hector.GraphArrays.from_graph(g), jnp.ones((9, 13)), jnp.ones((2, 13, 3)))


def test_compiler_that_writes_nothing_raises_compile_error_naming_it(tmp_path, monkeypatch):
  monkeypatch.setenv("JAXDATA_CACHE_DIR", str(tmp_path))
  monkeypatch.setenv("CXX", "/bin/true")
  with pytest.raises(compiler.CompileError, match="wrote no .so file.*/bin/true"):
    compiler.compile_cpu(_unique_source(str(tmp_path)))


def test_missing_or_failing_compiler_raises_compile_error_naming_it(tmp_path, monkeypatch):
  monkeypatch.setenv("JAXDATA_CACHE_DIR", str(tmp_path))
  monkeypatch.setenv("CXX", "/nonexistent/c++")
  with pytest.raises(compiler.CompileError, match="/nonexistent/c\\+\\+"):
    compiler.compile_cpu(_unique_source(str(tmp_path)))
  failing = _script(tmp_path, "echo 'no such luck' >&2; exit 3\n")
  monkeypatch.setenv("CXX", failing)
  with pytest.raises(compiler.CompileError, match=f"(?s){re.escape(failing)}.*no such luck"):
    compiler.compile_cpu(_unique_source(str(tmp_path) + "b"))
