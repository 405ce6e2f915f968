"""Launcher flag parsing: torchrun's flags, both spellings, PET_* defaults, errors.

Pure tests of ``elastrun.launcher`` (no processes): what a user would check is
that a flag lands where it should, and that a bad value is refused with a
message that names the flag.
"""

from __future__ import annotations

import asyncio
import os
import signal
import sys

import pytest

from elastrun.agent.command import Executable, PythonModule, PythonScript
from elastrun.agent.spec import DEFAULT_LOG_TEMPLATE, StartMethod, Std
from elastrun.errors import ConfigError, RestartBudgetExhausted
from elastrun.failure import FailureRecord
from elastrun.launcher.cli import parse
from elastrun.launcher.command import Command, worker_argv, worker_command
from elastrun.launcher.config import LaunchConfig
from elastrun.launcher.flag_grammar import parse_nnodes, parse_nproc, parse_signals, parse_std
from elastrun.launcher.hosting import is_local_address
from elastrun.launcher.plan import resolve
from elastrun.launcher.rdzv_conf import RendezvousConf, parse_rdzv_conf
from elastrun.names import RunId
from elastrun.rendezvous.api import RendezvousSettings
from elastrun.rendezvous.static import StaticRendezvous


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch):
    for name in list(os.environ):
        if name.startswith("PET_") or name in (
            "TORCH_ELASTIC_SHUTDOWN_TIMEOUT",
            "TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE",
            "PYTHON_EXEC",
        ):
            monkeypatch.delenv(name)


@pytest.fixture
def script(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "train.py").write_text("print('hi')\n")
    return "train.py"


def run_parse(*flags: str, script: str = "train.py"):
    return parse([*flags, script])


# --------------------------------------------------------------- both spellings
# Each flag lands in the typed settings its reader receives: the agent's
# (plan.workers), the rendezvous' (plan.rendezvous), or the plan's own.
SPELLED = [
    ("nproc-per-node", "3", lambda p, c: p.workers.nproc == p.rendezvous.nproc == 3),
    ("rdzv-backend", "c10d", lambda p, c: p.endpoints == (("localhost", 29400),)),
    ("rdzv-endpoint", "127.0.0.1:29999", lambda p, c: p.endpoints == (("127.0.0.1", 29999),)),
    ("rdzv-id", "job7", lambda p, c: p.run_id == p.workers.run_id == "job7"),
    ("rdzv-conf", "join_timeout=5", lambda p, c: p.rendezvous.join_timeout == 5),
    ("max-restarts", "4", lambda p, c: p.rendezvous.max_restarts == 4),
    ("monitor-interval", "0.5", lambda p, c: p.workers.monitor_interval == 0.5),
    ("start-method", "fork", lambda p, c: p.workers.start_method is StartMethod.FORK),
    ("node-rank", "1", lambda p, c: p.node_rank == p.rendezvous.node_rank_hint == 1),
    ("master-addr", "10.1.2.3", lambda p, c: p.endpoints == (("10.1.2.3", 29500),)),
    ("master-port", "29511", lambda p, c: p.endpoints == (("127.0.0.1", 29511),)),
    ("local-addr", "10.9.9.9", lambda p, c: p.local_addr == "10.9.9.9"),
    ("log-dir", "/tmp/x", lambda p, c: p.workers.logs.dir == "/tmp/x"),
    ("local-ranks-filter", "0,2", lambda p, c: p.workers.logs.local_ranks_filter == {0, 2}),
    (
        "signals-to-handle",
        "SIGTERM,SIGUSR1",
        lambda p, c: signal.SIGUSR1 in p.workers.signals_to_forward,
    ),
    ("shutdown-timeout", "7", lambda p, c: p.workers.shutdown_timeout == 7),
    ("log-template", "[{rank}]", lambda p, c: p.workers.logs.template == "[{rank}]"),
    ("events-file", "/tmp/ev.jsonl", lambda p, c: p.workers.events_file == "/tmp/ev.jsonl"),
    ("hang-timeout", "12", lambda p, c: p.workers.hang.timeout == 12),
    ("stack-signal", "SIGUSR2", lambda p, c: p.workers.hang.stack_signal == signal.SIGUSR2),
    ("exit-barrier-timeout", "9", lambda p, c: p.rendezvous.exit_barrier_timeout == 9),
]


