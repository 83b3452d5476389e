"""Typed decisions from a Laya checkpoint (task `decide`, runtime `laya`): a
bidirectional encoder (ModernBERT in the published ones) with the package's decision
head, read the way the `laya` package reads it, so its answers are the package's
(tests/test_decide_heads.py holds fleet to it on a tiny random checkpoint).

A checkpoint is the folder `laya.train.save_checkpoint` writes and pull recognises
by its `rl_agent_config.json`: the config (head layers, token budgets, the shipped
temperatures), `model.safetensors` (encoder and heads, fp16), `encoder/` (the
encoder's config) and `tokenizer/`.

One row per question, each its own sequence (the question is read before the state,
so nothing is shared between questions):

    [CLS] "<kind> question: <instructions>" [SEP] [MASK] option [MASK] option ... [SEP] state [SEP]

Options are rendered as the package renders them ("name: description", "level i:
...", "false: ..." / "true: ..." with its default descriptions), each cut to 48
tokens, all cut further when they overrun the head's budget (`head_max_len`): that is
how the checkpoint reads a question. The state is not cut: a state that does not fit
`max_len` after the question fails its request (`input_too_long`), where the package
would drop its end. The encoder's states, plus a per-kind embedding, go through the
head's transformer layers; the scorer reads each option at its [MASK]; a softmax over
the temperature gives the answer. The temperature is fleet's calibration for the
kind and option count where `fleetctl calibrate` fitted one, else the checkpoint's
(per option bucket, else per kind, held to the package's [0.5, 5]). The package's
action head (whether to defer) is not read.
"""

from __future__ import annotations

import json
import logging
import math
from typing import Any

import numpy as np

from fleet.decisions import DecideRequest, DecideResult
from fleet.errors import FleetError, ModelLoadFailed
from fleet.runtimes.base import Adapter, BatchContext, Steps
from fleet.runtimes.adapters.decide import probe_decision, too_long
from fleet.runtimes.device import causal_lm_dtype
from fleet.runtimes.adapters.decide_heads import Parts, answer, question_parts, state_value
from fleet.runtimes.adapters.hf_common import footprint_bytes
from fleet.runtimes.adapters.batching import micro_batches

log = logging.getLogger("fleet.worker")

CONFIG = "rl_agent_config.json"
#: The package's question-type ids (the head's type embedding) and temperature order.
QTYPES = {"choice": 0, "score": 1, "noul": 2}
#: Tokens an option keeps before the head budget cuts further (the package's cap).
OPTION_TOKENS = 48
#: The package's bounds on an applied temperature (a sharper one is not honest).
TEMP_MIN, TEMP_MAX = 0.5, 5.0
NOUL_DEFAULTS = ("no, the statement does not hold", "yes, the statement holds")


def clamp_temperature(t: Any) -> float:
    """`t` held to [TEMP_MIN, TEMP_MAX]; 1.0 where it is no finite number (as the package)."""
    if isinstance(t, bool) or not isinstance(t, (int, float)) or not math.isfinite(t):
        return 1.0
    return min(TEMP_MAX, max(TEMP_MIN, float(t)))


def option_bucket(kind: str, k: int) -> str:
    """The package's temperature key of `k` options (`kind:2`, `kind:3-5`, `kind:6-10`, `kind:11+`)."""
    return f"{kind}:{'2' if k <= 2 else '3-5' if k <= 5 else '6-10' if k <= 10 else '11+'}"


def option_lines(parts: Parts) -> list[str]:
    """The options' text in the package's words (`laya.common.render_options`)."""
    if parts.kind == "choice":
        return [key if desc is None else f"{key}: {desc}" for key, desc in zip(parts.keys, parts.descriptions)]
    if parts.kind == "score":
        return [f"level {i}: {level}" for i, level in enumerate(parts.descriptions)]
    return [f"{key}: {desc if desc is not None else default}"
            for key, desc, default in zip(parts.keys, parts.descriptions, NOUL_DEFAULTS)]


