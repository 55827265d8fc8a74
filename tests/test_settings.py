"""One configuration (issue 26): every flag also an environment variable and a TOML key; flags > env > file."""

from __future__ import annotations

from pathlib import Path

import pytest

from neurons.miner.cli import parse_args as miner_args
from neurons.validator.config import parse_args

LOCAL = ["--local"]


def _file(tmp_path: Path, text: str) -> str:
    path = tmp_path / "tensorgate.toml"
    path.write_text(text)
    return str(path)


def test_precedence_is_flag_then_environment_then_file(tmp_path: Path) -> None:
    cfg_file = _file(tmp_path, 'netuid = 3\nseed = 1\n[gateway]\nport = 8101\nmax-retries = 5\n'
                               'model = ["a", "b"]\n[audit]\nrate = 0.25\n[probes]\ncapacity-check = "off"\n')
    env = {"TENSORGATE_GATEWAY_PORT": "8102", "TENSORGATE_AUDIT_RATE": "0.5"}
    cfg = parse_args([*LOCAL, "--config", cfg_file, "--audit.rate", "0.75"], env=env)
    assert cfg.audit_rate == 0.75  # flag over env over file
    assert cfg.gateway_port == 8102  # env over file
    assert (cfg.netuid, cfg.seed, cfg.max_retries) == (3, 1, 5)  # file over the defaults, typed by the flag
    assert cfg.models == ["a", "b"] and cfg.capacity_check is False
    # a repeatable flag on the command line replaces the file's list rather than adding to it
    assert parse_args([*LOCAL, "--config", cfg_file, "--gateway.model", "c"], env={}).models == ["c"]
    # the file named in the environment; switches and lists from the environment
    cfg = parse_args([], env={"TENSORGATE_CONFIG": cfg_file, "TENSORGATE_LOCAL": "true",
                              "TENSORGATE_GATEWAY_MODEL": "x, y", "TENSORGATE_LOG_ACCESS": "1"})
    assert cfg.local and cfg.models == ["x", "y"] and cfg.log_access and cfg.gateway_port == 8101


@pytest.mark.parametrize("text,env,needle", [
    ("[gateway]\nprot = 1\n", {}, "unknown setting 'gateway.prot'"),
    ("[gateway]\nport = \"eighty\"\n", {}, "gateway.port: invalid value 'eighty'"),
    ("[gateway]\nport = 80.5\n", {}, "gateway.port: invalid value 80.5"),
    ("[probes]\nmix = \"tpu\"\n", {}, "'tpu' is not one of gpu, cpu"),
    ("local = \"yes\"\n", {}, "a switch is true or false"),
    ("netuid = [1]\n", {}, "expected one value"),
    ("not toml [\n", {}, "not TOML"),
    ("", {"TENSORGATE_AUDIT_RATE": "lots"}, "$TENSORGATE_AUDIT_RATE: invalid value 'lots'"),
    ("", {"TENSORGATE_LOCAL": "maybe"}, "$TENSORGATE_LOCAL: a switch is true or false"),
    ("", {"TENSORGATE_GATEWAY_MODEL": ""}, "$TENSORGATE_GATEWAY_MODEL: empty"),  # issue 56: accepted silently
    ("", {"TENSORGATE_GATEWAY_MODEL": " , "}, "$TENSORGATE_GATEWAY_MODEL: empty"),
])
def test_a_bad_setting_is_one_line_naming_its_source_and_exit_2(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                                text: str, env: dict[str, str], needle: str) -> None:
    with pytest.raises(SystemExit) as e:
        parse_args([*LOCAL, "--config", _file(tmp_path, text)], env=env)
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert needle in err and "Traceback" not in err


def test_a_missing_config_file_is_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as e:
        parse_args([*LOCAL, "--config", str(tmp_path / "nope.toml")], env={})
    assert e.value.code == 2 and "nope.toml: No such file or directory" in capsys.readouterr().err


def test_the_miner_reads_its_own_prefix_so_one_shell_can_hold_both(tmp_path: Path) -> None:
    env = {"TENSORGATE_WALLET_NAME": "vali", "TENSORGATE_MINER_WALLET_NAME": "mine", "TENSORGATE_MINER_SLOTS": "7",
           "TENSORGATE_MINER_RUNTIME_SIM": "rtx5090"}
    args = miner_args([], env=env)
    assert (args.wallet_name, args.slots, args.runtime_sim) == ("mine", 7, "rtx5090")
    assert parse_args(LOCAL, env=env).wallet_name == "vali"
    miner_file = _file(tmp_path, '[runtime]\nsim = "rtx5090"\nsampler = "subnet"\n[axon]\nport = 9001\n')
    args = miner_args(["--config", miner_file], env={})
    assert (args.axon_port, args.runtime_sampler) == (9001, "subnet")


