"""setup.sh's torch choice: a CPU build on a host without an NVIDIA GPU, asking pip what it would
take (here, offline, from stand-in wheels) and adding PyTorch's CPU index only when needed."""

import os
import subprocess
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
CPU_INDEX = "--extra-index-url https://download.pytorch.org/whl/cpu"


def stand_in_wheel(folder: Path, version: str) -> None:
    """An empty wheel named like torch's: pip reads only its metadata in a dry run."""
    info = f"torch-{version}.dist-info"
    with zipfile.ZipFile(folder / f"torch-{version}-py3-none-any.whl", "w") as wheel:
        wheel.writestr(f"{info}/METADATA", f"Metadata-Version: 2.1\nName: torch\nVersion: {version}\n")
        wheel.writestr(
            f"{info}/WHEEL", "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n"
        )
        wheel.writestr(f"{info}/RECORD", "")


def torch_pip_args(tmp_path: Path, wheel_version: str | None, **env: str) -> str:
    wheels = tmp_path / "wheels"
    wheels.mkdir(exist_ok=True)
    if wheel_version:
        stand_in_wheel(wheels, wheel_version)
    environment = {
        **os.environ,
        # pip sees only the stand-in wheels: no index, no configured find-links or mirrors.
        "PIP_CONFIG_FILE": os.devnull,
        "PIP_NO_INDEX": "1",
        "PIP_FIND_LINKS": str(wheels),
        "PATH": f"{tmp_path / 'bin'}:{os.environ['PATH']}",
        **env,
    }
    done = subprocess.run(
        ["bash", "-c", 'source ./setup.sh && torch_pip_args "torch==2.13.0"'],
        cwd=ROOT, env=environment, capture_output=True, text=True, timeout=300,
    )
    assert done.returncode == 0, done.stderr
    return done.stdout.strip()


@pytest.fixture(autouse=True)
def no_gpu_here(tmp_path):
    if Path("/proc/driver/nvidia/version").exists():
        pytest.skip("this host has an NVIDIA driver: the automatic choice is CUDA")
    (tmp_path / "bin").mkdir()


def test_a_cpu_build_pip_already_takes_is_installed_as_is(tmp_path):
    assert torch_pip_args(tmp_path, "2.13.0+cpu") == ""


def test_pypis_cuda_build_brings_in_the_cpu_index(tmp_path):
    assert torch_pip_args(tmp_path, "2.13.0") == CPU_INDEX


def test_a_host_with_an_nvidia_gpu_keeps_pypis_cuda_build(tmp_path):
    fake = tmp_path / "bin" / "nvidia-smi"
    fake.write_text("#!/bin/sh\necho 'GPU 0: a stand-in'\n")
    fake.chmod(0o755)
    assert torch_pip_args(tmp_path, None) == ""  # pip is not even asked
    fake.unlink()
    assert torch_pip_args(tmp_path, None, INHERENT_TORCH="cuda") == ""


def test_the_choice_can_be_forced_to_cpu(tmp_path):
    fake = tmp_path / "bin" / "nvidia-smi"
    fake.write_text("#!/bin/sh\necho 'GPU 0: a stand-in'\n")
    fake.chmod(0o755)
    assert torch_pip_args(tmp_path, "2.13.0", INHERENT_TORCH="cpu") == CPU_INDEX
