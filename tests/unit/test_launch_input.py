"""Bad input at the launcher's door: job ids, numbers, ranges, quoting.

Pure tests (no processes): each bad value is refused at parse time with a
ConfigError that names the flag (or, from Python, the LaunchConfig field),
says what is allowed, and leaves nothing started. The CLI turns these into
exit 2 (tests/integration/test_job_ids.py runs the real command).
"""

from __future__ import annotations

import os
import resource
import uuid

import pytest

from elastrun.errors import ConfigError
from elastrun.launcher import api, limits
from elastrun.launcher.cli import parse
from elastrun.launcher.config import LaunchConfig
from elastrun.launcher.plan import resolve
from elastrun.launcher.rdzv_conf import RendezvousConf, parse_rdzv_conf
from elastrun.names import RUN_ID_MAX_LEN, RunId, path_component, run_id_problem
from elastrun.rendezvous.keys import Keys


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch):
    for name in list(os.environ):
        if name.startswith("PET_") or name == "TORCH_ELASTIC_SHUTDOWN_TIMEOUT":
            monkeypatch.delenv(name)


@pytest.fixture
def script(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "train.py").write_text("print('hi')\n")
    return "train.py"


def refused(*flags: str) -> str:
    with pytest.raises(ConfigError) as info:
        parse([*flags, "train.py"])
    return str(info.value)


# ------------------------------------------------------------------ job ids
# (Fixed, not drawn: parallel test workers must collect the same test ids.)
_UUID = uuid.UUID("f47ac10b-58cc-4372-a567-0e02b2c3d479")  # a version 4 UUID
GOOD_IDS = [
    "none",  # torchrun's default
    str(_UUID),
    str(_UUID.int),  # torch's generated ids
    "123456",  # a SLURM job id
    "trainer-7.v2_a",  # a Kubernetes name
    "a" * RUN_ID_MAX_LEN,
    "A..b",  # dots inside are harmless: only "." and ".." are special
]
BAD_IDS = [
    ("A/waiting", "contains '/'"),
    ("A/nodes", "contains '/'"),
    ("../../x", "contains '/'"),
    (".", "must start with"),
    ("..", "must start with"),
    (".hidden", "must start with"),
    ("-rf", "must start with"),
    ("_x", "must start with"),
    ("a b", "contains ' '"),
    ("a\nb", "contains '\\n'"),
    ("jöb", "contains 'ö'"),
    ("\uff11", "contains '\uff11'"),  # FULLWIDTH DIGIT ONE
    ("a" * (RUN_ID_MAX_LEN + 1), "characters long"),
    ("a%2Fb", "contains '%'"),
    ("a:b", "contains ':'"),
    ("", "is empty"),
]


@pytest.mark.parametrize("run_id", GOOD_IDS)
def test_good_job_ids(run_id):
    assert run_id_problem(run_id) is None
    parsed = RunId.parse(run_id)
    assert parsed == run_id and str(parsed) == run_id and RunId(parsed) is parsed
    assert Keys(parsed).root == f"/elastrun/{run_id}/"


@pytest.mark.parametrize(("run_id", "why"), BAD_IDS, ids=[repr(b[0])[:20] for b in BAD_IDS])
def test_bad_job_ids_are_refused_everywhere(run_id, why):
    problem = run_id_problem(run_id)
    assert problem is not None and why in problem
    with pytest.raises(ConfigError, match=r"^--rdzv-id: .*not a valid job id"):
        RunId.parse(run_id)
    # No RunId holds it, and the key layout, the agent's folders and the event
    # log take only a RunId: no key or path is ever built from it.
    with pytest.raises(ConfigError, match=r"^run id: .*not a valid job id"):
        RunId(run_id)


@pytest.mark.parametrize("run_id", ["A/waiting", "../../x", "..", "a b"])
def test_bad_job_id_on_the_command_line(script, run_id):
    message = refused("--rdzv-backend=c10d", f"--rdzv-id={run_id}")
    assert message.startswith("--rdzv-id:"), message
    assert "letters, digits" in message  # the grammar is said


def test_bad_job_id_from_the_environment(script, monkeypatch):
    monkeypatch.setenv("PET_RDZV_ID", "x/../../y")
    assert refused("--rdzv-backend=c10d").startswith("--rdzv-id (from PET_RDZV_ID):")


def test_empty_run_id_generates_one(script):
    plan, _ = parse(["--rdzv-backend=c10d", "--rdzv-id=", "train.py"])
    assert plan.generated_run_id and run_id_problem(plan.run_id) is None
    uuid.UUID(plan.run_id)
    other, _ = parse(["--rdzv-backend=c10d", "--rdzv-id=", "train.py"])
    assert other.run_id != plan.run_id
    # torch's LaunchConfig default: run_id="" (an elastic 1:2 job, as upstream's tests)
    api_plan = resolve(LaunchConfig(min_nodes=1, max_nodes=2, run_id="", rdzv_backend="etcd"))
    assert api_plan.generated_run_id and run_id_problem(api_plan.run_id) is None
    # --standalone always generates its own: not reported as "generated from empty"
    assert not resolve(LaunchConfig(run_id="", standalone=True)).generated_run_id


