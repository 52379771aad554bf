"""A Hub load that fails an object read in parts gives its buffer back whole: no part still
running writes into it after ``get_many`` returned.

An outside tester reused the buffers of failed loads (32 MiB objects read in parts, a 0.3 s
deadline, 4 threads, no fault) and found 4 of 9 overwritten afterwards with the failed object's
bytes, up to 3.9 MiB: a part still running at the deadline kept writing through a gate nobody
closed, because the object's fetch job itself had returned its error in time
(kvbucket.stores.hub.loads.settled: a failed item's gate is closed before the load returns).
"""

from __future__ import annotations

import threading
import time
import uuid
from typing import Any

from kvbucket.errors import DeadlineExceededError
from kvbucket.stores.hub.config import build_config
from kvbucket.stores.hub.store import HFBucketStore

MiB = 1 << 20


def test_a_part_still_running_at_the_deadline_never_writes_into_the_returned_buffer(hub_bucket: Any) -> None:
    hub = hub_bucket.hub
    store = HFBucketStore(build_config(
        bucket_handle=f"hf://buckets/{hub_bucket.bucket_id}/parts-{uuid.uuid4().hex[:6]}",
        token=hub.write_token, token_env="", endpoint=hub.endpoint, load_timeout_secs=1.5,
        read_part_bytes=256 << 10, read_min_part_bytes=0, breaker_failures=0, max_retries=0))
    try:
        data = bytes(range(256)) * (8 * 4096)  # 8 MiB: read in parts of 256 KiB
        assert store.put_many([("obj", data)])[0].ok
        reader = store._client._reader
        real = reader._fetch_owned
        late_part_wrote = threading.Event()

        def fetch_owned(h: str, rec: Any, j: int, view: memoryview, gate: Any, deadline: float) -> None:
            if j != 1:
                return real(h, rec, j, view, gate, deadline)
            # One part is held up past the load's deadline (a descheduled thread, a decoder
            # busy elsewhere), then reads its bytes on a connection that is not cut.
            time.sleep(max(0.0, deadline - time.monotonic()) + 0.5)
            try:
                real(h, rec, j, view, gate, time.monotonic() + 10)
                late_part_wrote.set()
            finally:
                held.set()

        held = threading.Event()
        reader._fetch_owned = fetch_owned
        buf = bytearray(len(data))
        (r,) = store.get_many(["obj"], [buf])
        assert isinstance(r.error, DeadlineExceededError), r
        buf[:] = b"\xee" * len(buf)  # the caller reuses its buffer at once
        assert held.wait(15)
        time.sleep(0.2)
        assert not late_part_wrote.is_set()  # its write was refused (the gate was closed)
        assert buf == b"\xee" * len(buf)
        reader._fetch_owned = real
        (r,) = store.get_many(["obj"], [buf])
        assert r.ok and buf == data
    finally:
        store.close()