@pytest.mark.parametrize(("name", "value", "check"), SPELLED, ids=[s[0] for s in SPELLED])
@pytest.mark.parametrize("spelling", ["dash", "underscore"])
def test_every_value_flag_in_both_spellings(script, name, value, check, spelling):
    flag = "--" + (name if spelling == "dash" else name.replace("-", "_"))
    extra = []
    if name in ("rdzv-conf", "rdzv-id", "local-addr", "node-rank"):
        extra = ["--rdzv-backend=c10d", "--rdzv-endpoint=127.0.0.1:29400", "--nnodes=1:2"]
    if name in ("master-addr", "master-port"):
        extra = ["--nnodes=2", "--node-rank=0"]
    plan, cmd = run_parse(*extra, f"{flag}={value}")
    assert check(plan, cmd)


@pytest.mark.parametrize("flag", ["-m", "--module"])
def test_module_flag(flag):
    _plan, cmd = parse([flag, "json.tool", "--sort-keys"])
    assert cmd.module
    assert worker_argv(cmd)[-4:] == ("-u", "-m", "json.tool", "--sort-keys")
    assert worker_command(cmd) == PythonModule("json.tool", ("--sort-keys",))


@pytest.mark.parametrize("flag", ["--no-python", "--no_python"])
def test_no_python_runs_the_program_directly(flag):
    _, cmd = parse([flag, "true", "a"])
    assert worker_argv(cmd) == ("true", "a")
    assert worker_command(cmd) == Executable(("true", "a"))


@pytest.mark.parametrize("flag", ["--run-path", "--run_path"])
def test_run_path_uses_runpy(script, flag):
    _, cmd = parse([flag, "--no-python", script, "x"])
    argv = worker_argv(cmd)
    assert argv[1:3] == ("-u", "-c") and "runpy.run_path" in argv[3]
    assert argv[4] == os.path.abspath(script) and argv[5] == "x"
    # Not through the worker runner: a program run as given.
    assert worker_command(cmd) == Executable(argv)


def test_flags_after_the_script_belong_to_the_script(script):
    plan, cmd = parse(["--nproc-per-node=2", script, "--nproc-per-node=5", "--lr", "0.1"])
    assert plan.workers.nproc == 2
    assert cmd.args == ("--nproc-per-node=5", "--lr", "0.1")
    assert worker_argv(cmd) == (sys.executable, "-u", script, "--nproc-per-node=5", "--lr", "0.1")
    assert plan.workers.command == worker_command(cmd)  # what the agent runs
    assert worker_command(cmd) == PythonScript(script, ("--nproc-per-node=5", "--lr", "0.1"))


def test_redirects_and_tee_short_and_long(script):
    plan, _ = run_parse("-r", "3", "--tee=0:1,1:2")
    assert plan.workers.logs.redirects == {-1: Std.ALL}
    assert plan.workers.logs.tee == {0: Std.OUT, 1: Std.ERR}
    plan, _ = run_parse("--redirects", "0", "-t", "2")
    assert plan.workers.logs.redirects == {} and plan.workers.logs.tee == {-1: Std.ERR}


# --------------------------------------------------------------- defaults, PET_
def test_defaults_follow_torchrun(script):
    plan, _ = run_parse()
    rdzv, spec = plan.rendezvous, plan.workers
    assert (rdzv.min_nodes, rdzv.max_nodes, spec.nproc) == (1, 1, 1)
    assert rdzv.max_restarts == 0 and spec.role == rdzv.role == "default"
    assert spec.shutdown_timeout == 30
    # torchrun: a single-node static launch without a master port is standalone
    assert plan.standalone and plan.backend == "c10d" and plan.is_host is True
    assert plan.endpoints == (("127.0.0.1", 0),)
    assert rdzv.exit_barrier_timeout == 300
    assert [s.name for s in spec.signals_to_handle] == ["SIGTERM", "SIGINT", "SIGHUP", "SIGQUIT"]
    assert spec.signals_to_forward == ()


