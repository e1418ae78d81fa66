"""issue: images that train fast -- torch.compile works, bytecode is kept, activation is in
effect without `conda activate`, MKL's layer matches the loaded OpenMP runtime -- and
`threads: auto`, on real images built here (pip route); and what the image leaves out to stay
small (apt's cache, docs, torch's test programs) without losing what those need.

The cells built here differ from the shared cpu_build's good cell only in their runtime
section (threads: auto) or in the compiler layer, so their heavy layers come from the cache.
"""

from __future__ import annotations

import json
import time
from dataclasses import replace
from pathlib import Path

import docker
import pytest

from imagefactory.probe import checks
from imagefactory.config import matrix
from imagefactory.probe import smoke
from tests.integration.helpers import (FIXTURES, ONE_MODE, RUN_ID, TEST_REGISTRY, Build, judged, matrix_text,
                                       run_cli)

pytestmark = pytest.mark.docker


def failing(result: smoke.SmokeResult) -> dict[str, str]:
    return {c.name: f"{c.actual} -- {c.detail}" for c in result.checks if c.verdict == "fail"}


def by_name(result: smoke.SmokeResult) -> dict:
    return {c.name: c for c in result.checks}


def build_variant(root: Path, text: str, created_images: list[str]) -> tuple[dict, Path]:
    """`imagefactory build` of a one-cell matrix; (the cell's report, the matrix path)."""
    path = root / "matrix.yaml"
    path.write_text(text)
    report = root / "report.json"
    result = run_cli("build", "--matrix", str(path), "--plain", "--report", str(report), "--work-dir", str(root / "w"))
    cell = json.loads(report.read_text())["cells"][0]
    if cell["candidate"]:
        created_images.append(cell["candidate"])
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return cell, path


@pytest.fixture(scope="module")
def no_compiler(tmp_path_factory, cpu_build, wheelhouse, session_id, created_images):
    text = matrix_text(image=f"{TEST_REGISTRY}/it-{session_id}/nocc", wheelhouse=wheelhouse) + "compiler: false\n"
    cell, path = build_variant(tmp_path_factory.mktemp("no-compiler"), text, created_images)
    return cell, matrix.load(path).cells[0]


def good(cpu_build: Build) -> tuple:
    return matrix.load(cpu_build.matrix).cell(Build.GOOD), cpu_build.first_report[Build.GOOD]["candidate"]


# -- torch.compile -------------------------------------------------------------------------

def test_torch_compile_runs_and_matches_eager_in_a_built_image(cpu_build):
    checks = {c["name"]: c for c in cpu_build.first_report[Build.GOOD]["checks"]}
    assert checks["torch.compile"]["verdict"] == "pass", checks["torch.compile"]
    assert checks["torch.compile"]["actual"].startswith("matches eager on cpu in ")


def test_torch_compile_fails_where_the_compiler_was_removed(engine, cpu_build, derive):
    cell, image = good(cpu_build)
    result = smoke.test_image(engine, cell, derive("no-compiler", image), gpus=False, modes=ONE_MODE)
    assert set(failing(result)) == {"torch.compile"}, failing(result)
    assert "compiler" in failing(result)["torch.compile"].lower()


def test_compiler_false_image_fails_the_check_when_judged_as_a_compiler_cell(engine, cpu_build, no_compiler):
    report, declared = no_compiler
    own = {c["name"]: c for c in report["checks"]}
    assert report["status"] == "passed" and own["torch.compile"]["verdict"] == "skip"
    assert "compiler: false" in own["torch.compile"]["expected"]
    cell, _ = good(cpu_build)
    assert declared == replace(cell, compiler=False, tags=declared.tags)
    result = smoke.test_image(engine, cell, report["candidate"], gpus=False, modes=ONE_MODE)
    assert set(failing(result)) == {"torch.compile"}, failing(result)


# -- image size (README, "Image size") -----------------------------------------------------

