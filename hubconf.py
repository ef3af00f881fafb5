"""torch.hub entry points: ``torch.hub.load("<checkout>", "gspn2_tiny", source="local", num_classes=10)``.

Each entry builds the timm-registered GSPN-2 model of that name; keyword arguments go to
``timm.create_model`` (``num_classes``, ``drop_path_rate``, ``features_only``, ...).
No pretrained weights are published: load your own with ``model.load_state_dict`` or fine-tune with
``train.py initial_checkpoint=...``.
"""

dependencies = ["torch", "timm"]


def _create(name: str, pretrained: bool, kwargs: dict):
    import timm

    import gspn2  # noqa: F401  (registers the gspn2_* models with timm)

    if pretrained:
        raise ValueError(f"pretrained=True: no pretrained weights are published for {name}")
    return timm.create_model(name, pretrained=False, **kwargs)


def gspn2_micro(pretrained: bool = False, **kwargs):
    """GSPN-2 micro (0.4 M parameters, 32x32 inputs; tests and CPU demos)."""
    return _create("gspn2_micro", pretrained, kwargs)


def gspn2_tiny(pretrained: bool = False, **kwargs):
    """GSPN-2-T (24 M parameters, 4.2 G MACs at 224x224)."""
    return _create("gspn2_tiny", pretrained, kwargs)


def gspn2_small(pretrained: bool = False, **kwargs):
    """GSPN-2-S (50 M parameters, 9.2 G MACs at 224x224)."""
    return _create("gspn2_small", pretrained, kwargs)


def gspn2_base(pretrained: bool = False, **kwargs):
    """GSPN-2-B (89 M parameters, 14.4 G MACs at 224x224)."""
    return _create("gspn2_base", pretrained, kwargs)