def test_standalone_generates_run_id_and_ignores_backend(script):
    plan, _ = run_parse(
        "--standalone", "--rdzv-backend=etcd", "--rdzv-endpoint=x:1", "--rdzv-id=mine"
    )
    assert plan.backend == "c10d" and plan.endpoints == (("127.0.0.1", 0),)
    assert plan.run_id != "mine" and len(plan.run_id) == 36
    assert plan.workers.run_id == plan.rendezvous.run_id == plan.run_id


def test_pet_environment_defaults(script, monkeypatch):
    monkeypatch.setenv("PET_NPROC_PER_NODE", "3")
    monkeypatch.setenv("PET_NNODES", "1:2")
    monkeypatch.setenv("PET_RDZV_BACKEND", "c10d")
    monkeypatch.setenv("PET_RDZV_ENDPOINT", "127.0.0.1:29401")
    monkeypatch.setenv("PET_MAX_RESTARTS", "2")
    monkeypatch.setenv("PET_TEE", "3")
    plan, _ = run_parse()
    assert plan.workers.nproc == 3
    assert (plan.rendezvous.min_nodes, plan.rendezvous.max_nodes) == (1, 2)
    assert plan.endpoints == (("127.0.0.1", 29401),)
    assert plan.rendezvous.max_restarts == 2 and plan.workers.logs.tee == {-1: Std.ALL}
    # the command line wins over the environment
    plan, _ = run_parse("--nproc_per_node=1", "--max-restarts=0")
    assert plan.workers.nproc == 1 and plan.rendezvous.max_restarts == 0


def test_pet_boolean_flags(monkeypatch):
    monkeypatch.setenv("PET_MODULE", "1")
    monkeypatch.setenv("PET_STANDALONE", "1")
    plan, cmd = parse(["json.tool"])
    assert cmd.module and plan.standalone
    monkeypatch.setenv("PET_STANDALONE", "yes")
    with pytest.raises(ConfigError, match="PET_STANDALONE"):
        parse(["json.tool"])


def test_pet_warm_sets_the_default_and_the_command_line_wins(script, monkeypatch):
    assert run_parse("--standalone")[0].workers.warm.enabled is True  # unset: on
    monkeypatch.setenv("PET_WARM", "0")
    assert run_parse("--standalone")[0].workers.warm.enabled is False
    assert run_parse("--standalone", "--warm")[0].workers.warm.enabled is True
    monkeypatch.setenv("PET_WARM", "1")
    assert run_parse("--standalone", "--no-warm")[0].workers.warm.enabled is False
    monkeypatch.setenv("PET_WARM", "off")
    with pytest.raises(ConfigError, match="PET_WARM: expected 0 or 1"):
        run_parse("--standalone")


def test_the_old_prewarm_spellings_still_work(script, monkeypatch):
    """--warm* was first spelled --prewarm*: the old flags and variables are aliases."""
    assert run_parse("--standalone", "--no-prewarm")[0].workers.warm.enabled is False
    assert run_parse("--standalone", "--prewarm")[0].workers.warm.enabled is True
    workers = run_parse("--prewarm-modules=all", "--prewarm_cache=/tmp/c")[0].workers
    assert workers.warm.modules == "all" and workers.warm.cache == "/tmp/c"
    monkeypatch.setenv("PET_PREWARM_MODULES", "torch")
    assert run_parse()[0].workers.warm.modules == "torch"
    monkeypatch.setenv("PET_WARM_MODULES", "all")  # the new name wins
    assert run_parse()[0].workers.warm.modules == "all"


