"""megascale installed as a package, the way a user installs it: a wheel built from the checkout's
tracked files, installed non-editable into a fresh environment, used from a directory outside the
checkout. ``megascale train`` with no config (the ``tiny`` preset), every preset, a config given
by path, and ``megascale launch``.

The fresh environment is a new virtual environment whose own site-packages holds only megascale;
the dependencies (torch, megatron-core, ...) are reached through a ``.pth`` line naming this
interpreter's site-packages, so the test does not download gigabytes again. The checkout's
editable install is not reachable from it: ``.pth`` files of a directory named by a ``.pth`` line
are not processed.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]


def _run(argv: list[str], cwd: Path, timeout: float = 300, **kwargs) -> subprocess.CompletedProcess:
    return subprocess.run(
        argv, cwd=cwd, capture_output=True, text=True, timeout=timeout, check=False, **kwargs
    )


def _ok(result: subprocess.CompletedProcess) -> subprocess.CompletedProcess:
    assert result.returncode == 0, (
        f"{result.args}:\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}"
    )
    return result


@pytest.fixture(scope="module")
def installed(tmp_path_factory) -> dict[str, Path]:
    """A wheel of the checkout installed into a fresh environment: its bin dir and a work dir."""
    root = tmp_path_factory.mktemp("wheel")
    source = root / "source"
    tracked = _ok(_run(["git", "ls-files", "-z"], cwd=REPO)).stdout.split("\0")
    for name in filter(None, tracked):
        if (REPO / name).is_file():
            (source / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(REPO / name, source / name)
    dist = root / "dist"
    _ok(
        _run(
            [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "-w", str(dist), str(source)],
            cwd=root,
            timeout=600,
        )
    )
    (wheel,) = dist.glob("megascale-*.whl")
    venv = root / "venv"
    _ok(_run([sys.executable, "-m", "venv", "--without-pip", str(venv)], cwd=root))
    python = venv / "bin" / "python"
    site = Path(
        _ok(
            _run([str(python), "-c", "import site; print(site.getsitepackages()[0])"], cwd=root)
        ).stdout.strip()
    )
    here = {sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]}
    (site / "megascale-test-deps.pth").write_text("\n".join(sorted(here)) + "\n")
    _ok(
        _run(
            [
                sys.executable,
                "-m",
                "pip",
                "--python",
                str(python),
                "install",
                "-q",
                "--no-deps",
                str(wheel),
            ],
            cwd=root,
            timeout=600,
        )
    )
    work = root / "work"
    work.mkdir()
    return {"bin": venv / "bin", "work": work, "site": site, "wheel": wheel}


def test_the_wheel_holds_the_presets_and_the_package_data(installed):
    import zipfile

    names = set(zipfile.ZipFile(installed["wheel"]).namelist())
    presets = {n for n in names if n.startswith("megascale/config/presets/")}
    assert {
        "megascale/config/presets/tiny.toml",
        "megascale/config/presets/h100-1b.toml",
        "megascale/config/presets/megascale-175b.toml",
        "megascale/config/presets/selfcheck/h100-8gpu.toml",
    } <= presets
    assert "megascale/tools/report.html" in names
    assert any(n.startswith("megascale/parallel/mcore_sites/") for n in names)


def test_the_installed_package_is_the_one_imported_and_every_preset_loads(installed):
    code = (
        "import json, megascale\n"
        "from megascale.config import load, presets, to_toml\n"
        "from megascale.parallel import mcore_cuda_sites\n"
        "names = presets()\n"
        "for name in names: to_toml(load(name))\n"
        "print(json.dumps({'file': megascale.__file__, 'presets': names,"
        " 'series': mcore_cuda_sites.snapshot_series()}))\n"
    )
    out = json.loads(
        _ok(_run([str(installed["bin"] / "python"), "-c", code], cwd=installed["work"])).stdout
    )
    assert Path(out["file"]).is_relative_to(installed["site"]), out["file"]
    assert {"tiny", "h100-1b", "megascale-175b"} <= set(out["presets"])
    assert out["series"], "no megatron-core snapshot in the installed package"


def test_megascale_train_runs_from_the_wheel_with_a_preset_and_with_a_path(installed):
    megascale = str(installed["bin"] / "megascale")
    work = installed["work"]
    quick = ["--set", "train.steps=2", "--set", "optim.warmup_steps=1"]
    result = _ok(_run([megascale, "train", *quick, "--run-dir", "by-name"], cwd=work))
    assert "step 2/2" in result.stdout + result.stderr
    assert (
        json.loads((work / "by-name" / "metrics.jsonl").read_text().splitlines()[-1])["step"] == 2
    )
    own = work / "own.toml"
    own.write_text((installed["site"] / "megascale/config/presets/tiny.toml").read_text())
    _ok(_run([megascale, "train", str(own), *quick, "--run-dir", "by-path"], cwd=work))
    bad = _run([megascale, "train", "no-such-preset", "--run-dir", "bad"], cwd=work)
    assert bad.returncode == 2 and "tiny" in bad.stderr and "Traceback" not in bad.stderr


def test_megascale_launch_runs_from_the_wheel(installed):
    work = installed["work"]
    argv = [str(installed["bin"] / "megascale"), "launch", "--nodes", "1", "--nproc-per-node", "1"]
    argv += ["--set", "train.steps=4", "--set", "optim.warmup_steps=1", "--run-dir", "launched"]
    env = {**os.environ, "PYTHONPATH": ""}
    _ok(_run(argv, cwd=work, timeout=600, env=env))
    final = json.loads((work / "launched" / "final.json").read_text())
    assert final["finished"] and final["final_step"] == 4, final