SIZE_SCRIPT = r"""
t=/opt/venv/lib/python3.11/site-packages/torch
echo "apt-cache: $(ls /var/cache/apt/archives/*.deb /var/cache/apt/*.bin 2>/dev/null | wc -l)"
echo "apt-lists: $(find /var/lib/apt/lists -type f ! -name lock | wc -l)"
echo "docs: $(find /usr/share/doc/libc6-dev /usr/share/doc/binutils -type f ! -name copyright | wc -l)"
echo "copyright: $(ls /usr/share/doc/libc6-dev/copyright /usr/share/doc/binutils/copyright | wc -l)"
echo "man: $(find /usr/share/man \( -name 'g++*' -o -name 'as.1*' -o -name 'ld.1*' \) | wc -l)"
echo "locale: $(find /usr/share/locale \( -name 'gcc*.mo' -o -name 'cpp*.mo' -o -name 'ld.mo' \) | wc -l)"
echo "static-libpython: $(find / -xdev -name 'libpython3*.a' | wc -l)"
echo "lto-dump: $(ls /usr/bin/*lto-dump* 2>/dev/null | wc -l)"
echo "cc1plus: $(test -x "$(g++ -print-prog-name=cc1plus)" && echo yes)"
echo "python-h: $(test -e "$(python3.11 -c 'import sysconfig; print(sysconfig.get_paths()["include"])')/Python.h" && echo yes)"
echo "torch-test: $(test -e $t/test && echo present)"
echo "torch-bin: $(ls $t/bin | tr '\n' ' ')"
echo "pip-check: $(pip check 2>&1 | tr '\n' ' ')"
pip uninstall -y -q torch >/dev/null 2>&1 && echo "uninstall: ok"
echo "after-uninstall: $(python -c 'import torch' 2>&1 | tail -n 1) $(ls -d /opt/venv/lib/python3.11/site-packages/torch-* 2>/dev/null | wc -l)"
"""


def test_image_leaves_out_apt_cache_docs_static_libpython_and_torch_test_programs(engine, cpu_build):
    """What the toolchain and venv layers leave out, what must stay (the compiler, Python.h,
    torch_shm_manager), and that pip still manages torch. As root, in a throwaway container."""
    _, image = good(cpu_build)
    out = engine.client.containers.run(image, ["bash", "-c", SIZE_SCRIPT], user="0", network_mode="none",
                                       remove=True).decode()
    got = dict(line.split(": ", 1) for line in out.strip().splitlines())
    assert got == {
        "apt-cache": "0", "apt-lists": "0", "docs": "0", "copyright": "2", "man": "0", "locale": "0",
        "static-libpython": "0", "lto-dump": "0", "cc1plus": "yes", "python-h": "yes",
        "torch-test": "", "torch-bin": "torch_shm_manager ",
        "pip-check": "No broken requirements found. ",
        "uninstall": "ok", "after-uninstall": "ModuleNotFoundError: No module named 'torch' 0",
    }, out


# -- bytecode ------------------------------------------------------------------------------

def test_bytecode_is_present_and_an_import_compiles_nothing(engine, cpu_build):
    cell, image = good(cpu_build)
    checks = {c["name"]: c for c in cpu_build.first_report[Build.GOOD]["checks"]}
    assert checks["python.bytecode"]["verdict"] == "pass", checks["python.bytecode"]
    # As root, who could write bytecode anywhere: importing torch and numpy writes none.
    script = ("touch /tmp/mark && sleep 1.1 && python -c 'import torch, numpy' "
              "&& find / -xdev \\( -name '*.pyc' -o -name __pycache__ \\) -newer /tmp/mark -print")
    out = engine.client.containers.run(image, ["bash", "-c", script], user="0", network_mode="none", remove=True)
    assert out.decode().strip() == ""


# -- activation ----------------------------------------------------------------------------

