"""The version of somatize, said once: the package, its metadata and its records read it here."""

__version__ = "1.1.0"
