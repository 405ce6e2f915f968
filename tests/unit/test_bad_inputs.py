"""Bad input to every command: refused before anything starts.

Table-driven: each number flag of ``elastrun`` (the launch), ``elastrun
status``, ``elastrun store serve`` and ``elastrun timeline``, and each number
read from the environment (``PET_*``, the agent's and the workers'
``ELASTRUN_*`` / ``TORCHELASTIC_*`` variables), given empty, negative, huge,
overlong, non-ASCII digits (``'²'.isdigit()`` is True yet ``int('²')`` raises;
``int('٣') == 3``), NaN/inf and wrong-typed values. What a user checks: exit
code 2 (the launch: a ConfigError), one line naming the flag or the variable,
the value escaped, no traceback, nothing started (a command that got as far as
starting its server or reaching a store fails the test at once, never hangs).
tests/integration/test_cli.py runs a few of them as real processes.
"""

from __future__ import annotations

import os
from collections.abc import Callable

import pytest

from elastrun.errors import ConfigError
from elastrun.launcher.cli import parse
from elastrun.launcher.rdzv_conf import RDZV_CONF_KEYS
from elastrun.rendezvous.sizes import WorldSizes

BAD = {
    "empty": "",
    "negative": "-1",
    "huge": str(10**30),
    "overlong": "9" * 5000,
    "superscript": "\u00b2",  # '²'.isdigit() is True; int('²') raises
    "arabic-indic": "\u0663",  # int('٣') == 3
    "fullwidth": "\uff11",  # int() takes the fullwidth 1 as 1
    "nan": "nan",
    "inf": "inf",
    "word": "x",
    "fraction": "1.5",
    "control": "a\x07b",
}

# The launch's number flags, and the values of BAD each accepts as valid.
LAUNCH_NUMBERS: dict[str, set[str]] = {
    "--nnodes": set(),
    "--node-unit": set(),
    "--nproc-per-node": set(),
    "--node-rank": set(),
    "--master-port": set(),
    "--max-restarts": set(),
    "--monitor-interval": {"fraction"},
    "--shutdown-timeout": {"fraction"},
    "--hang-timeout": {"fraction"},
    "--exit-barrier-timeout": {"fraction"},
    "--warm-join-timeout": {"fraction"},
    "--local-ranks-filter": {"empty"},
    "--redirects": set(),
    "--tee": set(),
}
BASE = ["--rdzv-backend=c10d", "--rdzv-endpoint=127.0.0.1:29400", "--nnodes=1:2", "--rdzv-id=j"]


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in list(os.environ):
        if name.startswith("PET_") or name == "TORCH_ELASTIC_SHUTDOWN_TIMEOUT":
            monkeypatch.delenv(name)


@pytest.fixture
def script(tmp_path, monkeypatch) -> str:
    monkeypatch.chdir(tmp_path)
    (tmp_path / "train.py").write_text("print('hi')\n")
    return "train.py"


def _cases(table: dict[str, set[str]]) -> list[tuple[str, str]]:
    return [(flag, kind) for flag, ok in table.items() for kind in BAD if kind not in ok]


def _one_line(message: str, value: str) -> None:
    """One line, the value escaped (no control character, no 5000 digits)."""
    assert "\n" not in message and "\x07" not in message, message
    assert len(message) < 600, message[:200]
    if value and value.isprintable() and len(value) < 20:
        assert value in message, message


@pytest.mark.parametrize(("flag", "kind"), _cases(LAUNCH_NUMBERS))
def test_every_launch_number_flag_refuses_bad_values(script: str, flag: str, kind: str) -> None:
    value = BAD[kind]
    with pytest.raises(ConfigError) as err:
        parse([*BASE, f"{flag}={value}", script])
    message = str(err.value)
    assert flag in message, message
    _one_line(message, value)


