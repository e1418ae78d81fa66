"""The image catalogue: report.html, for the people who pull the images.

One self-contained page (no network, no script, inline CSS) written beside report.json for a run
that publishes, or by `imagefactory report --html` from an existing report.json. It shows the
matrix as a grid (Python x CUDA, one tile per BLAS/installer/variant, coloured by verdict) and,
per image, the pull commands by tag and by digest, what is inside as the probe saw it, the
launch modes, the launch lines for each cluster launcher, and the bench figures where measured.

Every value in the page comes from a report that may be hostile: the template autoescapes all of
it, and the page's Content-Security-Policy allows no script, no request and no remote style.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from imagefactory.files import fsutil
from imagefactory.files import bounded
from imagefactory.config import refs
from imagefactory.render import rendered
from imagefactory.probe.checks import Check
from imagefactory.errors import ConfigError
from imagefactory.run.results import CellReport, size_facts

MAX_REPORT = 64 * 1024 * 1024  # bytes of report.json (or bench.json) read at most
_TEMPLATES = Path(__file__).parents[1] / "templates"
_CELL_ID = re.compile(r"py(?P<python>\d+\.\d+)-(?P<accel>cpu|cu\d+\.\d+)-(?P<rest>.+)")
_DIGEST = re.compile(r"sha256:[0-9a-f]{64}")
# What is inside, as the probe saw it: (label, the check whose actual value says it).
# (report.json records no cuDNN version yet, so the page cannot show it; sizes: cell.size_facts.)
_INSIDE = (("Python", "python.version"), ("torch", "torch.version"), ("CUDA", "torch.cuda_build"),
           ("BLAS loaded by NumPy", "numpy.blas"), ("OpenMP runtime", "openmp.single_runtime"),
           ("MKL threading layer", "mkl.threading_layer"), ("threads", "env.OMP_NUM_THREADS"),
           ("user", "user.non_root"), ("architecture", "platform.machine"))


# --------------------------------------------------------------------------- reading a report

_KINDS: dict[str, type] = {"str": str, "float": float, "bool": bool, "int": int, "list": list, "dict": dict}


def _typed(value: Any, kind: type, where: str) -> Any:
    if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
        raise ConfigError(f"{where}: expected {kind.__name__}, got {type(value).__name__}")
    return value


def _check(raw: Any, where: str) -> Check:
    raw = _typed(raw, dict, where)
    names = [f.name for f in fields(Check)]
    return Check(**{n: _typed(raw.get(n, ""), str, f"{where}.{n}") for n in names})


def _cell(raw: Any, where: str) -> CellReport:
    """One cell of report.json; keys this version does not know are ignored (newer reports)."""
    raw = _typed(raw, dict, where)
    r = CellReport(cell=_typed(raw.get("cell"), str, f"{where}.cell"))
    for f in fields(CellReport):
        if f.name in ("cell", "checks", "pushed") or f.name not in raw:
            continue
        annotation = str(f.type)  # a string (postponed annotations): "str", "list[str]", ...
        kind = None if "|" in annotation or "Optional" in annotation else _KINDS.get(annotation.split("[", 1)[0])
        value = raw[f.name]
        if kind is float and isinstance(value, int) and not isinstance(value, bool):
            value = float(value)
        setattr(r, f.name, value if kind is None else _typed(value, kind, f"{where}.{f.name}"))
        if annotation == "list[str]":
            for i, item in enumerate(value):
                _typed(item, str, f"{where}.{f.name}[{i}]")
    r.checks = [_check(c, f"{where}.checks[{i}]") for i, c in enumerate(_typed(raw.get("checks", []), list, where))]
    r.pushed = [_typed(p, dict, f"{where}.pushed[{i}]") for i, p in enumerate(_typed(raw.get("pushed", []), list, where))]
    for i, p in enumerate(r.pushed):
        for key in ("ref", "digest"):
            _typed(p.get(key), str, f"{where}.pushed[{i}].{key}")
    return r


def read_report(path: Path) -> list[CellReport]:
    """The cells of a report.json written by `build`, `test` or `push`; ConfigError (exit 2) naming
    the file and the key for anything else."""
    try:
        doc = json.loads(bounded.read_regular(path, MAX_REPORT))
    except bounded.InputError as e:
        raise ConfigError(f"{bounded.short(path)}: {e}") from None
    except ValueError as e:  # JSON or UTF-8
        raise ConfigError(f"{bounded.short(path)}: not a JSON report: {e}") from None
    try:
        doc = _typed(doc, dict, "report")
        return [_cell(c, f"cells[{i}]") for i, c in enumerate(_typed(doc.get("cells"), list, "cells"))]
    except ConfigError as e:
        raise ConfigError([f"{bounded.short(path)}: {p}" for p in e.problems]) from None


def read_bench(path: Path) -> dict[str, list[dict[str, Any]]]:
    """{cell: [figure, ...]} from a bench.json beside the report; {} when there is none or it is
    not one (the figures are an extra, never a reason to fail)."""
    try:
        doc = json.loads(bounded.read_regular(path, MAX_REPORT))
        cells = doc["cells"] if isinstance(doc, dict) and isinstance(doc.get("cells"), list) else []
        return {c["cell"]: [f for f in c.get("figures", []) if isinstance(f, dict)]
                for c in cells if isinstance(c, dict) and isinstance(c.get("cell"), str)
                and isinstance(c.get("figures", []), list)}
    except (bounded.InputError, ValueError):
        return {}


# --------------------------------------------------------------------------- the page's data

@dataclass(frozen=True)
class Tile:
    """One cell in the grid."""
    cell: str
    anchor: str
    label: str  # "openblas · pip" (and the variant)
    verdict: str  # pass | fail | none (not built, skipped, interrupted)
    status: str
    failing: list[str]  # "hpc: torch.compile"


@dataclass(frozen=True)
class Bar:
    name: str
    text: str  # "1 thread: 78.4 GFLOP/s -> image threads (2): 86.5 GFLOP/s"
    speedup: float
    width: int  # percent of the widest bar of the image


@dataclass
class Image:
    """One cell's entry below the grid."""
    tile: Tile
    pull_tags: list[str] = field(default_factory=list)
    pull_digests: list[str] = field(default_factory=list)
    inside: list[tuple[str, str]] = field(default_factory=list)
    launches: dict[str, str] = field(default_factory=dict)
    launch_lines: list[tuple[str, str]] = field(default_factory=list)
    bars: list[Bar] = field(default_factory=list)
    failed_checks: list[Check] = field(default_factory=list)