def test_torch_shutdown_timeout_env(script, monkeypatch):
    monkeypatch.setenv("TORCH_ELASTIC_SHUTDOWN_TIMEOUT", "4")
    assert run_parse()[0].workers.shutdown_timeout == 4
    assert run_parse("--shutdown-timeout=2")[0].workers.shutdown_timeout == 2
    monkeypatch.setenv("TORCH_ELASTIC_SHUTDOWN_TIMEOUT", "1e9")
    with pytest.raises(ConfigError, match=r"^TORCH_ELASTIC_SHUTDOWN_TIMEOUT: must be"):
        run_parse()


def test_torch_log_prefix_template_env(script, monkeypatch):
    monkeypatch.setenv("TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE", "[${role_name}${rank}]:")
    spec = run_parse()[0].workers
    # Kept as torch's template (printed as torchrun does), not turned into ours.
    assert spec.logs.torch_template == "[${role_name}${rank}]:"
    assert spec.logs.template == DEFAULT_LOG_TEMPLATE
    spec = run_parse("--log-template={host}")[0].workers
    assert spec.logs.template == "{host}" and spec.logs.torch_template is None


# --------------------------------------------------------------- static backend
def test_static_multi_node(script):
    plan, _ = run_parse("--nnodes=2", "--node-rank=1", "--master-addr=10.0.0.1")
    assert plan.backend == "static" and not plan.standalone
    assert plan.endpoints == (("10.0.0.1", 29500),) and plan.node_rank == 1
    plan, _ = run_parse("--nnodes=2", "--node-rank=0", "--rdzv-endpoint=10.0.0.2:1234")
    assert plan.endpoints == (("10.0.0.2", 1234),)


def test_static_single_node_with_master_port_stays_static(script):
    plan, _ = run_parse("--master-port=29555")
    assert plan.backend == "static" and plan.endpoints == (("127.0.0.1", 29555),)


# --------------------------------------------------------------- bad input
BAD = [
    (["--nnodes=3:1"], "--nnodes", "larger than maximum"),
    (["--nnodes=0"], "--nnodes", "at least 1"),
    (["--nnodes=1:2:3"], "--nnodes", "MIN:MAX"),
    (["--nnodes=a"], "--nnodes", "integer"),
    (["--nproc-per-node=0"], "--nproc-per-node", "at least 1"),
    (["--nproc-per-node=many"], "--nproc-per-node", "auto"),
    (["--rdzv-conf=join_timeout"], "--rdzv-conf", "key=value"),
    (["--rdzv-conf=join_timeout=soon"], "--rdzv-conf", "number of seconds"),
    (["--rdzv-conf=timeout=-1"], "--rdzv-conf", "timeout: must be >= 1 and <= 604800 seconds"),
    (["--rdzv-conf=is_host=maybe"], "--rdzv-conf", "is_host"),
    (["--rdzv-conf=bogus=1"], "--rdzv-conf", "known keys: cacert"),
    (["--rdzv-conf=token=a,token_file=b"], "--rdzv-conf", "not both"),
    (["--rdzv-conf=token_file=/nonexistent/tok"], "--rdzv-conf", "token_file"),
    (["--rdzv-backend=zookeeper"], "--rdzv-backend", "c10d"),
    (["--nnodes=2"], "--node-rank", "required"),
    (["--nnodes=2", "--node-rank=2"], "--node-rank", "out of range"),
    (["--nnodes=2", "--node-rank=-1"], "--node-rank", ">= 0"),
    (["--nnodes=1:2", "--node-rank=0"], "--nnodes", "fixed number of nodes"),
    (["--rdzv-backend=c10d", "--rdzv-endpoint=a:b:c"], "--rdzv-endpoint", "IPv6"),
    (["--rdzv-backend=c10d", "--rdzv-endpoint=host:99999"], "--rdzv-endpoint", "bad port"),
    (["--rdzv-backend=c10d", "--rdzv-endpoint=[::1"], "--rdzv-endpoint", "unclosed"),
    (["--rdzv-backend=c10d", "--rdzv-endpoint=h:0", "--nnodes=2"], "--rdzv-endpoint", "port 0"),
    (["--rdzv-backend=etcd", "--rdzv-endpoint=a:1,,b"], "--rdzv-endpoint", "empty entry"),
    (["--standalone", "--nnodes=2"], "--standalone", "single node"),
    (["--max-restarts=-1"], "--max-restarts", ">= 0"),
    (["--max-restarts=x"], "--max-restarts", "integer"),
    (["--monitor-interval=0"], "--monitor-interval", "> 0"),
    (["--start-method=thread"], "--start-method", "invalid choice"),
    (["--master-port=70000"], "--master-port", "1..65535"),
    (["-r", "4"], "--redirects", "0-3"),
    (["--tee=0:1,x"], "--tee", "0-3"),
    (["--local-ranks-filter=a"], "--local-ranks-filter", "comma-separated"),
    (["--signals-to-handle=SIGNOPE"], "--signals-to-handle", "unknown signal"),
    (["--signals-to-handle=SIGKILL"], "--signals-to-handle", "cannot be handled"),
    (["--shutdown-timeout=-1"], "--shutdown-timeout", ">= 0"),
    (["--hang-timeout=0"], "--hang-timeout", ">= 1"),
    (["--stack-signal=SIGTERM"], "--stack-signal", "SIGRTMIN+N"),
    (["--stack-signal=SIGRTMIN+99"], "--stack-signal", "SIGRTMIN+N or SIGRTMAX-N"),
    (
        ["--stack-signal=SIGUSR1", "--signals-to-handle=SIGTERM,SIGUSR1"],
        "--stack-signal",
        "also in --signals-to-handle",
    ),
    (["--hang-timeout=inf"], "--hang-timeout", "finite"),
    (["--exit-barrier-timeout=x"], "--exit-barrier-timeout", "number"),
    (["--log-template={nope}"], "--log-template", "fields"),
    (["--numa-binding=nodes"], "--numa-binding", "invalid choice"),
    (["--role="], "--role", "empty"),
]