def test_start_up_failures_are_one_line_and_exit_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """No wallet; then a wallet but a chain that cannot be reached after its retries (and its fallback)."""
    import socket

    import bittensor as bt

    from neurons.validator.cli import main

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        closed = s.getsockname()[1]
    base = ["--netuid", "7", "--network", f"ws://127.0.0.1:{closed}", "--gateway.model", "m", "--audit.off",
            "--wallet.name", "vali", "--wallet.path", str(tmp_path), "--state-dir", str(tmp_path / "state")]
    assert main(base) == 2
    assert "no hotkey 'default' in wallet 'vali'" in capsys.readouterr().err
    bt.Wallet(name="vali", hotkey="default", path=str(tmp_path)).create_new_hotkey(suppress=True)
    assert main([*base, "--chain.connect-retries", "1", "--chain.fallback", f"ws://127.0.0.1:{closed}"]) == 2
    err = capsys.readouterr().err
    assert f"cannot reach ws://127.0.0.1:{closed} after 2 attempts" in err and "Traceback" not in err


def test_the_reference_service_reads_its_own_prefix(tmp_path: Path) -> None:
    from neurons.reference.__main__ import parse_args as reference_args

    cfg_file = _file(tmp_path, 'threads = 4\nhost = "0.0.0.0"\n')
    args = reference_args(["--config", cfg_file], env={"TENSORGATE_REFERENCE_PORT": "8111", "TENSORGATE_PORT": "1"})
    assert (args.threads, args.host, args.port, args.model) == (4, "0.0.0.0", 8111, "packaged")


# -- the config fuzz (issue 39 row 3): every number flag, three sources, hostile values --------------------------

_HOSTILE = ["nan", "inf", "-inf", "-1", "1e400", "99999999999999999999", "abc", "", "0x10", "1.5", "-0"]


def _number_flags(parser: object) -> list[tuple[str, object]]:
    import argparse

    assert isinstance(parser, argparse.ArgumentParser)
    return [(a.option_strings[0], a.type) for a in parser._actions
            if a.option_strings and getattr(a.type, "__module__", "") == "neurons.flag_types"]


def _programs() -> list[tuple[str, object, list[str], str, object]]:
    """(name, parse, base argv, env prefix, parser) of the three programs."""
    from neurons.miner.cli import build_parser as miner_parser
    from neurons.reference.__main__ import build_parser as reference_parser
    from neurons.reference.__main__ import parse_args as reference
    from neurons.validator.config import build_parser

    return [("validator", parse_args, ["--local", "--state-dir", "/tmp/tg-fuzz"], "TENSORGATE_", build_parser()),
            ("miner", miner_args, ["--dev-key", "Bob"], "TENSORGATE_MINER_", miner_parser()),
            ("reference", reference, [], "TENSORGATE_REFERENCE_", reference_parser())]