def test_activation_scripts_take_effect_without_conda_activate(engine, cpu_build, derive, created_images):
    """An image derived from a cell's image that adds an activate.d script: every `docker run`
    gets it through the entrypoint. Launched without the entrypoint (bare, hpc), only what was
    captured applies, and this image did not run `python -m imagefactory_launch capture` again:
    the activation check names the gap in those modes and only there. The same image with the
    capture run again passes every mode."""
    cell, image = good(cpu_build)
    activated = derive("activation", image)
    for command in (["python", "-c", "import os; print(os.environ['MKL_INTERFACE_LAYER'])"],
                    ["printenv", "MKL_INTERFACE_LAYER"],  # without a shell, too
                    ["bash", "-c", "echo $MKL_INTERFACE_LAYER"]):
        out = engine.client.containers.run(activated, command, network_mode="none", remove=True)
        assert out.decode().strip() == "LP64,GNU", command
    result = smoke.test_image(engine, judged(cell), activated, gpus=False)
    assert checks.launches(result.checks) == {"docker": "pass", "bare": "fail", "hpc": "fail"}, failing(result)
    failed = {(c.mode, c.name) for c in result.checks if c.verdict == "fail"}
    assert failed == {("bare", "env.activation"), ("hpc", "env.activation")}, failed
    docker = [c for c in result.checks if c.mode == "docker" and c.name == "env.activation"]
    assert [c.verdict for c in docker] == ["pass"]
    captured = f"imagefactory-test/activation-captured:{RUN_ID}-modes"
    engine.client.images.build(path=str(FIXTURES / "activation"), dockerfile="captured.Dockerfile", tag=captured,
                               rm=True, network_mode="none", buildargs={"BASE": image})
    created_images.append(captured)
    result = smoke.test_image(engine, judged(cell), captured, gpus=False)
    assert result.passed, failing(result)
    assert {c.mode for c in result.checks if c.name == "env.activation" and c.verdict == "pass"} == set(smoke.DEFAULT_MODES)


def test_missing_activation_variable_is_caught_and_named(engine, cpu_build, derive):
    cell, image = good(cpu_build)
    bare = derive("no-entrypoint", derive("activation", image))
    result = smoke.test_image(engine, judged(cell), bare, gpus=False, modes=ONE_MODE)
    assert set(failing(result)) == {"env.activation"}, failing(result)
    text = failing(result)["env.activation"]
    assert "MKL_INTERFACE_LAYER" in text and "IMAGEFACTORY_TEST_ACTIVATED" in text


def test_entrypoint_passes_exit_codes_and_signals(engine, cpu_build):
    _, image = good(cpu_build)
    container = engine.client.containers.run(image, ["python", "-c", "import sys; sys.exit(7)"], detach=True,
                                             network_mode="none")
    try:
        assert container.wait(timeout=60)["StatusCode"] == 7
    finally:
        container.remove(force=True)
    code = ("import signal, sys, time\n"
            "signal.signal(signal.SIGTERM, lambda *a: sys.exit(42))\n"
            "print('ready', flush=True)\n"
            "time.sleep(120)\n")
    container = engine.client.containers.run(image, ["python", "-c", code], detach=True, network_mode="none")
    try:
        deadline = time.monotonic() + 60
        while b"ready" not in container.logs() and time.monotonic() < deadline:
            time.sleep(0.2)
        started = time.monotonic()
        container.stop(timeout=20)  # SIGTERM, then SIGKILL after 20 s
        assert container.wait(timeout=30)["StatusCode"] == 42  # the handler ran: SIGTERM reached python
        assert time.monotonic() - started < 10
    finally:
        container.remove(force=True)


# -- MKL threading layer -------------------------------------------------------------------

def test_wrong_mkl_layer_beside_libgomp_is_caught(engine, cpu_build, mkl_numpy, derive):
    cell, _ = good(cpu_build)
    mkl_cell = replace(cell, blas="mkl")
    base = mkl_numpy
    right = smoke.test_image(engine, mkl_cell, base, gpus=False, modes=ONE_MODE)
    layer = by_name(right)["mkl.threading_layer"]
    assert layer.verdict == "pass" and layer.actual.startswith("gnu (threadpoolctl)"), layer
    wrong = smoke.test_image(engine, mkl_cell, derive("mkl-layer", base, LAYER="SEQUENTIAL"), gpus=False, modes=ONE_MODE)
    layer = by_name(wrong)["mkl.threading_layer"]
    assert layer.verdict == "fail" and "sequential" in layer.actual and "libgomp" in layer.detail, layer
    assert "MKL_THREADING_LAYER=GNU" in layer.detail