@pytest.mark.parametrize(("flags", "flag", "text"), BAD, ids=[" ".join(b[0]) for b in BAD])
def test_bad_input_names_the_flag(script, flags, flag, text):
    with pytest.raises(ConfigError) as info:
        run_parse(*flags)
    message = str(info.value)
    assert message.startswith(flag) or f"argument {flag}" in message, message
    assert text in message


def test_missing_script_file(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ConfigError, match=r"^script: file 'nope.py' not found"):
        parse(["nope.py"])
    with pytest.raises(ConfigError, match=r"^script: missing"):
        parse(["--nproc-per-node=2"])
    with pytest.raises(ConfigError, match=r"^script: program"):
        parse(["--no-python", "no-such-program-xyz"])
    with pytest.raises(ConfigError, match=r"^--no-python: cannot be combined"):
        parse(["--no-python", "-m", "json.tool"])
    parse(["-m", "not.checked.module"])  # a module is found by the worker's python


# --------------------------------------------------------------- value parsers
def test_parse_nnodes():
    assert parse_nnodes("2") == (2, 2)
    assert parse_nnodes("1:4") == (1, 4)


def test_parse_nproc_cpu_auto_gpu(monkeypatch):
    cpus = len(os.sched_getaffinity(0))
    assert parse_nproc("cpu") == cpus
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")  # hides every GPU
    assert parse_nproc("auto") == cpus
    with pytest.raises(ConfigError, match=r"^--nproc-per-node: 'gpu'.*no NVIDIA GPU"):
        parse_nproc("gpu")
    assert parse_nproc(" 4 ") == 4


def endpoints_of(backend: str, endpoint: str):
    config = LaunchConfig(max_nodes=2, rdzv_backend=backend, rdzv_endpoint=endpoint)
    return resolve(config).endpoints


