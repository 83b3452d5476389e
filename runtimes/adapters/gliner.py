"""Zero-shot entity extraction with GLiNER's span model (task `extract`, runtime `gliner`).

fleet runs GLiNER itself on the transformers it serves everything else with (the
`gliner` package pins an older transformers): the backbone through transformers,
and the span head here, as the library builds it for `UniEncoderSpan` models
(`span_mode` "markerV0", the v2.x and PII checkpoints). Read from the model's
folder as `GLiNER.save_pretrained` writes it: `gliner_config.json` (with the
backbone's `encoder_config`), the tokenizer with `<<ENT>>`/`<<SEP>>` added,
and `model.safetensors` or `pytorch_model.bin`. A checkpoint as the hub holds the
v2.x ones (no `encoder_config`, no tokenizer) is read with the backbone's config
and tokenizer its pull fetched into `backbone/` (fleet.gliner_backbone), GLiNER's
tokens added to that tokenizer as many as the checkpoint's embeddings have rows
for (`backbone_tokens`), as the package does at load.

One forward, for texts that share a label list (the steps name the library's code):

1. words: the whitespace splitter's regex `\\w+(?:[-_]\\w+)*|\\S` (character
   offsets kept), cut to `max_len` words;
2. prompt: `<<ENT>> label` per label, then `<<SEP>>`, then the words, tokenized
   with `is_split_into_words=True`; the first subtoken of each text word marks it
   (`prepare_word_mask`, subtoken_pooling "first");
3. backbone hidden states, projected to `hidden_size` when it differs; label
   vectors at the `<<ENT>>` tokens, word vectors at the marked subtokens;
4. a BiLSTM over the words; span (i, i+k) for k < `max_width` is
   relu([start_mlp(w_i); end_mlp(w_i+k)]) through out_mlp (SpanMarkerV0);
   labels through prompt_mlp; score = sigmoid(span . label);
5. decoding: spans above `threshold` (the catalog entry's `threshold`, default
   0.5), greedily by score, none overlapping a kept one (flat_ner), in text order.

Texts with other label lists never share a forward pass (the labels are part of
every text's input): requests are grouped by their exact label list, and each
group runs in length-sorted micro-batches.

`pytorch_model.bin` is a pickle: the store holds one only when its entry allowed
pickle at pull; it is read with `torch.load(weights_only=True)`, torch's
restricted unpickler (tensors and plain containers; no code runs), as GLiNER
itself reads it. A `model.safetensors` beside it is preferred (the pull skips
the pickle then).
"""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Generator
from pathlib import Path
from typing import Any

import msgspec
import numpy as np

from fleet.errors import ModelLoadFailed
from fleet.gliner_backbone import BACKBONE_DIR
from fleet.messages import EntitySpan, ExtractResult, WorkError
from fleet.protocol import ExtractRequest
from fleet.runtimes.base import Adapter, BatchContext, Steps
from fleet.runtimes.adapters.hf_common import CHECK_SET, choose_dtype, footprint_bytes, labels_agree, to_device
from fleet.runtimes.adapters.batching import cut_to_bound, input_too_long, micro_batches, over_char_bound

log = logging.getLogger("fleet.worker")

#: Entity types one request may ask for (each is part of every text's prompt).
MAX_LABELS = 64
MAX_LABEL_CHARS = 100
DEFAULT_THRESHOLD = 0.5
#: GLiNER's WhitespaceTokenSplitter: words, hyphen/underscore compounds, any other character alone.
WORDS = re.compile(r"\w+(?:[-_]\w+)*|\S")
#: Labels the reduced-precision check at load asks for.
CHECK_LABELS = ["person", "organization", "location", "date"]


