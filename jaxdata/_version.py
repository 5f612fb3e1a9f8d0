"""The version of jaxdata, in a module of its own: any module reads it without importing the
package's top level, and the build reads it from here (pyproject.toml)."""

__version__ = "0.1.0"
