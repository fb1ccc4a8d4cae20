"""The `tessera` command line: listing models, and one clear line for every kind of bad input."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from tessera import cli
from tessera.models import registry
from tessera.server.output_parsers import OutputParsing


@pytest.fixture()
def home(tmp_path, monkeypatch) -> Path:
    monkeypatch.setenv("TESSERA_HOME", str(tmp_path / "home"))
    return tmp_path / "home"


def run_tessera(*args: str, home: Path, timeout: float = 300) -> subprocess.CompletedProcess:
    env = dict(os.environ, TESSERA_HOME=str(home), HF_HUB_OFFLINE="1", PYTHONWARNINGS="ignore")
    return subprocess.run([sys.executable, "-m", "tessera", *args], env=env, capture_output=True,
                          text=True, timeout=timeout, stdin=subprocess.DEVNULL)


def assert_one_line_error(proc: subprocess.CompletedProcess, *needles: str) -> str:
    assert proc.returncode != 0, proc.stdout
    assert "Traceback" not in proc.stderr, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    line = lines[0]
    assert line.startswith("error: "), line
    for needle in needles:
        assert needle.lower() in line.lower(), line
    return line


def write_gguf(path: Path, arch: str, tensor_elems: int = 256) -> Path:
    import gguf

    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_block_count(1)
    writer.add_context_length(128)
    writer.add_embedding_length(64)
    writer.add_head_count(4)
    writer.add_tensor("token_embd.weight", np.zeros(tensor_elems, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


# ----------------------------------------------------------------------------- in-process

def test_models_lists_every_known_model(home, capsys):
    entry = registry.MODELS["gemma3-270m"]
    path = registry.model_path(entry)
    path.parent.mkdir(parents=True)
    with open(path, "wb") as f:
        f.truncate(entry.size)
    assert cli.main(["models"]) == 0
    out = capsys.readouterr().out
    for e in registry.MODELS.values():
        assert e.name in out and e.quantization in out
    rows = {line.split("│")[1].strip(): line for line in out.splitlines() if line.count("│") > 3}
    assert "yes" in rows["gemma3-270m"] and str(path) in rows["gemma3-270m"]
    assert "no" in rows["smollm2-135m"].split("│")[6]
    assert "llama" in rows["smollm2-135m"] and "135M" in rows["smollm2-135m"]
    # then the families one's own model may be, with what takes the one-call C decode step
    from tessera.models.families import FAMILIES

    for name in FAMILIES:
        assert name in rows, name
    assert {rows[name].split("│")[4].strip() for name in ("qwen2", "qwen3", "qwen3moe", "gpt-oss")} == {"yes"}


@pytest.mark.parametrize("command", [[], ["models"], ["pull"], ["generate"], ["chat"], ["serve"]])
def test_help_texts(command, capsys):
    with pytest.raises(SystemExit) as info:
        cli.main([*command, "--help"])
    assert info.value.code == 0
    assert "usage: tessera" in capsys.readouterr().out


def test_serve_flags_defaults():
    import argparse

    parser = argparse.ArgumentParser()
    cli.add_serve_args(parser)
    args = parser.parse_args([])
    assert (args.model, args.host, args.port) == ("smollm2-135m", "127.0.0.1", 8000)
    assert args.served_model_name is None and args.otlp_traces_endpoint is None
    args = parser.parse_args(["m.gguf", "--port", "9000", "--kv-cache-memory", "1GiB", "--max-num-seqs", "4"])
    assert (args.model, args.port, args.kv_cache_memory, args.max_num_seqs) == ("m.gguf", 9000, 1 << 30, 4)


def serving_spec(*argv: str):
    import argparse

    from tessera.server.config import ServingSpec

    parser = argparse.ArgumentParser()
    cli.add_serve_args(parser)
    return ServingSpec.from_args(parser.parse_args(list(argv)))


def test_serve_flags_become_one_typed_spec():
    spec = serving_spec()
    (only,) = spec.models
    assert (only.name, only.model, only.preload, only.keep_alive) == ("smollm2-135m", "smollm2-135m", True, None)
    assert (spec.host, spec.port, spec.log_level, spec.log_stats, spec.ui) == ("127.0.0.1", 8000, "info", True, True)
    assert (spec.engine_process, spec.engine_step_timeout, spec.request_timeout, spec.shutdown_timeout) \
        == (True, 120.0, 600.0, 10.0)
    assert spec.steps_on_main_thread and not spec.replicated and spec.ray is None
    spec = serving_spec("m.gguf", "--served-model-name", "mine", "--no-engine-process", "--engine-step-timeout", "0",
                        "--request-timeout", "0", "--keep-alive", "5m", "--disable-log-stats", "--no-ui",
                        "--otlp-traces-endpoint", "http://127.0.0.1:4318/v1/traces", "--max-num-seqs", "4")
    assert (spec.models[0].name, spec.models[0].keep_alive) == ("mine", None)  # one engine: never unloaded
    assert (spec.engine_process, spec.engine_step_timeout, spec.request_timeout, spec.log_stats, spec.ui) \
        == (False, None, None, False, False)
    assert spec.otlp_traces_endpoint == "http://127.0.0.1:4318/v1/traces"
    assert spec.engine_config(spec.models[0]).max_num_seqs == 4 and spec.steps_on_main_thread
    spec = serving_spec("m.gguf", "--replicas", "2", "--keep-alive", "5m", "--router-policy", "round-robin")
    assert spec.replicated and not spec.steps_on_main_thread and spec.models[0].keep_alive == 300
    assert (spec.replicas, spec.replica_count, spec.router_policy) == (2, 2, "round-robin")
    spec = serving_spec("--pd", "prefill=1,decode=2")
    assert spec.pd == (1, 2) and spec.replica_count == 3 and spec.replicated
    spec = serving_spec("--ray", "--ray-address", "auto", "--ray-num-cpus-per-replica", "2",
                        "--ray-memory-per-replica", "1GiB")
    assert spec.ray is not None and (spec.ray.address, spec.ray.num_cpus_per_replica, spec.ray.memory_per_replica) \
        == ("auto", 2.0, 1 << 30)
    spec = serving_spec("--tool-call-parser", "mistral", "--reasoning-parser", "deepseek_r1", "--chat-template",
                        "{{ messages }}")
    assert spec.models[0].parsing == OutputParsing("mistral", "deepseek_r1", "{{ messages }}")
    assert serving_spec().models[0].parsing == OutputParsing()  # the parser detected from the template


@pytest.mark.parametrize("argv, needle", [
    (["--replicas", "0"], "--replicas must be at least 1"),
    (["--ray-num-cpus-per-replica", "0"], "--ray-num-cpus-per-replica must be > 0"),
    (["--pd", "prefill=1"], "--pd: needs at least one prefill and one decode"),
    (["--port", "70000"], "--port must be from 0 to 65535"),
    (["--shutdown-timeout", "-1"], "--shutdown-timeout must be"),
    (["--max-num-queued-requests", "-1"], "--max-num-queued-requests must be at least 0"),
    (["--max-loaded-models", "0"], "--max-loaded-models must be at least 1"),
    (["a", "b", "--served-model-name", "x"], "--served-model-name names one model"),
    (["--max-num-seqs", "0"], "--max-num-seqs must be at least 1"),
    (["--chat-template", "/no/such/template.jinja"], "--chat-template: .* is neither a readable file"),
])
def test_bad_serve_flags_are_one_clear_error(argv, needle):
    from tessera.errors import TesseraError

    with pytest.raises(TesseraError, match=needle):
        serving_spec(*argv)


def test_bad_serve_flag_is_one_line_before_anything_loads(home):
    assert_one_line_error(run_tessera("serve", "no-such-model", "--replicas", "0", home=home), "--replicas")


def test_keyboard_interrupt_exits_130(monkeypatch, capsys):
    def interrupted(args):
        raise KeyboardInterrupt

    monkeypatch.setattr(cli, "cmd_models", interrupted)
    assert cli.main(["models"]) == 130
    assert capsys.readouterr().err == ""


def test_invalid_sampling_flag_is_one_line(home, capsys):
    assert cli.main(["generate", "smollm2-135m", "-p", "hi", "--temperature", "-1"]) != 0
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: ") and "temperature" in err[0]


# ----------------------------------------------------------------------------- subprocess: bad input

def test_models_subprocess(home):
    proc = run_tessera("models", home=home)
    assert proc.returncode == 0, proc.stderr
    assert "smollm2-135m" in proc.stdout and "qwen2.5-coder-1.5b" in proc.stdout


def test_pull_unknown_name(home):
    assert_one_line_error(run_tessera("pull", "gpt-17", home=home), "gpt-17", "tessera models")


def test_generate_unknown_model(home):
    assert_one_line_error(run_tessera("generate", "no-such-model", "-p", "hi", home=home),
                          "no-such-model", "tessera models")


def test_generate_missing_file(home, tmp_path):
    missing = tmp_path / "nowhere" / "model.gguf"
    assert_one_line_error(run_tessera("generate", str(missing), "-p", "hi", home=home), "not found")


def test_generate_corrupt_gguf(home, tmp_path):
    bad = tmp_path / "random.gguf"
    bad.write_bytes(np.random.default_rng(0).bytes(4096))
    assert_one_line_error(run_tessera("generate", str(bad), "-p", "hi", "--max-tokens", "1", home=home),
                          "random.gguf")


def test_generate_truncated_gguf(home, tmp_path):
    whole = write_gguf(tmp_path / "whole.gguf", "llama", tensor_elems=1 << 16)
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(whole.read_bytes()[: whole.stat().st_size // 2])
    assert_one_line_error(run_tessera("generate", str(cut), "-p", "hi", "--max-tokens", "1", home=home),
                          "cut.gguf")


def test_generate_unsupported_architecture(home, tmp_path):
    mamba = write_gguf(tmp_path / "mamba.gguf", "mamba")
    assert_one_line_error(run_tessera("generate", str(mamba), "-p", "hi", "--max-tokens", "1", home=home),
                          "mamba")


@pytest.mark.model
def test_generate_truncated_real_model(tmp_path):
    source = registry.ensure_model("smollm2-135m", progress=False)  # the shared cache: pulled once
    home = tmp_path / "home"
    cut = tmp_path / "smollm2-cut.gguf"
    with open(source, "rb") as f:
        cut.write_bytes(f.read(1 << 20))
    assert_one_line_error(run_tessera("generate", str(cut), "-p", "hi", "--max-tokens", "1", home=home),
                          "smollm2-cut.gguf")


# ----------------------------------------------------------------------------- chat loop

class _ScriptedEngine:
    """Replies "ok <n>" to the n-th request in two steps, so streaming and history can be checked."""

    def __init__(self) -> None:
        self.prompts: list = []
        self.pending: list = []
        self.tokenizer = self

    # tokenizer side
    def apply_chat_template(self, messages, add_generation_prompt=True):
        return "".join(f"<{m['role']}>{m['content']}" for m in messages) + "<assistant>"

    def encode(self, text, add_special_tokens=True):
        return [ord(c) for c in text]

    # engine side
    def add_request(self, request_id, prompt, params):
        self.prompts.append("".join(map(chr, prompt)))
        self.pending = [(request_id, "ok ", False), (request_id, str(len(self.prompts)), True)]

    def has_unfinished_requests(self):
        return bool(self.pending)

    def abort_request(self, request_id):
        self.pending = []

    def step(self):
        from tessera.engine.outputs import CompletionOutput, RequestOutput

        rid, delta, done = self.pending.pop(0)
        text = "ok " + (delta if done else "")
        out = CompletionOutput(index=0, text=text if done else delta, delta_text=delta,
                               finish_reason="stop" if done else None)
        return [RequestOutput(rid, None, [], [out], finished=done)]


def test_chat_keeps_the_conversation_and_streams(monkeypatch, capsys):
    engine = _ScriptedEngine()
    monkeypatch.setattr(cli, "_build_llm", lambda args, **_: type("L", (), {"engine": engine})())
    lines = iter(["hello", "", "again", "/exit"])
    monkeypatch.setattr("builtins.input", lambda prompt="": next(lines))
    assert cli.main(["chat", "smollm2-135m", "--system", "be brief"]) == 0
    out = capsys.readouterr().out
    assert out.splitlines() == ["ok 1", "ok 2"]
    assert engine.prompts[0] == "<system>be brief<user>hello<assistant>"
    assert engine.prompts[1] == "<system>be brief<user>hello<assistant>ok 1<user>again<assistant>"


def test_chat_quits_on_ctrl_d(monkeypatch):
    engine = _ScriptedEngine()
    monkeypatch.setattr(cli, "_build_llm", lambda args, **_: type("L", (), {"engine": engine})())

    def eof(prompt=""):
        raise EOFError

    monkeypatch.setattr("builtins.input", eof)
    assert cli.main(["chat"]) == 0
    assert engine.prompts == []