class GlinerConfig(msgspec.Struct, kw_only=True):
    """The fields of `gliner_config.json` this runtime reads (the rest are training settings)."""

    model_name: str = ""
    hidden_size: int = 512
    max_width: int = 12
    max_len: int = 384
    span_mode: str = "markerV0"
    subtoken_pooling: str = "first"
    words_splitter_type: str = "whitespace"
    num_rnn_layers: int = 1
    embed_ent_token: bool = True
    class_token_index: int = -1
    ent_token: str = "<<ENT>>"
    sep_token: str = "<<SEP>>"
    vocab_size: int = -1
    fuse_layers: bool = False
    encoder_config: dict[str, Any] | None = None
    span_encoder_config: dict[str, Any] | None = None
    labels_encoder: str | None = None
    labels_decoder: str | None = None
    relations_layer: str | None = None
    attn_implementation: str | None = msgspec.field(default=None, name="_attn_implementation")


def read_config(name: str, folder: Path) -> GlinerConfig:
    """The model's GLiNER config; ModelLoadFailed for a variant this runtime does not run."""
    try:
        cfg = msgspec.json.decode((folder / "gliner_config.json").read_bytes(), type=GlinerConfig)
    except FileNotFoundError:
        raise ModelLoadFailed(f"{name!r} has no gliner_config.json; runtime gliner serves GLiNER folders") from None
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise ModelLoadFailed(f"{name!r}: gliner_config.json does not read: {exc}") from None
    unsupported = [
        (cfg.labels_encoder is not None, "labels_encoder (bi-encoder GLiNER)"),
        (cfg.labels_decoder is not None, "labels_decoder (GLiNER with a label decoder)"),
        (cfg.relations_layer is not None, "relations_layer (GLiNER relation extraction)"),
        (cfg.span_mode != "markerV0", f"span_mode {cfg.span_mode!r}"),
        (cfg.subtoken_pooling != "first", f"subtoken_pooling {cfg.subtoken_pooling!r}"),
        (cfg.words_splitter_type != "whitespace", f"words_splitter_type {cfg.words_splitter_type!r}"),
        (cfg.fuse_layers, "fuse_layers"),
        (cfg.span_encoder_config is not None, "span_encoder_config"),
    ]
    refused = [what for bad, what in unsupported if bad]
    if refused:
        raise ModelLoadFailed(f"{name!r}: runtime gliner runs the uni-encoder span model (span_mode markerV0, "
                              f"first-subtoken pooling, whitespace words); this one has {', '.join(refused)}")
    backbone = folder / BACKBONE_DIR
    if cfg.encoder_config is None:
        if not (backbone / "config.json").is_file():
            raise ModelLoadFailed(
                f"{name!r}: gliner_config.json has no encoder_config and the folder no {BACKBONE_DIR}/ with "
                f"the backbone's ({cfg.model_name!r}) config: pull the model again (a pull fetches it)")
        cfg.encoder_config = json.loads((backbone / "config.json").read_text())
    if cfg.class_token_index < 0 and own_tokenizer(folder):
        raise ModelLoadFailed(f"{name!r}: gliner_config.json has no class_token_index (the id of "
                              f"{cfg.ent_token!r}); the model was saved before its prompt tokens were added")
    return cfg


def own_tokenizer(folder: Path) -> bool:
    """Whether the folder has GLiNER's tokenizer (its tokens added), not only its backbone's."""
    return (folder / "tokenizer_config.json").is_file()


def backbone_tokens(cfg: GlinerConfig, added: int) -> list[str]:
    """The tokens GLiNER added to its backbone's tokenizer, told by how many rows the
    checkpoint's embeddings have beyond it: [<<ENT>>, <<SEP>>] (gliner < 0.2.2x, the hub's
    v2.x checkpoints), or with "[FLERT]" before them (current gliner)."""
    return {2: [cfg.ent_token, cfg.sep_token], 3: ["[FLERT]", cfg.ent_token, cfg.sep_token]}.get(added, [])


def embedding_rows(state: dict[str, Any]) -> int | None:
    """Rows of the backbone's token embeddings in a GLiNER state dict."""
    prefix = "token_rep_layer.bert_layer.model."
    for key in (prefix + "embeddings.word_embeddings.weight", prefix + "shared.weight"):
        if key in state:
            return int(state[key].shape[0])
    return None


def split_words(text: str, max_words: int) -> tuple[list[str], list[int], list[int]]:
    """(words, start offsets, end offsets) of `text`, at most `max_words`."""
    words, starts, ends = [], [], []
    for m in WORDS.finditer(text):
        if len(words) == max_words:
            break
        words.append(m.group())
        starts.append(m.start())
        ends.append(m.end())
    return words, starts, ends


