"""The ``robotics`` extra is optional: a plain ``pip install mmpo`` trains and evaluates VLMs and dLLMs.

The subprocess tests hide the extra's packages (``sys.modules[name] = None``: as if they were not
installed), then import every module outside mmpo/robotics, run
``mmpo quickstart --tiny``, and check that the robot commands end in one line naming the extra.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
import tomllib
from pathlib import Path

import pytest

from mmpo._extras import EXTRA_MODULES, MissingExtraError, find_missing_extra, missing_extra_message, require_extra

REPO = Path(__file__).resolve().parents[2]
# everything the robotics extra installs (and mink, which robosuite pulls), by import name
BLOCKED = ("robosuite", "mujoco", "robomimic", "gymnasium", "h5py", "imageio", "imageio_ffmpeg", "mink")
# A None in sys.modules is how Python spells "not installed" for both `import` (ModuleNotFoundError) and
# importlib.util.find_spec (None), which transformers and diffusers use to probe for optional packages.
BLOCKER = f"import sys\nsys.modules.update(dict.fromkeys({BLOCKED!r}))\n"
ONE_LINE = ("mmpo {command}: error: mmpo.robotics needs the 'robotics' extra: pip install \"mmpo[robotics]\" "
            "(missing: robosuite, mujoco, gymnasium, h5py)")


def run_without_robotics(code: str, timeout: float = 120) -> subprocess.CompletedProcess:
    """``python -c BLOCKER + code`` from the repository root (so this checkout's mmpo is imported)."""
    return subprocess.run([sys.executable, "-c", BLOCKER + textwrap.dedent(code)], cwd=REPO,
                          capture_output=True, text=True, timeout=timeout)


def run_mmpo_without_robotics(args: list[str], timeout: float = 120) -> subprocess.CompletedProcess:
    return run_without_robotics(f"from mmpo.cli import main\nsys.exit(main({args!r}))", timeout)


def test_every_module_outside_robotics_imports_without_the_extra():
    result = run_without_robotics("""
        import importlib, pkgutil
        import mmpo
        failed = []
        for info in pkgutil.walk_packages(mmpo.__path__, "mmpo."):
            if not info.name.startswith("mmpo.robotics"):
                try:
                    importlib.import_module(info.name)
                except Exception as exc:
                    failed.append(f"{info.name}: {exc!r}")
        import mmpo.cli, mmpo.algos.grpo, mmpo.eval, mmpo.dllm.rl, mmpo.quickstart  # the brief's list, by name
        assert not failed, failed
        try:
            import mmpo.robotics
        except ImportError as exc:
            print(type(exc).__name__, exc)
        else:
            raise AssertionError("mmpo.robotics imported without the robotics extra")
    """)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "MissingExtraError " + ONE_LINE.split(": error: ", 1)[1]


@pytest.mark.slow
def test_quickstart_tiny_runs_without_the_extra(tmp_path):
    result = run_mmpo_without_robotics(["quickstart", "--tiny", "--no-progress", "--out", str(tmp_path / "qs")],
                                       timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert (tmp_path / "qs" / "quickstart.json").is_file()


@pytest.mark.parametrize("command, args", [
    ("demos", ["--task", "lift", "--num-demos", "1", "--out", "never.hdf5"]),
    ("rollout", ["--help"]),
    ("fit", ["-c", "configs/robotics/bc_lift.yaml"]),
])
def test_robot_commands_without_the_extra_end_in_one_line(command, args):
    result = run_mmpo_without_robotics([command, *args])
    assert result.returncode == 2
    assert result.stderr.splitlines() == [ONE_LINE.format(command=command)]
    assert not (REPO / "never.hdf5").exists()


def test_missing_extra_error_names_the_extra_to_install():
    with pytest.raises(MissingExtraError) as caught:
        require_extra("mmpo.something", "robotics", {"mmpo_no_such_module": "no-such-dist", "sys": "sys"})
    assert isinstance(caught.value, ImportError) and caught.value.name == "mmpo_no_such_module"
    assert str(caught.value) == ("mmpo.something needs the 'robotics' extra: pip install \"mmpo[robotics]\" "
                                 "(missing: no-such-dist)")
    assert missing_extra_message("p", "x", ["a", "b"]).endswith('pip install "mmpo[x]" (missing: a, b)')
    require_extra("mmpo.something", "robotics", {"sys": "sys"})  # all there: no error
    try:  # found through a chain, as jsonargparse wraps a class_path's import error
        try:
            raise caught.value
        except ImportError as exc:
            raise ValueError("class_path could not be imported") from exc
    except ValueError as wrapped:
        assert find_missing_extra(wrapped) is caught.value
    assert find_missing_extra(ValueError("no extra")) is None


def test_pyproject_keeps_the_robot_stack_in_the_extra():
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]

    def names(requirements):
        return {req.split(";")[0].split("[")[0].split("<")[0].split(">")[0].split("=")[0].strip().lower()
                for req in requirements}

    base = names(project["dependencies"])
    robotics = names(project["optional-dependencies"]["robotics"])
    assert set(EXTRA_MODULES["robotics"].values()) <= robotics
    assert not base & {"robosuite", "mujoco", "robomimic", "gymnasium", "h5py", "imageio", "imageio-ffmpeg"}
    assert project["optional-dependencies"]["all"] == ["mmpo[dev,robotics]"]
