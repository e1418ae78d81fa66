"""Build order: cells sharing leading layers wait for their leader to pass them."""

from __future__ import annotations

import threading

from imagefactory.pipeline import schedule

A = "# comment\nFROM base AS venv\n\nSHELL [\"bash\"]\nRUN a \\\n && b\nRUN torch-a\nFROM base\nLABEL x=1\n"
B = "FROM base AS venv\nSHELL [\"bash\"]\nRUN a \\\n  && b\nRUN torch-b\nFROM base\nLABEL x=2\n"
C = "FROM other\nSHELL [\"bash\"]\nRUN a && b\n"


def test_instructions_join_continuations_and_drop_comments():
    assert schedule.instructions(A) == ['FROM base AS venv', 'SHELL ["bash"]', 'RUN a && b', 'RUN torch-a',
                                        'FROM base', 'LABEL x=1']


def test_followers_come_after_every_leader():
    slots = schedule.plan([A, C, B])
    assert [(s.index, s.leader, s.shared_steps) for s in slots] == [(0, None, 0), (1, None, 0), (2, 0, 3)]


def test_sharing_only_from_is_no_group():
    slots = schedule.plan(["FROM base\nRUN x\n", "FROM base\nRUN y\n"])
    assert all(s.leader is None for s in slots)


def test_gate_opens_after_the_shared_steps_or_the_end():
    gates = schedule.Gates(schedule.plan([A, B]))
    opened = threading.Event()

    def follower():
        gates.wait(1)
        opened.set()

    t = threading.Thread(target=follower)
    t.start()
    gates.progress(0, 3)  # step 3 started: steps 1-2 done, step 3 (shared) not yet
    assert not opened.wait(0.2)
    gates.progress(0, 4)
    assert opened.wait(5)
    t.join()
    gates2 = schedule.Gates(schedule.plan([A, B]))
    gates2.release(0)
    gates2.wait(1)  # returns at once: the leader ended
    gates2.wait(0)  # a leader never waits
