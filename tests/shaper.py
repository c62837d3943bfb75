"""A cloud between the clients and the local S3 server: a TCP relay that adds a fixed latency to
every request and caps each connection's bytes per second, as a real object store's network
does (20-100 ms before the first byte of a GET's answer, tens of MB/s per connection).

    server = S3Server.start(tmp)                 # tests/s3.py
    cloud = Shaper(server.port, delay_s=0.1, rate=50e6)
    env = server.env() | {"AWS_ENDPOINT_URL": cloud.endpoint}
    cloud.stop()

The model is a link, not a queue of requests: every chunk a client sends reaches the server
`delay_s` after it was sent (a one-way delay on the way in, so the first byte of every answer on
a keep-alive connection comes at least `delay_s` after its request, however many requests the
connection carries, and a request sent while an earlier one is answered is not held behind it),
and each direction of a connection carries at most `rate` bytes per second: a chunk of n bytes
is handed on only once n / rate seconds have passed since the link was free (its last byte's
serialization), so N bytes take at least N / rate. A connection idle for a while earns no
credit. One asyncio loop in a daemon thread serves every connection.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time

CHUNK = 1 << 16  # bytes read from a socket at a time (a chunk is delayed and paced whole)
QUEUED = 256  # chunks held in one direction's delay line at most (16 MiB): then reads wait


class Shaper:
    """A relay from a local port to 127.0.0.1:`port` with `delay_s` seconds of latency on each
    request and `rate` bytes/s per connection and direction (0: no cap); see the docstring."""

    def __init__(self, port: int, delay_s: float = 0.0, rate: float = 0.0,
                 host: str = "127.0.0.1"):
        self.target, self.delay_s, self.rate = (host, port), float(delay_s), float(rate)
        self.connections = 0  # accepted so far (tests, benchmarks)
        self._loop = asyncio.new_event_loop()
        started = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(started,), daemon=True,
                                        name="shaper")
        self._thread.start()
        started.wait()
        self.endpoint = f"http://127.0.0.1:{self.port}"

    def _run(self, started: threading.Event) -> None:
        asyncio.set_event_loop(self._loop)
        self._server = self._loop.run_until_complete(
            asyncio.start_server(self._serve, "127.0.0.1", 0))
        self.port = self._server.sockets[0].getsockname()[1]
        started.set()
        self._loop.run_forever()

    async def _serve(self, client_r: asyncio.StreamReader, client_w: asyncio.StreamWriter):
        self.connections += 1
        try:
            server_r, server_w = await asyncio.open_connection(*self.target)
        except OSError:
            client_w.close()
            return
        await asyncio.gather(self._pipe(client_r, server_w, self.delay_s),
                             self._pipe(server_r, client_w, 0.0), return_exceptions=True)

    async def _pipe(self, src: asyncio.StreamReader, dst: asyncio.StreamWriter,
                    delay_s: float) -> None:
        """src's bytes to dst, each chunk `delay_s` after it arrived, paced at self.rate."""
        line: asyncio.Queue = asyncio.Queue(QUEUED)
        sender = asyncio.ensure_future(self._send(line, dst, delay_s))
        try:
            while data := await src.read(CHUNK):
                await line.put((time.monotonic(), data))
        except OSError:
            pass
        finally:
            await line.put((time.monotonic(), b""))  # the end: dst is closed once it is sent
            with contextlib.suppress(Exception):
                await sender

    async def _send(self, line: asyncio.Queue, dst: asyncio.StreamWriter, delay_s: float):
        free = 0.0  # when the link has sent the last chunk's last byte
        try:
            while True:
                arrived, data = await line.get()
                if not data:
                    break
                due = arrived + delay_s
                if self.rate:
                    free = max(due, free, time.monotonic()) + len(data) / self.rate
                    due = free
                wait = due - time.monotonic()
                if wait > 0:
                    await asyncio.sleep(wait)
                dst.write(data)
                await dst.drain()
        except OSError:
            pass
        finally:
            with contextlib.suppress(Exception):
                dst.close()

    def stop(self) -> None:
        """Closes the listener and every connection; the loop's thread ends."""
        async def close() -> None:
            self._server.close()
            tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

        if self._loop.is_running():
            with contextlib.suppress(Exception):
                asyncio.run_coroutine_threadsafe(close(), self._loop).result(timeout=5)
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(timeout=5)
