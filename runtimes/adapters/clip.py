"""Image and text embeddings in one space (task `embed`, runtime `clip`).

Any transformers folder whose model has `get_image_features` and
`get_text_features` (CLIPModel, SiglipModel, Siglip2Model and other dual
encoders of that shape) with its tokenizer and image processor
(`preprocessor_config.json`). An item of `inputs` is a text or `{image: bytes}`;
both kinds of one batch run in the same `batch`, texts through the text
tower and images through the vision tower.

SigLIP and SigLIP 2 (model types `siglip`, which SigLIP 2's fixed-resolution
checkpoints use too, and `siglip2`, the NaFlex ones) read the text vector at
the last position, which is padding for a short text: they were trained with
every text padded to the text tower's length (64), so texts are padded to
`max_length`, never to the batch's longest. Images get what the model's image
processor returns (NaFlex: patches, `pixel_attention_mask` and
`spatial_shapes` at the processor's `max_num_patches`), as
`get_image_features` takes them.

Images arrive as the encoded file the client sent (the queue payload carries
it untouched); they are decoded here, with Pillow, never in the API process.
An image that does not decode fails its request with `bad_request`; one over
MAX_IMAGE_PIXELS fails it with `payload_too_large` before any pixel is decoded.
"""

from __future__ import annotations

import inspect
import io
from collections.abc import Generator
from typing import Any

import numpy as np

from fleet.errors import BadRequest, ModelLoadFailed, PayloadTooLarge
from fleet.protocol import EmbedRequest, ImageInput
from fleet.runtimes.base import Adapter, BatchContext, Steps, run_through
from fleet.runtimes.adapters.batching import (
    char_bound, cut_to_bound, first_too_long, input_too_long, micro_batches, no_prompts,
)
from fleet.runtimes.adapters.dense import finish_dense, too_wide
from fleet.runtimes.adapters.hf_common import (
    CHECK_SET, choose_dtype, footprint_bytes, load_transformers, max_length, min_cosine, to_device,
)
from fleet.messages import WorkError

#: Pixels (width x height) an image may have: 40 M is a 7300 x 5500 photo. The
#: size is read from the file header, so a small file that would decode into
#: gigabytes (a decompression bomb) is refused before it is decoded.
MAX_IMAGE_PIXELS = 40_000_000
#: A reduced dtype is kept when every check text and image keeps this cosine to fp32.
MIN_COSINE = 0.999
#: Model types whose text vector depends on padding every text to the text tower's length.
PAD_TO_MAX_LENGTH = frozenset({"siglip", "siglip2"})
#: What an image processor may return that `get_image_features` takes.
IMAGE_INPUTS = ("pixel_values", "pixel_attention_mask", "spatial_shapes")


def check_images() -> list[np.ndarray]:
    """Images for the dtype check at load (no files needed): a gradient, a
    checkerboard and seeded noise, so a dtype that only works on flat images fails."""
    ramp = np.linspace(0, 255, 64, dtype=np.float32)
    gradient = np.stack(np.broadcast_arrays(ramp[:, None], ramp[None, :], 128.0), axis=-1)
    board = np.kron((np.indices((8, 8)).sum(axis=0) % 2) * 255.0, np.ones((8, 8)))[..., None].repeat(3, axis=-1)
    noise = np.random.default_rng(0).integers(0, 256, (48, 80, 3))
    return [a.astype(np.uint8) for a in (gradient, board, noise)]


def decode_image(index: int, data: bytes) -> Any:
    """The RGB Pillow image of input `index`; BadRequest if it does not decode,
    PayloadTooLarge if it has too many pixels (checked from the header first)."""
    from PIL import Image, UnidentifiedImageError

    try:
        img = Image.open(io.BytesIO(data))
        if img.width * img.height > MAX_IMAGE_PIXELS:
            raise PayloadTooLarge(f"input {index}: image is {img.width}x{img.height} pixels; at most "
                                  f"{MAX_IMAGE_PIXELS} pixels are taken")
        return img.convert("RGB")  # decodes now: a truncated file fails here
    except Image.DecompressionBombError as exc:
        raise PayloadTooLarge(f"input {index}: {exc}") from None
    except (UnidentifiedImageError, OSError, ValueError, SyntaxError) as exc:
        # Pillow raises OSError for truncated data, SyntaxError/ValueError for broken headers.
        raise BadRequest(f"input {index}: cannot decode the image ({type(exc).__name__}: {exc})") from None


