"""A real S3 endpoint for tests: moto's ThreadedMotoServer on 127.0.0.1, stoppable and restartable.

`ThreadedMotoServer.stop()` only leaves `serve_forever`: the listening socket stays open (clients then hang until
their read timeout) and kept-alive connections keep being served by their handler threads. An outage test needs a
real outage, so `S3Server.stop()` also closes the listening socket and every open client connection; `start()` on
the same port then brings the endpoint back (moto keeps its state in-process, so buckets and objects survive).
"""

from __future__ import annotations

import logging
import socket
import threading
from typing import Any

from moto.server import ThreadedMotoServer
from werkzeug.serving import make_server

KEY = "testing-key"  # moto accepts any credentials; these are not secrets


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class _TrackedMotoServer(ThreadedMotoServer):
    """ThreadedMotoServer whose request handler records its connections so that stop() can cut them."""

    def __init__(self, port: int, connections: set[socket.socket], lock: threading.Lock) -> None:
        super().__init__(ip_address="127.0.0.1", port=port, verbose=False)
        self._connections, self._lock = connections, lock

    def _server_entry(self) -> None:  # same as moto's, with a handler that tracks its socket
        from moto.moto_server.werkzeug_app import DomainDispatcherApplication, MotoRequestHandler, create_backend_app

        connections, lock = self._connections, self._lock

        class Handler(MotoRequestHandler):
            def setup(self) -> None:
                with lock:
                    connections.add(self.request)
                super().setup()

            def finish(self) -> None:
                with lock:
                    connections.discard(self.request)
                super().finish()

        app = DomainDispatcherApplication(create_backend_app)
        self._server = make_server(self._ip_address, self._port, app, True, request_handler=Handler)
        self._server_ready_event.set()
        self._server.serve_forever()


class S3Server:
    """Start/stop a moto S3 server on a fixed 127.0.0.1 port; `options(secret)` gives s3fs storage options."""

    def __init__(self, port: int | None = None, bucket: str = "h3gate-test") -> None:
        logging.getLogger("werkzeug").setLevel(logging.ERROR)
        self.port = port or free_port()
        self.endpoint = f"http://127.0.0.1:{self.port}"
        self.bucket = bucket
        self._connections: set[socket.socket] = set()
        self._lock = threading.Lock()
        self._server: _TrackedMotoServer | None = None

    def start(self) -> S3Server:
        """Serve on self.port (again, after stop(): moto's in-process state survives)."""
        if self._server is None:
            self._server = _TrackedMotoServer(self.port, self._connections, self._lock)
            self._server.start()
        return self

    def stop(self) -> None:
        server, self._server = self._server, None
        if server is None:
            return
        server.stop()
        if server._server is not None:
            server._server.server_close()  # release the listening socket: connects are refused from now on
        with self._lock:
            for conn in list(self._connections):
                try:
                    conn.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass

    def options(self, secret: str = "testing-secret", **extra: Any) -> dict[str, Any]:
        return {"key": KEY, "secret": secret, "client_kwargs": {"endpoint_url": self.endpoint}, **extra}

    def create_bucket(self, bucket: str | None = None) -> None:
        import s3fs

        bucket = bucket or self.bucket
        fs = s3fs.S3FileSystem(skip_instance_cache=True, config_kwargs={"retries": {"max_attempts": 1}},
                               **self.options())
        if not fs.exists(bucket):
            fs.mkdir(bucket)
