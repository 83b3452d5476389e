"""SigLIP and SigLIP 2 image-text embedders (runtime `clip`) against transformers.

Three tiny random models, each saved with its processor (tokenizer + image
processor) in the hub layout and pulled by path, as published checkpoints are
shaped:
- `siglip`: SiglipModel, SiglipTokenizer (a sentencepiece vocabulary), 32x32 images;
- `siglip2-fixres`: SiglipModel with a Gemma tokenizer (SigLIP 2's fixed-resolution
  checkpoints are model_type "siglip");
- `siglip2-naflex`: Siglip2Model with Siglip2Tokenizer and the NaFlex image
  processor (16-pixel patches at each image's aspect ratio, at most 256).

Reference: the same folder in-process through transformers, with the model's own
processor: texts padded to `max_length` (64), `get_text_features` /
`get_image_features(**processor(images=...))`, `pooler_output`, then L2
normalisation (`normalize: true`, the default) or none.
"""

from __future__ import annotations

import io
import os
import subprocess
import sys
from pathlib import Path

import httpx
import numpy as np
import pytest

from tests.conftest import start_daemon
from tests.test_images import make_images, vectors

ROOT = Path(__file__).resolve().parent.parent
KINDS = ("siglip", "siglip2-fixres", "siglip2-naflex")
TEXTS = ["a photo of a cat", "x", "A red square on a white background, seen from far away at dusk."]
#: Text positions of the tiny models (the published ones have 64 too).
TEXT_LEN = 64


def gemma_vocab() -> dict[str, int]:
    """Gemma-style BPE vocabulary: specials, the 256 byte-fallback pieces, letters and digits."""
    vocab = {"<pad>": 0, "<eos>": 1, "<bos>": 2, "<unk>": 3, "<mask>": 4}
    vocab.update({f"<0x{b:02X}>": 5 + b for b in range(256)})
    for ch in "▁abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789.,!?":
        vocab.setdefault(ch, len(vocab))
    return vocab


def siglip_spm(folder: Path) -> Path:
    """A sentencepiece model as SigLIP ships one (T5 ids: <pad> 0, </s> 1, <unk> 2)."""
    import sentencepiece as spm

    buf = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter((ROOT / "bench" / "corpus.txt").read_text().lower().splitlines()),
        model_writer=buf, vocab_size=300, model_type="unigram", pad_id=0, eos_id=1, unk_id=2, bos_id=-1,
        num_threads=1, minloglevel=2)
    folder.parent.mkdir(parents=True, exist_ok=True)
    path = folder.parent / "spiece.model"
    path.write_bytes(buf.getvalue())
    return path


def build(kind: str, folder: Path) -> Path:
    import torch
    import transformers as tf

    torch.manual_seed(0)
    if kind == "siglip":
        tok = tf.SiglipTokenizer(vocab_file=str(siglip_spm(folder)))
    elif kind == "siglip2-fixres":
        tok = tf.GemmaTokenizer(vocab=gemma_vocab(), merges=[])
    else:
        tok = tf.Siglip2Tokenizer(vocab=gemma_vocab(), merges=[])
    text = dict(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                num_attention_heads=2, max_position_embeddings=TEXT_LEN, pad_token_id=tok.pad_token_id,
                eos_token_id=tok.eos_token_id, bos_token_id=tok.bos_token_id or tok.eos_token_id)
    vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2)
    if kind == "siglip2-naflex":
        # Patches of 16 and at most 256 per image, as the published NaFlex checkpoints
        # (Siglip2Processor applies those two at call time whatever its image processor says).
        model = tf.Siglip2Model(tf.Siglip2Config(text_config=text, vision_config={**vision, "patch_size": 16,
                                                                                  "num_patches": 16}))
        processor = tf.Siglip2Processor(tf.Siglip2ImageProcessorPil(patch_size=16, max_num_patches=256), tok)
    else:
        model = tf.SiglipModel(tf.SiglipConfig(text_config=text,
                                               vision_config={**vision, "patch_size": 8, "image_size": 32}))
        processor = tf.SiglipProcessor(tf.SiglipImageProcessorPil(size={"height": 32, "width": 32}), tok)
    model.eval().save_pretrained(folder)
    # The published repos' layout: preprocessor_config.json and the tokenizer's files.
    processor.image_processor.save_pretrained(folder)
    processor.tokenizer.save_pretrained(folder)
    return folder


class Reference:
    """The folder through transformers in-process, with its own processor, one input at a time."""

    def __init__(self, folder: Path) -> None:
        import torch
        from transformers import AutoModel, AutoProcessor

        self.torch = torch
        self.model = AutoModel.from_pretrained(folder).eval()
        self.processor = AutoProcessor.from_pretrained(folder)

    @staticmethod
    def _out(x, normalize: bool) -> np.ndarray:
        x = x.pooler_output.float().numpy()[0]
        return x / np.linalg.norm(x) if normalize else x

    def text(self, text: str, *, normalize: bool = True, padding: str = "max_length") -> np.ndarray:
        enc = self.processor(text=[text], padding=padding, max_length=TEXT_LEN, truncation=True, return_tensors="pt")
        with self.torch.inference_mode():
            return self._out(self.model.get_text_features(**enc), normalize)

    def pixels(self, data: bytes):
        from PIL import Image

        return self.processor(images=[Image.open(io.BytesIO(data)).convert("RGB")], return_tensors="pt")

    def image(self, data: bytes, *, normalize: bool = True) -> np.ndarray:
        with self.torch.inference_mode():
            return self._out(self.model.get_image_features(**self.pixels(data)), normalize)


