"""Start-up on a tiny model: the calibration is checked before it is stored, and the steps the
first requests need run before the engine is built, whether or not the calibration was reused."""
from __future__ import annotations

import itertools

import pytest

from tessera.engine import calibration
from tessera.engine.worker.runner import ModelRunner
from tessera.llm import LLM
from tessera.sampling_params import SamplingParams

from tiny_model import make_tiny_model


@pytest.fixture(scope="module")
def loaded(tmp_path_factory):
    from tessera.models.loader import load_model

    folder = make_tiny_model(tmp_path_factory.mktemp("tiny") / "llama")
    return load_model(folder, "float32")


@pytest.fixture
def home(tmp_path, monkeypatch):
    monkeypatch.setenv("TESSERA_HOME", str(tmp_path))
    return tmp_path


@pytest.fixture
def quiet(monkeypatch):
    """A host-load meter that reports no other process and checks no noise can fail, whatever runs
    beside the test: these tests are about what start-up does with a trusted calibration."""
    import tessera.hostinfo

    monkeypatch.setattr(calibration, "others_cpu_seconds", lambda: 0.0)
    monkeypatch.setattr(tessera.hostinfo, "others_cpu_seconds", lambda: 0.0)
    monkeypatch.setattr(calibration, "CALIBRATION_CHECKS", calibration.CalibrationChecks(
        monotone_slack=100.0, max_over_roofline=1e6, min_of_bandwidth_floor=0.0))


def count_steps(monkeypatch) -> list[int]:
    """Steps run by any runner from now on (a one-element counter)."""
    calls = [0]
    execute = ModelRunner.execute

    def counted(self, out):
        calls[0] += 1
        return execute(self, out)

    monkeypatch.setattr(ModelRunner, "execute", counted)
    return calls


def test_a_reused_calibration_still_warms_up_before_the_engine_is_ready(loaded, home, quiet, monkeypatch):
    LLM(str(loaded.path), loaded=loaded, max_model_len=256)
    stored = list((home / "cost_models").glob("*.json"))
    assert len(stored) == 1
    calls = count_steps(monkeypatch)
    llm = LLM(str(loaded.path), loaded=loaded, max_model_len=256)
    assert llm.engine.cost_model_stats()["stored_calibration"] == str(stored[0])
    assert calls[0] == len(calibration._warm_up_steps(llm.engine.config, True)) >= 3
    out = llm.generate(["hello"], SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))
    assert len(out[0].outputs[0].token_ids) == 4


def test_a_calibration_beside_an_injected_hog_is_not_stored(loaded, home, monkeypatch):
    """The host-load meter says another process took two cores all along (a clock read in CPU
    seconds at twice wall time): both attempts are refused, the engine serves with the untrusted
    calibration, and nothing is written for the next start to reuse."""
    import time

    monkeypatch.setattr(calibration, "others_cpu_seconds", lambda: 2 * time.perf_counter())
    monkeypatch.setattr(calibration, "CALIBRATION_CHECKS", calibration.CalibrationChecks(pause_s=0.01))
    llm = LLM(str(loaded.path), loaded=loaded, max_model_len=256)
    stats = llm.engine.cost_model_stats()
    assert stats["calibration_trusted"] is False and stats["calibration_checks"]["attempts"] == 2
    assert stats["calibration_checks"]["other_cores"] == pytest.approx(2.0, rel=0.05)
    assert not list((home / "cost_models").glob("*.json"))
    out = llm.generate(["hello"], SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))
    assert len(out[0].outputs[0].token_ids) == 4


def test_the_roofline_counts_the_models_products(loaded, home, quiet):
    config = LLM(str(loaded.path), loaded=loaded, max_model_len=256).engine.config
    roofline = calibration._roofline(config, loaded)
    assert roofline is not None
    mc = loaded.config
    q, kv = mc.num_heads * mc.head_dim, mc.num_kv_heads * mc.head_dim
    per_layer = mc.hidden_size * (q + 2 * kv) + q * mc.hidden_size + 3 * mc.hidden_size * mc.intermediate_size
    assert roofline.flops_per_token == pytest.approx(2 * mc.num_layers * per_layer)
    assert roofline.weight_bytes >= 4 * mc.num_layers * per_layer  # float32, dense
    assert (home / "host").is_dir() and list(itertools.islice((home / "host").iterdir(), 1))
