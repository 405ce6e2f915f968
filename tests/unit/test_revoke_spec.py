"""How the orphan guard revokes a killed agent's lease: the typed spec the
stores give (``store.base.RevokeSpec``), its JSON on the guard's pipe, and the
guard's own reading of it (``agent/_guard_main.py``, standard library only).

The guard against real stores: tests/integration/test_guard_revokes_lease.py.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from elastrun.agent import _guard_main as guard
from elastrun.endpoint import Endpoint
from elastrun.store.base import EmbeddedRevoke, EtcdRevoke, RevokeSpec

EMBEDDED = EmbeddedRevoke(7, host="10.0.0.1", port=29400, token="s3cret")
ETCD = EtcdRevoke(
    8,
    endpoints=(Endpoint("10.0.0.1", 2379), Endpoint("::1", 2380)),
    https=True,
    cacert="/ca.pem",
    cert="/c.pem",
    key="/k.pem",
    user="root",
    password="pw",
)


def on_the_pipe(spec: RevokeSpec) -> object:
    """The spec as the guard receives it: one line of JSON."""
    line = json.dumps(spec.to_json(), separators=(",", ":"))
    assert "\n" not in line and line.isascii()
    return json.loads(line)


@pytest.mark.parametrize("spec", [EMBEDDED, ETCD, EmbeddedRevoke(1, host="h", port=1)])
def test_a_spec_reads_back_as_it_was_written(spec: RevokeSpec) -> None:
    assert RevokeSpec.from_json(on_the_pipe(spec)) == spec


def test_secrets_stay_out_of_reprs() -> None:
    assert "s3cret" not in repr(EMBEDDED) and "pw" not in repr(ETCD).replace("pem", "")


def test_the_guard_reads_every_field_the_agent_writes() -> None:
    embedded = guard.parse_spec(on_the_pipe(EMBEDDED))
    assert isinstance(embedded, guard.EmbeddedLease)
    assert (embedded.lease, embedded.host, embedded.port, embedded.token) == (
        7,
        "10.0.0.1",
        29400,
        "s3cret",
    )
    etcd = guard.parse_spec(on_the_pipe(ETCD))
    assert isinstance(etcd, guard.EtcdLease)
    assert etcd.lease == 8 and etcd.endpoints == [("10.0.0.1", 2379), ("::1", 2380)]
    assert (etcd.https, etcd.cacert, etcd.cert, etcd.key) == (True, "/ca.pem", "/c.pem", "/k.pem")
    assert (etcd.user, etcd.password) == ("root", "pw")


@pytest.mark.parametrize(
    "raw",
    [
        None,
        [1],
        {**EMBEDDED.to_json(), "lease": 0},
        {**EMBEDDED.to_json(), "lease": "7"},
        {**EMBEDDED.to_json(), "kind": "zookeeper"},
        {**EMBEDDED.to_json(), "port": 70000},
        {**EMBEDDED.to_json(), "host": None},
        {**ETCD.to_json(), "endpoints": 5},
        {**ETCD.to_json(), "endpoints": [["h"]]},
        {**ETCD.to_json(), "endpoints": [[1, 2379]]},
    ],
)
def test_a_malformed_spec_is_refused_by_both_readers(raw: object) -> None:
    """The guard ignores it (it must never die of a bad line); the typed
    reader names the problem."""
    assert guard.parse_spec(raw) is None
    with pytest.raises(ValueError, match="revoke spec"):
        RevokeSpec.from_json(raw)


def test_the_guard_stays_on_the_standard_library() -> None:
    """It runs as ``python -S -I`` by path: no elastrun, no site packages."""
    import ast
    import sys
    from pathlib import Path

    tree = ast.parse(Path(guard.__file__).read_text(encoding="utf-8"))
    names = {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    names |= {n.module or "" for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
    names -= {"elastrun.fields"}  # in the package; loaded by its path when run
    assert {n.split(".")[0] for n in names} <= set(sys.stdlib_module_names) | {"__future__"}


def test_the_guard_run_by_path_reads_a_spec(tmp_path: Path) -> None:
    """As the agent runs it (``python -S -I -B``): elastrun/fields.py loaded by
    its path, neither elastrun nor typing imported."""
    script = (
        "import importlib.util, json, sys\n"
        f"spec = importlib.util.spec_from_file_location('guard', {guard.__file__!r})\n"
        "g = importlib.util.module_from_spec(spec); spec.loader.exec_module(g)\n"
        "assert 'elastrun' not in sys.modules and 'typing' not in sys.modules\n"
        "lease = g.parse_spec(json.loads(sys.argv[1]))\n"
        "print(lease.lease, lease.host, lease.port, g.parse_spec({'lease': 0}))\n"
    )
    out = subprocess.run(
        [sys.executable, "-S", "-I", "-B", "-c", script, json.dumps(EMBEDDED.to_json())],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["7", "10.0.0.1", "29400", "None"]
