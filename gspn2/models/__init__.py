"""timm-style GSPN-2 model family; importing this registers ``gspn2_*`` with ``timm.create_model``."""

from gspn2.models.gspn2 import GSPN2, GSPN2Block, GSPN2Mixer, GSPN2Stage, LocalPerceptionUnit

__all__ = ["GSPN2", "GSPN2Block", "GSPN2Mixer", "GSPN2Stage", "LocalPerceptionUnit"]
