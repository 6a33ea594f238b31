"""The package version, kept apart so every module can import it without cycles."""

__version__ = "0.1.0"

#: Version of the graph contract (DESIGN.md); bumped when attributes change meaning.
FORMAT_VERSION = 1
