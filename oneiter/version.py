"""The package version, in a leaf module: recordings stamp it (`oneiter_version`) from `record/`, which must not
import the package facade above it (`oneiter/__init__.py` re-exports it as `oneiter.__version__`)."""

__version__ = "0.1.0"
