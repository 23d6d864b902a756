"""User code named on the command line by its import path: judges (--judge) and reward functions (--reward_fns)."""
import importlib


def import_object(path: str):
    """'package.module:attr' (or 'package.module.attr') -> the object. ValueError saying what is wrong; the
    caller puts the option's name in front."""
    mod_name, _, attr = path.partition(":") if ":" in path else path.rpartition(".")
    if not mod_name or not attr:
        raise ValueError("expected a dotted path 'module:attr'")
    try:
        return getattr(importlib.import_module(mod_name), attr)
    except (ImportError, AttributeError) as e:
        raise ValueError(f"cannot be imported: {e}") from None
