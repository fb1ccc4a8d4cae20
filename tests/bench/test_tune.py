"""`tessera tune`: the search space as `--config` files, the pruning rule, and a whole run on a
tiny budget whose winning TOML `tessera serve --config` accepts."""
from __future__ import annotations

import json
import random
from types import SimpleNamespace

import pytest
from tiny_model import make_tiny_model

from tessera.bench import tune
from tessera.cli import build_parser
from tessera.server.config import ServingSpec
from tessera.slo import SLOSpec

SLO = SLOSpec.parse("ttft_p95<=1s,itl_p50<=50ms")


def spec_of(path) -> ServingSpec:
    """What `tessera serve --config PATH` builds before it loads anything (every setting checked)."""
    return ServingSpec.from_args(build_parser(with_bench=False).parse_args(["serve", "--config", str(path)]))


class FixedTrial:
    """An optuna trial stand-in drawing each categorical choice at random."""

    def __init__(self, seed: int) -> None:
        self.rng = random.Random(seed)

    def suggest_categorical(self, name, choices):
        return self.rng.choice(choices)


def test_every_point_of_the_space_is_a_config_serve_accepts(tmp_path):
    space = tune.Space(topology=tuple(tune.topologies(4)))
    assert space.topology == ("1x4", "2x2", "4x1", "1x2", "2x1") and tune.topologies(2) == ["1x2", "2x1", "1x1"]
    for seed in range(12):
        params = space.suggest(FixedTrial(seed))
        engine, replicas = tune.engine_settings(params, 4)
        path = tmp_path / f"t{seed}.toml"
        path.write_text(tune.config_toml("smollm2-135m", engine, replicas, SLO, "a comment\nover two lines"))
        spec = spec_of(path)
        config = spec.engine_config(spec.models[0])
        assert spec.replicas == replicas and str(spec.slo) == str(SLO) and spec.models[0].preload
        for key in ("max_num_seqs", "max_num_batched_tokens", "target_itl_ms", "preemption_mode",
                    "enable_prefix_caching"):
            assert getattr(config, key) == params[key]
        assert (config.speculative_config is None) == (params["speculation"] == "off")
        if config.speculative_config is not None:
            assert config.speculative_config.num_speculative_tokens == params["num_speculative_tokens"]
        assert config.num_threads == (None if params["topology"] == "1x4" else int(params["topology"][-1]))
        assert spec.replicas == int(params["topology"][0])


def test_the_baseline_is_the_default_profile(tmp_path):
    space = tune.Space(topology=("1x2", "2x1"))
    engine, replicas = tune.engine_settings(tune.baseline_params(space), 2)
    path = tmp_path / "base.toml"
    path.write_text(tune.config_toml("smollm2-135m", engine, replicas, SLO))
    tuned = spec_of(path).engine_config(spec_of(path).models[0])
    default = ServingSpec.from_args(build_parser(with_bench=False).parse_args(["serve", "smollm2-135m"]))
    plain = default.engine_config(default.models[0])
    for key in ("max_num_seqs", "max_num_batched_tokens", "target_itl_ms", "min_prefill_chunk",
                "enable_prefix_caching", "preemption_mode", "kv_cache_dtype", "speculative_config", "num_threads"):
        assert getattr(tuned, key) == getattr(plain, key), key
    assert replicas == 1


def test_latency_targets_follow_the_slo_per_token_limit():
    assert tune.latency_targets(SLO) == (0.0, 25.0, 37.5, 50.0)
    # a tighter objective than the default profile's own target keeps that target as a choice
    assert tune.latency_targets(SLOSpec.parse("ttft_p95<=1s,itl_p50<=25ms,itl_p99<=200ms")) == \
        (0.0, 12.5, 18.8, 25.0, 50.0)
    assert tune.latency_targets(SLOSpec.parse("tpot_p50<=80ms")) == (0.0, 40.0, 50.0, 60.0, 80.0)
    assert tune.latency_targets(SLOSpec.parse("ttft_p95<=2s")) == tune.Space.target_itl_ms
    # the default profile is a point of every such space (it runs first as the baseline)
    space = tune.Space(topology=("1x2",), target_itl_ms=tune.latency_targets(SLOSpec.parse("itl_p50<=20ms")))
    assert tune.baseline_params(space)["target_itl_ms"] in space.target_itl_ms


