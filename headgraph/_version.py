"""The package version, in a module of its own so that every module can import it without importing the
package's lazy public API (headgraph/__init__.py)."""

__version__ = "0.1.0"
