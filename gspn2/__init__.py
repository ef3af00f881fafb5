"""gspn2: GSPN-2 spatial propagation networks, operator, models and training."""

__version__ = "0.1.0"

from gspn2 import ops  # noqa: E402,F401  (registers the gspn2:: torch ops)
from gspn2 import models  # noqa: F401

__all__ = ["ops", "__version__"]