def count_words(text: str) -> int:
    return sum(1 for _ in WORDS.finditer(text))


def word_marks(word_ids: np.ndarray, skip: int) -> np.ndarray:
    """GLiNER's `prepare_word_mask` ("first"), vectorised: per token, the 1-based
    index of the text word whose first subtoken it is, else 0.

    `word_ids` is (rows, tokens) float with NaN for special and padding tokens.
    Words are counted as they appear (a word that produced no token is not
    counted), and the first `skip` appearing words are the prompt's.
    """
    prev = np.full_like(word_ids, np.nan)
    prev[:, 1:] = word_ids[:, :-1]
    real = ~np.isnan(word_ids)
    first = real & (word_ids != prev)  # NaN != x: the token after a special token starts a word
    seen = np.cumsum(first, axis=1)
    return np.where(first & (seen > skip), seen - skip, 0)


def greedy_flat(starts: np.ndarray, ends: np.ndarray, scores: np.ndarray, n_words: int) -> np.ndarray:
    """Indices of the spans GLiNER's `greedy_search` keeps (flat_ner, one label per
    span): by score, highest first (ties in candidate order), each kept unless it
    shares a word with a kept one; returned in text order.

    Sequential by nature (each choice depends on the ones before it), as the
    library's; a word occupancy array makes each check O(span width).
    """
    taken = np.zeros(n_words, dtype=bool)
    kept = []
    for j in np.argsort(-scores, kind="stable").tolist():
        s, e = int(starts[j]), int(ends[j]) + 1
        if not taken[s:e].any():
            taken[s:e] = True
            kept.append(j)
    kept_arr = np.asarray(kept, dtype=np.int64)
    return kept_arr[np.argsort(starts[kept_arr], kind="stable")]


def backbone_of(cfg: GlinerConfig) -> Any:
    """The backbone with random weights (its own come with the checkpoint), as GLiNER builds it."""
    import transformers

    enc = dict(cfg.encoder_config or {})
    enc.setdefault("model_type", "deberta-v2")
    if cfg.attn_implementation is not None:
        enc["_attn_implementation"] = cfg.attn_implementation
    config = transformers.AutoConfig.for_model(**enc)
    kind = type(config).__name__
    if kind in ("T5Config", "MT5Config"):
        return transformers.T5EncoderModel(config)
    if kind == "DebertaV2Config":
        return transformers.DebertaV2Model(config)
    return transformers.AutoModel.from_config(config)


def span_network(cfg: GlinerConfig, backbone: Any) -> Any:
    """GLiNER's UniEncoderSpanModel as nested ModuleDicts, named as its state dict is."""
    from torch import nn

    def mlp(d_in: int, d_out: int) -> Any:  # create_projection_layer (dropout is inert at inference)
        return nn.Sequential(nn.Linear(d_in, d_out * 4), nn.ReLU(), nn.Dropout(0.0), nn.Linear(d_out * 4, d_out))

    d = cfg.hidden_size
    token_rep = nn.ModuleDict({"bert_layer": nn.ModuleDict({"model": backbone})})
    if backbone.config.hidden_size != d:
        token_rep["projection"] = nn.Linear(backbone.config.hidden_size, d)
    net = nn.ModuleDict({
        "token_rep_layer": token_rep,
        "span_rep_layer": nn.ModuleDict({"span_rep_layer": nn.ModuleDict({
            "project_start": mlp(d, d), "project_end": mlp(d, d), "out_project": mlp(2 * d, d)})}),
        "prompt_rep_layer": mlp(d, d),
    })
    if cfg.num_rnn_layers > 0:
        net["rnn"] = nn.ModuleDict({"lstm": nn.LSTM(d, d // 2, num_layers=cfg.num_rnn_layers,
                                                    bidirectional=True, batch_first=True)})
    return net


