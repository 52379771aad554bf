"""Fresh S3 buckets made ahead, in a thread: what the ``s3_bucket`` fixture hands out.

Making a warm bucket on SeaweedFS takes ~0.22 s, nearly all of it waiting (the server's CPU was
~12 ms of it: new volumes), and every test asking for a fresh bucket waited for it. The pool keeps
a few made ahead. Each bucket still goes to one test only and is never reused: a test gets a
bucket no other test has touched, as before. Buckets left in the pool are deleted at its close.
"""

from __future__ import annotations

import contextlib
import queue
import threading
from collections.abc import Callable
from typing import Any, Protocol


class S3Server(Protocol):
    """What the pool uses of kvbucket.testing.s3_server.S3Server."""

    def client(self) -> Any: ...

    def create_bucket(self, name: str | None = None, warm: bool = True) -> str: ...

    def delete_bucket(self, name: str) -> None: ...


class BucketPool:
    """``ahead`` fresh buckets of ``server``, named by ``name()``, made in a background thread."""

    def __init__(self, server: S3Server, name: Callable[[], str], ahead: int = 2) -> None:
        self.server = server
        self._name = name
        server.client()  # its boto3 client is made here, not first in two threads at once
        self._ready: queue.Queue[str] = queue.Queue(maxsize=ahead)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._fill, name="kvbucket-bucket-pool", daemon=True)
        self._thread.start()

    def _fill(self) -> None:
        while not self._stop.is_set():
            try:
                made = self.server.create_bucket(self._name())
            except Exception:  # the server is gone or failing: take() makes its buckets itself
                return
            while not self._stop.is_set():
                try:
                    self._ready.put(made, timeout=0.2)
                    break
                except queue.Full:
                    continue
            else:
                self._delete(made)

    def take(self) -> str:
        """A bucket made for the caller alone (made now if the thread has none ready or ended)."""
        while True:
            try:
                return self._ready.get(timeout=0.2)
            except queue.Empty:
                if not self._thread.is_alive():
                    return self.server.create_bucket(self._name())

    def _delete(self, bucket: str) -> None:
        with contextlib.suppress(Exception):
            self.server.delete_bucket(bucket)

    def close(self) -> None:
        """Stop making buckets; delete the ones nobody took."""
        self._stop.set()
        self._thread.join(10)
        while True:
            try:
                self._delete(self._ready.get_nowait())
            except queue.Empty:
                return

    def __enter__(self) -> BucketPool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
