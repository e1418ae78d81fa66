"""What the launch hook costs at interpreter start: `python -c pass` with and without it.

Every interpreter of an image's environment imports imagefactory_launch at start (a .pth line in
site-packages; README "Running on GPU nodes"). The goal is at most 1.05x a start without it.
Two ways, each side by side in one run (starts interleaved, with and without, N times each):

    python bench/launch_hook.py [--runs 200]            two throwaway venvs of this machine's python,
                                                        identical but for the hook (threads: auto)
    python bench/launch_hook.py --image IMAGE [--runs 200]
                                                        inside a built image, as root: the same
                                                        interpreter, its .pth moved aside and back

Prints the median and mean start time of each side and their ratio.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import venv
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

# Runs inside one process: start the interpreter N times each way, interleaved.
TIMER = r"""
import json, os, subprocess, sys, time
with_hook, without_hook, runs, pth = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4]
def start(python):
    t = time.perf_counter()
    subprocess.run([python, "-c", "pass"], check=True)
    return time.perf_counter() - t
times = {"with": [], "without": []}
for i in range(runs):
    for side in (("with", "without") if i % 2 else ("without", "with")):
        if pth:  # one interpreter: the .pth moved aside for the "without" start
            if side == "without":
                os.rename(pth, pth + ".off")
            try:
                times[side].append(start(with_hook))
            finally:
                if side == "without":
                    os.rename(pth + ".off", pth)
        else:
            times[side].append(start(with_hook if side == "with" else without_hook))
print(json.dumps(times))
"""


def _venvs(root: Path) -> tuple[str, str]:
    from imagefactory.render import contexts as render
    from imagefactory.config.model import AUTO, Cell

    cell = Cell(python="3.11", cuda=None, blas="openblas", installer="pip", torch="2.13.0", threads=AUTO,
                base_image="python:3.11-slim-bookworm")
    pythons = []
    for name, hooked in (("with", True), ("without", False)):
        env = root / name
        venv.EnvBuilder(with_pip=False, symlinks=True).create(env)
        python = env / "bin" / "python"
        site = subprocess.run([python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                              capture_output=True, text=True, check=True).stdout.strip()
        if hooked:
            (Path(site) / render.LAUNCH_HOOK).write_text(render.launch_hook_source())
            (Path(site) / render.LAUNCH_PTH).write_text("import imagefactory_launch\n")
            (env / "etc" / "imagefactory").mkdir(parents=True)
            (env / "etc" / "imagefactory" / "launch.conf").write_text(render.launch_conf_text(cell))
            subprocess.run([python, "-m", "compileall", "-q", site], check=True)  # as the image has it
        pythons.append(str(python))
    return pythons[0], pythons[1]


def _report(times: dict[str, list[float]], where: str) -> None:
    med = {k: statistics.median(v) * 1000 for k, v in times.items()}
    mean = {k: statistics.fmean(v) * 1000 for k, v in times.items()}
    print(f"python -c pass, {where}, {len(times['with'])} starts each, interleaved")
    print(f"  without the hook: median {med['without']:.2f} ms, mean {mean['without']:.2f} ms")
    print(f"  with the hook:    median {med['with']:.2f} ms, mean {mean['with']:.2f} ms")
    print(f"  ratio with/without: median {med['with'] / med['without']:.3f}x, mean {mean['with'] / mean['without']:.3f}x"
          " (goal: at most 1.05x)")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--runs", type=int, default=200)
    p.add_argument("--image", help="a built image (its hook is measured inside it, as root)")
    args = p.parse_args()
    if args.image:
        from imagefactory.engine.docker import Engine  # the only Docker SDK user

        pth = "/opt/venv/lib/python3.11/site-packages/imagefactory-launch.pth"
        out = Engine().run(args.image, ["-c", TIMER, "/opt/venv/bin/python", "", str(args.runs), pth],
                           timeout=600, options={"entrypoint": "python", "user": "0"})
        if out.exit_code != 0:
            print(out.stderr[-2000:], file=sys.stderr)
            return 1
        _report(json.loads(out.stdout.strip().splitlines()[-1]), f"in {args.image} (no entrypoint)")
        return 0
    with tempfile.TemporaryDirectory(prefix="launch-hook-bench-") as tmp:
        with_hook, without_hook = _venvs(Path(tmp))
        r = subprocess.run([sys.executable, "-c", TIMER, with_hook, without_hook, str(args.runs), ""],
                           capture_output=True, text=True, check=True)
        _report(json.loads(r.stdout), f"venvs of {sys.executable}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
