"""``codec: fp8`` with real vLLM engines (separate processes) on the small random model: engine A
stores a document through ``ram -> fs(fp8)`` (every entry fp8-coded, at most 0.55 x raw); engine
B, a fresh process with the same tiers, loads the whole cached prefix from the fp8 entries
(vLLM's external prefix-cache hits). That an engine without fp8 keys apart from them (and so
never reads a lossy entry) is tests/integration/test_namespace.py, on the connector itself.

Tokens are not compared: the lossy KV of a random-weight model (near-uniform logits) may change
greedy tokens; ``kvtier bench codec`` reports the error and the agreement.
"""

from __future__ import annotations

import os

import pytest

from kvtier import codecs, entry
from tests.integration.test_cross_engine import DOC_TOKENS, _doc, _engine, _warm

pytestmark = pytest.mark.vllm


@pytest.fixture(scope="module")
def model():
    pytest.importorskip("vllm")
    from kvtier.bench.models import make_random_model

    return make_random_model("small")


def _entries(root) -> list[str]:
    return [os.path.join(d, f) for d, _, files in os.walk(root) for f in files if len(f) == 64]


def test_an_engine_loads_a_prefix_from_fp8_entries(model, tmp_path):
    fs_dir = tmp_path / "fs"

    def tiers(codec: str) -> dict:
        return {"tiers": [{"type": "ram", "capacity": "256MiB"},
                          {"type": "fs", "path": str(fs_dir), "capacity": "2GiB", "codec": codec}]}

    doc = _doc(29)
    cached = (DOC_TOKENS - 1) // 256 * 256  # whole chunks of the prompt (the last token is computed)
    a = _engine(model, tiers("fp8"), doc, _warm(1), tmp_path / "a.log")
    assert a["first"]["hit_tokens"] == 0
    files = _entries(fs_dir)
    assert files, "engine A stored nothing in the fs tier"
    for name in files:
        with open(name, "rb") as f:
            header = entry.decode_header(f.read(entry.MAX_HEADER_BYTES))
        assert header.codec == codecs.FP8_ID and header.dtype == "bfloat16"
        assert header.stored <= 0.55 * header.length

    b = _engine(model, tiers("fp8"), doc, _warm(2), tmp_path / "b.log")
    assert b["first"]["hit_tokens"] == cached  # the whole prefix from the fp8 entries