def test_python_api_errors_name_the_field_not_the_flag(tmp_path):
    cases = [
        (LaunchConfig(run_id="A/waiting", rdzv_backend="c10d"), "LaunchConfig.run_id: "),
        (LaunchConfig(nproc_per_node=10**20), "LaunchConfig.nproc_per_node: "),
        (LaunchConfig(rdzv_configs={"lease_ttl": 1e9}), "LaunchConfig.rdzv_configs: lease_ttl"),
        (LaunchConfig(max_restarts=-1), "LaunchConfig.max_restarts: "),
        (LaunchConfig(role=""), "LaunchConfig.role: "),
    ]
    script = tmp_path / "w.py"
    script.write_text("pass\n")
    for cfg, head in cases:
        with pytest.raises(ConfigError) as info:
            api.launch(cfg, str(script))
        assert str(info.value).startswith(head), str(info.value)
        assert "--" not in str(info.value).split(":")[0]


def test_path_component_makes_host_names_safe():
    assert path_component("node-1.example.com") == "node-1.example.com"
    assert path_component("../../etc") == "_.._etc"
    assert path_component("..") == "unknown"
    assert path_component("a/b\x00c") == "a_b_c"
    assert path_component("hôte") == "h_te"
    assert path_component("", "unknown-host") == "unknown-host"
    assert len(path_component("x" * 500)) == 100
    for text in ["..", ".", "../x", "/", "a/../../b", ".ssh"]:
        out = path_component(text)
        assert "/" not in out and not out.startswith(".") and out not in ("", ".", "..")


# ------------------------------------------------------------ numbers: ASCII
# fullwidth one, Arabic-Indic three, superscript two, underscores, a fraction
UNICODE_DIGITS = ["\uff11", "\u0663", "\u00b2", "1_000", "\u00bd"]


@pytest.mark.parametrize("digits", UNICODE_DIGITS)
@pytest.mark.parametrize(
    "flag",
    [
        "--nproc-per-node",
        "--nnodes",
        "--max-restarts",
        "--node-rank",
        "--master-port",
        "--shutdown-timeout",
        "--monitor-interval",
        "--hang-timeout",
        "--exit-barrier-timeout",
        "--local-ranks-filter",
    ],
)
def test_numbers_are_ascii_only(script, flag, digits):
    message = refused(f"{flag}={digits}")
    assert message.startswith(flag), message


@pytest.mark.parametrize("digits", UNICODE_DIGITS)
def test_rdzv_conf_and_port_numbers_are_ascii_only(script, digits):
    assert refused(f"--rdzv-conf=join_timeout={digits}").startswith("--rdzv-conf: join_timeout")
    message = refused("--rdzv-backend=c10d", f"--rdzv-endpoint=h:{digits}")
    assert message.startswith("--rdzv-endpoint: bad port"), message
    assert refused(f"--tee=0:1,{digits}:2").startswith("--tee")


@pytest.mark.parametrize("text", ["nan", "inf", "-inf", "1e400", "0x10", "1,5", " ", "5s"])
def test_seconds_are_finite_ascii_decimals(script, text):
    assert refused(f"--shutdown-timeout={text}").startswith("--shutdown-timeout")
    assert refused(f"--rdzv-conf=lease_ttl={text}" if text.strip() else "--rdzv-conf=lease_ttl=")


# ----------------------------------------------------- ranges, said in the error
RANGES = [
    ("--rdzv-conf=lease_ttl=1e9", "lease_ttl: must be >= 0.5 and <= 3600 seconds"),
    ("--rdzv-conf=lease_ttl=0.01", "lease_ttl: must be >= 0.5 and <= 3600 seconds"),
    ("--rdzv-conf=join_timeout=0", "join_timeout: must be >= 1 and <= 604800 seconds"),
    ("--rdzv-conf=timeout=1e7", "timeout: must be >= 1 and <= 604800 seconds"),
    ("--rdzv-conf=last_call_timeout=1e6", "last_call_timeout: must be >= 0 and <= 86400"),
    ("--rdzv-conf=close_timeout=-1", "close_timeout: must be >= 0 and <= 3600"),
    ("--rdzv-conf=read_timeout=0", "read_timeout: must be >= 1 and <= 86400"),
    ("--rdzv-conf=exit_barrier_timeout=1e9", "exit_barrier_timeout: must be >= 0"),
    ("--shutdown-timeout=1e5", "must be >= 0 and <= 3600 seconds"),
    ("--monitor-interval=0", "must be > 0 and <= 3600 seconds"),
    ("--hang-timeout=1e9", "must be >= 1 and <= 604800 seconds"),
    ("--exit-barrier-timeout=-5", "must be >= 0 and <= 604800 seconds"),
    ("--nproc-per-node=100000", "must be in 1..1024"),
    ("--nproc-per-node=100000000000000000000", "must be in 1..1024"),
    ("--nproc-per-node=" + "9" * 80, "expected a number"),
    ("--nnodes=1:1000000", "must be in 1..100000"),
    ("--max-restarts=10000000000", "must be in 0..1000000"),
    ("--local-ranks-filter=0,5000", "must be in 0..1023"),
]


