"""The cloud in front of the S3 server (tests/shaper.py): its latency and its byte rate, each
measured as a lower bound only (what a request through it takes at least), so that a busy
machine can make it slower but never make a test fail."""

from __future__ import annotations

import http.client
import http.server
import threading
import time

import numpy as np
import s3fs

from tests.shaper import Shaper


def timed(conn: http.client.HTTPConnection, method: str, path: str,
          body: bytes | None = None) -> tuple[float, bytes]:
    start = time.monotonic()
    conn.request(method, path, body=body)
    data = conn.getresponse().read()
    return time.monotonic() - start, data


class KeptAlive(http.server.BaseHTTPRequestHandler):
    """An HTTP/1.1 server that keeps its connections open (moto's closes each after one
    answer), answering every GET with 5 bytes."""

    protocol_version = "HTTP/1.1"

    def do_GET(self):
        self.send_response(200)
        self.send_header("Content-Length", "5")
        self.end_headers()
        self.wfile.write(b"hello")

    def log_message(self, *args):
        pass


def test_every_request_on_a_kept_alive_connection_waits_the_delay():
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), KeptAlive)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    cloud = Shaper(server.server_address[1], delay_s=0.2)
    try:
        conn = http.client.HTTPConnection("127.0.0.1", cloud.port, timeout=30)
        for _ in range(3):
            took, data = timed(conn, "GET", "/")
            assert took >= 0.2 and data == b"hello"
        assert cloud.connections == 1  # three requests on one connection, each delayed
    finally:
        cloud.stop()
        server.shutdown()
        server.server_close()


def test_a_request_to_the_s3_server_waits_the_delay(s3_server):
    cloud = Shaper(s3_server.port, delay_s=0.2)
    try:
        conn = http.client.HTTPConnection("127.0.0.1", cloud.port, timeout=30)
        took, data = timed(conn, "GET", "/moto-api/data.json")
        assert took >= 0.2 and data.startswith(b"{")
    finally:
        cloud.stop()


def test_n_bytes_at_rate_r_take_n_over_r_each_way(s3_server):
    bucket = s3_server.bucket("shaped")[5:]
    body = np.random.default_rng(0).integers(0, 256, 3 << 20, dtype=np.uint8).tobytes()
    rate = 8e6  # 3 MiB at 8 MB/s: >= 0.39 s each way
    cloud = Shaper(s3_server.port, rate=rate)
    try:
        fs = s3fs.S3FileSystem(endpoint_url=cloud.endpoint, key="testing", secret="testing",
                               skip_instance_cache=True)
        start = time.monotonic()
        fs.pipe_file(f"{bucket}/up", body)  # one PUT (under s3fs's multipart size)
        assert time.monotonic() - start >= len(body) / rate
        start = time.monotonic()
        assert fs.cat_file(f"{bucket}/up") == body
        assert time.monotonic() - start >= len(body) / rate
    finally:
        cloud.stop()


def test_s3fs_through_the_cloud_fixture_reads_what_was_written(cloud, s3):
    bucket = s3.bucket("through")
    s3.fs().pipe_file(f"{bucket[5:]}/x", b"0123456789")
    endpoint = cloud(0.1, 50e6)
    fs = s3fs.S3FileSystem(endpoint_url=endpoint, key="testing", secret="testing",
                           skip_instance_cache=True)
    start = time.monotonic()
    assert fs.cat_file(f"{bucket[5:]}/x", start=2, end=5) == b"234"
    assert time.monotonic() - start >= 0.1
