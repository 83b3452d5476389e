"""Typed decisions from a bev-decider checkpoint (task `decide`, runtime `bev`): a
truncated Qwen3 backbone with the package's pointer head over the options, read the
way the `bev-decider` package reads it, so its answers are the package's
(tests/test_decide_heads.py holds fleet to it on a tiny random checkpoint).

A checkpoint is the folder `bev_decider.load` reads and pull recognises by its
`config.json` (`backbone_config`, `head`, the token limits): the backbone's config
in the file `backbone_config` names, `model.safetensors` (`backbone.*`, `head.*`)
and the tokenizer.

One sequence per question (the question is read before the state, so every state
token is read knowing what is asked):

    "<task hint>\\nQuestion: <instructions>\\n\\n<state>\\n"  <option>A</option> <option>B</option> ...  "The answer is:"

Every option starts at the same position and sees the prompt and its own earlier
tokens only (a 4-D attention mask), so the options' order cannot change the answer;
the answer tokens see everything before them. The head takes each option's state at
its last token and the answer's at the last one, attends over them (no positions),
and scores each option against the answer (float32, whatever the backbone's dtype);
the softmax over fleet's calibrated temperature (1 until `fleetctl calibrate` fits
one: the checkpoint ships none) is the answer. A state over the checkpoint's
`max_state_tokens` or an option over its `max_choice_tokens` fails its request
(`input_too_long`), where the package would cut it.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import numpy as np

from fleet.decisions import DecideRequest, DecideResult
from fleet.errors import FleetError, ModelLoadFailed
from fleet.messages import WorkError
from fleet.runtimes.base import Adapter, BatchContext, Steps
from fleet.runtimes.adapters.decide import probe_decision, too_long
from fleet.runtimes.device import causal_lm_dtype
from fleet.runtimes.adapters.decide_heads import Parts, answer, question_parts, state_value
from fleet.runtimes.adapters.hf_common import footprint_bytes
from fleet.runtimes.adapters.batching import micro_batches

#: The package's task ids (the head's task embedding) and hints.
TASK_TYPES = {"choice": 0, "noul": 1, "score": 2}
TASK_PROMPTS = {"choice": "Choose the best option.", "score": "Rate it on the given scale.",
                "noul": "Answer yes or no."}
ANSWER_PROMPT = "The answer is:"
#: Bytes of attention masks one micro-batch may hold (rows x tokens x tokens booleans).
MASK_BYTES = 64 << 20


def as_text(x: Any) -> str:
    """A state in the package's words: text as it is, JSON indented by 2."""
    return x if isinstance(x, str) else json.dumps(x, ensure_ascii=False, indent=2)


def option_lines(parts: Parts) -> list[str]:
    """The options in the package's words (`bev_decider.encode.question_options`). A
    noul with one outcome described reads the other's plain word (the package needs both)."""
    if parts.kind == "choice":
        return [key if desc is None else f"{key}: {desc}" for key, desc in zip(parts.keys, parts.descriptions)]
    if parts.kind == "score":
        return [f"{i}: {level}" for i, level in enumerate(parts.descriptions)]
    return [word if desc is None else f"{word}: {desc}" for word, desc in zip(("No", "Yes"), parts.descriptions)]