@pytest.mark.parametrize(("flag", "kind"), _cases(LAUNCH_NUMBERS))
def test_every_pet_number_variable_is_refused_naming_it(
    script: str, flag: str, kind: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    value = BAD[kind]
    if not value:
        return  # an empty PET_* variable is unset (torchrun's rule)
    variable = "PET_" + flag[2:].replace("-", "_").upper()
    monkeypatch.setenv(variable, value)
    with pytest.raises(ConfigError) as err:
        parse([*BASE, script] if flag != "--nnodes" else [*BASE[:2], *BASE[3:], script])
    message = str(err.value)
    assert variable in message and flag in message, message
    _one_line(message, value)


@pytest.mark.parametrize("variable", ["PET_STANDALONE", "PET_MODULE", "PET_WARM", "PET_RUN_PATH"])
@pytest.mark.parametrize("kind", ["superscript", "arabic-indic", "fullwidth", "word", "overlong"])
def test_boolean_pet_variables_take_ascii_numbers_only(
    script: str, variable: str, kind: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(variable, BAD[kind])
    with pytest.raises(ConfigError, match=f"^{variable}: expected 0 or 1"):
        parse([*BASE, script])


CONF_NUMBERS = [k for k, kind in RDZV_CONF_KEYS.items() if kind in ("int", "float")]


@pytest.mark.parametrize("key", CONF_NUMBERS)
@pytest.mark.parametrize(
    "kind", [k for k in BAD if k not in ("empty", "fraction", "control", "negative")]
)
def test_every_rdzv_conf_number_refuses_bad_values(script: str, key: str, kind: str) -> None:
    # '²' in store_max_connections_per_peer was a ValueError traceback.
    value = BAD[kind]
    with pytest.raises(ConfigError) as err:
        parse([*BASE, f"--rdzv-conf={key}={value}", script])
    assert str(err.value).startswith(f"--rdzv-conf: {key}") or key in str(err.value)
    _one_line(str(err.value), value)


def test_a_bad_rdzv_conf_number_from_the_environment_names_the_variable(
    script: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PET_RDZV_CONF", "store_max_connections_per_peer=\u00b2")
    with pytest.raises(ConfigError) as err:
        parse([*BASE, script])
    assert str(err.value).startswith("--rdzv-conf (from PET_RDZV_CONF): store_max_connections")


# ------------------------------------------------------------------ --node-unit
# Each impossible combination of --node-unit with --nnodes MIN:MAX (and
# --nproc-per-node) is refused at parse time, naming both flags.
NODE_UNIT = [
    (["--nnodes=1:3", "--node-unit=4"], ["--node-unit=4", "--nnodes=1:3"]),  # above max
    (["--nnodes=5:7", "--node-unit=4"], ["--node-unit=4", "--nnodes=5:7"]),  # no multiple
    (["--nnodes=3:3", "--node-unit=2"], ["--node-unit=2", "--nnodes=3:3"]),  # fixed, odd
    (["--nnodes=2:3", "--node-unit=0"], ["--node-unit=0", "--nnodes=2:3"]),  # zero
    (["--nnodes=2:3", "--node-unit=-2"], ["--node-unit=-2", "--nnodes=2:3"]),  # negative
    (["--nnodes=1:2", f"--node-unit={10**30}"], ["--node-unit=1000", "--nnodes=1:2"]),  # huge
    (["--nnodes=4:2", "--node-unit=2"], ["--nnodes", "minimum 4 is larger than maximum 2"]),
    (["--nnodes=2:4", "--node-unit=2", "--nproc-per-node=0"], ["--nproc-per-node"]),
    (["--standalone", "--node-unit=2"], ["--node-unit=2", "--nnodes=1:1"]),
]


@pytest.mark.parametrize(("flags", "words"), NODE_UNIT, ids=[" ".join(f) for f, _ in NODE_UNIT])
def test_impossible_node_unit_combinations_are_refused_naming_both_flags(
    script: str, flags: list[str], words: list[str]
) -> None:
    with pytest.raises(ConfigError) as err:
        parse([*BASE[:2], "--rdzv-id=j", *flags, script])
    assert all(w in str(err.value) for w in words), err.value


def test_a_node_unit_from_the_environment_names_the_variable(
    script: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PET_NODE_UNIT", "4")
    with pytest.raises(ConfigError) as err:
        parse([*BASE[:2], "--rdzv-id=j", "--nnodes=1:3", script])
    assert "--node-unit=4 (from PET_NODE_UNIT)" in str(err.value), err.value
    assert WorldSizes(2, 3, 0).problem() is not None  # never a ZeroDivisionError


# ------------------------------------------------------------------ other commands
class Started(Exception):
    """A bad input got as far as starting the command's work."""


def _never(*_: object, **__: object) -> object:
    raise Started


def _run(main: Callable[[list[str]], int], argv: list[str], capsys) -> tuple[int, str]:
    code = main(argv)
    err = capsys.readouterr().err
    return code, err


STATUS: dict[str, set[str]] = {
    "--timeout": {"fraction"},
    "--rdzv-backend": set(),
    "--rdzv-endpoint": {"negative", "huge", "nan", "inf", "word", "fraction"},  # host names
    "--rdzv-id": {"huge", "nan", "inf", "word", "fraction"},  # job ids
    "--rdzv-conf": {"empty"},
}


@pytest.mark.parametrize(("flag", "kind"), _cases(STATUS))
def test_status_refuses_bad_values_before_reaching_a_store(
    flag: str, kind: str, capsys, monkeypatch: pytest.MonkeyPatch
) -> None:
    from elastrun.status import cli

    monkeypatch.setattr(cli, "_main", _never)
    args = {"--rdzv-endpoint": "127.0.0.1:1", "--rdzv-id": "j", flag: BAD[kind]}
    code, err = _run(cli.main, [f"{k}={v}" for k, v in args.items()], capsys)
    assert code == 2, err
    assert err.startswith("elastrun status: error: ") and flag in err, err
    _one_line(err.strip().splitlines()[-1], BAD[kind])


SERVE_LIMITS = [
    "--max-connections",
    "--max-connections-per-peer",
    "--max-pending-hello",
    "--hello-timeout",
    "--history-bytes",
    "--max-data-bytes",
    "--max-value-bytes",
    "--stall-timeout",
    "--max-partial-bytes",
    "--max-output-bytes",
    "--slow-watch-bytes",
]
SERVE: dict[str, set[str]] = {
    "--port": set(),
    "--host": {"negative", "huge", "nan", "inf", "word", "fraction"},  # host names
    **{flag: set() for flag in SERVE_LIMITS},
}
for _flag in ("--hello-timeout", "--stall-timeout"):
    SERVE[_flag] = {"fraction"}


@pytest.mark.parametrize(("flag", "kind"), _cases(SERVE))
def test_store_serve_refuses_bad_values_before_listening(
    flag: str, kind: str, capsys, monkeypatch: pytest.MonkeyPatch
) -> None:
    from elastrun.store import cli

    monkeypatch.setattr(cli, "_serve", _never)
    argv = ["serve", "--port=0", f"{flag}={BAD[kind]}"]
    code, err = _run(cli.main, argv, capsys)
    assert code == 2, err
    last = err.strip().splitlines()[-1]
    # The flag itself, never another one it begins (--max-connections-per-peer).
    assert f"{flag}:" in last or f"argument {flag}" in last, last
    _one_line(last, BAD[kind])


def test_store_serve_limits_within_their_caps_are_taken() -> None:
    import argparse

    from elastrun.store.cli import _limits

    args = argparse.Namespace(**{f[2:].replace("-", "_"): None for f in SERVE_LIMITS})
    args.history_bytes, args.hello_timeout, args.max_connections = "64M", "2.5", "100"
    limits = _limits(args)
    assert (limits.history_bytes, limits.hello_timeout, limits.max_connections) == (
        64 << 20,
        2.5,
        100,
    )


@pytest.mark.parametrize(("where", "value"), [("--out", ""), ("EVENTS.jsonl", "")])
def test_timeline_refuses_an_empty_file_name(where: str, value: str, tmp_path, capsys) -> None:
    from elastrun.status.timeline import main

    events = tmp_path / "events.jsonl"
    events.write_text("")
    argv = [str(events), f"--out={value}"] if where == "--out" else [value]
    code, err = _run(main, argv, capsys)
    assert code == 2 and where in err, err


# ------------------------------------------------------------------ the environment
@pytest.mark.parametrize("kind", ["superscript", "arabic-indic", "overlong", "word", "negative"])
def test_the_replica_byte_cap_from_the_environment_is_ascii(
    kind: str, script: str, monkeypatch: pytest.MonkeyPatch, capsys
) -> None:
    # '²' was a ValueError in the agent, after it joined the round; then a
    # warning in the agent (replicas off). Now the launch is refused (exit 2).
    from elastrun.agent.replica import MAX_BYTES_ENV
    from elastrun.launcher.cli import main

    monkeypatch.setenv(MAX_BYTES_ENV, BAD[kind])
    with pytest.raises(ConfigError, match=f"^{MAX_BYTES_ENV}: expected a positive whole"):
        parse([*BASE, script])
    code, err = _run(main, [*BASE, script], capsys)
    assert code == 2 and f"elastrun: error: {MAX_BYTES_ENV}: expected" in err, err
    monkeypatch.setenv(MAX_BYTES_ENV, "1024")
    assert parse([*BASE, script])[0].workers.memory.replica_max_bytes == 1024


@pytest.mark.parametrize("kind", ["superscript", "arabic-indic", "overlong", "nan", "inf"])
def test_agent_number_variables_are_ascii_and_named_when_wrong(
    kind: str, script: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    from elastrun.agent import gpu_release, health_check

    monkeypatch.setenv(gpu_release.TIMEOUT_ENV, BAD[kind])
    with pytest.raises(ConfigError, match=f"^{gpu_release.TIMEOUT_ENV}: "):
        parse([*BASE, script])
    monkeypatch.delenv(gpu_release.TIMEOUT_ENV)
    # torch's variable: a bad port is ignored with a warning, as torch does
    monkeypatch.setenv(health_check.PORT_ENV, BAD[kind])
    plan = parse([*BASE, script])[0]
    assert plan.workers.health_check.port is None
    assert len(plan.warnings) == 1 and health_check.PORT_ENV in plan.warnings[0], plan.warnings


@pytest.mark.parametrize("kind", ["superscript", "arabic-indic", "fullwidth", "overlong"])
def test_a_worker_reads_its_rank_variables_in_ascii(kind: str) -> None:
    from elastrun.train.context import WorkerContext

    with pytest.raises(ConfigError, match="RANK="):
        WorkerContext.from_env({"RANK": BAD[kind], "WORLD_SIZE": "2"})


@pytest.mark.parametrize("kind", ["superscript", "arabic-indic", "fullwidth", "overlong"])
def test_the_worker_runner_reads_its_variables_in_ascii(kind: str) -> None:
    # int('٣') == 3 made ELASTRUN_STACK_SIGNAL='٣' SIGQUIT; '²' raised.
    from elastrun.worker import _runner

    assert _runner.stack_signal(BAD[kind]) is None
    assert _runner.stack_signal("34") == 34
