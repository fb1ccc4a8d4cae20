"""The disk tier of the prefix cache (`--kv-offload-dir`): files, restarts, refusals, and the engine
loading blocks instead of recomputing them with the same greedy output."""
from __future__ import annotations

import logging
import random

import pytest

from tessera.engine.core.kv_offload import HEADER, DiskKVTier
from tessera.errors import ConfigError
from tessera.sampling_params import SamplingParams

FIELDS = {"model_sha256": "ab" * 32, "dtype": "torch.float32", "kv_cache": "float32", "block_size": 16}


def _tier(path, max_bytes=1 << 20, fields=FIELDS, block_bytes=64):
    return DiskKVTier(path, max_bytes, fields, block_bytes)


def test_blocks_round_trip_and_survive_a_restart(tmp_path):
    tier = _tier(tmp_path)
    payloads = bytes(range(64)) + bytes(range(64, 128))
    tier.submit([11, 2**63 + 5], payloads)
    tier.flush()
    assert tier.read(11) == payloads[:64] and tier.read(2**63 + 5) == payloads[64:]
    assert tier.read(12) is None
    tier.close()
    again = _tier(tmp_path)
    assert again.num_blocks == 2 and again.read(11) == payloads[:64]
    other = _tier(tmp_path, fields={**FIELDS, "model_sha256": "cd" * 32})  # another model: its own folder
    assert other.num_blocks == 0 and other.read(11) is None


def test_corrupt_foreign_and_truncated_files_are_refused_with_a_warning(tmp_path, caplog):
    tier = _tier(tmp_path)
    tier.submit([1, 2, 3], bytes(64) * 3)
    tier.flush()
    files = {h: tier._path(h) for h in (1, 2, 3)}
    data = bytearray(files[1].read_bytes())
    data[-1] ^= 0xFF  # payload corrupted: the checksum disagrees
    files[1].write_bytes(bytes(data))
    foreign = bytearray(files[2].read_bytes())
    foreign[8] ^= 0xFF  # another model's fingerprint
    files[2].write_bytes(bytes(foreign))
    files[3].write_bytes(files[3].read_bytes()[:HEADER.size + 10])  # truncated
    (tier.dir / "zz-not-a-block.kvb").write_bytes(b"junk")
    with caplog.at_level(logging.WARNING, logger="tessera.engine.core.kv_offload"):
        assert tier.read(1) is None and tier.read(2) is None and tier.read(3) is None
        restarted = _tier(tmp_path)
    assert tier.stats.misses_rejected >= 2
    assert "checksum mismatch" in caplog.text and "another model" in caplog.text
    assert "not a block file name" in caplog.text
    assert restarted.read(3) is None  # its size was wrong: never indexed


def test_size_limit_evicts_the_least_recently_used(tmp_path):
    tier = _tier(tmp_path, max_bytes=3 * (HEADER.size + 64))
    for h in range(5):
        tier.submit([h], bytes([h]) * 64)
        tier.flush()
        if h == 2:
            assert tier.read(0) is not None  # touched: 1 is now the oldest
    assert tier.num_blocks == 3 and tier.disk_bytes <= tier.max_bytes
    assert tier.contains(0) and not tier.contains(1) and not tier.contains(2)
    assert not tier._path(1).exists()


def test_config_checks():
    from tessera.config import EngineConfig

    with pytest.raises(ConfigError, match="enable-prefix-caching"):
        EngineConfig(kv_offload_dir="/tmp/x", enable_prefix_caching=False)
    with pytest.raises(ConfigError, match="draft model"):
        EngineConfig(kv_offload_dir="/tmp/x", speculative_config={"model": "qwen2.5-coder-0.5b"})


# -- through the engine ------------------------------------------------------------------------

GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def loaded(tmp_path_factory):
    from tiny_model import make_tiny_model

    from tessera.models.loader import load_model

    return load_model(make_tiny_model(tmp_path_factory.mktemp("tiny") / "llama"), "float32")


def _llm(loaded, **opts):
    from tessera.llm import LLM

    if opts.get("kv_cache_dtype") == "int8":
        per_block = 2 * 2 * 2 * (16 * 16 + 4)  # K/V x layers x KV heads x (16 tokens x head dim 16 + scale)
    else:
        per_block = 2 * 2 * 2 * 16 * 16 * 4  # float32
    opts.setdefault("kv_cache_memory", 24 * per_block)  # 24 blocks: not all four conversations
    return LLM(str(loaded.path), loaded=loaded, max_model_len=256, max_num_seqs=2, **opts)


def _conversation(seed: int, n: int = 150) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 300) for _ in range(n)]


@pytest.mark.parametrize("kv_dtype", ["auto", "int8"])
def test_evicted_and_restarted_prefixes_load_from_disk_with_the_same_output(loaded, tmp_path, kv_dtype):
    prompts = [_conversation(s) for s in range(4)]  # 4 x 150 tokens: more than the RAM cache holds
    want = [o.outputs[0].token_ids for o in _llm(loaded, kv_cache_dtype=kv_dtype).generate(prompts, GREEDY)]
    llm = _llm(loaded, kv_cache_dtype=kv_dtype, kv_offload_dir=str(tmp_path))
    first = [llm.generate([p], GREEDY)[0].outputs[0].token_ids for p in prompts]
    llm.engine.close()
    assert llm.engine.offload.num_blocks >= 4 * (150 // 16)
    again = [llm.generate([p], GREEDY)[0].outputs[0].token_ids for p in prompts]  # evicted from RAM by now
    assert llm.engine.kv.offload_hits > 0
    restarted = _llm(loaded, kv_cache_dtype=kv_dtype, kv_offload_dir=str(tmp_path))
    out = restarted.generate([prompts[0]], GREEDY)[0]
    assert restarted.engine.kv.offload_hits == 144  # 9 full blocks; the last partial one is computed
    assert first == again == want and out.outputs[0].token_ids == want[0]
    info = restarted.engine.kv_cache_info()["offload"]
    assert info["hit_tokens"] == 144 and info["bytes_read"] > 0 and info["files_refused"] == 0
    assert restarted.engine.kv.num_free_blocks == restarted.engine.kv.num_blocks


def test_corrupt_tier_is_recomputed_not_loaded(loaded, tmp_path):
    prompt = _conversation(9)
    llm = _llm(loaded, kv_offload_dir=str(tmp_path))
    want = llm.generate([prompt], GREEDY)[0].outputs[0].token_ids
    llm.engine.close()
    for path in llm.engine.offload.dir.glob("*.kvb"):
        data = bytearray(path.read_bytes())
        data[HEADER.size + 3] ^= 0x55
        path.write_bytes(bytes(data))
    fresh = _llm(loaded, kv_offload_dir=str(tmp_path))
    assert fresh.generate([prompt], GREEDY)[0].outputs[0].token_ids == want
    assert fresh.engine.kv.offload_hits == 0 and fresh.engine.offload.stats.misses_rejected >= 1
