"""Sockets that hold a connection without a request: a client that connects and sends nothing, or trickles
its headers, is dropped after `header_timeout_s` (ServerConfig; uvicorn has no such limit: its keep-alive
timeout only runs between a response and the next request's first byte). A small subclass of uvicorn's own
HTTP protocol (httptools' or h11's, whichever uvicorn picks) with one timer per connection:

- started when the connection is made, and again when the first bytes of a next request arrive;
- stopped once a request's headers are in (its body has the guard's --body-timeout-s; see guard.py);
- when it fires with no request under way, the connection is closed.
"""
import asyncio


def header_timeout_protocol(timeout_s: float) -> type[asyncio.Protocol]:
    """uvicorn's HTTP protocol class, with connections dropped after timeout_s without a request's headers."""
    from uvicorn.protocols.http.auto import AutoHTTPProtocol

    class HeaderTimeoutProtocol(AutoHTTPProtocol):  # type: ignore[misc,valid-type]
        header_timer: asyncio.TimerHandle | None = None

        def connection_made(self, transport) -> None:
            super().connection_made(transport)
            self._start_timer()

        def data_received(self, data: bytes) -> None:
            waiting = self._waiting_for_headers()
            if waiting and self.header_timer is None:  # the first bytes of a next request
                self._start_timer()
            super().data_received(data)
            if not self._waiting_for_headers():  # its headers are in (parsed within data_received)
                self._stop_timer()

        def connection_lost(self, exc) -> None:
            self._stop_timer()
            super().connection_lost(exc)

        def _waiting_for_headers(self) -> bool:
            return self.cycle is None or self.cycle.response_complete

        def _start_timer(self) -> None:
            self._stop_timer()
            self.header_timer = self.loop.call_later(timeout_s, self._timed_out)

        def _stop_timer(self) -> None:
            if self.header_timer is not None:
                self.header_timer.cancel()
                self.header_timer = None

        def _timed_out(self) -> None:
            self.header_timer = None
            if self._waiting_for_headers() and not self.transport.is_closing():
                self.transport.close()

    return HeaderTimeoutProtocol
