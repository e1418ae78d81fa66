"""publish/budget.py and the budget in publish: a cell over its size_budget is not pushed, and says
which layers are largest and what made them; within it, or without one, nothing changes."""

from __future__ import annotations

import io

from imagefactory.config import matrix
from imagefactory.engine.api import EngineInfo
from imagefactory.engine.layer_sizes import Layer, Measured
from imagefactory.pipeline.progress import Plain
from imagefactory.publish import budget
from imagefactory.publish import push
from imagefactory.run.results import NOT_PUBLISHED, PASSED, PUBLISHED, CellReport
from imagefactory.run.context import PushOptions, RunContext
from tests.fake_engine import Image, World
from tests.unit.helpers import ONE_PIP_CELL

MATRIX = "\n" + ONE_PIP_CELL.replace("  installer: [pip]\n", """  installer: [pip]
  variant: [small, big]
  include:
    - {variant: big, size_budget: 2kB}
""") + "size_budget: 1000\n"

IMAGE = Measured((Layer(600, "sha256:" + "1" * 64, "sha256:" + "11" * 32, step="FROM base"),
                  Layer(900, "sha256:" + "2" * 64, "sha256:" + "22" * 32, step="COPY /opt/venv /opt/venv # buildkit"),
                  Layer(30, "sha256:" + "3" * 64, "sha256:" + "33" * 32, step="COPY launch.conf /etc/launch.conf # buildkit"),
                  Layer(10, "sha256:" + "4" * 64, "sha256:" + "44" * 32, step="")))


def test_within_budget_is_no_refusal_and_the_verdict_says_how_it_was_measured():
    assert budget.refusal(IMAGE, 1540) is None  # the budget itself is allowed
    verdict = budget.verdict(IMAGE, 1540)
    assert (verdict["measured"], verdict["over"], verdict["how"]) == (1540, False, "exact")
    estimated = Measured((Layer(5, "sha256:" + "5" * 64, estimated=True),))
    assert budget.verdict(estimated, 1)["how"] == "estimated"


def test_over_budget_names_the_largest_layers_their_sizes_and_steps_largest_first():
    why = budget.refusal(IMAGE, 1539)
    assert why is not None and "\n" not in why
    assert why.startswith("not published: 1.54 kB compressed is over its size_budget of 1.54 kB by 1 B")
    assert why.index("900 B (COPY /opt/venv /opt/venv)") < why.index("600 B (FROM base)") < why.index("30 B")
    assert "10 B" not in why  # three layers named, not every one
    assert "# buildkit" not in why
    assert "estimated" in budget.refusal(Measured((Layer(5, "", estimated=True),)), 1)


def test_a_settled_run_step_is_named_without_its_stamp_and_an_apt_step_by_what_it_installs():
    sh, stamp = "/bin/bash -o pipefail -c ", "touch /tmp/imagefactory-stamp && sleep 0.02  && "
    image = Measured((Layer(900, "sha256:" + "2" * 64, step=sh + stamp + "printf '%s\\n' 'path-exclude=/usr/share/doc/*' "
                            "> /etc/dpkg/dpkg.cfg.d/x  && apt-get update  && apt-get install -y --no-install-recommends "
                            "g++ python3-dev libgomp1  && apt-get clean"),
                      Layer(800, "sha256:" + "5" * 64, step=sh + stamp + "useradd --create-home trainer  && find /"),
                      Layer(700, "sha256:" + "6" * 64, step=sh + "touch /tmp/other  && true"),
                      Layer(600, "sha256:" + "7" * 64, step="RUN " + sh + stamp + "update-ca-certificates  && find /"),
                      Layer(500, "sha256:" + "8" * 64, step=sh + "touch /tmp/imagefactory-stamp  && echo before")))
    why = budget.refusal(image, 1)
    assert why is not None and "imagefactory-stamp" not in why and "sleep" not in why
    assert "500 B (echo before)" in budget.refusal(Measured(image.layers[3:]), 1)  # an image of the stamp without its pause
    assert "900 B (apt-get install g++ python3-dev libgomp1)" in why
    assert "800 B (useradd --create-home trainer && find /)" in why
    assert "700 B (touch /tmp/other && true)" in why  # only the stamp is left out
    assert "600 B (update-ca-certificates && find /)" in budget.refusal(Measured(image.layers[1:]), 1)  # BuildKit's


def test_over_budget_names_the_packages_of_an_environment_layer_rather_than_its_step():
    many = tuple(f"pkg{n}==1.0" for n in range(14))
    image = Measured((Layer(900, "sha256:" + "2" * 64, step="COPY --from=venv /imagefactory-layers/3-torch/ /",
                            packages=("filelock==3.20.0", "torch==2.13.0")),
                      Layer(800, "sha256:" + "5" * 64, step="COPY --from=venv /imagefactory-layers/5-packages/ /",
                            packages=many),
                      Layer(600, "sha256:" + "1" * 64, step="FROM base")))
    why = budget.refusal(image, 1)
    assert why is not None and "900 B (filelock==3.20.0, torch==2.13.0)" in why and "3-torch" not in why
    assert "pkg11==1.0 and 2 more)" in why and "pkg12" not in why  # 12 named, the rest counted
    assert "600 B (FROM base)" in why  # a layer without a list: its step
    assert budget.verdict(image, 1)["largest"][0]["packages"] == ["filelock==3.20.0", "torch==2.13.0"]


