"""A quick end-to-end check of the channel and the stand-in installer (not a pytest; ~2-4 min):

    python3 -m tests.conda_channel.selfcheck [--out DIR] [--image IMAGE]

Builds (or reuses) the channel, serves it on loopback, locks an MKL and an OpenBLAS cell here
with py-rattler (as `imagefactory lock` does), then in ONE bookworm-slim container
(--network host): installs with `bash installer.sh -b -p /opt/conda`, creates environments from
specs and from the @EXPLICIT locks, and judges each with threadpoolctl: numpy's BLAS through
the libblas switch, MKL_INTERFACE_LAYER from the activate.d script, one OpenMP runtime (torch on
the environment's libgomp.so.1), torch importing and computing. Also: a second create from a lock
downloads nothing (server log), a tampered lock digest fails naming both digests, and the broken
channel's libblas is caught.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from tests.conda_channel.build import ChannelInfo, build
from tests.conda_channel.server import ChannelServer

IMAGE = "127.0.0.1:5000/library/debian:bookworm-slim"
BASE = ["python=3.11", "pytorch=2.13.0=cpu*", "numpy", "threadpoolctl"]
SPECS = {"mkl": [*BASE, "libblas=*=*mkl"], "openblas": [*BASE, "libblas=*=*openblas", "nomkl"]}

# Run by each environment's python, after its activate.d scripts were sourced.
JUDGE = r'''
import json, os, sys
import numpy, threadpoolctl
first = threadpoolctl.threadpool_info()
blas = sorted({(e["internal_api"], os.path.basename(os.path.realpath(e["filepath"]))) for e in first
               if e["user_api"] == "blas"})
x = numpy.array([complex(i % 7 - 3, i % 5 - 2) for i in range(37)])
y = numpy.array([complex(i % 3 - 1, i % 4 - 2) for i in range(37)])
zdotc_ok = complex(numpy.vdot(x, y)) == sum(a.conjugate() * b for a, b in zip(x.tolist(), y.tolist()))
import torch
xt, yt = torch.tensor(x.tolist()), torch.tensor(y.tolist())
torch_dot_ok = complex(torch.dot(xt, yt)) == sum(a * b for a, b in zip(x.tolist(), y.tolist()))
torch.set_num_threads(2)
threads = torch.get_num_threads()
a = torch.randn(600, 600, dtype=torch.float64)
par = (a @ a).sum().item(), torch.exp(torch.linspace(0, 1, 10 ** 6)).sum().item()
torch.set_num_threads(1)
seq = (a @ a).sum().item(), torch.exp(torch.linspace(0, 1, 10 ** 6)).sum().item()
after = threadpoolctl.threadpool_info()
openmp = sorted({os.path.realpath(e["filepath"]) for e in after if e["user_api"] == "openmp"})
layers = sorted({str(e.get("threading_layer")) for e in after if e["internal_api"] == "mkl"})
maps = open("/proc/self/maps").read()
omp_maps = sorted({line.split()[-1] for line in maps.splitlines() if "omp" in line.split("/")[-1]})
meta = [os.stat(p).st_mode & 0o777 for p in __import__("glob").glob(sys.prefix + "/conda-meta/*.json")]
print(json.dumps(dict(blas=blas, zdotc_ok=zdotc_ok, torch_dot_ok=torch_dot_ok, mkl_interface_layer=os.environ.get("MKL_INTERFACE_LAYER"),
                      torch=torch.__version__, threads=threads, parallel_matches=all(abs(p - s) < 1e-6 * abs(s)
                      for p, s in zip(par, seq)), openmp=openmp, mkl_layers=layers, omp_maps=omp_maps,
                      mkl_available=torch.backends.mkl.is_available(), meta_modes=sorted(set(meta)))))
'''

# The container's script: argv URL; /work holds judge.py and the locks; /channel the files.
SCRIPT = r'''
set -u
url="$1"; cd /work
bash /channel/installer.sh -b -p /opt/conda > /dev/null || exit 10
printf 'channels:\n  - "%s/channel"\nchannel_priority: strict\n' "$url" > /opt/conda/.condarc
/opt/conda/bin/conda --version
/opt/conda/bin/conda clean -afy || exit 11
export CONDA_PKGS_DIRS=/pkgs
judge() {  # PREFIX LABEL
    echo "JUDGE $2 $(env -i PATH=/usr/bin:/bin CONDA_PREFIX="$1" bash -c \
        'for f in "$CONDA_PREFIX"/etc/conda/activate.d/*.sh; do [ -e "$f" ] && . "$f"; done; \
         exec "$CONDA_PREFIX/bin/python" /work/judge.py' 2>/work/$2.err || echo '{"error": "see stderr"}')"
    tail -3 /work/$2.err >&2
}
for blas in mkl openblas; do
    s=$(date +%s)
    eval "set -- $(cat specs-$blas.txt)"
    /opt/conda/bin/conda create -y -p /opt/spec-$blas "$@" > /dev/null || exit 12
    echo "ELAPSED create-specs-$blas $(( $(date +%s) - s ))"
    judge /opt/spec-$blas spec-$blas
    s=$(date +%s)
    /opt/conda/bin/conda create -y -p /opt/lock-$blas --file lock-$blas.txt > /dev/null || exit 13
    echo "ELAPSED create-lock-$blas $(( $(date +%s) - s ))"
    judge /opt/lock-$blas lock-$blas
done
echo "MARK cached"
read -r _ < /work/go  # the host clears the server log, then lets us go on
/opt/conda/bin/conda create -y -p /opt/again --file lock-mkl.txt > /dev/null || exit 14
echo "MARK again-done"
/opt/conda/bin/conda create -y -p /opt/tampered --file lock-tampered.txt > /dev/null 2> tampered.err
echo "TAMPERED rc=$? $(cat tampered.err)"
printf 'channels:\n  - "%s/broken"\n  - "%s/channel"\nchannel_priority: strict\n' "$url" "$url" > /opt/conda/.condarc
eval "set -- $(cat specs-mkl.txt)"
/opt/conda/bin/conda create -y -p /opt/broken "$@" > /dev/null || exit 15
judge /opt/broken broken
/opt/conda/bin/conda info > /dev/null 2> info.err; echo "UNSUPPORTED rc=$? $(cat info.err)"
/opt/conda/bin/conda clean -afy && echo "CLEANED $(ls -A /pkgs | wc -l)"
'''


async def _solve(url: str, specs: list[str]) -> list[tuple[str, str]]:
    import rattler
    records = await rattler.solve([rattler.Channel(url)], [rattler.MatchSpec(s, strict=False) for s in specs],
                                  gateway=rattler.Gateway(cache_dir=Path(tempfile.mkdtemp())),
                                  platforms=["linux-64", "noarch"], virtual_packages=rattler.VirtualPackage.detect())
    return sorted((str(r.url), r.sha256.hex() if isinstance(r.sha256, bytes) else str(r.sha256)) for r in records)


def lock_text(records: list[tuple[str, str]]) -> str:
    return "# imagefactory lock for cell selfcheck\n@EXPLICIT\n" + "".join(f"{u}#{s}\n" for u, s in records)


def prepare(work: Path, url: str) -> None:
    (work / "judge.py").write_text(JUDGE)
    (work / "check.sh").write_text(SCRIPT)
    for blas, specs in SPECS.items():
        (work / f"specs-{blas}.txt").write_text(" ".join(f"'{s}'" for s in specs))
        started = time.monotonic()
        records = asyncio.run(_solve(url + "/channel", specs))
        print(f"host lock {blas}: {len(records)} packages in {time.monotonic() - started:.1f} s")
        (work / f"lock-{blas}.txt").write_text(lock_text(records))
    records = asyncio.run(_solve(url + "/channel", SPECS["mkl"]))
    i = next(i for i, (u, _) in enumerate(records) if "/numpy-" in u)
    records[i] = (records[i][0], "0" * 64)
    (work / "lock-tampered.txt").write_text(lock_text(records))
    subprocess.run(["mkfifo", str(work / "go")], check=True)


def run_container(info: ChannelInfo, server: ChannelServer, work: Path, image: str) -> list[str]:
    # The template installs ca-certificates before the installer; rattler's HTTP client needs them.
    cmd = ["docker", "run", "--rm", "--network", "host", "-v", f"{info.root}:/channel:ro", "-v", f"{work}:/work",
           "-v", "/etc/ssl/certs:/etc/ssl/certs:ro", image, "bash", "/work/check.sh", server.url]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines = []
    assert proc.stdout is not None
    for line in proc.stdout:
        lines.append(line.rstrip("\n"))
        print("  |", line.rstrip("\n")[:400], flush=True)
        if line.startswith("MARK cached"):
            server.clear()
            with open(work / "go", "w") as go:
                go.write("go\n")
        if line.startswith("MARK again-done"):
            lines.append("DOWNLOADS-AGAIN " + json.dumps(server.paths(".conda")))
    lines.append(f"RC {proc.wait()}")
    return lines


def verdicts(lines: list[str]) -> list[tuple[bool, str]]:
    judged = {ln.split(" ", 2)[1]: json.loads(ln.split(" ", 2)[2]) for ln in lines if ln.startswith("JUDGE ")}
    out = []
    for label, doc in sorted(judged.items()):
        if "error" in doc:
            out.append((False, f"{label}: {doc}"))
            continue
        want = "openblas" if label.endswith("openblas") or label == "broken" else "mkl"
        apis = sorted({api for api, _ in doc["blas"]})
        if label == "broken":
            out.append(("openblas" in apis, f"broken: numpy's BLAS {doc['blas']} (an MKL cell must see openblas)"))
            continue
        one_omp = len(doc["openmp"]) == 1 and doc["openmp"][0].endswith("/lib/libiomp5.so")
        out += [(apis == [want], f"{label}: numpy's BLAS {doc['blas']}"),
                (doc["zdotc_ok"], f"{label}: numpy.vdot (zdotc) exact: {doc['zdotc_ok']}"),
                (doc["torch_dot_ok"], f"{label}: torch.dot complex128 after numpy exact: {doc['torch_dot_ok']}"),
                (one_omp, f"{label}: OpenMP runtimes {doc['openmp']}; mapped {doc['omp_maps']}"),
                (doc["parallel_matches"] and doc["threads"] == 2, f"{label}: torch {doc['torch']}, "
                 f"get_num_threads {doc['threads']}, parallel == serial: {doc['parallel_matches']}"),
                (doc["meta_modes"] == [0o644], f"{label}: conda-meta modes {[oct(m) for m in doc['meta_modes']]}")]
        if want == "mkl":
            out += [(doc["mkl_interface_layer"] == "LP64,GNU", f"{label}: MKL_INTERFACE_LAYER="
                     f"{doc['mkl_interface_layer']}"),
                    (doc["mkl_layers"] == ["intel"], f"{label}: MKL threading layer {doc['mkl_layers']}")]
    again = next((json.loads(ln.split(" ", 1)[1]) for ln in lines if ln.startswith("DOWNLOADS-AGAIN")), None)
    out.append((again == [], f"create from a lock with a warm CONDA_PKGS_DIRS downloaded: {again}"))
    tampered = next((ln for ln in lines if ln.startswith("TAMPERED")), "TAMPERED missing")
    out.append(("rc=0" not in tampered and "0" * 64 in tampered and "actual sha256" in tampered, tampered[:300]))
    unsupported = next((ln for ln in lines if ln.startswith("UNSUPPORTED")), "")
    out.append(("rc=2" in unsupported and "stand-in" in unsupported, unsupported[:200]))
    out.append((lines[-1] == "RC 0", f"container {lines[-1]}"))
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="end-to-end check of the test conda channel")
    parser.add_argument("--out", type=Path, default=Path(tempfile.gettempdir()) / "imagefactory-conda-channel")
    parser.add_argument("--image", default=IMAGE)
    args = parser.parse_args(argv)
    started = time.monotonic()
    info = build(args.out)
    print(f"build(): {time.monotonic() - started:.2f} s; again: ", end="")
    started = time.monotonic()
    info = build(args.out)
    print(f"{time.monotonic() - started:.3f} s")
    with tempfile.TemporaryDirectory() as tmp, ChannelServer(info.root) as server:
        work = Path(tmp)
        work.chmod(0o777)
        prepare(work, server.url)
        started = time.monotonic()
        lines = run_container(info, server, work, args.image)
        print(f"container: {time.monotonic() - started:.0f} s")
    results = verdicts(lines)
    for ok, what in results:
        print(("PASS " if ok else "FAIL ") + what)
    return 0 if all(ok for ok, _ in results) else 1


if __name__ == "__main__":
    sys.exit(main())