def test_parse_endpoint_forms():
    assert endpoints_of("c10d", "node0") == (("node0", 29400),)
    assert endpoints_of("c10d", "node0:1") == (("node0", 1),)
    assert endpoints_of("c10d", "[::1]:5") == (("::1", 5),)
    assert endpoints_of("c10d", "[::1]") == (("::1", 29400),)
    assert endpoints_of("c10d", "fe80::1") == (("fe80::1", 29400),)
    assert endpoints_of("etcd", "http://a:1, https://b,c:3") == (
        ("a", 1),
        ("b", 2379),
        ("c", 3),
    )


def test_parse_rdzv_conf_types_and_ignored_torch_keys():
    conf = parse_rdzv_conf(
        "join_timeout=5,last_call_timeout=0.5,is_host=true,token=t,use_libuv=1,key_prefix=/p"
    )
    assert conf == RendezvousConf(
        join_timeout=5.0, last_call_timeout=0.5, is_host=True, token="t", key_prefix="/p"
    )
    assert parse_rdzv_conf({"is_host": 0, "timeout": 3}).is_host is False


def test_parse_std_and_signals():
    assert parse_std("0", "-r") == {}
    assert parse_std("0:3,2:1", "-r") == {0: 3, 2: 1}
    assert parse_signals("TERM, SIGUSR2") == (signal.SIGTERM, signal.SIGUSR2)


def test_token_file_is_read(tmp_path, script):
    token = tmp_path / "tok"
    token.write_text("s3cret\n")
    token.chmod(0o600)  # a token file others can read is refused
    plan, _ = run_parse(
        "--rdzv-backend=c10d", "--rdzv-endpoint=h", f"--rdzv-conf=token_file={token}"
    )
    assert plan.token == "s3cret"
    assert plan.endpoints == (("h", 29400),)


@pytest.mark.parametrize(
    ("text", "expect"),
    [
        ("SIGRTMIN+5", signal.SIGRTMIN + 5),
        ("rtmin+3", signal.SIGRTMIN + 3),
        ("SIGRTMIN", signal.SIGRTMIN),
        ("SIGRTMAX-2", signal.SIGRTMAX - 2),
        ("usr2", signal.SIGUSR2),
        ("none", None),
        ("OFF", None),
    ],
)
def test_stack_signal_forms(script, text, expect):
    plan, _ = run_parse(f"--stack-signal={text}")
    assert plan.workers.hang.stack_signal == (None if expect is None else int(expect))


def test_stack_signal_default_and_environment(script, monkeypatch):
    plan, _ = run_parse()
    assert plan.workers.hang.stack_signal == signal.SIGRTMIN + 5
    monkeypatch.setenv("PET_STACK_SIGNAL", "SIGUSR1")
    plan, _ = run_parse()
    assert plan.workers.hang.stack_signal == signal.SIGUSR1
    with pytest.raises(ConfigError, match="--stack-signal: SIGINT cannot be used"):
        resolve(LaunchConfig(stack_signal=int(signal.SIGINT)))


@pytest.mark.parametrize(
    ("flag", "key"),
    [
        ("--rdzv-conf=read_timeout=0.001", "read_timeout"),
        ("--rdzv-conf=join_timeout=0.001", "join_timeout"),
        ("--rdzv-conf=timeout=0.5", "timeout"),
        ("--hang-timeout=0.001", "--hang-timeout"),
        ("--hang-timeout=auto:0.2", "--hang-timeout"),
    ],
)
def test_timeouts_too_short_to_tell_healthy_from_lost_are_refused(script, flag, key):
    """Accepted before, then the job failed blaming a healthy store (or rank)."""
    with pytest.raises(ConfigError) as info:
        run_parse(flag)
    message = str(info.value)
    assert key in message and "must be >= 1" in message, message
    assert "cannot tell a healthy store or worker from a lost one" in message, message
    plan, _ = run_parse(
        flag.rsplit("=", 1)[0] + "=1" if "auto" not in flag else "--hang-timeout=auto:1"
    )
    assert plan is not None  # the minimum itself is fine


