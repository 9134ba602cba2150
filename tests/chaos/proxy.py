"""A TCP proxy on loopback between one worker and PostgreSQL that the harness can cut.

``cut()`` is a network partition: every open connection is dropped and new ones are
closed as soon as they are accepted, until ``heal()``. It runs an asyncio loop on a
daemon thread of the harness.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading


class Proxy:
    def __init__(self, target_port: int, *, host: str = "127.0.0.1") -> None:
        self.host = host
        self.target_port = target_port
        self.port = 0
        self.cuts = 0
        self._cut = False
        self._writers: set[asyncio.StreamWriter] = set()
        self._loop = asyncio.new_event_loop()
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._main, name="chaos-proxy", daemon=True)
        self._thread.start()
        if not self._ready.wait(10):
            raise RuntimeError("the proxy did not start")

    def _main(self) -> None:
        asyncio.set_event_loop(self._loop)
        self._server = self._loop.run_until_complete(
            asyncio.start_server(self._accept, self.host, 0)
        )
        self.port = self._server.sockets[0].getsockname()[1]
        self._ready.set()
        self._loop.run_forever()

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if self._cut:
            writer.transport.abort()
            return
        try:
            up_reader, up_writer = await asyncio.open_connection(self.host, self.target_port)
        except OSError:
            writer.transport.abort()
            return
        pair = {writer, up_writer}
        self._writers |= pair
        try:
            await asyncio.gather(self._pipe(reader, up_writer), self._pipe(up_reader, writer))
        finally:
            for w in pair:
                self._writers.discard(w)
                w.transport.abort()

    async def _pipe(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        with contextlib.suppress(OSError, ConnectionError, asyncio.CancelledError):
            while data := await reader.read(65536):
                if self._cut:
                    break
                writer.write(data)
                await writer.drain()
        writer.transport.abort()

    def _call(self, func) -> None:
        done = threading.Event()

        def run() -> None:
            try:
                func()
            finally:
                done.set()

        self._loop.call_soon_threadsafe(run)
        done.wait(10)

    def cut(self) -> None:
        """Drop every connection and refuse new ones."""

        def do() -> None:
            self._cut = True
            for w in list(self._writers):
                w.transport.abort()
            self._writers.clear()

        self.cuts += 1
        self._call(do)

    def heal(self) -> None:
        def do() -> None:
            self._cut = False

        self._call(do)

    @property
    def connections(self) -> int:
        return len(self._writers) // 2

    def close(self) -> None:
        def do() -> None:
            self._server.close()
            for w in list(self._writers):
                w.transport.abort()

        self._call(do)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(5)
