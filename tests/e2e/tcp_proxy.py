"""A TCP proxy on 127.0.0.1 that can partition its clients from the server: ``stall()`` stops
forwarding in both directions while every socket stays open (no reset, no error, no close
passed on: what a network partition looks like to the two ends), ``resume()`` lets everything
held flow again, in order. ``lose_answer(marker)``: the server's answer to the next statement
whose bytes contain ``marker`` is dropped and that connection closed at both ends (a commit
that went through, its answer lost to the client). ``down()``: every connection is closed
and new ones are closed at once, until ``up()`` (a server restarting or failing over). Used
by the partition, the lost answer and the outage end-to-end tests."""

from __future__ import annotations

import contextlib
import socket
import threading

from sqlalchemy.engine import URL, make_url


class StallingProxy:
    def __init__(self, upstream: tuple[str, int]) -> None:
        self._upstream = upstream
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port: int = self._listener.getsockname()[1]
        self._flowing = threading.Event()
        self._flowing.set()
        self._down = False
        self._lock = threading.Lock()
        self._sockets: list[socket.socket] = []
        self._closed = False
        #: Bytes the clients sent that the partition held, and that reached the server only
        #: once it healed (the late writes), and connections opened during the partition.
        self.held_to_server = 0
        self.opened_while_stalled = 0
        self._lose_marker: bytes | None = None
        self._losing: set[int] = set()  # server sockets whose next answer goes nowhere
        self._at_commit = False
        self._committing: set[int] = set()  # server sockets whose next COMMIT's answer does
        #: Answers dropped by ``lose_answer``.
        self.answers_lost = 0
        threading.Thread(target=self._accept, name="proxy-accept", daemon=True).start()

    @classmethod
    def to(cls, url: str | URL) -> StallingProxy:
        """A proxy to the server of the database ``url``."""
        server = make_url(url)
        return cls((server.host or "127.0.0.1", server.port or 5432))

    def through(self, url: str | URL) -> str:
        """``url`` reaching its database through this proxy."""
        proxied = make_url(url).set(host="127.0.0.1", port=self.port)
        return proxied.render_as_string(hide_password=False)

    def stall(self) -> None:
        self._flowing.clear()

    def resume(self) -> None:
        self._flowing.set()

    def down(self) -> None:
        """Close every connection, and every new one at once, until ``up()``."""
        with self._lock:
            self._down = True
            sockets, self._sockets = self._sockets, []
        for sock in sockets:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
            with contextlib.suppress(OSError):
                sock.close()

    def up(self) -> None:
        with self._lock:
            self._down = False

    def lose_answer(self, marker: bytes, *, at_commit: bool = False) -> None:
        """Drop the answer to the next statement containing ``marker``; with ``at_commit``,
        the answer to the ``COMMIT`` that follows it on its connection (a transaction of
        several statements)."""
        self._lose_marker = marker
        self._at_commit = at_commit

    def close(self) -> None:
        self._closed = True
        self._flowing.set()
        with self._lock:
            sockets, self._sockets = self._sockets, []
        for sock in [self._listener, *sockets]:
            with contextlib.suppress(OSError):
                sock.close()

    def _accept(self) -> None:
        while not self._closed:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            if self._down:
                with contextlib.suppress(OSError):
                    client.close()
                continue
            if not self._flowing.is_set():
                with self._lock:
                    self.opened_while_stalled += 1
            threading.Thread(target=self._connect, args=(client,), daemon=True).start()

    def _connect(self, client: socket.socket) -> None:
        # A connection made during the partition reaches the server only once it heals.
        self._flowing.wait()
        try:
            server = socket.create_connection(self._upstream)
        except OSError:
            client.close()
            return
        with self._lock:
            self._sockets += [client, server]
        threading.Thread(target=self._pump, args=(client, server, True), daemon=True).start()
        threading.Thread(target=self._pump, args=(server, client, False), daemon=True).start()

    def _pump(self, source: socket.socket, target: socket.socket, to_server: bool) -> None:
        try:
            while True:
                data = source.recv(65536)
                if not self._flowing.is_set():
                    if to_server:
                        with self._lock:
                            self.held_to_server += len(data)
                    self._flowing.wait()  # nothing crosses a partition, not even a close
                if not data:
                    target.shutdown(socket.SHUT_WR)
                    return
                if to_server and self._lose_marker is not None and self._lose_marker in data:
                    with self._lock:
                        self._lose_marker = None
                        armed = self._committing if self._at_commit else self._losing
                        armed.add(id(target))
                elif to_server and id(target) in self._committing and b"COMMIT" in data:
                    with self._lock:
                        self._committing.discard(id(target))
                        self._losing.add(id(target))
                elif not to_server and id(source) in self._losing:
                    with self._lock:
                        self._losing.discard(id(source))
                        self.answers_lost += 1
                    for sock in (source, target):  # the answer goes nowhere
                        with contextlib.suppress(OSError):
                            sock.shutdown(socket.SHUT_RDWR)
                    return
                target.sendall(data)
        except OSError:
            with contextlib.suppress(OSError):
                target.shutdown(socket.SHUT_RDWR)