def test_every_number_flag_refuses_hostile_values_from_every_source_in_one_line(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Each number flag of the validator, the miner and the reference, given nan, inf, out-of-range, huge and
    non-numbers on the command line, in the environment and in the TOML file: either the value parses within the
    flag's range, or the program exits 2 with one line naming the setting. Never a traceback (nine settings used to
    end in one, exit 1)."""
    import math

    from neurons.settings import env_name

    checked = 0
    for name, parse, base, prefix, parser in _programs():
        flags = _number_flags(parser)
        assert len(flags) >= 3, name  # the programs' number flags all carry a range
        for flag, _ in flags:
            for value in _HOSTILE:
                table, _, key = flag[2:].rpartition(".")
                toml = tmp_path / "c.toml"
                toml.write_text((f"[{table}]\n" if table else "") + f"{key} = \"{value}\"\n")
                for argv, env in ((base + [flag, value], {}),
                                  (base, {env_name(flag[2:], prefix): value}),
                                  (base + ["--config", str(toml)], {})):
                    try:
                        ns = parse(argv, env)  # type: ignore[operator]
                    except SystemExit as e:
                        assert e.code == 2, (name, flag, value)
                        err = capsys.readouterr().err.strip().splitlines()
                        assert err and "Traceback" not in "\n".join(err), (name, flag, value, err)
                        continue
                    dest = next(a.dest for a in parser._actions if flag in a.option_strings)  # type: ignore[attr-defined]
                    got = getattr(ns, dest)
                    for one in got if isinstance(got, list) else [got]:  # a list flag (percents) checks each
                        assert one is None or (math.isfinite(one) and one >= 0), (name, flag, value, got)
                    checked += 1
    assert checked > 0  # some hostile values are fine ("1.5" seconds, "-0")


def test_unknown_variables_and_deep_tables_are_refused_and_log_levels_and_redis_urls_checked(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    base = ["--local", "--state-dir", str(tmp_path)]
    for argv, env, says in (
            (base, {"TENSORGATE_GATEWAY_PROT": "8001"}, "did you mean $TENSORGATE_GATEWAY_PORT"),
            (base + ["--log-level", "LOUD"], {}, "unknown log level"),
            (base + ["--redis.url", "localhost:6379"], {}, "redis://"),
            (base + ["--gateway.port", "70000"], {}, "[0, 65535]")):
        with pytest.raises(SystemExit) as e:
            parse_args(argv, env)
        assert e.value.code == 2 and says in capsys.readouterr().err
    # other programs' variables and the documented non-flag ones are not the validator's settings
    ok = parse_args(base, {"TENSORGATE_MINER_SLOTS": "2", "TENSORGATE_SKIP_REAL": "1", "TENSORGATE_API_KEYS": "k"})
    assert ok.log_level == "INFO"
    assert parse_args(base + ["--log-level", "debug"], {}).log_level == "DEBUG"
    deep = tmp_path / "deep.toml"
    deep.write_text("a = " + "{b = " * 3000 + "1" + "}" * 3000 + "\n")
    with pytest.raises(SystemExit) as e:
        parse_args(base + ["--config", str(deep)], {})
    assert e.value.code == 2 and "nested too deeply" in capsys.readouterr().err


def test_a_switch_that_is_also_a_table_is_enabled_in_it(tmp_path: Path) -> None:
    """Issue 39 row 3: ``local = true`` beside a ``[local]`` table is not TOML, so --local and its settings could
    not share one file; ``[local] enabled = true`` is --local."""
    f = tmp_path / "local.toml"
    f.write_text(f'state-dir = "{tmp_path}"\n[local]\nenabled = true\nrounds = 3\n')
    cfg = parse_args(["--config", str(f)], {})
    assert cfg.local and cfg.local_rounds == 3
    f.write_text("[gateway]\nenabled = true\n")  # not a switch: still an unknown key
    with pytest.raises(SystemExit) as e:
        parse_args(["--local", "--config", str(f)], {})
    assert e.value.code == 2


def test_each_validator_setting_is_declared_once_as_a_field(tmp_path: Path) -> None:
    """Issue 40: a setting was a config field with its default and a flag with the same default, its range in a table
    apart. Now the field is the one declaration: every field is a flag, and one declared field is at once a flag, a
    variable and a file key, its bounds checked from each."""
    import argparse
    import dataclasses

    from neurons.config_fields import add_flags, config_of, setting
    from neurons.settings import add_config_flag, resolve
    from neurons.validator.config import ValidatorConfig, build_parser

    parser = build_parser()
    assert {a.dest for a in parser._actions} - {"help", "config"} == {f.name for f in dataclasses.fields(
        ValidatorConfig)}
    assert all(a.help for a in parser._actions)

    @dataclasses.dataclass
    class Demo:
        port: int = setting(8000, flag="gateway.port", group="gateway", type=int, bounds=(1, 65535), help="bind port")
        check: bool = setting(True, flag="probes.check", kind="onoff", help="checks on or off")
        peers: list[str] = setting(flag="peer", kind="append", factory=list, help="repeatable")

    demo = argparse.ArgumentParser()
    add_config_flag(demo, "DEMO_")
    add_flags(demo, Demo, groups=("gateway",))

    def parse(argv: list[str], env: dict[str, str]) -> Demo:
        values = vars(resolve(demo, argv, env=env, prefix="DEMO_"))
        values.pop("config")
        return config_of(values, Demo)

    assert parse(["--peer", "a"], {"DEMO_GATEWAY_PORT": "8001"}) == Demo(port=8001, check=True, peers=["a"])
    toml = tmp_path / "demo.toml"
    toml.write_text('[probes]\ncheck = "off"\n')
    assert parse(["--config", str(toml)], {}).check is False
    with pytest.raises(SystemExit):  # the declared bounds, from the environment too
        parse([], {"DEMO_GATEWAY_PORT": "0"})

    @dataclasses.dataclass
    class Unbounded:
        n: int = setting(1, flag="n", type=int, help="a number that says nothing of its range")

    with pytest.raises(KeyError):  # a number setting must say what it accepts
        add_flags(argparse.ArgumentParser(), Unbounded, groups=())
