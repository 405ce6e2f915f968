"""``elastrun status`` with candidate store hosts: the line that says who
hosts the store never names the host among the others (the answers asked
before a host was elected said "refused" of it), and the revision says of
which term it is (each host's store counts its own)."""

from __future__ import annotations

import dataclasses

from elastrun.status.hosts import store_hosts
from elastrun.status.model import StoreHosts
from elastrun.status.show import render_table
from elastrun.store.failover import Answer, Probe
from tests.unit.test_compat_format import ROUND, summary

ADDRS = ["127.0.0.1:29400", "127.0.0.2:29400", "127.0.0.3:29400"]


def address(index: int | None) -> str:
    return "" if index is None else ADDRS[index]


def test_the_host_is_never_among_the_others() -> None:
    # asked while the job started: nothing served yet; then candidate 0 was elected
    seen = [Probe(i, Answer.REFUSED) for i in range(3)]
    hosts = store_hosts(1, 0, seen, address)
    assert hosts.host == ADDRS[0] and hosts.standbys == ()
    assert hosts.others == (f"{ADDRS[1]} (refused)", f"{ADDRS[2]} (refused)")
    assert ADDRS[0] not in hosts.describe().split("standing by", 1)[1]


def test_standbys_and_others_as_they_answered() -> None:
    seen = [Probe(0, Answer.REFUSED), Probe(1, Answer.HOST, 2), Probe(2, Answer.STANDBY, 2)]
    hosts = store_hosts(2, 1, seen, address)
    assert hosts.describe() == (
        f"hosted by {ADDRS[1]} (term 2); standing by: {ADDRS[2]}; {ADDRS[0]} (refused)"
    )


def test_the_revision_names_its_term() -> None:
    plain = summary(ROUND)
    assert "(store h:1, revision 7)" in render_table(plain, "h:1")
    after = dataclasses.replace(plain, store_hosts=StoreHosts(2, ADDRS[1], (), ()))
    assert "(store h:1, term 2, revision 7)" in render_table(after, "h:1")
