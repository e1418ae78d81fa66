"""One run's settings and context: what every engine-driving command (build, test, push,
merge, bench) is given.

Each command gets a settings type of its own (BuildOptions, TestOptions, PushOptions,
MergeOptions, BenchOptions), composed of small frozen groups (Workspace, Reporting, Probing,
Builders, Testing, Building, Publishing, Releasing, Benching) and holding only the settings that command
takes: the CLI declares each shared flag once (cli/options.py) and resolves a command's flags into
its type. The pipeline steps (pipeline/build.py, publish/, attest/supply.py, tools/bench.py) read
the groups they need (RunContext.settings), so bench cannot read a push setting. Choice values are
checked here once, as enums. `RunContext` adds what the run holds: the display (a typed `UI`), the
run's Interrupt (SIGINT/SIGTERM, interrupt.py) and the engine factory (engine/select.py). Defaults
are defined here only. `Builder` is engine/api.py's.
"""

from __future__ import annotations

import datetime as dt
from dataclasses import dataclass, field, fields
from enum import Enum
from pathlib import Path
from typing import TYPE_CHECKING, ClassVar, Protocol, TypeVar

from imagefactory.engine.api import Builder
from imagefactory.errors import ConfigError
from imagefactory.interrupt import Interrupt
from imagefactory.probe.limits import DEFAULT_PROBE_SHM, DEFAULT_PROBE_TIMEOUT

if TYPE_CHECKING:  # annotations only: the engines, the netrc reader and the report are a run's, not --help's
    from imagefactory.engine.api import BuildProgress, EngineFactory
    from imagefactory.config.netrc import Netrc
    from imagefactory.run.results import CellReport

DEFAULT_PUSH_TRIES = 4  # tries per tag, the first included
DEFAULT_RETRY_DELAY = 2.0  # seconds before the first push retry; doubles each time, at most 60 s
DEFAULT_BENCH_BUDGET = 50.0  # seconds of bench workload per image (both containers together)


class Gpus(str, Enum):
    none = "none"
    all = "all"
    auto = "auto"


class Network(str, Enum):
    host = "host"
    default = "default"


class Pull(str, Enum):
    always = "always"
    missing = "missing"
    never = "never"


_CHOICES: dict[str, type[Enum]] = {"gpus": Gpus, "network": Network, "pull": Pull, "builder": Builder}


# Every setting, in the order a run's summary line shows them (Settings.summary).
ORDER = ("work_dir", "report", "jobs", "fail_fast", "gpus", "network", "pull", "retest", "probe_shm", "probe_timeout",
         "cache_from", "registry_cache", "verdicts_dir", "builder", "buildx_builder", "netrc", "push", "atomic",
         "attempts", "backoff", "git_sha", "today", "sign", "budget")

S = TypeVar("S", bound="Settings")


@dataclass(frozen=True)
class Settings:
    """What every settings type shares: the choice check and the summary line. Alone (no fields),
    the settings of a command that drives no engine (list, render, lock)."""

    # the fields the CLI sets without a shared flag of the command (tests/unit/cli/test_options.py)
    NO_SHARED_FLAG: ClassVar[tuple[str, ...]] = ()

    def __post_init__(self) -> None:
        """The one check of the choice values (the CLI hands enums already; code may hand strings)."""
        own = {f.name for f in fields(self)}
        for name, kind in _CHOICES.items():
            if name not in own:
                continue
            value = getattr(self, name)
            if not isinstance(value, kind):
                try:
                    object.__setattr__(self, name, kind(value))
                except ValueError:
                    allowed = ", ".join(str(m.value) for m in kind)
                    raise ConfigError(f"--{name} {value}: not allowed (allowed: {allowed})") from None

    def summary(self, names: tuple[str, ...]) -> str:
        """The resolved settings `names` (the fields a command has flags for), on one line, in
        ORDER: what a run prints when it starts."""
        own = {f.name for f in fields(self)}
        shown = []
        for name in ORDER:
            if name in names and name in own:
                value = getattr(self, name)
                value = value.value if isinstance(value, Enum) else value
                value = ",".join(map(str, value)) or "-" if isinstance(value, tuple) else value
                shown.append(f"{name.replace('_', '-')}={value}")
        return " ".join(shown)


# -- the groups: each pipeline step reads the groups it needs (need / or_defaults) -----------------

@dataclass(frozen=True)
class Workspace(Settings):
    """Where a run works, and the GPUs its containers get (build, test, push, bench)."""

    work_dir: Path = Path("build")
    gpus: Gpus = Gpus.auto


@dataclass(frozen=True)
class Reporting(Settings):
    """Where the run's report goes (build, test, push, merge)."""

    report: Path = Path("build/report.json")


@dataclass(frozen=True)
class Probing(Settings):
    """How long the probe of a built image may run (build, test, push)."""

    probe_timeout: float = DEFAULT_PROBE_TIMEOUT


