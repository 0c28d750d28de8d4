"""weightlift: open, plan and load large language models on small machines."""

from weightlift._native import __version__

__all__ = ["__version__"]
