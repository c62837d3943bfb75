"""A real S3-compatible server for the tests: moto's standalone server (`moto[server]`, in the dev
extra), started by the fixtures on a free localhost port; `env()` holds the ecosystem's variables
(AWS_ENDPOINT_URL, AWS_ACCESS_KEY_ID, ...) that point a client at it, which the `s3` fixture
sets for the one test that asks for it (and so for the subprocesses that test starts).

    server = S3Server.start()           # fails loudly if it never answers
    url = server.bucket("data")         # s3://data-<n>, a new bucket
    server.stop()

`S3Server.start(auth=True)` enforces credentials and IAM policies (moto's
INITIAL_NO_AUTH_ACTION_COUNT): its first requests create a writer and a reader-only user, whose
keys `writer` and `reader` hold; every later request must sign with one of them.
`Cut` sits between the clients and a server as a TCP relay that a test can sever: "the server
stopped in the middle of an upload".
"""

from __future__ import annotations

import itertools
import json
import os
import socket
import subprocess
import sys
import threading
import time
import urllib.request

from tests.processes import free_port

START_S = 30  # the longest a server may take to answer before the fixture fails
BASE_ENV = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing",
            "AWS_DEFAULT_REGION": "us-east-1", "AWS_CONFIG_FILE": os.devnull,
            "AWS_SHARED_CREDENTIALS_FILE": os.devnull, "AWS_EC2_METADATA_DISABLED": "true"}
ALL = {"Version": "2012-10-17", "Statement": [{"Effect": "Allow", "Action": "*", "Resource": "*"}]}
READ = {"Version": "2012-10-17", "Statement": [{"Effect": "Allow", "Resource": "*", "Action": [
    "s3:GetObject", "s3:ListBucket", "s3:GetBucketLocation"]}]}
USERS = (("writer", ALL), ("reader", READ))
SETUP_CALLS = ("create_user", "create_access_key", "put_user_policy")  # `_users`, per user
SETUP_ACTIONS = len(USERS) * len(SETUP_CALLS)  # the requests moto lets through unauthenticated


