"""The store's budgets for all connections (store/budgets.py), as pure rules:
who is closed when the bytes held in incomplete frames, or queued for
clients, pass the budget; and a connection's output queue
(store/server_output.py), whose shared pieces count once. The servers under
real floods: tests/store/test_store_floods.py."""

from __future__ import annotations

from elastrun.clock import FakeClock
from elastrun.store.budgets import InputBudget, OutputBudget
from elastrun.store.server_output import OutputQueue


class Conn:
    def __init__(self, name: str, queued: int = 0) -> None:
        self.name = name
        self.queued = queued

    def output_sizes(self) -> tuple[int, int]:
        return self.queued, self.queued

    def __repr__(self) -> str:
        return self.name


def test_input_closes_the_oldest_incomplete_frames_first() -> None:
    closed: list[Conn] = []
    budget: InputBudget[Conn] = InputBudget(100, lambda c, why: closed.append(c))
    a, b, c = Conn("a"), Conn("b"), Conn("c")
    budget.update(a, 40, new_frame=True)
    budget.update(b, 40, new_frame=True)
    budget.update(a, 50, new_frame=False)  # a's frame grows: still the oldest
    assert (budget.total, closed) == (90, [])
    budget.update(c, 30, new_frame=True)
    assert closed == [a] and budget.total == 70 and budget.evicted == 1
    # b completes its frame and begins another: now the newest, c goes first.
    budget.update(b, 60, new_frame=True)
    budget.update(c, 50, new_frame=False)
    assert closed == [a, c] and budget.total == 60
    # A connection whose own frame is the oldest is closed itself.
    budget.update(b, 120, new_frame=False)
    assert closed == [a, c, b] and budget.total == 0
    assert budget.peak == 120


def test_input_forgets_completed_and_closed_connections() -> None:
    budget: InputBudget[Conn] = InputBudget(100, lambda c, why: None)
    a = Conn("a")
    budget.update(a, 70, new_frame=True)
    budget.update(a, 0, new_frame=True)
    assert budget.total == 0
    budget.update(a, 10, new_frame=True)
    budget.forget(a)
    budget.forget(a)
    assert budget.total == 0


def test_output_closes_the_longest_unread_not_the_writer() -> None:
    clock = FakeClock()
    closed: list[tuple[Conn, str]] = []
    budget: OutputBudget[Conn] = OutputBudget(
        100, lambda c, why: closed.append((c, why)), clock.monotonic
    )
    stuck, reader, writer = Conn("stuck", 40), Conn("reader", 40), Conn("writer", 10)
    budget.observe(stuck, 40)
    clock.advance(1)
    budget.observe(reader, 40)
    clock.advance(1)
    budget.observe(writer, 10)
    budget.make_room(writer, 5)  # fits
    assert closed == []
    clock.advance(1)
    reader.queued = 35  # it reads: it drained since it was last seen
    budget.make_room(writer, 30)  # 40 + 35 + 10 + 30 > 100: the stuck one goes
    assert [c for c, _ in closed] == [stuck]
    assert "unread for 3.0 s" in closed[0][1] and "max_output_bytes" in closed[0][1]
    assert budget.total == 45 and budget.evicted == 1
    # Alone over the budget, the writer is never closed for its own write.
    budget.forget(reader)
    budget.make_room(writer, 500)
    assert [c for c, _ in closed] == [stuck]


def test_output_counts_what_drained_before_closing_anyone() -> None:
    closed: list[Conn] = []
    budget: OutputBudget[Conn] = OutputBudget(100, lambda c, why: closed.append(c))
    a, b = Conn("a", 60), Conn("b", 30)
    budget.observe(a, 60)
    budget.observe(b, 30)
    a.queued = 0  # the kernel took it all: nothing to close
    budget.make_room(b, 50)
    assert closed == [] and budget.total == 30 and budget.peak == 90


def test_output_counts_a_piece_queued_for_many_connections_once() -> None:
    closed: list[Conn] = []
    budget: OutputBudget[Conn] = OutputBudget(1000, lambda c, why: closed.append(c))
    event = b"e" * 600
    queues = [OutputQueue(budget) for _ in range(3)]
    for queue in queues:
        assert budget.added(event) == (0 if budget.shared else 600)
        queue.append(b"head", shared=False)
        queue.append(event, shared=True)
        queue.append(b"}")
    assert (budget.shared, budget.total, budget.peak) == (600, 600, 600)
    assert [(q.size, q.own) for q in queues] == [(605, 5)] * 3
    # A second event for all three would pass the budget only if counted for each.
    budget.make_room(Conn("writer"), 300)
    assert closed == []
    # Handed over by one queue, cleared by another: still held by the third.
    assert queues[0].take(10_000) == b"head" + event + b"}"
    queues[1].clear()
    assert budget.shared == 600 and (queues[1].size, queues[1].own) == (0, 0)
    queues[2].clear()
    assert budget.shared == 0 and budget.total == 0


def test_output_queue_hands_over_in_order_a_chunk_at_a_time() -> None:
    budget: OutputBudget[Conn] = OutputBudget(10_000, lambda c, why: None)
    queue = OutputQueue(budget)
    body = bytes(range(256)) * 4
    queue.append(b"abc")
    queue.append(body, shared=True)
    queue.append(b"")  # nothing
    queue.append(b"xyz")
    taken: list[bytes] = []
    while queue.size:
        assert queue.size == len(body) + 6 - sum(map(len, taken))
        taken.append(queue.take(100))
        assert len(taken[-1]) <= 100
    assert b"".join(taken) == b"abc" + body + b"xyz"
    assert queue.own == 0 and budget.shared == 0
    # A whole small piece is handed over as it is, not copied.
    frame = b"0123456789"
    queue.append(frame)
    assert queue.take(100) is frame
