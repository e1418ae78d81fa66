"""Build order for -j N: cells that share layers build their shared part once.

Two classic-builder builds racing through the same instructions each build them (the
layer cache only knows finished steps), so the shared part is paid twice and stored
twice. So cells are grouped by the longest run of leading Dockerfile instructions they
have in common with an earlier cell (their leader). A follower starts only once its
leader's build has gone past the shared steps (its progress reports a later step) or
ended; from then on the follower's shared steps are cache hits, and the different,
expensive steps of both run in parallel.

Leaders are queued before followers, so with a FIFO pool a follower can only wait on a
leader that already holds a worker: no deadlock for any -j.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence


def instructions(dockerfile: str) -> list[str]:
    """Logical Dockerfile instructions: comments and blank lines dropped, continuations joined."""
    out: list[str] = []
    current: list[str] = []
    for raw in dockerfile.splitlines():
        line = raw.strip()
        if not current and (not line or line.startswith("#")):
            continue
        if current and line.startswith("#"):
            continue  # a comment inside a continued instruction
        if line.endswith("\\"):
            current.append(line[:-1].strip())
            continue
        current.append(line)
        out.append(" ".join(part for part in current if part))
        current = []
    if current:
        out.append(" ".join(current))
    return out


def common_prefix(a: Sequence[str], b: Sequence[str]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


@dataclass(frozen=True)
class Slot:
    index: int  # position in the matrix order
    leader: int | None  # index of the cell whose build goes first
    shared_steps: int  # leading instructions shared with the leader


def plan(dockerfiles: Sequence[str]) -> list[Slot]:
    """Slots in the order to start them: leaders first (matrix order), then followers.

    A cell follows the earliest earlier leader with which it shares the most steps, when
    they share more than the FROM line (a FROM alone builds nothing)."""
    parsed = [instructions(text) for text in dockerfiles]
    leaders: list[int] = []
    slots: list[Slot] = []
    for i, steps in enumerate(parsed):
        best, shared = None, 1
        for j in leaders:
            n = common_prefix(parsed[j], steps)
            if n > shared:
                best, shared = j, n
        if best is None:
            leaders.append(i)
            slots.append(Slot(i, None, 0))
        else:
            slots.append(Slot(i, best, shared))
    return sorted(slots, key=lambda s: (s.leader is not None, s.index))


def plan_paths(paths: Sequence[Path]) -> list[Slot]:
    return plan([(p / "Dockerfile").read_text(encoding="utf-8") for p in paths])


class Gates:
    """One gate per leader: opened when its build passes a follower's shared steps, or ends."""

    def __init__(self, slots: Sequence[Slot]):
        self.slots = {s.index: s for s in slots}
        self._step: dict[int, int] = {}
        self._done: set[int] = set()
        self._cond = threading.Condition()

    def progress(self, index: int, step: int) -> None:
        """The leader `index` has started build step `step` (so steps before it are done)."""
        with self._cond:
            self._step[index] = max(step, self._step.get(index, 0))
            self._cond.notify_all()

    def release(self, index: int) -> None:
        with self._cond:
            self._done.add(index)
            self._cond.notify_all()

    def wait(self, index: int) -> None:
        slot = self.slots.get(index)
        if slot is None or slot.leader is None:
            return
        leader, need = slot.leader, slot.shared_steps
        with self._cond:
            self._cond.wait_for(lambda: leader in self._done or self._step.get(leader, 0) > need)