def test_a_command_line_replicas_or_slo_beats_the_file(tmp_path):
    path = tmp_path / "t.toml"
    path.write_text(tune.config_toml("smollm2-135m", {"max_num_seqs": 8}, 2, SLO))
    args = build_parser(with_bench=False).parse_args(["serve", "--config", str(path), "--replicas", "3",
                                                      "--slo", "ttft_p99<=3s"])
    spec = ServingSpec.from_args(args)
    assert spec.replicas == 3 and str(spec.slo) == "ttft_p99<=3s"
    path.write_text('slo = "ttft_p95 <= fast"\n[[model]]\nmodel = "smollm2-135m"\n')
    with pytest.raises(Exception, match="cannot read"):
        spec_of(path)


def test_hopeless_pruner_stops_only_trials_that_cannot_beat_the_best():
    import optuna

    complete = optuna.trial.TrialState.COMPLETE

    def study(*values):
        return SimpleNamespace(get_trials=lambda deepcopy, states: [SimpleNamespace(value=v) for v in values]
                               if complete in states else [])

    rule = tune.HopelessPruner()
    trial = lambda fail: SimpleNamespace(user_attrs={} if fail is None else {"lowest_fail": fail})  # noqa: E731
    assert rule.prune(study(2.0, 1.0), trial(1.5))  # failed below the best: cannot win
    assert rule.prune(study(2.0), trial(2.0))
    assert not rule.prune(study(2.0), trial(2.5))  # may still land between 2 and 2.5
    assert not rule.prune(study(2.0), trial(None))  # has not failed yet
    assert not rule.prune(study(), trial(0.5))  # nothing to beat


@pytest.mark.slow
def test_tune_end_to_end_on_a_tiny_budget(tmp_path):
    from tessera.cli import main

    folder = make_tiny_model(tmp_path / "llama")
    out = tmp_path / "tune"
    code = main(["tune", str(folder), "--workload", "random", "--time-budget", "4m", "--trials", "2",
                 "--probe-duration", "3", "--max-probes", "2", "--min-requests", "4", "--prompt-words", "3:10",
                 "--max-tokens", "2:8", "--slo", "ttft_p95<=3s,itl_p50<=500ms", "--start-rate", "1",
                 "--output-dir", str(out)])
    assert code == 0
    report = json.loads((out / "tune_report.json").read_text())
    assert report["kind"] == "tessera-tune" and report["baseline"]["trial"] == 0
    assert len(report["trials"]) == 2 and report["elapsed_s"] < 4 * 60 + 60
    assert all(t["probes"] for t in report["trials"] if t["state"] != "failed")
    assert (out / "tune_capacity.png").exists() and (out / "tune_frontier.png").exists()
    spec = spec_of(out / "tuned.toml")
    best = report["best"]["params"]
    config = spec.engine_config(spec.models[0])
    assert config.max_num_seqs == best["max_num_seqs"] and str(spec.slo) == "ttft_p95<=3s,itl_p50<=500ms"
    assert spec.replicas == int(best["topology"].split("x")[0])
    assert report["best"]["capacity"] >= report["baseline"]["capacity"]


def test_a_trace_workload_keeps_its_arrival_pattern_scaled_to_each_rate(tmp_path):
    from tessera.server import traffic

    records = [{"t": 100.0 + t, "endpoint": "chat", "model": "m", "prompt_tokens": 40, "output_tokens": 5,
                "prefix_hashes": ["%016x" % (i % 3), "%016x" % i], "block_size": 16, "stream": True, "status": 200}
               for i, t in enumerate((0, 1, 1.5, 4, 4.5, 9))]
    path = tmp_path / "t.jsonl"
    path.write_text("\n".join(json.dumps(x) for x in [traffic.header(False), *records]) + "\n")
    args = SimpleNamespace(skip_invalid=False, model=str(tmp_path / "no-such-model"))
    workload = tune.trace_workload(path, args)
    base = 5 / 9  # the trace's own rate
    sessions, arrivals = workload.build(2 * base, 6, seed=1)  # twice as fast
    assert arrivals == pytest.approx([0, 0.5, 0.75, 2, 2.25, 4.5])
    assert [s.turns[0].max_tokens for s in sessions] == [5] * 6
    again, _ = workload.build(base, 6, seed=2)  # another probe: other text, same structure
    assert again[0].turns[0].prompt != sessions[0].turns[0].prompt
    first = [s.turns[0].prompt.split()[:8] for s in sessions]
    assert first[0] == first[3] != first[1]  # the shared leading block is the same words
