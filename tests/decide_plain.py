"""The reference of a causal LM's typed decisions: each question's own full
sequences (the state, the question's head, one row) run alone through transformers
without a cache, in the prompt runtimes/adapters/decide.py documents. What fleet answers
(prefix caches, packed rows, padding, LoRA rows) must equal it (tests/test_decide.py,
tests/test_parity_generators.py).
"""

from __future__ import annotations

import string
from pathlib import Path
from typing import Any

import numpy as np

INTRO = ("Read the following, then answer the question after it: the letter of the best option when the "
         "options are lettered, else the option itself.\n\n")


class PlainForward:
    """The documented prompt around one model's folder: `answer(state, text, lines,
    names)` is a question's probabilities, in its option order."""

    def __init__(self, folder: Path, model: Any = None) -> None:
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer

        self.torch = torch
        self.tok = AutoTokenizer.from_pretrained(folder)
        self.model = (model or AutoModelForCausalLM.from_pretrained(folder)).eval()
        # The chat template around the user turn (thinking off), else plain text.
        rendered = self.tok.apply_chat_template([{"role": "user", "content": "\x00"}], tokenize=False,
                                                add_generation_prompt=True, enable_thinking=False)
        self.head, self.tail = rendered.split("\x00")
        self.cue = (" " if not self.tail[-1].isspace() else "") + "Answer:"
        # The letters read as one token each after the cue: " A" when the tokenizer has it,
        # else "A" after "Answer: " (the tiny test tokenizers).
        self.space, self.labels = self._labels()

    def _ids(self, text: str) -> list[int]:
        return self.tok(text, add_special_tokens=False)["input_ids"]

    def _labels(self) -> tuple[str, list[int]]:
        probe = "Question: x\n" + self.tail
        for space in (" ", ""):
            cue = self.cue + ("" if space else " ")
            base = self._ids(probe + cue)
            ids = []
            for letter in string.ascii_uppercase:
                full = self._ids(probe + cue + space + letter)
                if len(full) != len(base) + 1 or full[: len(base)] != base:
                    break
                ids.append(full[-1])
            if len(ids) >= 2:
                return space, ids
        return "", []

    def _logits(self, prefix: list[int], question: str, row: list[int]) -> Any:
        ids = prefix + self._ids(question) + row
        with self.torch.no_grad():
            return self.model(self.torch.tensor([ids])).logits[0].double()

    def answer(self, state: str, text: str, lines: list[str], names: list[str]) -> np.ndarray:
        torch = self.torch
        prefix = self._ids(self.head + INTRO + state + "\n\n")
        n = len(lines)
        if n <= len(self.labels):  # listed in both orders, the label logits averaged
            rows = []
            cue = self.cue + ("" if self.space else " ")
            for order in (lines, lines[::-1]):
                body = "".join(f"{c}. {o}\n" for c, o in zip(string.ascii_uppercase, order))
                logits = self._logits(prefix, f"Question: {text}\n", self._ids(f"{body}{self.tail}{cue}"))
                rows.append(torch.softmax(logits[-1, self.labels[:n]], 0).numpy())
            return (rows[0] + rows[1][::-1]) / 2
        scores = []  # each option's summed log-likelihood after the cue
        for name in names:
            option = self._ids(" " + name)
            logp = torch.log_softmax(self._logits(prefix, f"Question: {text}\n{self.tail}{self.cue}", option), -1)
            k = len(option)
            scores.append(float(sum(logp[-k - 1 + j, option[j]] for j in range(k))))
        return torch.softmax(torch.tensor(scores), 0).numpy()