def read_weights(name: str, folder: Path) -> dict[str, Any]:
    import torch

    if (folder / "model.safetensors").is_file():
        from safetensors.torch import load_file

        return load_file(str(folder / "model.safetensors"))
    if (folder / "pytorch_model.bin").is_file():
        try:
            return torch.load(folder / "pytorch_model.bin", map_location="cpu", weights_only=True)
        except Exception as exc:  # the unpickler raises many types for a file that is not plain tensors
            raise ModelLoadFailed(f"{name!r}: pytorch_model.bin does not read as plain tensors: {exc}") from None
    raise ModelLoadFailed(f"{name!r} has no model.safetensors or pytorch_model.bin")


class GlinerExtractor(Adapter):
    request_type = ExtractRequest

    def load(self) -> None:
        import torch
        import transformers

        self._torch = torch
        name, folder = self.spec.name, Path(self.spec.path)
        self.cfg = cfg = read_config(name, folder)
        state = {k.removeprefix("_orig_mod."): v for k, v in read_weights(name, folder).items()}
        own = own_tokenizer(folder)
        try:
            tok = transformers.AutoTokenizer.from_pretrained(str(folder if own else folder / BACKBONE_DIR),
                                                             local_files_only=True)
        except Exception as exc:  # the library raises many types for a missing or bad tokenizer
            raise ModelLoadFailed(f"cannot load the tokenizer of {name!r} from its folder: {exc}") from exc
        if not own:
            # A hub checkpoint (fleet.gliner_backbone): GLiNER's tokens are added to its
            # backbone's tokenizer and the embeddings sized to it, as the package does at load.
            rows = embedding_rows(state)
            tokens = backbone_tokens(cfg, (rows or 0) - len(tok))
            if not tokens:
                raise ModelLoadFailed(f"{name!r}: the checkpoint's {rows} token embeddings do not fit its "
                                      f"backbone's tokenizer ({len(tok)} tokens) with GLiNER's tokens added")
            tok.add_tokens(tokens, special_tokens=True)
            cfg.class_token_index = tok.convert_tokens_to_ids(cfg.ent_token)
            cfg.encoder_config = {**(cfg.encoder_config or {}), "vocab_size": len(tok)}
        if not getattr(tok, "is_fast", False):
            raise ModelLoadFailed(f"{name!r} has no fast tokenizer (tokenizer.json): word marks need one")
        # As GLiNER sets its tokenizer up (`_set_tokenizer_spec_tokens`, `_check_and_set_special_tokens`).
        if hasattr(tok, "add_bos_token") and tok.bos_token_id is not None:
            tok.add_bos_token = True
        if hasattr(tok, "add_eos_token") and tok.eos_token_id is not None:
            tok.add_eos_token = True
        if tok.pad_token is None and tok.eos_token is not None:
            tok.pad_token = tok.eos_token
        if tok.convert_tokens_to_ids(cfg.ent_token) != cfg.class_token_index:
            raise ModelLoadFailed(f"{name!r}: the tokenizer's id of {cfg.ent_token!r} is not class_token_index "
                                  f"{cfg.class_token_index} of gliner_config.json")
        self.tokenizer = tok
        #: Words per text the model reads (GLiNER's `max_len`); the rest is cut.
        self.max_words = cfg.max_len
        threshold = self.spec.extra.get("threshold")  # the catalog entry's `threshold`
        self.threshold = DEFAULT_THRESHOLD if threshold is None else float(threshold)
        # Structure, then weights: every parameter must come from the checkpoint.
        try:
            net = span_network(cfg, backbone_of(cfg))
        except Exception as exc:  # an encoder_config transformers cannot build
            raise ModelLoadFailed(f"{name!r}: cannot build the backbone from encoder_config: {exc}") from exc
        missing, unexpected = net.load_state_dict(state, strict=False)
        if missing:
            raise ModelLoadFailed(f"{name!r}: the checkpoint lacks {len(missing)} weights of the span model "
                                  f"({', '.join(missing[:4])}{' ...' if len(missing) > 4 else ''})")
        if unexpected:
            # Layers the uni-encoder span model builds but never runs (cross_fuser) or buffers.
            log.info("%s: %d checkpoint tensors unused (%s ...)", name, len(unexpected), unexpected[0])
        net = net.to(self.device).eval()
        self.model, self.dtype = choose_dtype(
            net, name=name, wanted=self.spec.profile.dtype, device=self.device,
            run=self._check_probs, agree=labels_agree(max_prob_diff=0.02), kept_in=self.spec.path,
        )

    def _check_probs(self, net: Any) -> np.ndarray:
        """Span probabilities (spans inside their text, labels) over the check set, in one forward."""
        words = [split_words(text, self.max_words)[0] for text in CHECK_SET]
        probs = self._probs(net, words, CHECK_LABELS)
        ends = np.arange(probs.shape[1])[None, :, None] + np.arange(probs.shape[2])[None, None, :]
        return probs[ends < np.array([len(w) for w in words])[:, None, None]]

    def footprint_bytes(self) -> int:
        return footprint_bytes(self.model)

    def refuse(self, req: ExtractRequest) -> WorkError | None:
        if not req.labels:
            return WorkError("bad_request", f"{self.spec.name} is a zero-shot extraction model: send `labels`, "
                                            "the entity types to look for")
        if len(req.labels) > MAX_LABELS:
            return WorkError("bad_request", f"{len(req.labels)} labels is more than the limit of {MAX_LABELS}")
        bad = next((x for x in req.labels if not x.strip() or len(x) > MAX_LABEL_CHARS), None)
        if bad is not None:
            return WorkError("bad_request", f"label {bad!r} must be 1 to {MAX_LABEL_CHARS} characters")
        if len(set(req.labels)) != len(req.labels):
            return WorkError("bad_request", "`labels` has duplicates")
        if not req.truncate:
            if over_text := over_char_bound(self.spec.name, req.inputs, self.max_words):
                return over_text
            words = [count_words(t) for t in req.inputs]
            over = next((i for i, n in enumerate(words) if n > self.max_words), None)
            if over is not None:
                return input_too_long(self.spec.name, f"input {over}", words[over], self.max_words, "words")
        return None

    def batch(self, requests: list[ExtractRequest], ctx: BatchContext) -> Steps:
        # 1. Requests that cannot run fail alone; the others group by their labels.
        results: list[Any] = [self.refuse(r) for r in requests]
        groups: dict[tuple[str, ...], list[int]] = {}
        for i, r in enumerate(requests):
            if results[i] is None:
                groups.setdefault(tuple(r.labels), []).append(i)
        # 2. One run per label list over all of its requests' texts; split back.
        for labels, members in groups.items():
            texts = cut_to_bound([t for i in members for t in requests[i].inputs], self.max_words)
            spans, words = yield from self.extract(texts, list(labels), ctx=ctx)
            at = 0
            for i in members:
                n = len(requests[i].inputs)
                results[i] = ExtractResult(spans[at : at + n], int(words[at : at + n].sum()))
                at += n
        return results

    def extract(self, texts: list[str], labels: list[str], *, ctx: BatchContext,
                ) -> Generator[None, None, tuple[list[list[EntitySpan]], np.ndarray]]:
        """Spans per text (text order) and words read per text; texts run in
        length-sorted micro-batches, the generator yielding before each (the
        worker's step loop decides there whether the rest is wanted: `Adapter.batch`).
        A text without a word has no span and no forward."""
        n = len(texts)
        out: list[list[EntitySpan]] = [[] for _ in range(n)]
        split = [split_words(t, self.max_words) for t in texts]
        words_read = np.fromiter((len(w) for w, _, _ in split), dtype=np.int64, count=n)
        live = np.flatnonzero(words_read > 0)
        lengths = np.fromiter((len(texts[j]) for j in live), dtype=np.int64, count=len(live))
        for part in micro_batches(lengths, self.micro_items(ctx), self.fixed_chars()):
            yield
            idx = live[part]
            probs = self._probs(self.model, [split[j][0] for j in idx], labels)
            for row, j in enumerate(idx.tolist()):
                out[j] = self._decode(probs[row], split[j], labels)
        return out, words_read

    def _probs(self, net: Any, words: list[list[str]], labels: list[str]) -> np.ndarray:
        """Span probabilities (texts, max words, max_width, labels), float32; spans
        past a text's end hold values nobody reads."""
        torch, cfg = self._torch, self.cfg
        prompt = [x for label in labels for x in (cfg.ent_token, label)] + [cfg.sep_token]
        enc = self.tokenizer([prompt + w for w in words], is_split_into_words=True, truncation=True,
                             padding="longest", return_tensors="pt")
        word_ids = np.array([enc.word_ids(i) for i in range(len(words))], dtype=np.float64)  # None -> NaN
        marks = torch.from_numpy(word_marks(word_ids, len(prompt)))
        n_words = torch.tensor([len(w) for w in words])
        feats = to_device({"input_ids": enc["input_ids"], "attention_mask": enc["attention_mask"],
                           "marks": marks}, self.device)
        with torch.inference_mode():
            return span_probs(torch, net, cfg, feats["input_ids"], feats["attention_mask"], feats["marks"],
                              n_words).float().cpu().numpy()

    def _decode(self, probs: np.ndarray, split: tuple[list[str], list[int], list[int]],
                labels: list[str]) -> list[EntitySpan]:
        words, starts, ends = split
        n = len(words)
        k = probs.shape[1]
        inside = (np.arange(probs.shape[0])[:, None] + np.arange(k)[None, :]) < n
        s, w, c = np.nonzero((probs > self.threshold) & inside[:, :, None])
        if not len(s):
            return []
        scores = probs[s, w, c]
        keep = greedy_flat(s, s + w, scores, n)
        return [EntitySpan(labels[c[j]], starts[s[j]], ends[s[j] + w[j]], float(scores[j])) for j in keep.tolist()]

    def unload(self) -> None:
        self.model = None


