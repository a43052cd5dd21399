"""One HTTP POST that ends at a deadline: connect, send, status line, headers and body together take at most
``timeout`` seconds.

A socket timeout bounds each read, not the request: a server that sends one byte a second never trips it, and the
job waits for as long as the server likes. Here a timer shuts down every socket the request opened when the time is
up (through a duplicate of each, so the request's own socket objects are untouched and no descriptor is reused),
which ends whatever read or write is blocked on it; the request then fails as timed out. Standard library only
(``urllib.request``: proxies from the environment as before). Redirects are not followed: the contract is one POST
answered with status 200 (urllib would resend a redirected POST as a GET without its body).
"""

from __future__ import annotations

import functools
import http.client
import socket
import threading
import urllib.error
import urllib.parse
import urllib.request
from types import TracebackType
from typing import Any

__all__ = ["Answer", "DeadlineExceeded", "RedirectRefused", "post", "reachable"]


class DeadlineExceeded(TimeoutError):
    """The request did not finish within its timeout."""


class RedirectRefused(Exception):
    """The server answered with a redirect (3xx); ``location`` is where it pointed."""

    def __init__(self, status: int, reason: str, location: str | None) -> None:
        super().__init__(status, reason, location)
        self.status, self.reason, self.location = status, reason, location


class Answer:
    """A finished exchange: the status, its reason phrase and at most ``limit`` + 1 bytes of the body."""

    def __init__(self, status: int, reason: str, body: bytes) -> None:
        self.status, self.reason, self.body = status, reason, body


class _Deadline:
    """Shuts down the request's sockets when ``seconds`` have passed (a timer thread); ``expired`` says it did."""

    def __init__(self, seconds: float) -> None:
        self.expired = False
        self._copies: list[socket.socket] = []
        self._lock = threading.Lock()
        self._timer = threading.Timer(seconds, self._expire)
        self._timer.daemon = True

    def watch(self, sock: socket.socket) -> None:
        """Shut ``sock`` down at the deadline (at once when it has passed)."""
        copy = sock.dup()
        with self._lock:
            self._copies.append(copy)
            if self.expired:
                _shutdown(copy)

    def _expire(self) -> None:
        with self._lock:
            self.expired = True
            for copy in self._copies:
                _shutdown(copy)

    def __enter__(self) -> _Deadline:
        self._timer.start()
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        self._timer.cancel()
        with self._lock:
            for copy in self._copies:
                copy.close()
            self._copies.clear()


def _shutdown(sock: socket.socket) -> None:
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:  # not connected (any more)
        pass


class _Watched(http.client.HTTPConnection):
    """A connection whose socket the deadline watches from the moment it is connected (before a TLS handshake:
    ``HTTPSConnection.connect`` wraps the socket after this class's ``connect`` returns)."""

    def __init__(self, *args: Any, deadline: _Deadline, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._deadline = deadline

    def connect(self) -> None:
        super().connect()
        self._deadline.watch(self.sock)


class _WatchedHTTPS(http.client.HTTPSConnection, _Watched):
    pass


class _HTTP(urllib.request.HTTPHandler):
    def __init__(self, deadline: _Deadline) -> None:
        super().__init__()
        self._deadline = deadline

    def http_open(self, req: urllib.request.Request) -> Any:
        return self.do_open(functools.partial(_Watched, deadline=self._deadline), req)


class _HTTPS(urllib.request.HTTPSHandler):
    def __init__(self, deadline: _Deadline) -> None:
        super().__init__()
        self._deadline = deadline

    def https_open(self, req: urllib.request.Request) -> Any:
        return self.do_open(functools.partial(_WatchedHTTPS, deadline=self._deadline), req)


class _NoRedirect(urllib.request.HTTPRedirectHandler):
    def redirect_request(self, *args: Any, **kwargs: Any) -> None:
        return None  # urllib then raises the 3xx as an HTTPError


def post(url: str, body: bytes, headers: dict[str, str], timeout: float, limit: int) -> Answer:
    """POST ``body`` to ``url`` and read the answer, all within ``timeout`` seconds. Raises ``DeadlineExceeded``,
    ``RedirectRefused``, ``urllib.error.HTTPError`` (a 4xx/5xx status), ``urllib.error.URLError`` (no connection),
    ``OSError`` or ``http.client.HTTPException`` (a broken answer)."""
    request = urllib.request.Request(url, data=body, headers=headers, method="POST")
    with _Deadline(timeout) as deadline:
        opener = urllib.request.build_opener(_HTTP(deadline), _HTTPS(deadline), _NoRedirect())
        try:
            with opener.open(request, timeout=timeout) as response:
                answer = Answer(response.status, response.reason, response.read(limit + 1))
        except urllib.error.HTTPError as exc:
            exc.close()
            if deadline.expired:
                raise DeadlineExceeded from None
            if 300 <= exc.code < 400:
                raise RedirectRefused(exc.code, str(exc.reason), exc.headers.get("Location")) from None
            raise
        except (OSError, http.client.HTTPException, ValueError):
            if deadline.expired:
                raise DeadlineExceeded from None
            raise
        if deadline.expired:  # a body read to a shut-down socket's end: cut short
            raise DeadlineExceeded
    return answer


def reachable(url: str, timeout: float) -> str | None:
    """Why a TCP connection to the server of ``url`` (or to the proxy a POST to it would go through, from the
    environment as ``urllib`` reads it) cannot be opened within ``timeout`` seconds; None when it can. Nothing is
    sent: the start-up probe of an HTTP reward, so that a server that is not there stops the run before the model
    is built rather than at the first iteration's scoring."""
    parts = urllib.parse.urlsplit(url)
    proxy = urllib.request.getproxies().get(parts.scheme)
    if proxy and not urllib.request.proxy_bypass(parts.hostname or ""):
        parts = urllib.parse.urlsplit(proxy if "://" in proxy else f"http://{proxy}")
    port = parts.port or (443 if parts.scheme == "https" else 80)
    try:
        with socket.create_connection((parts.hostname, port), timeout=timeout):
            return None
    except OSError as exc:
        return f"cannot be reached ({parts.hostname}:{port}: {exc.strerror or exc})"