@pytest.mark.parametrize(("flag", "said"), RANGES, ids=[r[0][:40] for r in RANGES])
def test_ranges_are_checked_at_parse_time_and_said(script, flag, said):
    message = refused(flag)
    assert message.startswith(flag.split("=")[0]), message
    assert said in message, message


def test_rdzv_conf_limits_are_in_range_at_the_edges():
    conf = parse_rdzv_conf(
        "lease_ttl=0.5,join_timeout=604800,last_call_timeout=0,close_timeout=3600,"
        "read_timeout=1,exit_barrier_timeout=0"
    )
    assert conf.lease_ttl == 0.5 and conf.join_timeout == 604800
    assert parse_rdzv_conf({"lease_ttl": 3600, "timeout": 5}).lease_ttl == 3600.0
    with pytest.raises(ConfigError, match="lease_ttl: expected a number"):
        parse_rdzv_conf({"lease_ttl": True})


# ------------------------------------------------------------------ quoting
def test_quoted_rdzv_conf_is_tolerated_as_torchrun_does(script):
    # What PyTorch's own launcher tests pass when no shell strips the quotes.
    plan, _ = parse(
        ["--rdzv-conf='join_timeout=5,last_call_timeout=1,timeout=5'", "--nnodes=1", "train.py"]
    )
    assert plan.conf.join_timeout == 5 and plan.conf.last_call_timeout == 1
    assert plan.rendezvous.join_timeout == 5 and plan.rendezvous.last_call_timeout == 1
    conf = parse_rdzv_conf("\"lease_ttl=3\" , 'token=s'")
    assert conf == RendezvousConf(lease_ttl=3.0, token="s")
    conf = parse_rdzv_conf("join_timeout='7',token=\"abc\"")
    assert conf == RendezvousConf(join_timeout=7.0, token="abc")


def test_timeout_is_an_alias_of_join_timeout_which_wins(script):
    plan, _ = parse(["--rdzv-conf=timeout=9", "--nnodes=1", "train.py"])
    assert plan.rendezvous.join_timeout == 9
    plan, _ = parse(["--rdzv-conf=timeout=9,join_timeout=4", "--nnodes=1", "train.py"])
    assert plan.rendezvous.join_timeout == 4
    plan, _ = parse(["--rdzv-conf=join_timeout=4,timeout=9", "--nnodes=1", "train.py"])
    assert plan.rendezvous.join_timeout == 4


def test_unknown_rdzv_conf_key_stays_an_error_listing_the_keys(script):
    message = refused("--rdzv-conf='joint_timeout=5'")
    assert message.startswith("--rdzv-conf: unknown key 'joint_timeout'"), message
    assert "join_timeout" in message and "lease_ttl" in message


# ------------------------------------------------------- nproc and the machine
def test_nproc_beyond_what_the_machine_allows_names_the_limit(script, monkeypatch):
    real = resource.getrlimit

    def small_nofile(which):
        if which == resource.RLIMIT_NOFILE:
            return (256, 256)
        return real(which)

    monkeypatch.setattr(resource, "getrlimit", small_nofile)
    procs, fds = limits.worker_cost(files=True, warm=True)
    allowed = (256 - limits.FD_RESERVE) // fds
    assert limits.machine_nproc_limit(procs, fds) is not None
    parse([f"--nproc-per-node={allowed}", "--log-dir=logs", "train.py"])
    message = refused(f"--nproc-per-node={allowed + 1}", "--log-dir=logs")
    assert message.startswith("--nproc-per-node:") and "ulimit -n" in message, message
    # Without log files the agent holds fewer files per worker: more fit.
    parse([f"--nproc-per-node={allowed + 1}", "train.py"])


def test_other_bad_values(script):
    assert refused("--local-addr=a/b").startswith("--local-addr")
    assert refused("--local-addr=a b").startswith("--local-addr")
    assert refused("--role=a\x1b[31m").startswith("--role")
    assert refused("--role=" + "r" * 200).startswith("--role")
    assert refused("--rdzv-conf=token=a\x00b").startswith("--rdzv-conf: token")
    assert refused(f"--log-dir={script}/sub").startswith("--log-dir")