def _run(write_matrix, layers: Measured, *, atomic: bool = False, base_image: str = "",
         **world_args) -> tuple[World, list[CellReport], str]:
    m = matrix.load(write_matrix(MATRIX))
    world = World(**world_args)
    reports = []
    for n, cell in enumerate(m.cells):
        world.images[f"img{n}"] = Image(f"img{n}", {}, cell=cell.id)
        world.layers[f"img{n}"] = layers
        reports.append(CellReport(cell=cell.id, status=PASSED, content_hash=f"{n:02x}" * 32, image_id=f"img{n}",
                                  base_image=base_image))
    out = io.StringIO()
    options = PushOptions(backoff=0, atomic=atomic)
    push.publish(m, reports, RunContext(options, Plain(out), world.interrupt, world.engine))
    return world, reports, out.getvalue()


def test_a_cell_over_its_budget_is_not_pushed_and_one_within_its_own_is(write_matrix):
    world, (small, big), out = _run(write_matrix, IMAGE)
    assert small.publish == NOT_PUBLISHED and not small.ok  # 1540 > 1000: the file's budget
    assert "over its size_budget of 1 kB" in small.error and "COPY /opt/venv" in small.error
    assert small.sizes["budget"]["over"] is True and small.sizes["budget"]["largest"][0]["size"] == 900
    assert not [ref for ref in world.ops("push") if small.cell in ref or "sha-00" in ref]
    assert small.error in out
    assert big.publish == PUBLISHED  # 1540 <= 2000: its include entry's budget
    assert big.sizes["budget"] == {**budget.verdict(IMAGE, 2000)} and big.sizes["compressed"] == 1540
    assert world.ops("layer_sizes") == ["img0", "img1"]  # measured before pushing, by image id
    assert big.sizes["local"] == small.sizes["local"] == {"compressed": 1540, "how": "exact"}  # the local image's too


def test_the_local_size_with_its_measured_compressed_size_is_shown():
    from imagefactory.run.results import size_facts

    facts = dict(size_facts({"local": {"size": 4_100_000_000, "compressed": 1_540_000_000, "how": "estimated"}}))
    assert facts["image size"] == "4.1 GB in the engine's store, 1.54 GB compressed (estimated)"
    assert dict(size_facts({"local": {"size": 4_100_000_000}}))["image size"] == "4.1 GB in the engine's store"
    assert size_facts({"local": {"size": "4 GB"}}) == [] and size_facts({"local": 7}) == []


BASE = "python:3.11-slim-bookworm@sha256:" + "b" * 64
DEBIAN, PYTHON = "sha256:" + "a1" * 32, "sha256:" + "a2" * 32  # the base's own layers
WITH_BASE = Measured((Layer(72_200_000, DEBIAN, "sha256:" + "c1" * 32, step=""),
                      Layer(900, PYTHON, "sha256:" + "c2" * 32, step="/bin/sh -c set -eux; make install"),
                      Layer(50_000_000, "sha256:" + "a3" * 32, "sha256:" + "c3" * 32, step=""),
                      Layer(800, "sha256:" + "a4" * 32, "sha256:" + "c4" * 32, step="COPY launch.conf /etc/ # buildkit")))


def test_the_base_images_own_layers_are_named_by_the_base_in_the_message_and_the_report(write_matrix):
    """The leading layers that are the local base's (its diff ids) are named by its reference, not
    "step not recorded"; a layer after them that records no step still says so."""
    world, (small, _), _ = _run(write_matrix, WITH_BASE, base_image=BASE, base_layers={BASE: (DEBIAN, PYTHON)})
    assert "72.2 MB (base image python:3.11-slim-bookworm)" in small.error
    assert "900 B (base image python:3.11-slim-bookworm)" in small.error
    assert "50 MB (step not recorded)" in small.error and small.error.count("step not recorded") == 1
    largest = small.sizes["budget"]["largest"]
    assert [(x["size"], x["base"]) for x in largest] == [(72_200_000, BASE), (50_000_000, None), (900, BASE)]
    assert BASE in world.ops("local_image")


def test_a_base_that_is_not_here_or_shares_no_layer_names_no_layer_by_it(write_matrix):
    for base_layers in ({}, {BASE: ("sha256:" + "ff" * 32, PYTHON)}):
        _, (small, _), _ = _run(write_matrix, WITH_BASE, base_image=BASE, base_layers=base_layers)
        assert "base image" not in small.error and "72.2 MB (step not recorded)" in small.error
        assert all(x["base"] is None for x in small.sizes["budget"]["largest"])
    assert budget.base_of(WITH_BASE, BASE, (DEBIAN, "sha256:" + "ff" * 32, PYTHON)) == budget.Base(BASE, 1)
    assert budget.base_of(WITH_BASE, BASE, None) is None


