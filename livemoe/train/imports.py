"""User code named on the command line by its import path: judges (--judge) and reward functions (--reward_fns)."""
import importlib


def split_path(path: str) -> tuple[str, str]:
    """'package.module:attr' (or 'package.module.attr') -> ('package.module', 'attr'); ValueError when it is
    not such a path."""
    mod_name, _, attr = path.partition(":") if ":" in path else path.rpartition(".")
    if not mod_name or not attr:
        raise ValueError("expected a dotted path 'module:attr'")
    return mod_name, attr


def import_object(path: str):
    """The object a split_path path names. ValueError saying what is wrong; the caller puts the option's name
    in front."""
    mod_name, attr = split_path(path)
    try:
        return getattr(importlib.import_module(mod_name), attr)
    except (ImportError, AttributeError) as e:
        raise ValueError(f"cannot be imported: {e}") from None