@dataclass(frozen=True)
class Builders(Settings):
    """The builder the run's engine drives, and whose images test and push find (build, test, push).
    Both resolved together from --builder and --buildx-builder by the CLI (preflight: buildkit.select)."""

    builder: Builder = Builder.classic
    buildx_builder: str | None = None  # buildx's --builder NAME (a remote or Kubernetes builder)


@dataclass(frozen=True)
class Testing(Settings):
    """How the cells are run and the probe's verdicts kept (build, test; push probes with the defaults)."""

    jobs: int = 1
    fail_fast: bool = False
    pull: Pull = Pull.missing  # how base images are resolved (freshness.py)
    retest: bool = False  # probe even when a verdict for this image is cached (verdicts.py)
    probe_shm: str = DEFAULT_PROBE_SHM  # /dev/shm of the probe containers: a size, host or default
    verdicts_dir: Path | None = None  # None: the cache folder's (verdicts.VERDICTS)


@dataclass(frozen=True)
class Building(Settings):
    """What only a build reads: its containers' network, its caches, the netrc (build)."""

    network: Network = Network.host
    cache_from: tuple[str, ...] = ()  # images whose layers a build may reuse (e.g. the previous release)
    registry_cache: bool | None = None  # pull a cell's pushed content tag instead of building (None: with --push)
    netrc: Netrc | None = None  # the netrc mounted as a BuildKit secret, as netrc.load read it (None: nothing)


@dataclass(frozen=True)
class Publishing(Settings):
    """Pushing tags and lists (build --push, push, merge)."""

    push: bool = False
    attempts: int = DEFAULT_PUSH_TRIES
    backoff: float = DEFAULT_RETRY_DELAY
    git_sha: str | None = None
    today: dt.date | None = None


@dataclass(frozen=True)
class Releasing(Settings):
    """What a push of tested cells decides: all or nothing, and signing (build --push, push)."""

    atomic: bool = False
    sign: str | None = None  # --sign: a cosign key file (absolute) or KMS URI, checked (signing.ready)


@dataclass(frozen=True)
class Benching(Settings):
    budget: float = DEFAULT_BENCH_BUDGET


# -- one type per command: the groups it takes, nothing else ----------------------------------------

@dataclass(frozen=True)
class BuildOptions(Workspace, Reporting, Probing, Builders, Testing, Building, Publishing, Releasing):
    NO_SHARED_FLAG = ("verdicts_dir", "git_sha", "today")  # the verdict cache; set by a push's preflight


@dataclass(frozen=True)
class TestOptions(Workspace, Reporting, Probing, Builders, Testing):
    __test__ = False  # not a pytest test class
    NO_SHARED_FLAG = ("verdicts_dir", "buildx_builder")  # the verdict cache; resolved with --builder (None)


@dataclass(frozen=True)
class PushOptions(Workspace, Reporting, Probing, Builders, Publishing, Releasing):
    NO_SHARED_FLAG = ("git_sha", "today", "buildx_builder")


@dataclass(frozen=True)
class MergeOptions(Reporting, Publishing):
    NO_SHARED_FLAG = ("git_sha", "today")


@dataclass(frozen=True)
class BenchOptions(Workspace, Benching):
    NO_SHARED_FLAG = ("budget",)  # bench's own --budget


def need(options: Settings, group: type[S]) -> S:
    """`options` as the settings group a step reads; a command whose type lacks it cannot run that step."""
    if not isinstance(options, group):
        raise TypeError(f"{type(options).__name__} holds no {group.__name__} settings")
    return options


def or_defaults(options: Settings, group: type[S]) -> S:
    """`options` as `group`, or the group's defaults for a command that has no flag for it (push's
    probe: Testing's; merge's and bench's engine: Workspace's and Builders')."""
    return options if isinstance(options, group) else group()


class UI(Protocol):
    """What the pipeline tells the display (progress.py: Plain lines or a Live view)."""

    def start(self, cell: str, what: str) -> None: ...

    def step(self, cell: str, p: BuildProgress) -> None: ...

    def log(self, cell: str, line: str) -> None: ...

    def status(self, cell: str, text: str) -> None: ...

    def finish(self, r: CellReport) -> None: ...


class Silent:
    """A UI that shows nothing."""

    def start(self, cell: str, what: str) -> None:
        pass

    def step(self, cell: str, p: BuildProgress) -> None:
        pass

    def log(self, cell: str, line: str) -> None:
        pass

    def status(self, cell: str, text: str) -> None:
        pass

    def finish(self, r: CellReport) -> None:
        pass


@dataclass
class RunContext:
    """One run: its options, its display, its cancellation and where its engines come from.
    The engines `engine_factory` makes must share `interrupt` (select.docker_factory does)."""

    options: Settings = field(default_factory=Settings)
    ui: UI = field(default_factory=Silent)
    interrupt: Interrupt = field(default_factory=Interrupt)
    engine_factory: EngineFactory | None = None

    def engines(self) -> EngineFactory:
        from imagefactory.engine import select

        return self.engine_factory or select.docker_factory(self.interrupt)

    def settings(self, group: type[S]) -> S:
        """This run's settings as `group` (need): a step reads only what its command takes."""
        return need(self.options, group)
