"""Typed errors. The CLI catches ImageFactoryError once, prints it, exits with its code."""

from __future__ import annotations


class ImageFactoryError(Exception):
    """Base of every failure a user can cause or meet. Never shown with a traceback."""

    exit_code = 1

    def __init__(self, message: str):
        super().__init__(message)
        self.message = message


class ConfigError(ImageFactoryError):
    """The matrix file (or a command-line option) is wrong. Carries every problem found."""

    exit_code = 2

    def __init__(self, problems: list[str] | str):
        if isinstance(problems, str):
            problems = [problems]
        self.problems = list(problems)
        super().__init__("\n".join(self.problems))


class CellFailure(ImageFactoryError):
    """At least one cell failed to build, failed a check, or failed to publish."""

    exit_code = 1


class LocksMissing(ImageFactoryError):
    """`imagefactory lock --check`: some cells have no lock (the others are up to date)."""

    exit_code = 1


class DockerUnavailable(ImageFactoryError):
    """No Docker engine answered."""

    exit_code = 3


class EngineError(ImageFactoryError):
    """The Docker engine refused or failed a request (run, tag, inspect)."""


class BuildError(ImageFactoryError):
    """One image build failed. Raised by the engine layer, caught per cell."""

    def __init__(self, message: str, *, step: str | None = None, log_tail: list[str] | None = None):
        super().__init__(message)
        self.step = step
        self.log_tail = log_tail or []


class ForeignPlatform(BuildError):
    """A build for a platform its builder cannot build (the classic builder builds only for the
    engine's own, whatever it is asked): refused, never an image of the wrong arch under the name."""


class PushError(ImageFactoryError):
    """A push failed. `transient` tells the retry policy whether trying again can help."""

    def __init__(self, message: str, *, transient: bool):
        super().__init__(message)
        self.transient = transient


class RegistryError(PushError):
    """The registry's HTTP API refused, failed or contradicted a request (engine/registry.py): a
    manifest it would not serve or store, or one whose digest is not its bytes' sha256."""


class EngineGone(EngineError):
    """The Docker engine stopped answering in the middle of a run. The cell that met it fails,
    the report is still written, and the run exits 3."""

    exit_code = 3


class Cancelled(ImageFactoryError):
    """Raised inside a cell's work when the run was interrupted (SIGINT/SIGTERM): the cell is
    reported as interrupted, not as failed."""


class Interrupted(ImageFactoryError):
    """The run was stopped by a signal; exits 128 + the signal number (130 SIGINT, 143 SIGTERM)."""

    def __init__(self, signum: int,
                 note: str = "the report marks the cells that were stopped; the next run resumes "
                             "(finished cells are cached)"):
        super().__init__("interrupted" + (" (SIGTERM)" if signum == 15 else ""))
        self.exit_code = 128 + signum
        self.note = note
