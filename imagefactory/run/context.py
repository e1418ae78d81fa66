"""One run's settings and context: what every engine-driving command (build, test, push,
bench) is given.

`Options` is the one options object: the CLI declares each shared flag once (cli.py) and
resolves them into it; the pipeline steps (pipeline/build.py, publish/push.py, tools/bench.py) read the fields
they need. Choice values are checked here once, as enums. `RunContext` adds what the run
holds: the display (a typed `UI`), the run's Interrupt (SIGINT/SIGTERM, interrupt.py) and
the engine factory (engine/select.py). Defaults are defined here only. `Builder` is engine/api.py's.
"""

from __future__ import annotations

import datetime as dt
from dataclasses import dataclass, field, fields
from enum import Enum
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

from imagefactory.engine.api import Builder
from imagefactory.errors import ConfigError
from imagefactory.interrupt import Interrupt
from imagefactory.probe.limits import DEFAULT_PROBE_SHM, DEFAULT_PROBE_TIMEOUT

if TYPE_CHECKING:  # annotations only: the engines, the netrc reader and the report are a run's, not --help's
    from imagefactory.engine.api import BuildProgress, EngineFactory
    from imagefactory.config.netrc import Netrc
    from imagefactory.report.summary import CellReport

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


@dataclass(frozen=True)
class Options:
    """Every setting of a run. Fields a command has no flag for keep their defaults."""

    work_dir: Path = Path("build")
    report: Path = Path("build/report.json")
    jobs: int = 1
    fail_fast: bool = False
    gpus: Gpus = Gpus.auto
    network: Network = Network.host
    pull: Pull = Pull.missing  # how base images are resolved (freshness.py)
    retest: bool = False  # probe even when a verdict for this image is cached (verdicts.py)
    probe_shm: str = DEFAULT_PROBE_SHM  # /dev/shm of the probe containers: a size, host or default
    probe_timeout: float = DEFAULT_PROBE_TIMEOUT
    cache_from: tuple[str, ...] = ()  # images whose layers a build may reuse (e.g. the previous release)
    registry_cache: bool | None = None  # pull a cell's pushed content tag instead of building (None: with --push)
    verdicts_dir: Path | None = None  # None: verdicts.cache_dir()
    # the builder: resolved to buildkit or classic by the CLI (buildkit.select) before a run starts
    builder: Builder = Builder.classic
    buildx_builder: str | None = None  # buildx's --builder NAME (a remote or Kubernetes builder)
    netrc: Netrc | None = None  # the netrc mounted as a BuildKit secret, as netrc.load read it (None: nothing)
    # publishing (push, build --push)
    push: bool = False
    atomic: bool = False
    attempts: int = DEFAULT_PUSH_TRIES
    backoff: float = DEFAULT_RETRY_DELAY
    git_sha: str | None = None
    today: dt.date | None = None
    sign: str | None = None  # --sign: a cosign key file (absolute) or KMS URI, checked (signing.ready)
    # bench
    budget: float = DEFAULT_BENCH_BUDGET

    def __post_init__(self) -> None:
        """The one check of the choice values (the CLI hands enums already; code may hand strings)."""
        for name, kind in _CHOICES.items():
            value = getattr(self, name)
            if not isinstance(value, kind):
                try:
                    object.__setattr__(self, name, kind(value))
                except ValueError:
                    allowed = ", ".join(str(m.value) for m in kind)
                    raise ConfigError(f"--{name} {value}: not allowed (allowed: {allowed})") from None

    def summary(self, names: tuple[str, ...]) -> str:
        """The resolved settings `names` (the fields a command has flags for), on one line: what
        a run prints when it starts."""
        shown = []
        for f in fields(self):
            if f.name in names:
                value = getattr(self, f.name)
                value = value.value if isinstance(value, Enum) else value
                value = ",".join(map(str, value)) or "-" if isinstance(value, tuple) else value
                shown.append(f"{f.name.replace('_', '-')}={value}")
        return " ".join(shown)


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
    The engines `engine_factory` makes must share `interrupt` (engines.docker_factory does)."""

    options: Options = field(default_factory=Options)
    ui: UI = field(default_factory=Silent)
    interrupt: Interrupt = field(default_factory=Interrupt)
    engine_factory: EngineFactory | None = None

    def engines(self) -> EngineFactory:
        from imagefactory.engine import select as engines

        return self.engine_factory or engines.docker_factory(self.interrupt)