def test_the_budget_matrix_keys_reach_the_cells(write_matrix):
    m = matrix.load(write_matrix(MATRIX))
    assert [c.size_budget for c in m.cells] == [1000, 2000]
    assert matrix.load(write_matrix(MATRIX.replace("size_budget: 1000\n", ""))).cells[0].size_budget is None


def test_zstd_is_refused_before_any_push_where_it_cannot_be_made(write_matrix):
    import pytest
    from imagefactory.errors import ConfigError

    text = MATRIX.replace("size_budget: 1000\n", "compression: zstd\n")
    with pytest.raises(ConfigError, match="--builder buildkit"):
        _run(lambda t: write_matrix(text), IMAGE)
    legacy = EngineInfo("20.10.24", "1.41", ("runc",), (), store="graph-driver")
    with pytest.raises(ConfigError, match="graph-driver store"):
        _run(lambda t: write_matrix(text), IMAGE, builder="buildkit", info=legacy)


def test_estargz_is_refused_like_zstd_and_both_are_named(write_matrix):
    import pytest
    from imagefactory.errors import ConfigError

    text = MATRIX.replace("size_budget: 1000\n", "compression: estargz\n")
    with pytest.raises(ConfigError, match=r"compression estargz \(for registry.example.com\).*cannot write estargz"):
        _run(lambda t: write_matrix(text), IMAGE)
    both = MATRIX.replace("size_budget: 1000\n", "compression: estargz\ntags: {registries: [other.example.net], "
                                                  "compression: {other.example.net: zstd}}\n")
    legacy = EngineInfo("20.10.24", "1.41", ("runc",), (), store="graph-driver")
    with pytest.raises(ConfigError, match=r"compression zstd \(for other.example.net\); compression estargz "
                                          r"\(for registry.example.com\): .*graph-driver store"):
        _run(lambda t: write_matrix(both), IMAGE, builder="buildkit", info=legacy)


def test_zstd_goes_to_its_registry_only_through_the_engines_recompressing_push(write_matrix):
    text = MATRIX.replace("size_budget: 1000\n", "tags: {registries: [other.example.net], compression: "
                                                 "{registry.example.com: zstd}}\n")
    text = text.replace("- {variant: big, size_budget: 2kB}", "- {variant: big}")
    containerd = EngineInfo("26.1.5", "1.45", ("runc",), (), store="containerd")
    world, reports, _ = _run(lambda t: write_matrix(text), IMAGE, builder="buildkit", info=containerd)
    assert all(r.publish == PUBLISHED for r in reports)
    zstd = world.ops("push_compression")
    assert zstd and {how for _, how in zstd} == {"zstd"} and len(zstd) == len(world.ops("push"))


def test_with_atomic_a_cell_over_budget_keeps_every_cell_from_being_pushed(write_matrix):
    world, (small, big), _ = _run(write_matrix, IMAGE, atomic=True)
    assert world.ops("push") == [] and small.publish == big.publish == NOT_PUBLISHED
    assert "over its size_budget" in small.error  # its own reason, not the run's
    assert "--atomic and 1 cell(s) not within their size_budget" in big.error


def test_an_image_that_cannot_be_measured_is_not_pushed_and_fails(write_matrix):
    from imagefactory.run.results import PUBLISH_FAILED

    m = matrix.load(write_matrix(MATRIX))
    world = World()
    report = CellReport(cell=m.cells[0].id, status=PASSED, content_hash="00" * 32, image_id="gone")
    push.publish(m, [report], RunContext(PushOptions(backoff=0), Plain(io.StringIO()), world.interrupt,
                                                world.engine))
    assert report.publish == PUBLISH_FAILED and report.error.startswith("size_budget: cannot measure gone")
    assert world.ops("push") == []


def test_an_interrupt_while_measuring_marks_the_cells_interrupted_and_pushes_nothing(write_matrix):
    from imagefactory.run.results import INTERRUPTED

    def stop(op, arg):
        if op == "layer_sizes":
            world.interrupt.cancel()

    m = matrix.load(write_matrix(MATRIX))
    world = World(on_call=stop)
    reports = []
    for n, cell in enumerate(m.cells):
        world.images[f"img{n}"] = Image(f"img{n}", {}, cell=cell.id)
        reports.append(CellReport(cell=cell.id, status=PASSED, content_hash=f"{n:02x}" * 32, image_id=f"img{n}"))
    push.publish(m, reports, RunContext(PushOptions(backoff=0), Plain(io.StringIO()), world.interrupt,
                                               world.engine))
    assert [r.publish for r in reports] == [INTERRUPTED, INTERRUPTED] and world.ops("push") == []
