"""What ``elastrun --help`` and its refusals tell a user: every value flag
names its default, the start method says how workers really start, and a
single-node job asked for several nodes is refused in the user's terms."""

from __future__ import annotations

import argparse
import re

import pytest

from elastrun.errors import ConfigError
from elastrun.launcher.flags import build_parser, parse_flags
from elastrun.launcher.plan import resolve
from tests.conftest import REPO

# Value flags whose help has no default to give: accepted and ignored, or required.
NO_DEFAULT = {"--monitor-interval", "--event-log-handler", "--node-rank"}


def _value_flags(parser: argparse.ArgumentParser) -> dict[str, str]:
    return {
        next(o for o in a.option_strings if o.startswith("--")): " ".join((a.help or "").split())
        for a in parser._actions
        if a.option_strings and a.nargs != 0 and a.help != argparse.SUPPRESS
    }


@pytest.mark.parametrize("legacy", [False, True], ids=["elastrun", "launch"])
def test_every_value_flag_names_its_default(legacy: bool) -> None:
    flags = _value_flags(build_parser(legacy=legacy))
    # The ones a user asked about by name are among them.
    for name in ("--role", "--log-dir", "--tee", "--local-ranks-filter", "--rdzv-conf"):
        assert "default" in flags[name].lower(), (name, flags[name])
    missing = [n for n, h in flags.items() if "default" not in h.lower() and n not in NO_DEFAULT]
    assert not missing, missing
    conf = flags["--rdzv-conf"]
    for key, default in (("close_timeout", "30"), ("read_timeout", "60"), ("join_timeout", "600")):
        assert re.search(rf"{key} \({default}\b", conf), (key, conf)


def test_start_method_help_says_workers_are_forked_from_the_warm_interpreter() -> None:
    text = _value_flags(build_parser())["--start-method"]
    assert "forked from elastrun's warm interpreter" in text, text
    assert "--no-warm start as fresh processes" in text, text


@pytest.mark.parametrize("nnodes", ["2", "1:2", "2:4"])
def test_standalone_with_several_nodes_is_refused_in_the_users_terms(nnodes: str) -> None:
    flags = parse_flags(["--standalone", f"--nnodes={nnodes}", "-m", "json.tool"])
    with pytest.raises(ConfigError) as e:
        resolve(flags.config)
    text = str(e.value)
    assert f"--nnodes={nnodes} asks for more" in text, text
    assert "--rdzv-backend=c10d" in text and "--rdzv-endpoint" in text
    assert not re.search(r"asks for \d+:\d+", text), text


def test_standalone_with_one_node_is_accepted() -> None:
    for nnodes in ("1", "1:1"):
        plan = resolve(
            parse_flags(["--standalone", f"--nnodes={nnodes}", "-m", "json.tool"]).config
        )
        assert plan.standalone


def test_docs_mark_no_conformance_case_as_expected_to_fail() -> None:
    """Every ported case of torch's launcher tests passes; docs/cli.md says so."""
    cases = (REPO / "tests" / "integration" / "test_torchrun_conformance.py").read_text()
    assert "xfail" not in cases
    cli = (REPO / "docs" / "cli.md").read_text()
    assert "xfail" not in cli.lower() and "Every case passes" in cli