def span_probs(torch: Any, net: Any, cfg: GlinerConfig, ids: Any, attn: Any, marks: Any, n_words: Any) -> Any:
    """sigmoid(span . label) for one micro-batch: (rows, max words, max_width, labels)."""
    token_rep = net["token_rep_layer"]
    h = token_rep["bert_layer"]["model"](input_ids=ids, attention_mask=attn)[0]
    if "projection" in token_rep:
        h = token_rep["projection"](h)
    rows, _, d = h.shape
    # Label vectors: the hidden state at each <<ENT>> (or the token after it).
    is_label = ids.eq(cfg.class_token_index) & attn.gt(0)
    per_row = is_label.sum(dim=1)
    slots = torch.arange(int(per_row.max()), device=h.device).expand(rows, -1) < per_row[:, None]
    at_b, at_t = torch.where(is_label)
    labels = h.new_zeros((rows, slots.shape[1], d))
    labels[slots] = h[at_b, at_t + (0 if cfg.embed_ent_token else 1)]
    # Word vectors: the hidden state at each word's first subtoken.
    n_max = int(n_words.max())
    words = h.new_zeros((rows, n_max, d))
    wb, wt = torch.where(marks > 0)
    words[wb, marks[wb, wt] - 1] = h[wb, wt]
    if "rnn" in net:
        packed = torch.nn.utils.rnn.pack_padded_sequence(words, n_words.cpu(), batch_first=True, enforce_sorted=False)
        words, _ = torch.nn.utils.rnn.pad_packed_sequence(net["rnn"]["lstm"](packed)[0], batch_first=True,
                                                          total_length=n_max)
    # SpanMarkerV0 over every (start, width); spans past a text's end point at word 0, as in the library.
    k = cfg.max_width
    span = net["span_rep_layer"]["span_rep_layer"]
    start = torch.arange(n_max, device=h.device).repeat_interleave(k)
    end = start + torch.arange(k, device=h.device).repeat(n_max)
    inside = end[None, :] < n_words.to(h.device)[:, None]
    start, end = start[None, :] * inside, end[None, :] * inside
    first = span["project_start"](words).gather(1, start[..., None].expand(-1, -1, d))
    last = span["project_end"](words).gather(1, end[..., None].expand(-1, -1, d))
    spans = span["out_project"](torch.cat([first, last], dim=-1).relu()).view(rows, n_max, k, d)
    scores = torch.einsum("BLKD,BCD->BLKC", spans, net["prompt_rep_layer"](labels))
    return scores.sigmoid()
