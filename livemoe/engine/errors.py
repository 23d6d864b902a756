"""Every exception of the engine, in one module that imports nothing of ours, so no module has to import another
(and go up the layers) for an exception class. vLLM keeps v1/engine/exceptions.py for the same reason."""


class RequestError(ValueError):
    """A request the engine cannot serve as asked (bad prompt or sampling params); the message names it."""


class GrammarCompileTimeout(RequestError):
    """An output constraint whose compile ran past the caller's time budget (AsyncLLM.compile_grammar)."""


class CheckpointError(ValueError):
    """A checkpoint or config that cannot be loaded as asked; the message names the file, tensor or field."""


class RequestFailedError(RuntimeError):
    """The engine ended one request because of a fault in its own step (the message says what)."""


class WorkerError(RuntimeError):
    """A tensor-parallel worker process failed (the message names its rank and the cause): the engine cannot
    step any more (livemoe/engine/decoder/workers.py)."""


class EngineError(RuntimeError):
    """The engine ended a request that the caller did not stop: a fault of its own in a step (it alone ends
    with this), or a step that failed as a whole (the requests in flight end with this); the loop goes on
    serving new ones."""


class EngineDeadError(EngineError):
    """The engine loop stopped (shut down, or it crashed); requests in flight and new ones get this."""


class EngineSleepingError(EngineError):
    """A request sent while the engine sleeps (sleep(); the server answers 503 until wake_up())."""


class EngineConfigError(ValueError):
    """An engine option out of range; the message names it."""


class DecisionFormatError(ValueError):
    """Text that is not a decision; the message says what is wrong."""


class CoreDeadError(RuntimeError):
    """An engine-core process that exited, or never became ready, while starting."""


class MediaError(RequestError):
    """A media item of a request (audio, image, video) that cannot be used: undecodable, too long, the wrong sample
    rate, or not allowed from where it was given; the message names the item."""
