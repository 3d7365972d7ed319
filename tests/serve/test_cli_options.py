"""Every EngineConfig field is an option of the commands that start an engine, generated from the pydantic
model (tools/config_flags.py): parsed into the field's type, shown in --help with its description and
default, under the environment's TIEREDKV_<FIELD>; a bad value is one line naming the option."""

import pytest

from tieredkv import EngineConfig
from tieredkv.cli import build_parser, main
from tieredkv.tools.config_flags import engine_config, flag

COMMANDS = ["demo", "generate", "chat", "serve", "explain"]
POSITIONAL = {"generate": ["hi"], "explain": ["hi"]}


def parse(command, *options):
    return build_parser().parse_args([command, *POSITIONAL.get(command, []), *options])


@pytest.mark.parametrize("command", COMMANDS)
def test_every_field_is_an_option_with_its_description_and_default(command, capsys):
    with pytest.raises(SystemExit):
        parse(command, "--help")
    text = " ".join(capsys.readouterr().out.split())  # argparse wraps lines
    for name, field in EngineConfig.model_fields.items():
        assert flag(name) in text, name
        assert field.description, f"{name} has no description"
        default = field.get_default(call_default_factory=True)
        shown = "unset" if default is None else default
        assert f"[default: {shown}; env TIEREDKV_{name.upper()}]" in text, name
    assert "0.0.0.0" in text or command != "serve"


def test_options_are_parsed_into_the_fields_types():
    args = parse("serve", "--block-size", "32", "--warm-bytes", "1.5GiB", "--cold-bytes", "512MiB",
                 "--no-enable-prefix-caching", "--compile-decode", "--scheduling-policy", "fcfs",
                 "--gpu-memory-utilization", "0.5", "--weights", "int8", "--cold-path", "/tmp/x", "--model", "m",
                 "--remote", "redis://10.0.0.5:6379/2", "--remote-ttl-s", "none")
    cfg = engine_config(args)
    assert cfg.remote_url == "redis://10.0.0.5:6379/2" and cfg.remote_ttl_s is None
    assert (cfg.block_size, cfg.warm_bytes, cfg.cold_bytes) == (32, 3 << 29, 512 << 20)
    assert cfg.enable_prefix_caching is False and cfg.compile_decode is True and cfg.scheduling_policy == "fcfs"
    assert cfg.gpu_memory_utilization == 0.5 and cfg.quantization == "int8"
    assert (cfg.cold_path, cfg.model) == ("/tmp/x", "m")
    assert engine_config(parse("serve")) == EngineConfig.from_env()  # nothing given: the environment, the defaults


def test_an_option_wins_over_the_environment_which_wins_over_the_command_and_the_default(monkeypatch):
    monkeypatch.setenv("TIEREDKV_BLOCK_SIZE", "8")
    monkeypatch.setenv("TIEREDKV_OFFLOAD", "0")
    assert engine_config(parse("generate"), num_blocks=64).block_size == 8
    cfg = engine_config(parse("generate", "--block-size", "64", "--offload", "staged"), num_blocks=64)
    assert (cfg.block_size, cfg.offload, cfg.num_blocks) == (64, "staged", 64)
    assert engine_config(parse("generate"), num_blocks=64).offload == "off"  # TIEREDKV_OFFLOAD=0
    assert engine_config(parse("generate", "--num-blocks", "32"), num_blocks=64).num_blocks == 32


@pytest.mark.parametrize("options, message", [
    (["--block-size", "0"], "tieredkv generate: --block-size: Input should be greater than or equal to 1"),
    (["--quantization-group-size", "48"], "tieredkv generate: --quantization-group-size: Value error, "
                                          "quantization_group_size must be one of"),
    (["--device", "tpu"], "tieredkv generate: --device: Value error, device must be"),
])
def test_a_bad_value_is_one_line_naming_the_option(options, message, capsys):
    with pytest.raises(SystemExit) as e:
        main(["generate", "hi", *options])
    assert str(e.value.code).startswith(message) and "\n" not in str(e.value.code)


def test_a_value_argparse_cannot_read_is_refused_before_anything_starts(capsys):
    for options in (["--warm-bytes", "lots"], ["--scheduling-policy", "lifo"], ["--num-blocks", "x"]):
        with pytest.raises(SystemExit) as e:
            main(["serve", *options])
        assert e.value.code == 2
        assert flag(options[0][2:].replace("-", "_")) in capsys.readouterr().err


def test_an_unknown_model_is_one_line(tmp_path):
    with pytest.raises(SystemExit) as e:
        main(["generate", "hi", "--model", str(tmp_path / "nowhere")])
    assert "tieredkv generate:" in str(e.value.code) and "nowhere" in str(e.value.code)
