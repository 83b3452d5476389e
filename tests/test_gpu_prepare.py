"""The lent GPU machine's call, prepared here (bench/gpu_prepare.py, bench/gpu_session.sh).

The wheels and the rehearsal itself need the registry and a 4.6 GB venv like the
machine's image, so they run by hand (bench/README "GPU acceptance run"); these tests
hold what decides whether that call can work: which packages travel, that the call fits
the device tool's limits, that the script parses."""

from __future__ import annotations

import subprocess
from pathlib import Path

from fleet.bench import gpu_prepare

ROOT = Path(__file__).resolve().parent.parent


def test_the_server_install_is_walked_to_its_leaves():
    needed = gpu_prepare.requirements()
    # Direct requirements of the server extra and requirements of those (litestar -> msgspec).
    for name in ("litestar", "torch", "transformers", "posix-ipc", "llguidance", "msgspec", "anyio"):
        assert name in needed, name
    assert needed["litestar"].count(".") >= 1


def test_only_what_the_image_lacks_travels():
    carried = gpu_prepare.to_carry(gpu_prepare.requirements())
    # What a daemon imports and the image does not hold.
    for name in ("litestar", "msgspec", "posix-ipc", "nats-py", "uvicorn", "httptools", "llguidance"):
        assert name in carried, name
    assert not set(carried) & gpu_prepare.IMAGE
    assert not set(carried) & set(gpu_prepare.LEFT_OUT)
    assert "torch" not in carried and "transformers" not in carried
    assert "py-spy" in carried  # gpu-check's profile (bench/spy.py)


def test_minilm_travels_with_or_without_its_weights(tmp_path):
    gpu_prepare.minilm_folder(tmp_path / "shapes", weights=False)
    gpu_prepare.minilm_folder(tmp_path / "fp16", weights=True)
    shapes = {p.name for p in (tmp_path / "shapes").iterdir()}
    assert "model.safetensors" not in shapes and {"config.json", "tokenizer.json", "modules.json"} <= shapes
    weights = (tmp_path / "fp16" / "model.safetensors").stat().st_size
    assert 40e6 < weights < 50e6  # fp16: half the package's 91 MB
    assert gpu_prepare.size(tmp_path / "shapes") < 2e6


def test_a_rehearsal_venv_pins_the_images_versions():
    out = subprocess.run([str(ROOT / ".venv/bin/python"), "-m", "fleet.bench", "gpu-prepare", "--image-requirements"],
                         cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    reqs = out.stdout.split()
    assert "torch==2.11.0" in reqs and "transformers==5.17.0" in reqs
    assert not any(r.split("==")[0] in gpu_prepare.LEFT_OUT for r in reqs)


def test_the_call_fits_the_device_tools_limits():
    call = gpu_prepare.run_call([".whl", ".gpu"])
    assert len(call["command"]) <= 2000  # the tool's limit on a command
    assert call["timeout_s"] <= 600 and gpu_prepare.CHECK_S + 60 <= call["timeout_s"]
    assert "bench/gpu_session.sh" in call["command"]
    assert subprocess.run(["bash", "-n", str(ROOT / "bench/gpu_session.sh")]).returncode == 0


def test_the_tree_that_travels_is_counted():
    sizes = gpu_prepare.travelling_bytes([])
    tracked = sum((ROOT / f).stat().st_size for f in ("README.md", "pyproject.toml"))
    assert sizes["tree"] > tracked
    assert sizes["tree"] < gpu_prepare.LIMIT_BYTES


def test_gpu_check_serves_a_folder_without_weights_with_random_ones_of_its_shapes(tmp_path):
    from safetensors import safe_open

    from fleet.bench import gpu_check

    gpu_prepare.minilm_folder(tmp_path / "shapes", weights=False)
    got = gpu_check.random_weights(tmp_path / "shapes", tmp_path / "random")
    with safe_open(got / "model.safetensors", "pt") as f:
        shape = f.get_slice("embeddings.word_embeddings.weight").get_shape()
    assert shape == [30522, 384]  # all-MiniLM-L6-v2's vocabulary x width
    assert (got / "tokenizer.json").exists() and (got / "modules.json").exists()
