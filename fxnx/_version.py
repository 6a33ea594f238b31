"""The package version, kept apart so every module can import it without cycles."""

from ._contract import FORMAT_VERSION

__all__ = ["FORMAT_VERSION", "__version__"]

__version__ = "0.1.0"
