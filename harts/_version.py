"""The HARTS version (its own module, so that modules inside the package can read it without importing the package)."""

__version__ = "0.1.0"
