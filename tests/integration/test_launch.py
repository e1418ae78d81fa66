"""Images launched the way GPU nodes launch them (README "Running on GPU nodes"): without the
ENTRYPOINT (Kubernetes `command:`, pyxis, `apptainer exec`), as an arbitrary UID on a read-only root,
under only a cpuset or only a CPU quota, and under Charliecloud's ch-run, which applies neither the
ENTRYPOINT nor the image's ENV. Real containers of the session's shared CPU image (cpu_build) and
its `threads: auto` variant (cpu_auto_image: conftest's threads_auto, which test_train_fast judges
too, built in seconds from the same layers).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest

from tests.integration.helpers import Build

pytestmark = [pytest.mark.docker]

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"
HOST_CPUS = len(os.sched_getaffinity(0))

# Threads as a job sees them: the variables, torch's pool, and numpy's BLAS pool (threadpoolctl).
THREADS = r"""
import json, os, sys
import threadpoolctl, numpy
blas = [(e["internal_api"], e["num_threads"]) for e in threadpoolctl.threadpool_info() if e["user_api"] == "blas"]
import torch
print(json.dumps({"env": {k: os.environ.get(k) for k in ("OMP_NUM_THREADS", "MKL_NUM_THREADS",
                  "OPENBLAS_NUM_THREADS", "MKL_INTERFACE_LAYER", "IMAGEFACTORY_TEST_ACTIVATED")},
                  "torch": torch.get_num_threads(), "blas": blas, "prefix": sys.prefix}))
