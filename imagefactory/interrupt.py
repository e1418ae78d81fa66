"""One run's cancellation: SIGINT/SIGTERM set it, every worker observes it.

The main thread owns the signal handlers. A handler only records the signal and wakes a
helper thread, which runs the stop actions the workers registered (close a build or push
stream, kill a probe or build container). Workers see the cancellation between stream
events, or when their blocked call returns, and end their cell as interrupted.
"""

from __future__ import annotations

import itertools
import signal
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager

from imagefactory.errors import Cancelled

GRACE_SECONDS = 7.0  # after a signal, how long the workers get before the run stops waiting for them


class Interrupt:
    def __init__(self) -> None:
        self._event = threading.Event()
        self._lock = threading.Lock()
        self._actions: dict[int, Callable[[], None]] = {}
        self._ids = itertools.count()
        self.signum: int | None = None

    def is_set(self) -> bool:
        return self._event.is_set()

    def check(self) -> None:
        if self._event.is_set():
            raise Cancelled("interrupted")

    def wait(self, seconds: float) -> None:
        """Sleep `seconds` unless interrupted first (then raise Cancelled)."""
        self._event.wait(seconds)
        self.check()

    @contextmanager
    def on_cancel(self, action: Callable[[], None]) -> Iterator[None]:
        """Run `action` (which must be safe from another thread) if the run is cancelled while
        the block runs; at once if it already is."""
        key = next(self._ids)
        with self._lock:
            self._actions[key] = action
        if self._event.is_set():
            _quietly(action)
        try:
            yield
        finally:
            with self._lock:
                self._actions.pop(key, None)

    def cancel(self, signum: int = signal.SIGINT) -> None:
        """Cancel the run and run every registered stop action (in the calling thread)."""
        with self._lock:
            if self.signum is None:
                self.signum = int(signum)
            self._event.set()
            actions = list(self._actions.values())
        for action in actions:
            _quietly(action)

    @contextmanager
    def signals(self) -> Iterator[None]:
        """Turn SIGINT and SIGTERM into a cancellation while the block runs (main thread only)."""
        wake = threading.Event()
        done = threading.Event()

        def handler(signum: int, frame: object) -> None:
            if self.signum is None:
                self.signum = signum
            wake.set()

        def stopper() -> None:
            while True:
                wake.wait()
                if done.is_set():
                    return
                wake.clear()
                self.cancel(self.signum or signal.SIGINT)
                # a container or stream registered a moment later is stopped at registration

        thread = threading.Thread(target=stopper, name="imagefactory-interrupt", daemon=True)
        thread.start()
        try:
            with _handling(handler):
                yield
        finally:  # the run's handlers are back in place by now
            pending = wake.is_set()  # a signal the stopper has not acted on yet
            done.set()
            wake.set()  # the stopper returns at once: no polling interval to wait out
            if pending:
                self.cancel(self.signum or signal.SIGINT)
            thread.join(timeout=5)

    @contextmanager
    def raising(self) -> Iterator[None]:
        """For work that runs in the main thread and can only be stopped there (a resolver
        subprocess, `imagefactory lock`): SIGINT/SIGTERM set the interrupt and raise Cancelled
        at once in the main thread (subprocess.run kills its child on the way out)."""

        def handler(signum: int, frame: object) -> None:
            if self.signum is None:
                self.signum = signum
            self._event.set()
            raise Cancelled("interrupted")

        with _handling(handler):
            yield


@contextmanager
def _handling(handler: Callable[[int, object], None]) -> Iterator[None]:
    """SIGINT and SIGTERM go to `handler` while the block runs; the previous handlers after."""
    previous = {s: signal.signal(s, handler) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for s, h in previous.items():
            signal.signal(s, h)


def _quietly(action: Callable[[], None]) -> None:
    try:
        action()
    except Exception:  # noqa: BLE001 - a stop action that fails must not stop the others
        pass
