"""Images in (`inputs` items `{image: bytes}`), runtime `clip`, end to end: a tiny
CLIPModel built from a CLIPConfig with a CLIPImageProcessor and the all-MiniLM
tokenizer, pulled with `--runtime clip`, served by a real daemon; real PNG/JPEG
images made with Pillow here; checked against `get_image_features` /
`get_text_features` run directly on the same folder.
"""

from __future__ import annotations

import base64
import io
import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import msgspec
import numpy as np
import pytest

from tests.conftest import default_model_dir, start_daemon

MSGPACK = "application/msgpack"
NAME = "tiny-clip"
TEXTS = ["a photo of a cat", "a red square on a white background", "x"]


def png(img) -> bytes:
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    return buf.getvalue()


def make_images() -> list[bytes]:
    """Real encoded images of several sizes, modes and formats."""
    from PIL import Image, ImageDraw

    square = Image.new("RGB", (64, 64), "white")
    ImageDraw.Draw(square).rectangle([16, 16, 48, 48], fill="red")
    noise = Image.fromarray(np.random.default_rng(1).integers(0, 256, (50, 90, 3), dtype=np.uint8))
    gray = Image.linear_gradient("L").resize((40, 120))
    rgba = Image.new("RGBA", (33, 47), (0, 128, 255, 100))
    jpeg = io.BytesIO()
    noise.save(jpeg, format="JPEG", quality=90)
    return [png(square), png(noise), png(gray), png(rgba), jpeg.getvalue()]


def build_clip(folder: Path) -> Path:
    import torch
    from transformers import AutoTokenizer, CLIPConfig, CLIPImageProcessor, CLIPModel

    tok = AutoTokenizer.from_pretrained(default_model_dir())
    torch.manual_seed(0)
    cfg = CLIPConfig(
        text_config=dict(vocab_size=tok.vocab_size, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=2, max_position_embeddings=64, bos_token_id=tok.cls_token_id,
                         eos_token_id=tok.sep_token_id, pad_token_id=tok.pad_token_id),
        vision_config=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                           image_size=32, patch_size=8),
        projection_dim=16,
    )
    CLIPModel(cfg).eval().save_pretrained(folder)
    tok.save_pretrained(folder)
    CLIPImageProcessor(size={"shortest_edge": 32}, crop_size={"height": 32, "width": 32}).save_pretrained(folder)
    return folder


class Reference:
    """The folder run directly through transformers, one input at a time."""

    def __init__(self, folder: Path) -> None:
        import torch
        from transformers import AutoImageProcessor, AutoTokenizer, CLIPModel

        self.torch = torch
        self.model = CLIPModel.from_pretrained(folder).eval()
        self.tok = AutoTokenizer.from_pretrained(folder)
        self.processor = AutoImageProcessor.from_pretrained(folder)

    @staticmethod
    def _unit(x) -> np.ndarray:
        x = (x if hasattr(x, "dim") else x.pooler_output).float().numpy()
        return x / np.linalg.norm(x, axis=1, keepdims=True)

    def image(self, data: bytes) -> np.ndarray:
        from PIL import Image

        pixels = self.processor(images=[Image.open(io.BytesIO(data)).convert("RGB")], return_tensors="pt")
        with self.torch.inference_mode():
            return self._unit(self.model.get_image_features(pixel_values=pixels["pixel_values"]))[0]

    def text(self, text: str) -> np.ndarray:
        enc = self.tok([text], truncation=True, max_length=64, return_tensors="pt")
        with self.torch.inference_mode():
            return self._unit(self.model.get_text_features(input_ids=enc["input_ids"],
                                                           attention_mask=enc["attention_mask"]))[0]


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_clip(tmp_path_factory.mktemp("clip") / "model")


@pytest.fixture(scope="module")
def ref(folder: Path) -> Reference:
    return Reference(folder)


