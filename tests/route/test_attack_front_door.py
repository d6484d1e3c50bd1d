"""``kvtier route``'s front door attacked once more (issue 24 follow-up), through real ``kvtier
route`` processes in front of the tests' stub engine."""

from __future__ import annotations

import json
import time

import pytest
import requests

from tests.route._stub_engine import StubEngine
from tests.route.test_front_door import Router
from tests.route.test_proxy import _word_tokenizer


@pytest.fixture(scope="module")
def stub():
    engine = StubEngine().start()
    yield engine
    engine.stop()


def test_a_huge_chat_is_tokenized_only_as_far_as_it_is_routed(stub, tmp_path):
    """A 16 MiB chat message was tokenized whole through the chat template (about 30 s here,
    holding the tokenizer every text and chat request waits for); now its messages are cut at
    8 characters per routed token like a text prompt. Bound: routed and answered within 5 s
    with max_route_tokens 1024, and the engine gets the whole body."""
    _word_tokenizer(tmp_path / "tok", "{% for m in messages %}w1 {{ m['content'] }} {% endfor %}w2")
    r = Router(tmp_path, "chat", {"engines": [stub.url], "block_size": 4, "max_route_tokens": 1024,
                                   "tokenizer": str(tmp_path / "tok")})
    try:
        words = " ".join(f"w{i % 200}" for i in range(4_000_000))
        body = json.dumps({"messages": [{"role": "system", "content": "w1 w2"},
                                        {"role": "user", "content": words},
                                        {"role": "user", "content": words[:1000]}]})
        before = len(stub.seen)
        t0 = time.monotonic()
        resp = requests.post(r.base + "/v1/chat/completions", data=body, timeout=120,
                             headers={"Content-Type": "application/json"})
        took = time.monotonic() - t0
        assert resp.status_code == 200, resp.text
        assert took < 5.0, f"a 16 MiB chat took {took:.1f} s to route"
        assert len(stub.seen) == before + 1 and stub.seen[-1]["path"] == "/v1/chat/completions"
        assert "Traceback" not in r.text()
    finally:
        r.stop()
