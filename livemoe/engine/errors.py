class CheckpointError(ValueError):
    """A checkpoint or config that cannot be loaded as asked; the message names the file, tensor or field."""


class RequestFailedError(RuntimeError):
    """The engine ended one request because of a fault in its own step (the message says what)."""


class WorkerError(RuntimeError):
    """A tensor-parallel worker process failed (the message names its rank and the cause): the engine cannot
    step any more (livemoe/engine/parallel/workers.py)."""