def test_launch_config_validate_names_flags():
    with pytest.raises(ConfigError, match=r"^--nnodes"):
        resolve(LaunchConfig(min_nodes=2, max_nodes=1))
    with pytest.raises(ConfigError, match=r"^--nproc-per-node"):
        resolve(LaunchConfig(nproc_per_node=0))
    with pytest.raises(ConfigError, match=r"^--rdzv-conf: unknown key"):
        resolve(LaunchConfig(rdzv_configs={"joint_timeout": 1}))


# --------------------------------------------------------------- spec, settings
def test_worker_spec_and_settings_from_flags(script):
    plan, cmd = run_parse(
        "--rdzv-backend=c10d",
        "--rdzv-endpoint=127.0.0.1:29400",
        "--nnodes=1:3",
        "--nproc-per-node=2",
        "--rdzv-conf=join_timeout=7,last_call_timeout=1,close_timeout=2,lease_ttl=3",
        "--exit-barrier-timeout=4",
        "--signals-to-handle=SIGTERM,SIGUSR1",
        "--role=trainer",
        "--node-rank=2",
    )
    spec = plan.workers
    assert spec.nproc == 2 and spec.role == "trainer" and spec.command == worker_command(cmd)
    assert spec.signals_to_handle == (signal.SIGTERM,)
    assert spec.signals_to_forward == (signal.SIGUSR1,)
    settings = plan.rendezvous
    assert (settings.min_nodes, settings.max_nodes, settings.nproc) == (1, 3, 2)
    assert (settings.join_timeout, settings.last_call_timeout, settings.close_timeout) == (7, 1, 2)
    assert settings.lease_ttl == 3 and settings.exit_barrier_timeout == 4
    assert settings.node_rank_hint == 2 and settings.role == "trainer"


def test_is_local_address():
    assert is_local_address("127.0.0.1")
    assert is_local_address("localhost")
    assert not is_local_address("192.0.2.1")  # TEST-NET-1: never assigned
    assert not is_local_address("no-such-host.invalid")


# --------------------------------------------------------------- static rendezvous
def test_static_rendezvous_fixed_world_and_local_restart_budget():
    settings = RendezvousSettings(
        run_id=RunId("r"),
        min_nodes=2,
        max_nodes=2,
        max_restarts=1,
        nproc=3,
        host="b",
        addr="10.0.0.2",
    )
    rdzv = StaticRendezvous(settings, node_rank=1, master_addr="10.0.0.1", master_port=29500)

    async def scenario():
        result = await rdzv.next_round()
        assert result.group_rank == 1 and result.world_size == 6 and result.rank_offset == 3
        assert (result.master_addr, result.master_port) == ("10.0.0.1", 29500)
        assert result.me.addr == "10.0.0.2" and result.members[0].addr == "10.0.0.1"
        with pytest.raises(TimeoutError):
            await asyncio.wait_for(rdzv.wait_for_change(), 0.2)
        await rdzv.request_restart(FailureRecord(rank=3))
        assert (await rdzv.next_round()).restart_count == 1
        with pytest.raises(RestartBudgetExhausted, match="--max-restarts=1"):
            await rdzv.request_restart(FailureRecord(rank=3))
        await asyncio.wait_for(rdzv.complete(), 1)
        await rdzv.shutdown()

    asyncio.run(scenario())


def test_the_static_backend_refuses_a_range_of_nodes():
    config = LaunchConfig(min_nodes=1, max_nodes=2, rdzv_backend="static", node_rank=0)
    with pytest.raises(ConfigError, match=r"^--nnodes: the static backend needs a fixed"):
        resolve(config)


def test_command_dataclass_defaults():
    assert worker_argv(Command("t.py", ())) == (sys.executable, "-u", "t.py")


