"""An HTTP file server on loopback for tests of log inputs by URL (fsspec's HTTP filesystem)."""

from __future__ import annotations

import asyncio
import http.server
import threading
from pathlib import Path
from typing import Any

from aiohttp import web


class FileServer:
    """An aiohttp server on 127.0.0.1 in its own thread, serving a directory with web.FileResponse
    (which answers Range requests) and logging each request's method, path and Range header."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.log: list[tuple[str, str, str | None]] = []
        self.fail_after: dict[str, int] = {}  # name: GETs answered before it answers 503
        self.loop = asyncio.new_event_loop()
        self.ready = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)

    async def _file(self, request: web.Request) -> web.StreamResponse:
        self.log.append((request.method, request.path, request.headers.get("Range")))
        name = request.match_info["name"]
        path = self.root / name
        if name.startswith("private"):
            raise web.HTTPForbidden()
        if not path.is_file():
            raise web.HTTPNotFound()
        if request.method == "GET" and name in self.fail_after:
            self.fail_after[name] -= 1
            if self.fail_after[name] < 0:
                raise web.HTTPServiceUnavailable()
        return web.FileResponse(path)

    def _run(self) -> None:
        asyncio.set_event_loop(self.loop)
        app = web.Application()
        app.router.add_route("*", "/{name}", self._file)
        app.router.add_static("/dir/", self.root, show_index=True)  # an index page linking the files
        self.runner = web.AppRunner(app, access_log=None)
        self.loop.run_until_complete(self.runner.setup())
        site = web.TCPSite(self.runner, "127.0.0.1", 0)
        self.loop.run_until_complete(site.start())
        self.port = self.runner.addresses[0][1]
        self.ready.set()
        self.loop.run_forever()
        self.loop.run_until_complete(self.runner.cleanup())
        self.loop.close()

    def __enter__(self) -> FileServer:
        self.thread.start()
        assert self.ready.wait(10)
        return self

    def __exit__(self, *exc: object) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)

    def url(self, name: str) -> str:
        return f"http://127.0.0.1:{self.port}/{name}"


class PlainFileServer:
    """Python's own `http.server` on 127.0.0.1 in a thread, serving a directory: it ignores Range
    headers (every GET answers 200 with the whole file), as many static web servers do. It logs
    each request's method, path and Range header as FileServer does."""

    def __init__(self, root: Path) -> None:
        log: list[tuple[str, str, str | None]] = []
        self.root = root
        self.log = log

        class Handler(http.server.SimpleHTTPRequestHandler):
            def __init__(self, *args: Any, **kwargs: Any) -> None:
                super().__init__(*args, directory=str(root), **kwargs)

            def send_head(self) -> Any:
                log.append((self.command, self.path, self.headers.get("Range")))
                return super().send_head()

            def log_message(self, format: str, *args: Any) -> None:
                pass

        class Server(http.server.ThreadingHTTPServer):
            def handle_error(self, request: Any, client_address: Any) -> None:
                pass  # a client closing early (the one-byte probe) is not news

        self.httpd = Server(("127.0.0.1", 0), Handler)
        self.port = self.httpd.server_address[1]
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)

    def __enter__(self) -> PlainFileServer:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()
        self.thread.join(10)

    def url(self, name: str) -> str:
        return f"http://127.0.0.1:{self.port}/{name}"