def head_ids(cls: int, sep: int, mask: int, question: list[int], options: list[list[int]],
             budget: int) -> tuple[list[int], list[int]]:
    """(the head's ids, each option's [MASK] position): `laya.common.build_head`'s cuts."""
    opts = [[mask, *o[:OPTION_TOKENS]] for o in options]
    room = budget - sum(map(len, opts))
    if room < 16:
        per = max(4, (budget - 16) // max(1, len(opts)))
        opts = [o[:per] for o in opts]
        room = budget - sum(map(len, opts))
    ids = [cls, *question[: max(8, room)], sep]
    markers = []
    for o in opts:
        markers.append(len(ids))
        ids.extend(o)
    ids.append(sep)
    return ids, markers


class LayaDecider(Adapter):
    request_type = DecideRequest

    def load(self) -> None:
        import torch

        self._torch = torch
        folder = self.spec.path
        try:
            cfg = json.loads((folder / CONFIG).read_text())
            if cfg.get("option_layout", "sequential") != "sequential":
                raise ModelLoadFailed(f"{self.spec.name!r} reads its options in the {cfg['option_layout']!r} "
                                      "layout; fleet serves Laya checkpoints of the sequential one")
            self.tokenizer, model = load_laya(folder, cfg)
        except FleetError:
            raise
        except Exception as exc:  # the libraries raise many types for bad folders
            raise ModelLoadFailed(f"cannot load {self.spec.name!r} as a Laya checkpoint: {exc}") from exc
        self.dtype = causal_lm_dtype(self)
        self.model = model.to(self.device, getattr(torch, self.dtype)).eval()
        self.max_len = int(self.spec.max_seq_len or cfg.get("max_len", 512))
        self.head_max_len = int(cfg.get("head_max_len", 192))
        raw = cfg.get("temperature", [1.0, 1.0, 1.0])
        if not isinstance(raw, list) or len(raw) != 3:
            raise ModelLoadFailed(f"{self.spec.name!r}: its temperature must be a list of 3 numbers, not {raw!r}")
        self.temperature = [clamp_temperature(t) for t in raw]
        self.by_options = {str(k): clamp_temperature(v) for k, v in (cfg.get("temperature_by_options") or {}).items()}
        tok = self.tokenizer
        self.special = (tok.cls_token_id, tok.sep_token_id, tok.mask_token_id, tok.pad_token_id)
        if None in self.special:
            raise ModelLoadFailed(f"{self.spec.name!r}: its tokenizer lacks [CLS], [SEP], [MASK] or [PAD]")
        probe_decision(self)

    def footprint_bytes(self) -> int:
        return footprint_bytes(self.model)

    def unload(self) -> None:
        self.model = None

    def shipped_temperature(self, kind: str, k: int) -> float:
        return self.by_options.get(option_bucket(kind, k), self.temperature[QTYPES[kind]])

    def batch(self, requests: list[DecideRequest], ctx: BatchContext) -> Steps:
        torch = self._torch
        tok = self.tokenizer
        cls, sep, mask, pad = self.special
        hide = tok.mask_token
        # 1. Token ids: each state once, each question's text and options (one tokenizer call each).
        states = [state_value(r) for r in requests]
        state_ids = tok([(s if isinstance(s, str) else json.dumps(s, ensure_ascii=False)).replace(hide, " ")
                         for s in states], add_special_tokens=False)["input_ids"]
        parts = [[question_parts(q) for q in r.questions] for r in requests]
        flat = [p for ps in parts for p in ps]
        texts = [f"{p.kind} question: {p.instructions}".replace(hide, " ") for p in flat]
        lines = [" " + line.replace(hide, " ") for p in flat for line in option_lines(p)]
        q_ids = tok(texts, add_special_tokens=False)["input_ids"] if texts else []
        o_ids = tok(lines, add_special_tokens=False)["input_ids"] if lines else []
        # 2. One row per question: its head, then its request's state; a state that does
        #    not fit after a head fails its request.
        rows: list[list[int]] = []
        markers: list[list[int]] = []
        kinds: list[int] = []
        owner: list[int] = []
        results: list[Any] = [None] * len(requests)
        at = qi = 0
        for i, ps in enumerate(parts):
            start = len(rows)
            for p in ps:
                n = len(p.keys)
                head, marks = head_ids(cls, sep, mask, q_ids[qi], o_ids[at : at + n], self.head_max_len)
                qi, at = qi + 1, at + n
                rows.append(head + state_ids[i] + [sep])
                markers.append(marks)
                kinds.append(QTYPES[p.kind])
                owner.append(i)
            longest = max((len(r) for r in rows[start:]), default=0)
            if longest > self.max_len:
                results[i] = too_long(self.spec.name, "state and question", longest, self.max_len, "tokens")
        # 3. The rows of requests that fit, in length-sorted micro-batches.
        lengths = np.fromiter(map(len, rows), dtype=np.int64, count=len(rows))
        live = np.flatnonzero([results[o] is None for o in owner]) if rows else np.zeros(0, dtype=np.int64)
        logits: list[np.ndarray] = [np.zeros(0)] * len(rows)
        for part in micro_batches(lengths[live], self.micro_items(ctx), self.fixed_tokens or 0.0):
            yield
            idx = live[part]
            width = int(lengths[idx].max())
            kmax = max(len(markers[j]) for j in idx)
            ids = np.full((len(idx), width), pad, dtype=np.int64)
            att = np.zeros((len(idx), width), dtype=np.int64)
            pos = np.zeros((len(idx), kmax), dtype=np.int64)
            for r, j in enumerate(idx):
                ids[r, : lengths[j]] = rows[j]
                att[r, : lengths[j]] = 1
                pos[r, : len(markers[j])] = markers[j]
            with torch.inference_mode():
                out = option_logits(self.model, torch.from_numpy(ids).to(self.device),
                                    torch.from_numpy(att).to(self.device), torch.from_numpy(pos).to(self.device),
                                    torch.tensor([kinds[j] for j in idx], device=self.device)).double().cpu().numpy()
            for r, j in enumerate(idx):
                logits[j] = out[r, : len(markers[j])]
        # 4. Answers: per question a softmax of its options' logits over its temperature.
        row = 0
        for i, (req, ps) in enumerate(zip(requests, parts)):
            if results[i] is not None:
                row += len(ps)
                continue
            probs = [answer(self.spec, p.kind, logits[row + k], self.shipped_temperature(p.kind, len(p.keys)), req.raw)
                     for k, p in enumerate(ps)]
            results[i] = DecideResult(np.concatenate(probs).astype("<f8").tobytes() if probs else b"",
                                      int(lengths[row : row + len(ps)].sum()))
            row += len(ps)
        return results


def load_laya(folder: Any, cfg: dict[str, Any]) -> tuple[Any, Any]:
    """(tokenizer, the network with the checkpoint's weights in float32) of a Laya folder:
    the encoder and the package's decision head (`laya.common.DecisionModel` without its
    action head), under the package's parameter names."""
    import torch
    from safetensors.torch import load_file
    from torch import nn
    from transformers import AutoConfig, AutoModel, AutoTokenizer

    if "head_layers" not in cfg:
        raise ModelLoadFailed(f"{CONFIG} has no 'head_layers'")
    tokenizer = AutoTokenizer.from_pretrained(str(folder / "tokenizer"), local_files_only=True)
    encoder = AutoModel.from_config(AutoConfig.from_pretrained(str(folder / "encoder"), local_files_only=True),
                                    attn_implementation="sdpa")
    d = encoder.config.hidden_size
    layer = nn.TransformerEncoderLayer(d, max(1, d // 64), 4 * d, 0.0, batch_first=True, norm_first=True)
    parts = {"encoder": encoder, "type_emb": nn.Embedding(3, d),
             "scorer": nn.Sequential(nn.LayerNorm(d), nn.Linear(d, d), nn.GELU(), nn.Linear(d, 1))}
    if int(cfg["head_layers"]) > 0:
        parts["head"] = nn.TransformerEncoder(layer, int(cfg["head_layers"]), enable_nested_tensor=False)
    net = nn.ModuleDict(parts)
    weights = load_file(str(folder / "model.safetensors"))
    # The action head and the temperature buffer are the package's; fleet reads neither.
    kept = {k: v.float() for k, v in weights.items() if not k.startswith("act_head.") and k != "temperature"}
    net.load_state_dict(kept, strict=True)
    return tokenizer, net.to(torch.float32)


def option_logits(net: Any, input_ids: Any, attention_mask: Any, marker_pos: Any, qtype: Any) -> Any:
    """Each row's option logits (float32) at its markers: the package's forward."""
    import torch

    h = net["encoder"](input_ids=input_ids, attention_mask=attention_mask).last_hidden_state
    h = h + net["type_emb"](qtype)[:, None, :]
    if "head" in net:
        pad = ~attention_mask.bool()
        for layer in net["head"].layers:
            h = layer(h, src_key_padding_mask=pad)
    picked = torch.gather(h, 1, marker_pos[:, :, None].expand(-1, -1, h.size(-1)))
    return net["scorer"](picked).squeeze(-1).float()