@pytest.mark.parametrize(
    ("flags", "warm"),
    [
        (["--standalone", "--max-restarts=2"], True),
        (["--standalone"], True),  # the first workers start warm too
        (["--nnodes=1:2", "--rdzv-backend=c10d", "--rdzv-endpoint=127.0.0.1:29400"], True),
        (["--standalone", "--max-restarts=2", "--no-warm"], False),
        (["--standalone", "--max-restarts=2", "--run-path"], False),
    ],
)
def test_warm_starts_only_for_python_commands(script, flags, warm):
    plan, _ = run_parse(*flags, script=script)
    assert plan.workers.warm.enabled is warm


def test_no_python_programs_get_no_warm_interpreter():
    plan, _ = parse(["--standalone", "--max-restarts=2", "--no-python", "true", "-u", "x"])
    assert plan.workers.warm.enabled is False


@pytest.mark.parametrize(
    ("flags", "authenticated"),
    [
        (["--rdzv-backend=c10d", "--rdzv-endpoint=h"], False),
        (["--rdzv-backend=c10d", "--rdzv-endpoint=h", "--rdzv-conf=token=t"], True),
        (["--rdzv-backend=etcd", "--rdzv-endpoint=h"], False),
        (["--rdzv-backend=etcd", "--rdzv-endpoint=h", "--rdzv-conf=user=u,password=p"], True),
        (["--rdzv-backend=etcd", "--rdzv-endpoint=h", "--rdzv-conf=cert=c.pem,key=k.pem"], True),
        (["--rdzv-backend=etcd", "--rdzv-endpoint=h", "--rdzv-conf=cacert=ca.pem"], False),
        (["--standalone"], False),
        (["--nnodes=2", "--node-rank=0", "--master-addr=h", "--master-port=1"], False),
    ],
    ids=["c10d", "c10d-token", "etcd", "etcd-user", "etcd-cert", "etcd-tls-only", "standalone",
         "static"],
)  # fmt: skip
def test_the_agent_is_told_whether_the_store_authenticates(script, flags, authenticated):
    # Only then does a warm interpreter import what another node's note names.
    plan, _ = run_parse(*flags)
    assert plan.workers.warm.store_authenticated is authenticated
    assert plan.authenticated is authenticated


@pytest.mark.parametrize(
    ("name", "backend"),
    [("tcp", "c10d"), (" C10D ", "c10d"), ("etcd-v2", "etcd"), ("etcd_v2", "etcd")],
)
def test_backend_aliases_are_one_backend(script, name, backend):
    plan, _ = run_parse(f"--rdzv-backend={name}", "--rdzv-endpoint=h", "--nnodes=1:2")
    assert plan.backend == backend and str(plan.backend) == backend


@pytest.mark.parametrize(
    ("env", "flag"),
    [("PET_START_METHOD", "--start-method"), ("PET_WARM_MODULES", "--warm-modules")],
)
def test_choices_from_the_environment_are_checked_too(script, monkeypatch, env, flag):
    # argparse checks the choices of a flag given, not of its PET_* default.
    monkeypatch.setenv(env, "bogus")
    with pytest.raises(ConfigError, match=f"^{flag} \\(from {env}\\): must be .* got 'bogus'"):
        run_parse()


def test_rdzv_conf_caps_the_hosted_stores_connections_per_address() -> None:
    from elastrun.launcher.hosting import hosted_limits
    from elastrun.store.limits import DEFAULT_LIMITS

    conf = parse_rdzv_conf("store_max_connections_per_peer=10000")
    limits = hosted_limits(conf)
    assert limits.max_connections_per_peer == 10000
    assert limits.max_connections == 10000  # at least as many in all
    small = hosted_limits(parse_rdzv_conf("store_max_connections_per_peer=16"))
    assert (small.max_connections_per_peer, small.max_connections) == (16, 8192)
    assert hosted_limits(parse_rdzv_conf("")) is DEFAULT_LIMITS
    for bad in ("0", "-3", "1.5", "many", "2000000"):
        with pytest.raises(ConfigError, match="store_max_connections_per_peer must be a whole"):
            parse_rdzv_conf(f"store_max_connections_per_peer={bad}")
