class CheckpointError(ValueError):
    """A checkpoint or config that cannot be loaded as asked; the message names the file, tensor or field."""


class RequestFailedError(RuntimeError):
    """The engine ended one request because of a fault in its own step (the message says what)."""