def test_pip_image_judged_as_mkl_cell_fails_the_layer_check(engine, cpu_build):
    cell, image = good(cpu_build)  # PyPI torch runs libgomp; nothing asks MKL for GNU's layer here
    result = smoke.test_image(engine, replace(judged(cell), blas="mkl"), image, gpus=False, modes=ONE_MODE)
    assert by_name(result)["mkl.threading_layer"].verdict == "fail"


def test_complex_blas_and_import_time_are_reported(cpu_build):
    checks = {c["name"]: c for c in cpu_build.first_report[Build.GOOD]["checks"]}
    for name in ("numpy.complex_blas", "torch.complex_blas", "openmp.single_runtime"):
        assert checks[name]["verdict"] == "pass", checks[name]
    assert checks["probe.import_time"]["verdict"] == "info"
    assert float(checks["probe.import_time"]["actual"].split()[0]) > 0


# -- threads: auto -------------------------------------------------------------------------

THREADS = "import os; print(*(os.environ.get(v) for v in ('OMP_NUM_THREADS', 'MKL_NUM_THREADS', 'OPENBLAS_NUM_THREADS')))"


def run_threads(engine, image: str, **kwargs) -> str:
    return engine.client.containers.run(image, ["python", "-c", THREADS], network_mode="none", remove=True,
                                        **kwargs).decode().strip()


def test_threads_auto_passes_its_checks(threads_auto):
    checks = {c["name"]: c for c in threads_auto["checks"]}
    assert threads_auto["status"] == "passed"
    assert checks["env.OMP_NUM_THREADS"]["verdict"] == "pass"


@pytest.mark.parametrize("limits, want", [
    ({"nano_cpus": 10**9}, "1"),                   # --cpus 1
    ({"nano_cpus": 15 * 10**8}, "1"),              # --cpus 1.5: rounded down, never oversubscribed
    ({"cpuset_cpus": "0"}, "1"),                   # --cpuset-cpus 0
])
def test_threads_auto_fits_the_container(engine, threads_auto, limits, want):
    assert run_threads(engine, threads_auto["candidate"], **limits) == f"{want} {want} {want}"


def test_threads_auto_without_limits_uses_the_visible_cpus(engine, threads_auto):
    visible = engine.client.containers.run(threads_auto["candidate"], ["nproc"], network_mode="none",
                                           remove=True, entrypoint=[]).decode().strip()
    assert run_threads(engine, threads_auto["candidate"]) == f"{visible} {visible} {visible}"


def test_a_value_the_user_sets_wins(engine, threads_auto, cpu_build):
    image = threads_auto["candidate"]
    assert run_threads(engine, image, environment={"OMP_NUM_THREADS": "3"}, nano_cpus=10**9) == "3 3 3"
    assert run_threads(engine, image, environment={"MKL_NUM_THREADS": "5"}) == "5 5 5"
    # an integer `threads:` is baked and not recomputed
    _, baked = good(cpu_build)
    assert run_threads(engine, baked, nano_cpus=10**9) == "2 2 2"


def test_threads_auto_passes_signals_through(engine, threads_auto):
    code = ("import signal, sys, time\n"
            "signal.signal(signal.SIGTERM, lambda *a: sys.exit(43))\n"
            "print('ready', flush=True)\n"
            "time.sleep(120)\n")
    container = engine.client.containers.run(threads_auto["candidate"], ["python", "-c", code], detach=True,
                                             network_mode="none", nano_cpus=10**9)
    try:
        deadline = time.monotonic() + 60
        while b"ready" not in container.logs() and time.monotonic() < deadline:
            time.sleep(0.2)
        container.stop(timeout=20)
        assert container.wait(timeout=30)["StatusCode"] == 43
    finally:
        try:
            container.remove(force=True)
        except docker.errors.APIError:
            pass