@pytest.fixture(scope="module")
def folders(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    base = tmp_path_factory.mktemp("siglip")
    return {kind: build(kind, base / kind / "model") for kind in KINDS}


@pytest.fixture(scope="module")
def refs(folders: dict[str, Path]) -> dict[str, Reference]:
    return {kind: Reference(folder) for kind, folder in folders.items()}


@pytest.fixture(scope="module")
def images() -> list[bytes]:
    return make_images()


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory, folders: dict[str, Path]):
    """One daemon serving the three (float32: the comparison is with fp32 transformers)."""
    home = tmp_path_factory.mktemp("fleet-siglip")
    (home / "models.toml").write_text("".join(
        f'[models."{kind}"]\nsource = "path:{folders[kind].resolve()}"\ntask = "embed"\nruntime = "clip"\n'
        f'[models."{kind}".profile]\ndtype = "float32"\n' for kind in KINDS))
    env = {**os.environ, "FLEET_HOME": str(home), "HF_HUB_OFFLINE": "1"}
    for kind in KINDS:
        done = subprocess.run([sys.executable, "-m", "fleetctl", "pull", kind], env=env, capture_output=True,
                              text=True, timeout=120)
        assert done.returncode == 0, done.stderr
    d = start_daemon(home, extra_env={"FLEET_PRELOAD": ",".join(KINDS)})
    yield d
    d.stop()


def embed(d, body: dict) -> httpx.Response:
    import msgspec

    return httpx.post(d.url + "/v1/embed", content=msgspec.msgpack.encode(body),
                      headers={"Content-Type": "application/msgpack"}, timeout=60)


def cosines(got: np.ndarray, want: np.ndarray) -> np.ndarray:
    return np.sum(got * want, axis=1) / (np.linalg.norm(got, axis=1) * np.linalg.norm(want, axis=1))


@pytest.mark.parametrize("kind", KINDS)
def test_texts_and_images_equal_transformers(fleet, refs, images, kind):
    ref = refs[kind]
    inputs = [TEXTS[0], {"image": images[0]}, TEXTS[1], {"image": images[1]}, TEXTS[2],
              *({"image": b} for b in images[2:])]
    want = np.stack([ref.image(x["image"]) if isinstance(x, dict) else ref.text(x) for x in inputs])
    got = vectors(embed(fleet, {"model": kind, "inputs": inputs}))
    assert got.shape == want.shape
    cos = cosines(got, want)
    print(f"{kind}: min cosine {cos.min():.7f}, largest abs difference {np.abs(got - want).max():.2e}")
    assert cos.min() >= 0.9999
    np.testing.assert_allclose(got, want, atol=1e-5)


@pytest.mark.parametrize("kind", KINDS)
def test_unnormalized_vectors_are_the_features(fleet, refs, images, kind):
    ref = refs[kind]
    got = vectors(embed(fleet, {"model": kind, "inputs": [TEXTS[2], {"image": images[1]}], "normalize": False}))
    want = np.stack([ref.text(TEXTS[2], normalize=False), ref.image(images[1], normalize=False)])
    assert not np.allclose(np.linalg.norm(want, axis=1), 1.0, atol=1e-3)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("kind", KINDS)
def test_texts_are_padded_to_the_models_length(fleet, refs, kind):
    """The pooled text vector depends on the padding: fleet's is the max_length one,
    which differs from what padding to the longest text would give."""
    ref = refs[kind]
    got = vectors(embed(fleet, {"model": kind, "inputs": ["x"]}))[0]
    assert float(cosines(got[None], ref.text("x")[None])[0]) >= 0.9999
    assert float(cosines(got[None], ref.text("x", padding="longest")[None])[0]) < 0.999


def test_image_usage_counts_its_patches(fleet, refs, images):
    """SigLIP: every image is (32/8)^2 = 16 patches (no class token); NaFlex: each
    image's own patch grid under max_num_patches, as its processor lays it out."""
    for kind in KINDS:
        reply = embed(fleet, {"model": kind, "inputs": [{"image": b} for b in images]})
        assert reply.status_code == 200
        import msgspec

        used = msgspec.msgpack.decode(reply.content)["usage"]["input_tokens"]
        if kind == "siglip2-naflex":
            want = sum(int(refs[kind].pixels(b)["pixel_attention_mask"].sum()) for b in images)
            assert want < 256 * len(images)  # some images leave patches unused: the count is per image
        else:
            want = 16 * len(images)
        assert used == want, kind


def test_siglip_folders_are_detected_as_clip(folders):
    from fleet.pull_meta import Kind, detect_kind

    for kind in KINDS:
        assert detect_kind(folders[kind]) == Kind("embed", "clip"), kind
