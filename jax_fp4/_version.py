"""The package version: the single source (pyproject.toml reads it through scikit-build-core's regex provider)."""

__version__ = "0.2.0"