def _anchor(cell: str) -> str:
    return "cell-" + re.sub(r"[^A-Za-z0-9_.-]", "-", cell)[:200]


def _verdict(r: CellReport) -> str:
    if r.status in ("build-failed", "check-failed") or r.publish == "publish-failed":
        return "fail"
    return "pass" if r.status == "passed" else "none"


def _tile(r: CellReport) -> Tile:
    m = _CELL_ID.fullmatch(r.cell)
    label = " · ".join(m["rest"].split("-")) if m else r.cell
    failing = [f"{c.mode}: {c.name}" if c.mode else c.name for c in r.checks if c.verdict == "fail"]
    if r.status == "build-failed":
        failing.insert(0, "build: " + (r.failed_step or r.error or "failed"))
    return Tile(r.cell, _anchor(r.cell), label, _verdict(r), r.status, failing)


def grid(reports: list[CellReport]) -> tuple[list[str], list[str], dict[tuple[str, str], list[Tile]]]:
    """(Python rows, accelerator columns, {(python, accel): tiles}); a cell whose id is not
    `py{python}-{cpu|cu{cuda}}-...` goes to the row and column "other"."""
    cells: dict[tuple[str, str], list[Tile]] = {}
    for r in reports:
        m = _CELL_ID.fullmatch(r.cell)
        key = (m["python"], "CPU" if m["accel"] == "cpu" else "CUDA " + m["accel"][2:]) if m else ("other", "other")
        cells.setdefault(key, []).append(_tile(r))

    def order(v: str) -> tuple[int, list[int]]:
        nums = re.findall(r"\d+", v)
        return (2 if v == "other" else 0 if v == "CPU" or nums else 1, [int(n) for n in nums])
    return (sorted({k[0] for k in cells}, key=order), sorted({k[1] for k in cells}, key=order), cells)


def pulls(r: CellReport) -> tuple[list[str], list[str]]:
    """(docker pull by tag, for each pushed tag; docker pull by digest, once per digest). A digest
    line only for a well-formed reference and a `sha256:<64 hex>` digest."""
    by_tag, by_digest = [], []
    for p in r.pushed:
        ref, digest = str(p.get("ref", "")), str(p.get("digest", ""))
        by_tag.append(f"docker pull {ref}")
        parsed = refs.parse(ref)
        if parsed and not parsed.digest and _DIGEST.fullmatch(digest):
            by_digest.append(f"docker pull {parsed.repository}@{digest}")
    return by_tag, list(dict.fromkeys(by_digest))


def _inside(r: CellReport) -> list[tuple[str, str]]:
    """What the probe saw in the image (its `docker` mode, else the first mode judged)."""
    seen: dict[str, str] = {}
    for c in r.checks:
        if c.name not in seen or c.mode == "docker":
            seen[c.name] = c.actual
    facts = [(label, seen[name]) for label, name in _INSIDE if name in seen]
    more = (("probed", f"emulated: {r.emulated}" if r.emulated else ""), ("base image", r.base_image),
            ("built with", r.builder))
    return facts + [(label, value) for label, value in more if value] + size_facts(r.sizes)


def _launch_ref(r: CellReport) -> tuple[str, str]:
    """(the release tag, tag@digest) to launch: the pushed entry of the first release tag, else
    the last pushed entry; ("", "") when nothing was pushed."""
    chosen = next((p for p in r.pushed if r.tags and p.get("ref") == r.tags[0]), r.pushed[-1] if r.pushed else None)
    if not chosen:
        return "", ""
    ref, digest = str(chosen["ref"]), str(chosen["digest"])
    parsed = refs.parse(ref)
    pinned = f"{parsed.repository}@{digest}" if parsed and _DIGEST.fullmatch(digest) else ref
    return ref, pinned


