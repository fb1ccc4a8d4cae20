"""Engine options are checked when the config is made, with messages naming the flag."""
from __future__ import annotations

import pytest
import torch

from tessera.config import EngineConfig
from tessera.errors import ConfigError, TesseraError


@pytest.mark.parametrize("bad, flag", [
    (dict(quantization="fp8"), "--quantization"),
    (dict(dense_weight_copy="maybe"), "--dense-weight-copy"),
    (dict(attention_backend="flash"), "--attention-backend"),
    (dict(dtype="half"), "--dtype"),
    (dict(max_num_seqs=0), "--max-num-seqs"),
    (dict(block_size=0), "--block-size"),
])
def test_bad_options_are_config_errors(bad, flag):
    with pytest.raises(ConfigError, match=flag) as err:
        EngineConfig(**bad)
    assert isinstance(err.value, TesseraError) and isinstance(err.value, ValueError)


def test_python_api_may_pass_a_torch_dtype():
    assert EngineConfig(dtype=torch.bfloat16).dtype == torch.bfloat16
    assert EngineConfig(dense_weight_copy="off").dense_copy is False
    assert EngineConfig().dense_copy is None


def test_cli_reports_bad_options_without_a_traceback(capsys):
    from tessera import cli

    assert cli.main(["generate", "smollm2-135m", "--prompt", "hi", "--max-num-seqs", "0"]) == 2
    err = capsys.readouterr().err
    assert "error: --max-num-seqs must be at least 1" in err and "Traceback" not in err


def test_int8_activations_flag_reaches_the_config():
    import argparse

    from tessera.engine.args import add_engine_args, config_from_args

    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    assert config_from_args(parser.parse_args([]), "smollm2-135m").int8_activations is True
    assert config_from_args(parser.parse_args(["--no-int8-activations"]), "smollm2-135m").int8_activations is False
