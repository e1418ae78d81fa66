"""interrupt.py: stop actions and signals at the edges of the signal scope."""

from __future__ import annotations



def test_a_stop_action_registered_after_an_interrupt_runs_at_once():
    from imagefactory.interrupt import Interrupt

    interrupt, ran = Interrupt(), []
    interrupt.cancel()
    with interrupt.on_cancel(lambda: ran.append("stopped")):
        assert ran == ["stopped"]
    assert ran == ["stopped"]  # once, not again on the way out


def test_a_signal_caught_just_before_the_scope_ends_is_not_lost(monkeypatch):
    """The stopper thread never gets to run here (as when the signal lands on the block's last
    line): the scope's exit itself must act on the pending signal."""
    import signal

    from imagefactory import interrupt as interrupt_mod

    class Idle:
        def __init__(self, *a, **k):
            pass

        def start(self):
            pass

        def join(self, timeout=None):
            pass

    monkeypatch.setattr(interrupt_mod.threading, "Thread", Idle)
    interrupt, ran = interrupt_mod.Interrupt(), []
    with interrupt.on_cancel(lambda: ran.append("stopped")):
        with interrupt.signals():
            signal.raise_signal(signal.SIGTERM)
        assert interrupt.is_set() and interrupt.signum == signal.SIGTERM and ran == ["stopped"]