class BevDecider(Adapter):
    request_type = DecideRequest

    def load(self) -> None:
        import torch

        self._torch = torch
        try:
            self.config = json.loads((self.spec.path / "config.json").read_text())
            self.tokenizer, backbone, self.head = load_bev(self.spec.path, self.config)
        except FleetError:
            raise
        except Exception as exc:  # the libraries raise many types for bad folders
            raise ModelLoadFailed(f"cannot load {self.spec.name!r} as a bev-decider checkpoint: {exc}") from exc
        self.dtype = causal_lm_dtype(self)
        self.backbone = backbone.to(self.device, getattr(torch, self.dtype)).eval()
        self.head = self.head.to(self.device).eval()
        tok = self.tokenizer
        self.begin, self.end, self.answer_ids = (tok(t)["input_ids"] for t in ("<option>", "</option>",
                                                                               ANSWER_PROMPT))
        self.pad_id = int(tok.pad_token_id if tok.pad_token_id is not None else 0)
        self.max_state = int(self.config["max_state_tokens"])
        self.max_choice = int(self.config["max_choice_tokens"])
        self.positions = int(getattr(backbone.config, "max_position_embeddings", 0) or 1 << 30)
        probe_decision(self)

    def footprint_bytes(self) -> int:
        return footprint_bytes(self.backbone) + footprint_bytes(self.head)

    def unload(self) -> None:
        self.backbone = self.head = None

    def batch(self, requests: list[DecideRequest], ctx: BatchContext) -> Steps:
        tok = self.tokenizer
        # 1. Token ids: the states (their limit), each question's prompt and its options.
        states = [as_text(state_value(r)) for r in requests]
        state_len = [len(ids) for ids in tok(states)["input_ids"]] if states else []
        results: list[Any] = [too_long(self.spec.name, "state", n, self.max_state, "tokens")
                              if n > self.max_state else None for n in state_len]
        parts = [[question_parts(q) for q in r.questions] for r in requests]
        prompts = [f"{TASK_PROMPTS[p.kind]}\nQuestion: {p.instructions}\n\n{state}\n"
                   for state, ps in zip(states, parts) for p in ps]
        lines = [line for ps in parts for p in ps for line in option_lines(p)]
        p_ids = tok(prompts)["input_ids"] if prompts else []
        o_ids = tok(lines)["input_ids"] if lines else []
        # 2. One row per question; an option over the limit, or a row past the
        #    backbone's positions, fails its request.
        rows: list[Row] = []
        at = 0
        for i, ps in enumerate(parts):
            for p in ps:
                opts = o_ids[at : at + len(p.keys)]
                at += len(p.keys)
                row = Row(i, TASK_TYPES[p.kind], p_ids[len(rows)], [self.begin + o + self.end for o in opts],
                          self.answer_ids, len(self.end))
                rows.append(row)
                longest = max(map(len, opts))
                if results[i] is None and longest > self.max_choice:
                    results[i] = WorkError("input_too_long", f"an option comes to {longest} tokens; {self.spec.name} "
                                                             f"reads at most {self.max_choice} tokens an option: "
                                                             "send a shorter one")
                elif results[i] is None and row.reach > self.positions:
                    results[i] = too_long(self.spec.name, "state and question", row.reach, self.positions,
                                          "tokens")
        # 3. The rows of requests that fit, in length-sorted micro-batches.
        lengths = np.fromiter((len(r.ids) for r in rows), dtype=np.int64, count=len(rows))
        live = np.flatnonzero([results[r.owner] is None for r in rows]) if rows else np.zeros(0, dtype=np.int64)
        logits: list[np.ndarray] = [np.zeros(0)] * len(rows)
        step = max(1, min(self.micro_items(ctx), MASK_BYTES // max(1, int(lengths.max(initial=1)) ** 2)))
        for part in micro_batches(lengths[live], step, self.fixed_tokens or 0.0):
            yield
            idx = live[part]
            out = self._forward([rows[j] for j in idx])
            for r, j in enumerate(idx):
                logits[j] = out[r, : len(rows[j].reads)]
        # 4. Answers: per question a softmax of its options' logits.
        k = 0
        for i, (req, ps) in enumerate(zip(requests, parts)):
            if results[i] is None:
                probs = [answer(self.spec, p.kind, logits[k + j], 1.0, req.raw) for j, p in enumerate(ps)]
                results[i] = DecideResult(np.concatenate(probs).astype("<f8").tobytes() if probs else b"",
                                          int(lengths[k : k + len(ps)].sum()))
            k += len(ps)
        return results

    def _forward(self, rows: list[Row]) -> np.ndarray:
        """The option logits of `rows` (one micro-batch), float64 on the host."""
        torch = self._torch
        width = max(len(r.ids) for r in rows)
        cmax = max(len(r.reads) for r in rows)
        ids = np.full((len(rows), width), self.pad_id, dtype=np.int64)
        pos = np.zeros((len(rows), width), dtype=np.int64)
        # Padding attends to itself only: a row of nothing would be all -inf.
        allowed = np.broadcast_to(np.eye(width, dtype=bool), (len(rows), width, width)).copy()
        reads = np.zeros((len(rows), cmax), dtype=np.int64)
        valid = np.zeros((len(rows), cmax), dtype=bool)
        ends = np.zeros(len(rows), dtype=np.int64)
        for b, r in enumerate(rows):
            n = len(r.ids)
            ids[b, :n] = r.ids
            pos[b, :n] = r.positions
            allowed[b, :n, :n] = r.mask()
            reads[b, : len(r.reads)] = r.reads
            valid[b, : len(r.reads)] = True
            ends[b] = n - 1
        dev = self.device
        with torch.inference_mode():
            hidden = self.backbone(input_ids=torch.from_numpy(ids).to(dev),
                                   attention_mask=torch.from_numpy(allowed)[:, None].to(dev),
                                   position_ids=torch.from_numpy(pos).to(dev), use_cache=False).last_hidden_state.float()
            at = torch.arange(len(rows), device=dev)
            choices = hidden[at[:, None], torch.from_numpy(reads).to(dev)]
            out = choice_logits(self.head, choices, hidden[at, torch.from_numpy(ends).to(dev)],
                                torch.from_numpy(valid).to(dev),
                                torch.tensor([r.task for r in rows], device=dev))
        return out.double().cpu().numpy()


class Row:
    """One question's sequence: its prompt, its options side by side (each from the
    same position), the answer prompt; `reads`: each option's last content token
    (before its `close` closing tokens)."""

    def __init__(self, owner: int, task: int, prompt: list[int], options: list[list[int]], tail: list[int],
                 close: int) -> None:
        self.owner, self.task, self.prompt = owner, task, len(prompt)
        self.ids = [*prompt]
        self.positions = list(range(len(prompt)))
        self.spans: list[tuple[int, int]] = []
        for o in options:
            self.spans.append((len(self.ids), len(self.ids) + len(o)))
            self.ids += o
            self.positions += range(len(prompt), len(prompt) + len(o))
        self.answer_at = len(self.ids)
        top = max(self.positions) + 1
        self.ids += tail
        self.positions += range(top, top + len(tail))
        self.reach = top + len(tail)
        self.reads = [end - 1 - close for _, end in self.spans]

    def mask(self) -> np.ndarray:
        """Who sees whom (True: attends): `bev_decider.encode.Encoder.encode`'s mask."""
        n, p, a = len(self.ids), self.prompt, self.answer_at
        allowed = np.zeros((n, n), dtype=bool)
        allowed[:p, :p] = np.tri(p, dtype=bool)
        for lo, hi in self.spans:
            allowed[lo:hi, :p] = True
            allowed[lo:hi, lo:hi] = np.tri(hi - lo, dtype=bool)
        allowed[a:, :a] = True
        allowed[a:, a:] = np.tri(n - a, dtype=bool)
        return allowed


def load_bev(folder: Path, config: dict[str, Any]) -> tuple[Any, Any, Any]:
    """(tokenizer, backbone, head), float32, of a bev-decider folder, under the package's
    parameter names (`bev_decider.model`)."""
    from safetensors.torch import load_file
    from torch import nn
    from transformers import AutoTokenizer, Qwen3Config, Qwen3Model

    name = str(config.get("backbone_config", ""))
    if not name or Path(name).name != name:
        raise ModelLoadFailed(f"config.json's backbone_config must name a file beside it, not {name!r}")
    weights = load_file(str(folder / "model.safetensors"))
    backbone = Qwen3Model(Qwen3Config.from_json_file(str(folder / name)))
    backbone.load_state_dict({k[9:]: v.float() for k, v in weights.items() if k.startswith("backbone.")})
    head_cfg = config["head"]
    d, new, layers = backbone.config.hidden_size, int(head_cfg["new_dim"]), int(head_cfg["num_layers"])

    def block() -> Any:
        attn = nn.ModuleDict({"q": nn.Linear(d, new), "k": nn.Linear(d, new), "v": nn.Linear(d, new),
                              "o": nn.Linear(new, d)})
        return nn.ModuleDict({"norm1": nn.LayerNorm(d), "attn": attn, "norm2": nn.LayerNorm(d),
                              "mlp": nn.Sequential(nn.Linear(d, new), nn.GELU(), nn.Linear(new, d))})

    head = nn.ModuleDict({"task_embedding": nn.Embedding(int(head_cfg["num_task_types"]), d),
                          "input_norm": nn.LayerNorm(d), "layers": nn.ModuleList([block() for _ in range(layers)]),
                          "final_norm": nn.LayerNorm(d), "answer_proj": nn.Linear(d, new),
                          "choice_proj": nn.Linear(d, new)})
    head.load_state_dict({k[5:]: v.float() for k, v in weights.items() if k.startswith("head.")})
    tokenizer = AutoTokenizer.from_pretrained(str(folder), local_files_only=True)
    return tokenizer, backbone, head


def choice_logits(head: Any, choices: Any, answer_state: Any, valid: Any, task: Any) -> Any:
    """Option logits [rows, options] (-inf at padding): `bev_decider.model.ChoiceHead`'s forward."""
    import torch

    new = head["answer_proj"].out_features
    x = torch.cat([head["task_embedding"](task)[:, None], choices, answer_state[:, None]], dim=1)
    x = head["input_norm"](x)
    always = torch.ones(len(valid), 1, dtype=torch.bool, device=valid.device)
    keys = torch.cat([always, valid, always], dim=1)
    for block in head["layers"]:
        attn, y = block["attn"], block["norm1"](x)
        scores = torch.einsum("bqd,bkd->bqk", attn["q"](y), attn["k"](y)) / math.sqrt(new)
        scores = scores.masked_fill(~keys[:, None, :], -float("inf"))
        x = x + attn["o"](torch.einsum("bqk,bkd->bqd", torch.softmax(scores, dim=-1), attn["v"](y)))
        x = x + block["mlp"](block["norm2"](x))
    x = head["final_norm"](x)
    scores = torch.einsum("bd,bcd->bc", head["answer_proj"](x[:, -1]), head["choice_proj"](x[:, 1:-1]))
    return (scores / math.sqrt(new)).masked_fill(~valid, -float("inf"))