"""


def bare(engine, image: str, code: str = THREADS, **kwargs) -> dict:
    """`python -c code` with the ENTRYPOINT bypassed, as Kubernetes `command:` does."""
    out = engine.client.containers.run(image, ["-c", code], entrypoint="python", network_mode="none",
                                       remove=True, **kwargs)
    return json.loads(out.decode().strip().splitlines()[-1])


def good_image(cpu_build: Build) -> str:
    return cpu_build.first_report[Build.GOOD]["candidate"]


@pytest.mark.parametrize("limit", [{"nano_cpus": 10**9}, {"cpuset_cpus": "0"}], ids=["--cpus 1", "--cpuset-cpus 0"])
def test_bare_python_sizes_threads_to_a_quota_or_a_cpuset(engine, cpu_auto_image, limit):
    _, image = cpu_auto_image
    got = bare(engine, image, **limit)
    assert got["env"]["OMP_NUM_THREADS"] == got["env"]["MKL_NUM_THREADS"] == got["env"]["OPENBLAS_NUM_THREADS"] == "1"
    assert got["torch"] == 1 and got["blas"] == [["openblas", 1]], got
    unlimited = bare(engine, image)  # the same image, no limit: the host's cores (2 on CI), so 1 is not a default
    assert unlimited["env"]["OMP_NUM_THREADS"] == str(HOST_CPUS) and unlimited["torch"] == HOST_CPUS


def test_a_value_the_user_sets_wins_and_a_bad_one_does_not_stop_python(engine, cpu_auto_image):
    _, image = cpu_auto_image
    got = bare(engine, image, nano_cpus=10**9, environment={"OMP_NUM_THREADS": "3"})
    assert got["env"]["OMP_NUM_THREADS"] == got["env"]["MKL_NUM_THREADS"] == "3", got
    got = bare(engine, image, nano_cpus=10**9, environment={"OMP_NUM_THREADS": "abc"})
    assert got["env"]["OMP_NUM_THREADS"] == "abc" and got["env"]["MKL_NUM_THREADS"] == "1", got
    assert got["torch"] == 1


def test_login_shells_and_apptainer_get_the_same_settings(engine, cpu_auto_image):
    _, image = cpu_auto_image
    show = 'printf "%s %s\\n" "$OMP_NUM_THREADS" "$(command -v python)"'  # (output without a newline is lost)
    # A login shell: /etc/profile resets PATH; /etc/profile.d/imagefactory.sh puts the environment back.
    login = engine.client.containers.run(image, ["-lc", show], entrypoint="bash", cpuset_cpus="0",
                                         network_mode="none", remove=True)
    # Apptainer sources /.singularity.d/env/*.sh on every action, from a bare environment here.
    apptainer = engine.client.containers.run(
        image, ["-c", f". /.singularity.d/env/91-imagefactory.sh; {show}"],
        entrypoint=["env", "-i", "PATH=/usr/bin:/bin", "sh"], cpuset_cpus="0", network_mode="none", remove=True)
    assert login.decode() == apptainer.decode() == "1 /opt/venv/bin/python\n", (login, apptainer)


def test_captured_activation_applies_without_the_entrypoint(engine, cpu_build, created_images):
    tag = f"imagefactory-test/activation-captured:{abs(hash(good_image(cpu_build))) % 10**8}"
    engine.client.images.build(path=str(FIXTURES / "activation"), dockerfile="captured.Dockerfile", tag=tag,
                               rm=True, network_mode="none", buildargs={"BASE": good_image(cpu_build)})
    created_images.append(tag)
    got = bare(engine, tag)
    assert got["env"]["MKL_INTERFACE_LAYER"] == "LP64,GNU" and got["env"]["IMAGEFACTORY_TEST_ACTIVATED"] == "yes"
    got = bare(engine, tag, environment={"MKL_INTERFACE_LAYER": "ILP64"})
    assert got["env"]["MKL_INTERFACE_LAYER"] == "ILP64"  # the user's value wins


# Never imports the hook itself (that would run it): only `site` may have.
STATE = "getattr(sys.modules.get('imagefactory_launch'), 'state', {})"
COMPILE = r"""
import json, os, sys, torch
f = torch.compile(lambda x: torch.sin(x) + x * 2)
x = torch.linspace(0, 1, 64)
assert torch.allclose(f(x), torch.sin(x) + x * 2)
print(json.dumps({"cache": os.environ.get("TORCHINDUCTOR_CACHE_DIR"), "place": STATE.get("exec_place")}))
""".replace("STATE", STATE)

HPC = {"user": "4242:4242", "read_only": True, "environment": {"HOME": "/nonexistent"}}


def test_torch_compile_as_an_arbitrary_uid_on_a_read_only_root(engine, cpu_build):
    got = bare(engine, good_image(cpu_build), COMPILE, tmpfs={"/tmp": "exec"}, cpuset_cpus="0", **HPC)
    assert got["place"] == "/tmp", got


def test_compiled_code_goes_where_it_can_run(engine, cpu_build):
    """/tmp mounted noexec (Docker's default tmpfs) but HOME on an exec tmpfs: Inductor's default,
    under /tmp, cannot map its .so; the hook points TORCHINDUCTOR_CACHE_DIR at HOME."""
    image = good_image(cpu_build)
    got = bare(engine, image, COMPILE, tmpfs={"/tmp": "", "/scratch": "exec,mode=1777"}, cpuset_cpus="0",
               **{**HPC, "environment": {"HOME": "/scratch"}})
    assert got["cache"] == "/scratch/torchinductor_uid4242" and got["place"] == "/scratch", got
    # The hook says so when there is no such place (the probe names the fix: --tmpfs /tmp:exec).
    code = f"import json, sys; print(json.dumps({STATE}))"
    got = bare(engine, image, code, tmpfs={"/tmp": ""}, **HPC)
    assert got["exec_place"] is None and got["error"] is None, got


@pytest.fixture(scope="module")
def charliecloud_dir(engine, cpu_auto_image, tmp_path_factory):
    """The threads: auto image as a Charliecloud image folder, removed afterwards: its filesystem
    as `docker export` writes it, unpacked by `ch-convert -i tar`. (`ch-convert -i docker` gives
    the same tree plus /ch/environment, the ENV that only `ch-run --set-env` reads, but goes
    through a compressed archive of every layer: about 60 s here against 8.)"""
    for tool in ("ch-convert", "ch-run", "taskset"):
        if shutil.which(tool) is None:
            if os.environ.get("CI"):
                pytest.fail(f"{tool} is missing (scripts/ci-setup.sh installs charliecloud)")
            pytest.skip(f"{tool} is missing; run `sudo bash scripts/ci-setup.sh` first")
    _, image = cpu_auto_image
    root = tmp_path_factory.mktemp("charliecloud")
    target, archive = root / "image", root / "image.tar"
    # ch-run shares the host's /tmp, and the image's HOME is not there: the launch hook puts its
    # cache folders (torch_uid0, triton_uid0) in the host's /tmp, as it would for a user. They are
    # this module's to remove (the run's leak check named them).
    caches_before = set(Path("/tmp").glob("*_uid*"))
    try:
        container = engine.client.containers.create(image, ["true"], network_mode="none")
        try:
            with archive.open("wb") as out:
                for chunk in container.export(chunk_size=4 << 20):
                    out.write(chunk)
        finally:
            container.remove(force=True)
        subprocess.run(["ch-convert", "-i", "tar", str(archive), str(target)], check=True, capture_output=True,
                       timeout=900, env={**os.environ, "USER": os.environ.get("USER") or "root"})
        archive.unlink()
        yield target
    finally:
        shutil.rmtree(root, ignore_errors=True)
        for made in set(Path("/tmp").glob("*_uid*")) - caches_before:
            shutil.rmtree(made, ignore_errors=True)


@pytest.mark.slow
def test_ch_run_without_set_env_behaves_as_docker(engine, cpu_auto_image, charliecloud_dir):
    """Plain `ch-run DIR -- python` (no --set-env: the host's PATH, none of the image's ENV), pinned
    to one CPU: the environment's interpreter runs, with the threads and BLAS `docker run` gives."""
    _, image = cpu_auto_image
    env = {"PATH": "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin", "USER": "root", "HOME": "/root"}
    r = subprocess.run(["taskset", "-c", "0", "ch-run", str(charliecloud_dir), "--", "python", "-c", THREADS],
                       env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    ch = json.loads(r.stdout.strip().splitlines()[-1])
    docker_run = json.loads(engine.client.containers.run(image, ["python", "-c", THREADS], cpuset_cpus="0",
                                                         network_mode="none", remove=True).decode().splitlines()[-1])
    assert ch == docker_run, (ch, docker_run)
    assert ch["prefix"] == "/opt/venv" and ch["env"]["OMP_NUM_THREADS"] == "1" and ch["torch"] == 1