class S3Server:
    _names = itertools.count()

    def __init__(self, proc: subprocess.Popen, port: int, log: str):
        self.proc, self.port, self.log = proc, port, log
        self.endpoint = f"http://127.0.0.1:{port}"
        self.writer: dict | None = None
        self.reader: dict | None = None

    @classmethod
    def start(cls, log_dir, auth: bool = False) -> S3Server:
        port = free_port()
        log = os.path.join(str(log_dir), f"moto-{port}.log")
        env = {**os.environ, **BASE_ENV}
        if auth:
            env["INITIAL_NO_AUTH_ACTION_COUNT"] = str(SETUP_ACTIONS)
        with open(log, "w") as out:
            proc = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1",
                                     "-p", str(port)], stdout=out, stderr=subprocess.STDOUT,
                                    env=env, start_new_session=True)
        server = cls(proc, port, log)
        deadline = time.monotonic() + START_S
        while True:
            try:
                urllib.request.urlopen(f"{server.endpoint}/moto-api/data.json", timeout=2)
                break
            except OSError:
                if proc.poll() is not None or time.monotonic() > deadline:
                    server.stop()
                    raise RuntimeError(f"the S3 server (moto) did not answer on port {port} "
                                       f"within {START_S} s:\n{open(log).read()[-3000:]}"
                                       ) from None
                time.sleep(0.05)
        if auth:
            try:
                server.writer, server.reader = server._users()
            except BaseException:
                server.stop()
                raise
        return server

    def env(self, keys: dict | None = None) -> dict[str, str]:
        """The variables that point a client at this server (with `keys`' credentials)."""
        keys = keys or self.writer or {}
        env = {**BASE_ENV, "AWS_ENDPOINT_URL": self.endpoint}
        if keys:
            env.update(AWS_ACCESS_KEY_ID=keys["AccessKeyId"],
                       AWS_SECRET_ACCESS_KEY=keys["SecretAccessKey"])
        return env

    def fs(self, keys: dict | None = None):
        """An s3fs filesystem on this server (a new instance: not fsspec's cached one)."""
        import s3fs

        keys = keys or self.writer
        kwargs = {"key": keys["AccessKeyId"], "secret": keys["SecretAccessKey"]} if keys else \
            {"key": "testing", "secret": "testing"}
        return s3fs.S3FileSystem(endpoint_url=self.endpoint, skip_instance_cache=True,
                                 use_listings_cache=False, **kwargs)

    def bucket(self, name: str = "b") -> str:
        """A new, empty bucket; its URL."""
        bucket = f"{name}-{next(self._names)}"
        self.fs().mkdir(bucket)
        return f"s3://{bucket}"

    def _users(self) -> tuple[dict, dict]:
        """The writer and the reader made with SETUP_ACTIONS requests, counted as they are sent
        (no retries); then a request signed with no one's keys must be refused, or the server
        would let some tests through unauthenticated."""
        import boto3
        from botocore.config import Config
        from botocore.exceptions import ClientError

        iam = boto3.client("iam", endpoint_url=self.endpoint, region_name="us-east-1",
                           aws_access_key_id="testing", aws_secret_access_key="testing",
                           config=Config(retries={"total_max_attempts": 1}))
        sent = []
        iam.meta.events.register("before-send", lambda **_: sent.append(1))
        made = {}
        for user, policy in USERS:
            args = {"create_user": {"UserName": user}, "create_access_key": {"UserName": user},
                    "put_user_policy": {"UserName": user, "PolicyName": user,
                                        "PolicyDocument": json.dumps(policy)}}
            for call in SETUP_CALLS:
                made[user, call] = getattr(iam, call)(**args[call])
        if len(sent) != SETUP_ACTIONS:
            raise RuntimeError(f"setting up the users took {len(sent)} requests, not "
                               f"SETUP_ACTIONS = {SETUP_ACTIONS}")
        s3 = boto3.client("s3", endpoint_url=self.endpoint, region_name="us-east-1",
                          aws_access_key_id="AKIANOBODYNOBODY", aws_secret_access_key="x")
        try:
            s3.list_buckets()
        except ClientError:
            pass
        else:
            raise RuntimeError("the S3 server accepts a request signed with no user's keys "
                               "after its setup: SETUP_ACTIONS does not count its requests")
        return tuple(made[user, "create_access_key"]["AccessKey"] for user, _ in USERS)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()


class Cut:
    """A TCP relay from a local port to the server's that a test severs (`sever`): every
    connection is closed and new ones are refused, as when the server goes away; `when` severs
    it as soon as a request's first bytes hold that text (an upload of one object), and with
    `after`, only once a request holding that text has gone through whole (a checkpoint's
    meta.json: the server gone between two checkpoints)."""

    def __init__(self, server: S3Server, when: bytes | None = None, after: bytes | None = None):
        self.target, self.when, self.after = ("127.0.0.1", server.port), when, after
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self.endpoint = f"http://127.0.0.1:{self.port}"
        self.severed = threading.Event()
        self.on_sever = None  # called once, as it severs (a test kills a client then)
        self._conns: list[socket.socket] = []
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while not self.severed.is_set():
            try:
                client, _ = self.listener.accept()
            except OSError:
                return
            if self.severed.is_set():
                client.close()
                return
            upstream = socket.create_connection(self.target)
            self._conns += [client, upstream]
            threading.Thread(target=self._pipe, args=(client, upstream, True), daemon=True).start()
            threading.Thread(target=self._pipe, args=(upstream, client, False),
                             daemon=True).start()

    def _pipe(self, src: socket.socket, dst: socket.socket, watch: bool) -> None:
        try:
            while data := src.recv(1 << 16):
                if watch and self.after is not None and self.after in data:
                    self.after = None  # armed: the next request holding `when` severs it
                elif watch and self.when is not None and self.after is None and self.when in data:
                    if self.on_sever is not None and not self.severed.is_set():
                        self.on_sever()
                    self.sever()
                    return
                dst.sendall(data)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                try:
                    s.close()
                except OSError:
                    pass

    def sever(self) -> None:
        self.severed.set()
        try:
            self.listener.close()
        except OSError:
            pass
        for s in self._conns:
            try:
                s.shutdown(socket.SHUT_RDWR)
                s.close()
            except OSError:
                pass
