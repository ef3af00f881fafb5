"""Names of the registered model family, shared by the model tests."""

MODEL_NAMES = ("gspn2_micro", "gspn2_tiny", "gspn2_small", "gspn2_base")
BIG_MODELS = ("gspn2_tiny", "gspn2_small", "gspn2_base")