@pytest.fixture(scope="module")
def images() -> list[bytes]:
    return make_images()


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory, folder: Path):
    home = tmp_path_factory.mktemp("fleet-clip")
    (home / "models.toml").write_text(
        f'[models."{NAME}"]\nsource = "path:{folder.resolve()}"\ntask = "embed"\nruntime = "clip"\n'
        f'[models."{NAME}".profile]\ndtype = "float32"\n')
    env = {**os.environ, "FLEET_HOME": str(home), "HF_HUB_OFFLINE": "1"}
    done = subprocess.run([sys.executable, "-m", "fleetctl", "pull", f"path:{folder}", "--name", NAME,
                           "--task", "embed", "--runtime", "clip"],
                          env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    d = start_daemon(home, extra_env={"FLEET_PRELOAD": NAME})
    yield d
    d.stop()


def post(d, body: dict, *, msgpack: bool) -> httpx.Response:
    if msgpack:
        return httpx.post(d.url + "/v1/embed", content=msgspec.msgpack.encode(body),
                          headers={"Content-Type": MSGPACK}, timeout=60)
    return httpx.post(d.url + "/v1/embed", json=body, timeout=60)


def vectors(resp: httpx.Response) -> np.ndarray:
    assert resp.status_code == 200, resp.content[:400]
    if resp.headers["content-type"].startswith(MSGPACK):
        reply = msgspec.msgpack.decode(resp.content)
        return np.frombuffer(reply["embeddings"], dtype="<f4").reshape(reply["shape"])
    return np.asarray(resp.json()["embeddings"], dtype=np.float32)


def test_msgpack_images_and_texts_in_one_request_match_clip(fleet, ref, images):
    inputs = [{"image": images[0]}, TEXTS[0], {"image": images[1]}, TEXTS[1], *({"image": b} for b in images[2:])]
    got = vectors(post(fleet, {"model": NAME, "inputs": inputs}, msgpack=True))
    want = np.stack([ref.image(x["image"]) if isinstance(x, dict) else ref.text(x) for x in inputs])
    assert got.shape == (len(inputs), 16)
    np.testing.assert_allclose(got, want, atol=1e-5)


def test_json_images_as_base64_and_data_urls(fleet, ref, images):
    b64 = base64.b64encode(images[0]).decode()
    inputs = [{"image": b64}, {"image": "data:image/jpeg;base64," + base64.b64encode(images[4]).decode()}, "x"]
    got = vectors(post(fleet, {"model": NAME, "inputs": inputs}, msgpack=False))
    np.testing.assert_allclose(got, np.stack([ref.image(images[0]), ref.image(images[4]), ref.text("x")]), atol=1e-5)


def test_client_sends_bytes_as_images(fleet, ref, images):
    from fleetctl import Client

    with Client(fleet.url) as client:
        got = client.embed(NAME, [images[3], "a photo of a cat"])
    np.testing.assert_allclose(got, np.stack([ref.image(images[3]), ref.text("a photo of a cat")]), atol=1e-5)


def test_a_large_image_body_is_accepted(fleet, ref):
    """A 2.6 MB PNG (over the 1 MiB large-payload threshold) travels in the queue slab as sent."""
    from PIL import Image

    big = png(Image.fromarray(np.random.default_rng(2).integers(0, 256, (900, 1000, 3), dtype=np.uint8)))
    assert len(big) > 2 << 20
    got = vectors(post(fleet, {"model": NAME, "inputs": [{"image": big}]}, msgpack=True))
    np.testing.assert_allclose(got[0], ref.image(big), atol=1e-5)


def test_concurrent_image_requests_batch_and_each_get_their_own(fleet, ref, images):
    def one(k: int) -> tuple[int, np.ndarray]:
        return k, vectors(post(fleet, {"model": NAME, "inputs": [{"image": images[k % len(images)]}]}, msgpack=True))

    with ThreadPoolExecutor(6) as pool:
        for k, got in pool.map(one, range(18)):
            np.testing.assert_allclose(got[0], ref.image(images[k % len(images)]), atol=1e-5)


def test_images_are_decoded_in_the_worker_not_the_api_process(fleet, images):
    assert post(fleet, {"model": NAME, "inputs": [{"image": images[1]}]}, msgpack=True).status_code == 200

    def maps_pillow(pid: int) -> bool:
        return "PIL/_imaging" in Path(f"/proc/{pid}/maps").read_text()

    api = fleet.proc.pid
    children = [int(p) for t in Path(f"/proc/{api}/task").iterdir()
                for p in (t / "children").read_text().split()]
    assert not maps_pillow(api)
    assert any(maps_pillow(c) for c in children)


def oversized_png() -> bytes:
    """8000 x 6000 = 48 M pixels (over the 40 M limit) in a file of a few kB."""
    from PIL import Image

    return png(Image.new("1", (8000, 6000)))


@pytest.mark.parametrize("case", ["not an image", "truncated", "bad base64", "bad data url", "oversized",
                                  "tokens output", "sparse output"])
def test_bad_image_requests_fail_alone(fleet, images, case):
    msgpack = case not in ("bad base64", "bad data url")
    body, status, code = {
        "not an image": ({"inputs": [{"image": b"GIF89a but not really"}]}, 400, "bad_request"),
        "truncated": ({"inputs": [{"image": images[1][: len(images[1]) // 2]}]}, 400, "bad_request"),
        "bad base64": ({"inputs": [{"image": "***"}]}, 400, "bad_request"),
        "bad data url": ({"inputs": [{"image": "data:image/png,rawbytes"}]}, 400, "bad_request"),
        "oversized": ({"inputs": ["fine", {"image": oversized_png()}]}, 413, "payload_too_large"),
        "tokens output": ({"inputs": [{"image": images[0]}], "output": "tokens"}, 400, "bad_request"),
        "sparse output": ({"inputs": ["a"], "output": "sparse"}, 400, "bad_request"),
    }[case]
    resp = post(fleet, {"model": NAME, **body}, msgpack=msgpack)
    assert resp.status_code == status, resp.content[:300]
    decoded = msgspec.msgpack.decode(resp.content) if msgpack else resp.json()
    assert decoded["error"]["code"] == code
    if case == "oversized":
        assert "input 1" in decoded["error"]["message"] and "8000x6000" in decoded["error"]["message"]
    # The model still answers the next request.
    assert post(fleet, {"model": NAME, "inputs": ["ok"]}, msgpack=True).status_code == 200


def test_one_batch_with_a_bad_image_answers_the_others(folder, ref, images):
    """The worker's call: a request with an undecodable image fails alone; the
    others of its batch (texts, images, normalize=false) are answered."""
    from fleet.protocol import EmbedRequest, ImageInput
    from fleet.runtimes.base import ModelSpec, Profile
    from fleet.messages import EmbedResult, WorkError
    from fleet.runtimes.registry import adapter_class

    spec = ModelSpec(name=NAME, path=folder, task="embed", runtime="clip",
                     profile=Profile(dtype="float32", micro_batch_items=2))
    a = adapter_class("embed", "clip")(spec, "cpu")
    a.load()
    batch = [
        EmbedRequest(NAME, [ImageInput(images[0]), "a photo of a cat", ImageInput(images[2])]),
        EmbedRequest(NAME, ["ok", ImageInput(b"\x89PNG\r\n\x1a\n broken")]),
        EmbedRequest(NAME, [ImageInput(images[4])], normalize=False),
    ]
    got = a.run_batch(batch)
    assert isinstance(got[1], WorkError) and got[1].code == "bad_request" and "input 1" in got[1].message
    first = np.frombuffer(got[0].data, "<f4").reshape(got[0].shape)
    np.testing.assert_allclose(first, np.stack([ref.image(images[0]), ref.text("a photo of a cat"),
                                                ref.image(images[2])]), atol=1e-5)
    raw = np.frombuffer(got[2].data, "<f4")
    assert isinstance(got[2], EmbedResult) and abs(np.linalg.norm(raw) - 1.0) > 1e-3
    np.testing.assert_allclose(raw / np.linalg.norm(raw), ref.image(images[4]), atol=1e-5)