class ClipEmbedder(Adapter):
    request_type = EmbedRequest

    def load(self) -> None:
        import torch
        import transformers

        self._torch = torch
        model, self.tokenizer = load_transformers(self.spec, self.device, "AutoModel")
        if not (hasattr(model, "get_image_features") and hasattr(model, "get_text_features")):
            raise ModelLoadFailed(f"{self.spec.name!r} ({type(model).__name__}) has no image and text towers "
                                  "(get_image_features / get_text_features); runtime clip needs a CLIP-style model")
        try:
            self.processor = transformers.AutoImageProcessor.from_pretrained(str(self.spec.path), local_files_only=True)
        except Exception as exc:  # the library raises many types for a missing or bad preprocessor_config.json
            raise ModelLoadFailed(f"cannot load the image processor of {self.spec.name!r}: {exc}") from exc
        text_config = getattr(model.config, "text_config", model.config)
        self.max_seq_len = max_length(self.spec, self.tokenizer, text_config)
        #: `padding` of every text batch: the model's length for SigLIP, else the batch's longest.
        self.padding = "max_length" if model.config.model_type in PAD_TO_MAX_LENGTH else True
        takes = inspect.signature(model.get_image_features).parameters
        self.image_inputs = [k for k in IMAGE_INPUTS if k in takes]
        embeddings = getattr(getattr(model, "vision_model", None), "embeddings", None)
        #: Vision positions per image (CLIP: patches + class token; SigLIP: patches), reported
        #: as its input tokens; a NaFlex model counts each image's real patches instead.
        self.image_tokens = int(getattr(embeddings, "num_positions", 1))
        self.model, self.dtype = choose_dtype(
            model, name=self.spec.name, wanted=self.spec.profile.dtype, device=self.device,
            run=self._check_vectors, agree=min_cosine(MIN_COSINE), kept_in=self.spec.path,
        )
        self.dim = int(self._check_vectors(self.model).shape[1])  # also the warm-up forward of both towers

    def _check_vectors(self, model: Any) -> np.ndarray:
        texts, _ = run_through(self._texts(model, CHECK_SET, ctx=BatchContext()))
        images, _ = run_through(self._images(model, check_images(), ctx=BatchContext()))
        rows = np.concatenate([texts, images])
        return rows / np.maximum(np.linalg.norm(rows, axis=1, keepdims=True), 1e-12)

    def footprint_bytes(self) -> int:
        return footprint_bytes(self.model)

    def prepare(self, req: EmbedRequest) -> tuple[list[Any], WorkError | None]:
        """(inputs with images decoded, None) or ([], why the request fails alone)."""
        if req.output != "dense":
            return [], WorkError("bad_request", f"{self.spec.name} gives one dense vector per input "
                                                f"(output 'dense'), not {req.output!r}")
        if refused := no_prompts(self.spec.name, self.spec.runtime, req):
            return [], refused
        if (wide := too_wide(self.spec.name, req, self.dim)) is not None:
            return [], wide
        items: list[Any] = []
        texts = []
        for i, x in enumerate(req.inputs):
            if x.__class__ is ImageInput:
                try:
                    items.append(decode_image(i, x.image))
                except (BadRequest, PayloadTooLarge) as exc:
                    return [], WorkError(exc.code, exc.message)
            else:
                items.append(x)
                texts.append((i, x))
        if not req.truncate and texts:
            bound = char_bound(self.max_seq_len)
            if (over := next((i for i, t in texts if len(t) > bound), None)) is not None:
                return [], input_too_long(self.spec.name, f"input {over}", len(req.inputs[over]), bound, "characters")
            lengths = self.tokenizer([t for _, t in texts], truncation=False, return_length=True)["length"]
            too_long = first_too_long(lengths, self.max_seq_len)
            if too_long is not None:
                return [], input_too_long(self.spec.name, f"input {texts[too_long[0]][0]}", too_long[1],
                                          self.max_seq_len)
        return items, None

    def batch(self, requests: list[EmbedRequest], ctx: BatchContext) -> Steps:
        # 1. Decode images and check inputs per request: a bad one fails alone.
        results: list[Any] = [None] * len(requests)
        live, items = [], []
        for i, req in enumerate(requests):
            prepared, error = self.prepare(req)
            if error is not None:
                results[i] = error
            else:
                live.append(i)
                items += prepared
        if not live:
            return results
        # 2. Texts through the text tower, images through the vision tower, each
        #    micro-batched, scattered back into input order.
        is_text = np.fromiter((x.__class__ is str for x in items), dtype=bool, count=len(items))
        text_at, image_at = np.flatnonzero(is_text), np.flatnonzero(~is_text)
        vectors = np.empty((len(items), self.dim), dtype=np.float32)
        tokens = np.full(len(items), self.image_tokens, dtype=np.int64)
        if len(text_at):
            vectors[text_at], tokens[text_at] = yield from self._texts(self.model, [items[j] for j in text_at],
                                                                       ctx=ctx)
        if len(image_at):
            vectors[image_at], tokens[image_at] = yield from self._images(self.model, [items[j] for j in image_at],
                                                                          ctx=ctx)
        # 3. Cut, normalise and convert per request, and split back (runtimes.adapters.dense).
        finish_dense(vectors, tokens, requests, live, results)
        return results

    def _texts(self, model: Any, texts: list[str], *, ctx: BatchContext,
               ) -> Generator[None, None, tuple[np.ndarray, np.ndarray]]:
        """(n, d) float32 text features in input order, tokens per text. Texts run
        in length-sorted micro-batches, the generator yielding before each (the
        worker's step loop decides there whether the rest is wanted: `Adapter.batch`),
        outside inference mode (a thread-local switch another batch's steps may flip
        between)."""
        torch = self._torch
        out, used = None, np.empty(len(texts), dtype=np.int64)
        lengths = np.fromiter((len(t) for t in texts), dtype=np.int64, count=len(texts))
        for idx in micro_batches(lengths, self.micro_items(ctx), self.fixed_chars()):
            yield
            with torch.inference_mode():
                enc = self.tokenizer(cut_to_bound([texts[j] for j in idx], self.max_seq_len), padding=self.padding,
                                     truncation=True, max_length=self.max_seq_len, return_tensors="pt")
                # Only what a text tower takes (a BERT-style tokenizer adds token_type_ids).
                enc = to_device({k: enc[k] for k in ("input_ids", "attention_mask") if k in enc}, self.device)
                feats = features(model.get_text_features(**enc)).float().cpu().numpy()
                if out is None:
                    out = np.empty((len(texts), feats.shape[1]), dtype=np.float32)
                out[idx] = feats
                used[idx] = enc["attention_mask"].sum(dim=1).cpu().numpy()
        return out, used

    def _images(self, model: Any, images: list[Any], *, ctx: BatchContext,
                ) -> Generator[None, None, tuple[np.ndarray, np.ndarray]]:
        """(n, d) float32 image features in order, vision positions per image
        (images are resized to one shape or patch budget, so micro-batches need
        no length sort). Images run in micro-batches, the generator yielding before
        each (the worker's step loop decides there whether the rest is wanted:
        `Adapter.batch`), outside inference mode (a thread-local switch another
        batch's steps may flip between)."""
        torch = self._torch
        step = self.micro_items(ctx)
        parts = []
        used = np.full(len(images), self.image_tokens, dtype=np.int64)
        dtype = next(model.parameters()).dtype
        for lo in range(0, len(images), step):
            yield
            with torch.inference_mode():
                out = self.processor(images=images[lo : lo + step], return_tensors="pt")
                inputs = to_device({k: out[k] for k in self.image_inputs if k in out}, self.device)
                inputs["pixel_values"] = inputs["pixel_values"].to(dtype)
                if "pixel_attention_mask" in inputs:
                    used[lo : lo + step] = out["pixel_attention_mask"].sum(dim=1).numpy()
                parts.append(features(model.get_image_features(**inputs)).float().cpu().numpy())
        return np.concatenate(parts), used

    def unload(self) -> None:
        self.model = None


def features(out: Any) -> Any:
    """The projected features: a tensor (transformers 4) or the output's `pooler_output` (5)."""
    return out if hasattr(out, "dim") else out.pooler_output
