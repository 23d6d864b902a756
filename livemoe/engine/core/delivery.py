"""Handing a step's outputs to their streams on the callers' event loops, from the thread that stepped (the
in-thread engine's or the engine-core client's reader)."""
import concurrent.futures


def settle(future: concurrent.futures.Future, error: BaseException) -> None:
    try:
        future.set_exception(error)
    except concurrent.futures.InvalidStateError:
        pass  # the engine settled it first


def deliver(items: list[tuple], on_closed_loop=None) -> None:
    """Hands each (stream, RequestOutput or error) to its stream (a RequestStream: its loop and push), from the engine's thread: one
    call_soon_threadsafe per caller event loop for all its items (each wakes that loop once), in order.
    on_closed_loop(stream, item) is called for the items whose loop is closed (nobody will read them)."""
    by_loop: dict = {}
    for stream, item in items:
        by_loop.setdefault(stream.loop, []).append((stream, item))
    for loop, batch in by_loop.items():
        try:
            loop.call_soon_threadsafe(push_all, batch)
        except RuntimeError:  # the caller's loop is closed
            if on_closed_loop is not None:
                for stream, item in batch:
                    on_closed_loop(stream, item)


def push_all(items) -> None:
    for stream, item in items:
        stream.push(item)
