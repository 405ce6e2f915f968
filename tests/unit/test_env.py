"""The worker environment: the variables torchrun sets for each rank."""

from __future__ import annotations

import dataclasses
import sys

import pytest

from elastrun.agent.command import Executable
from elastrun.agent.env import WORKER_ENV_VARS, check_round, worker_env
from elastrun.agent.spec import WorkerSpec
from elastrun.errors import WorkerError
from elastrun.names import RunId
from elastrun.rendezvous.api import Member, RoundResult


def _round(group_rank: int = 1, restart_count: int = 2) -> RoundResult:
    members = (
        Member("a", "host-a", "10.0.0.1", 0, 2),
        Member("b", "host-b", "10.0.0.2", 1, 3),
        Member("c", "host-c", "10.0.0.3", 2, 4),
    )
    return RoundResult(
        run_id="job7",
        round=5,
        members=members,
        group_rank=group_rank,
        master_addr="10.0.0.1",
        master_port=29511,
        restart_count=restart_count,
        max_restarts=3,
    )


def _spec(nproc: int = 3, role: str = "trainer", **kw) -> WorkerSpec:
    return WorkerSpec(
        command=Executable(("python", "x.py")), nproc=nproc, run_id=RunId("job7"), role=role, **kw
    )


def test_every_variable_for_a_middle_node():
    env = worker_env(_spec(), _round(), local_rank=2, error_file="/e/2/error.json", base={})
    assert set(WORKER_ENV_VARS) <= set(env)
    assert env["LOCAL_RANK"] == "2"
    assert env["RANK"] == "4"  # node 0 has 2 workers, so this node starts at 2
    assert env["GROUP_RANK"] == "1"
    assert env["ROLE_RANK"] == "4"
    assert env["ROLE_NAME"] == "trainer"
    assert env["LOCAL_WORLD_SIZE"] == "3"
    assert env["WORLD_SIZE"] == "9"
    assert env["GROUP_WORLD_SIZE"] == "3"
    assert env["ROLE_WORLD_SIZE"] == "9"
    assert env["MASTER_ADDR"] == "10.0.0.1"
    assert env["MASTER_PORT"] == "29511"
    assert env["TORCHELASTIC_RESTART_COUNT"] == "2"
    assert env["TORCHELASTIC_MAX_RESTARTS"] == "3"
    assert env["TORCHELASTIC_RUN_ID"] == "job7"
    assert env["TORCHELASTIC_ERROR_FILE"] == "/e/2/error.json"
    assert env["TORCHELASTIC_USE_AGENT_STORE"] == "False"
    assert env["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == "1"
    assert env["PYTHON_EXEC"] == sys.executable
    assert env["OMP_NUM_THREADS"] == "1"
    assert env["PYTHONUNBUFFERED"] == "1"


def test_user_settings_kept_but_ranks_always_computed():
    base = {"OMP_NUM_THREADS": "8", "RANK": "99", "PATH": "/bin", "PYTHON_EXEC": "/opt/py"}
    spec = _spec(env={"PYTHONUNBUFFERED": "0", "WORLD_SIZE": "1", "MY_VAR": "x"})
    env = worker_env(spec, _round(group_rank=0), local_rank=0, error_file="/e", base=base)
    assert env["OMP_NUM_THREADS"] == "8"
    assert env["PYTHONUNBUFFERED"] == "0"
    assert env["PATH"] == "/bin"
    assert env["MY_VAR"] == "x"
    assert env["PYTHON_EXEC"] == "/opt/py"
    assert env["RANK"] == "0"
    assert env["WORLD_SIZE"] == "9"


def test_nccl_async_error_handling_respects_user_choice():
    env = worker_env(_spec(), _round(), 0, "/e", base={"TORCH_NCCL_ASYNC_ERROR_HANDLING": "0"})
    assert env["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == "0"


def test_round_disagreeing_with_nproc_is_refused():
    check_round(_spec(), _round(group_rank=1))
    with pytest.raises(WorkerError, match="--nproc-per-node"):
        check_round(_spec(), _round(group_rank=2))


def test_virtual_local_rank_flags_the_real_local_rank_0():
    # Every worker is LOCAL_RANK=0 under --virtual-local-rank; the node's one
    # real local rank 0 lists the memory checkpoint's replicas and writes
    # node-local files (WorkerContext.is_local_main).
    from elastrun.agent.warm_pool import compatible, local_vars
    from elastrun.train.context import WorkerContext
    from elastrun.worker.local_main import is_local_main

    spec = _spec(virtual_local_rank=True)
    envs = [worker_env(spec, _round(), lr, "/e", base={"PATH": "/bin"}) for lr in (0, 1, 2)]
    assert [e["LOCAL_RANK"] for e in envs] == ["0", "0", "0"]
    assert [is_local_main(e) for e in envs] == [True, False, False]
    assert [WorkerContext.from_env(e).is_local_main for e in envs] == [True, False, False]
    # The warm interpreter (started with local rank 0's) forks the others all the same.
    assert compatible(envs[0], envs[2], local_vars(spec)) is None
    # Without the flag, as before: LOCAL_RANK says.
    plain = [worker_env(_spec(), _round(), lr, "/e", base={"PATH": "/bin"}) for lr in (0, 1)]
    assert [is_local_main(e) for e in plain] == [True, False]
    assert [WorkerContext.from_env(e).is_local_main for e in plain] == [True, False]


def test_both_nccl_spellings_are_set_and_a_users_choice_kept_for_both():
    # torch 2.0 and 2.1 read only NCCL_ASYNC_ERROR_HANDLING.
    env = worker_env(_spec(), _round(), 0, "/e", base={})
    assert env["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == env["NCCL_ASYNC_ERROR_HANDLING"] == "1"
    env = worker_env(_spec(), _round(), 0, "/e", base={"NCCL_ASYNC_ERROR_HANDLING": "0"})
    assert env["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == env["NCCL_ASYNC_ERROR_HANDLING"] == "0"


def test_each_worker_gets_its_share_of_the_cpus_for_torch_compile():
    from elastrun.agent.env import compile_threads

    assert [compile_threads(n, cpus=16) for n in (1, 3, 8, 32)] == [16, 5, 2, 1]
    env = worker_env(_spec(), _round(), 0, "/e", base={})
    assert env["TORCHINDUCTOR_COMPILE_THREADS"] == str(compile_threads(3))
    mine = worker_env(_spec(), _round(), 0, "/e", base={"TORCHINDUCTOR_COMPILE_THREADS": "7"})
    assert mine["TORCHINDUCTOR_COMPILE_THREADS"] == "7"


def test_role_ranks_count_within_the_role_as_torch() -> None:
    """A master with 1 worker and trainers with 2 and 3 (torch's heterogeneous roles)."""
    members = (
        Member("m", "host-m", "10.0.0.1", 0, 1, "master"),
        Member("t1", "host-t1", "10.0.0.2", 1, 2, "trainer"),
        Member("t2", "host-t2", "10.0.0.3", 2, 3, "trainer"),
    )
    result = dataclasses.replace(_round(group_rank=2), members=members)
    env = worker_env(_spec(), result, local_rank=1, error_file="/e", base={})
    got = {k: env[k] for k in ("RANK", "ROLE_RANK", "WORLD_SIZE", "ROLE_WORLD_SIZE")}
    assert got == {"RANK": "4", "ROLE_RANK": "3", "WORLD_SIZE": "6", "ROLE_WORLD_SIZE": "5"}
    assert (env["GROUP_RANK"], env["GROUP_WORLD_SIZE"], env["LOCAL_WORLD_SIZE"]) == ("2", "3", "3")
    master = dataclasses.replace(result, group_rank=0)
    env = worker_env(_spec(nproc=1, role="master"), master, local_rank=0, error_file="/e", base={})
    assert (env["RANK"], env["ROLE_RANK"], env["ROLE_WORLD_SIZE"]) == ("0", "0", "1")
