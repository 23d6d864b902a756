"""Option checks shared by the engine's config classes (EngineConfig, SpeculativeConfig), each failing through the
caller's `fail`, which names the class in the message."""


def check_positive_ints(obj, names, fail) -> None:
    """Each of obj's attributes `names` must be an int > 0 (a bool is not one)."""
    for name in names:
        value = getattr(obj, name)
        if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
            fail(f"{name} must be a positive integer, got {value!r}")