def launch_lines(r: CellReport) -> list[tuple[str, str]]:
    """(launcher, the line to run) with this image filled in, pinned by digest where the launcher
    takes one (pyxis/enroot take `REGISTRY#IMAGE:TAG`)."""
    tag, pinned = _launch_ref(r)
    parsed = refs.parse(tag)
    if not parsed:
        return []
    gpu = not r.cell.split("-")[1:2] == ["cpu"]
    pyxis = (f"{parsed.domain}#" if parsed.domain else "") + parsed.path + (f":{parsed.tag}" if parsed.tag else "")
    pod = "\n".join([
        "apiVersion: v1", "kind: Pod", "metadata: {name: train}", "spec:",
        "  securityContext: {runAsUser: 4242, runAsGroup: 4242}", "  containers:", "    - name: train",
        f"      image: {pinned}", '      command: ["python", "train.py"]',
        "      resources: {limits: {cpu: \"8\", memory: 32Gi" + (", nvidia.com/gpu: 1" if gpu else "") + "}}",
        "      securityContext: {readOnlyRootFilesystem: true}",
        "      volumeMounts: [{name: dshm, mountPath: /dev/shm}, {name: tmp, mountPath: /tmp}]",
        "  volumes:", "    - {name: dshm, emptyDir: {medium: Memory, sizeLimit: 8Gi}}", "    - {name: tmp, emptyDir: {}}"])
    return [
        ("Docker", f"docker run --rm --ipc=host{' --gpus all' if gpu else ''} {pinned} python train.py"),
        ("Kubernetes", pod),
        ("Slurm + pyxis/enroot", f"srun{' --gpus-per-task=1' if gpu else ''} --container-image={pyxis} python train.py"),
        ("Apptainer / Singularity", f"apptainer exec{' --nv' if gpu else ''} docker://{pinned} python train.py"),
        ("Charliecloud", f"docker pull {pinned} && ch-convert -i docker {pinned} /var/tmp/train"
                         " && ch-run /var/tmp/train -- python train.py"),
    ]


def _side(side: Any, unit: str) -> str:
    if not isinstance(side, dict):
        return "?"
    value = side.get("value")
    shown = f"{value:.4g}" if isinstance(value, (int, float)) and not isinstance(value, bool) else "?"
    return f"{side.get('label', '?')}: {shown} {unit}"


def bars(figures: list[dict[str, Any]]) -> list[Bar]:
    """The bench figures that were measured, as bars scaled to the image's largest speedup."""
    ok = [f for f in figures if f.get("status") == "ok" and isinstance(f.get("speedup"), (int, float))
          and not isinstance(f.get("speedup"), bool) and 0 < f["speedup"] < 1e6]
    top = max((float(f["speedup"]) for f in ok), default=1.0)
    return [Bar(str(f.get("name", "?")) + ("" if f.get("container") in (None, "default") else f" [{f['container']}]"),
                f"{_side(f.get('baseline'), str(f.get('unit', '')))} → {_side(f.get('candidate'), str(f.get('unit', '')))}",
                float(f["speedup"]), max(1, round(100 * float(f["speedup"]) / top))) for f in ok]


def image(r: CellReport, figures: list[dict[str, Any]]) -> Image:
    by_tag, by_digest = pulls(r)
    return Image(tile=_tile(r), pull_tags=by_tag, pull_digests=by_digest, inside=_inside(r), launches=r.launches,
                 launch_lines=launch_lines(r), bars=bars(figures),
                 failed_checks=[c for c in r.checks if c.verdict == "fail"])


# --------------------------------------------------------------------------- the page

def render(reports: list[CellReport], bench: dict[str, list[dict[str, Any]]] | None = None,
           *, title: str = "imagefactory image catalogue") -> str:
    rows, columns, cells = grid(reports)
    images = [image(r, (bench or {}).get(r.cell, [])) for r in reports]
    values = {"title": title, "rows": rows, "columns": columns, "cells": cells, "images": images,
              "counts": {v: sum(1 for i in images if i.tile.verdict == v) for v in ("pass", "fail", "none")}}

    def make() -> str:
        import jinja2  # only for a page not kept from an earlier run (rendered.py)

        env = jinja2.Environment(loader=jinja2.FileSystemLoader(_TEMPLATES), autoescape=True,
                                 undefined=jinja2.StrictUndefined, keep_trailing_newline=True)
        return env.get_template("catalog.html.j2").render(values)

    return rendered.text("catalog.html.j2", values, make, templates=_TEMPLATES, code=(__name__,))


def write(reports: list[CellReport], report_path: Path) -> Path:
    """report.html beside report.json, with bench.json's figures when one lies beside it too."""
    out = Path(report_path).with_suffix(".html")
    fsutil.atomic_write(out, render(reports, read_bench(Path(report_path).with_name("bench.json"))))
    return out
