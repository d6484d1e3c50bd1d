"""``writer_idle`` (SCHED_IDLE writers) must not reach the threads that serve reads: threads a
SCHED_IDLE thread starts inherit its policy, and an S3 tier's transfer pool, if started lazily,
would be started by the S3 writer's first put; the same pool serves the engine's loads of S3
hits. The tier starts its pools when it is built, so reads run at the engine's policy."""

from __future__ import annotations

import os
import threading

import numpy as np
import pytest

pytest.importorskip("boto3")

from kvtier.store import TieredStore  # noqa: E402

pytestmark = pytest.mark.skipif(not hasattr(os, "SCHED_IDLE") or os.uname().sysname != "Linux",
                                reason="SCHED_IDLE is Linux's")
PAGE = 64 << 10


def key(i: int) -> bytes:
    return i.to_bytes(4, "little") * 8


class _Body:
    def __init__(self, data: bytes):
        self._data = data

    def read(self) -> bytes:
        return self._data

    def close(self) -> None:
        pass


class FakeS3Client:
    """put_object/get_object in memory; records the scheduling policy of the thread each runs on."""

    def __init__(self):
        self.objects: dict[str, bytes] = {}
        self.policies: dict[str, list[int]] = {"put": [], "get": []}

    def put_object(self, Bucket, Key, Body):
        self.policies["put"].append(os.sched_getscheduler(0))
        self.objects[Key] = bytes(Body)
        return {}

    def get_object(self, Bucket, Key):
        self.policies["get"].append(os.sched_getscheduler(0))
        data = self.objects[Key]
        return {"ContentLength": len(data), "Body": _Body(data)}


def test_s3_reads_do_not_run_under_the_writers_sched_idle():
    store = TieredStore.from_config({
        "tiers": [{"type": "ram", "capacity": PAGE, "page_size": PAGE},
                  {"type": "s3", "bucket": "b", "endpoint_url": "http://127.0.0.1:9", "access_key": "k",
                   "secret_key": "s", "list_interval_s": 0}],
        "writer_idle": True})
    try:
        s3 = store.tiers[1]
        fake = FakeS3Client()
        s3._client = fake
        data = np.arange(PAGE, dtype=np.uint8).tobytes()
        assert store.put(key(0), data)
        assert store.flush()
        assert fake.policies["put"]  # the write-through ran (on the idle writer's pool thread)
        assert store.put(key(1), data[::-1] + b"")  # evicts key 0 from the one-page RAM tier
        assert store.flush()
        got = bytearray(PAGE)
        # a load of an S3 hit from the engine's (normal-priority) thread
        assert s3.get_into(key(0), got) == PAGE and bytes(got) == data
        me = os.sched_getscheduler(threading.get_native_id())
        assert me != os.SCHED_IDLE
        assert fake.policies["get"] == [me], (
            f"the read ran under policy {fake.policies['get']} (SCHED_IDLE={os.SCHED_IDLE}): the S3 pool's "
            "threads were started by the SCHED_IDLE writer and inherited its policy")
    finally:
        store.close()
