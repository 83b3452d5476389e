"""LLM rerankers (task `rerank`, runtime `llm-rerank`) end to end, against their
reference code run in-process on the same folders:

- Qwen3-Reranker: a tiny random `Qwen3ForCausalLM` with a Qwen2-style byte BPE
  tokenizer (trained here; "yes"/"no" and the chat tokens in its vocabulary),
  saved in the hub layout. Reference: the README's transformers snippet
  (QwenLM/Qwen3-Embedding@f4ad0c43 README.md, `format_instruction`,
  `process_inputs`, `compute_logits`, copied below), and sentence-transformers
  6.3's CrossEncoder (`LogitScore(yes, no)` + sigmoid) on the same folder, which
  renders the pair through the folder's chat template (written here to give the
  README's prompt).
- mxbai-rerank-v2: a tiny random `Qwen2ForCausalLM`, same tokenizer, with
  `prompt_format = "mxbai-v2"` (in the worker's call, and in a catalog entry
  over HTTP). Reference: `MxbaiRerankV2.prepare_inputs`
  and `forward` (mixedbread-ai/mxbai-rerank@8e709dca mxbai_rerank/mxbai_rerank_v2.py,
  copied below: the package needs `batched`, which this project does not carry).

Both models get their answer rows set so scores spread over (0, 1): a random
head gives near-ties everywhere, which would hide swapped answer tokens.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import httpx
import msgspec
import numpy as np
import pytest

from tests.conftest import default_model_dir, start_daemon
from tests.gen_models import pull

QWEN = "tiny-qwen3-reranker"
MXBAI = "tiny-mxbai-v2"
CROSS = "tiny-cross-encoder"
#: Tokens per pair fleet serves the tiny models with (their positions: 512).
MAX_TOKENS = 512
CORPUS = [
    "the quick brown fox jumps over the lazy dog",
    "judge whether the document meets the requirements based on the query and the instruct provided",
    "note that the answer can only be yes or no",
    "yes\nno\nyes\nno\n1\n0\n1\n0",
    "given a web search query, retrieve relevant passages that answer the query",
    "what is the capital of china? the capital of china is beijing.",
    "explain gravity: gravity is a force that attracts two bodies towards each other",
    "you are a search relevance expert who evaluates how well documents match search queries",
    "system user assistant instruct instruction query document relevance",
    "a b c d e f g h i j k l m n o p q r s t u v w x y z 0 1 2 3 4 5 6 7 8 9 . , ! ? : < > \" '",
]
QUERIES = ["What is the capital of China?", "Explain gravity", "how do cats behave at home"]
DOCS = [
    "The capital of China is Beijing.",
    "Gravity is a force that attracts two bodies towards each other. It gives weight to physical objects.",
    "Cats sleep for most of the day and are most active at dawn and dusk.",
    "The stock market closed higher on Friday.",
    "yes",
    "¿Dónde está la biblioteca? 東京は日本の首都です。",
]
LONG_DOC = " ".join(["gravity attracts bodies"] * 300)
INSTRUCTION = "Given a question, find the passage that answers it"

# The README's prompt (QwenLM/Qwen3-Embedding@f4ad0c43 README.md), and a chat template
# that renders it for sentence-transformers' pair messages (roles "query" and
# "document"; a system message is the instruction). Jinja drops one trailing
# newline, so the last two come from an expression.
QWEN_PREFIX = ("<|im_start|>system\nJudge whether the Document meets the requirements based on the Query and the "
               "Instruct provided. Note that the answer can only be \"yes\" or \"no\".<|im_end|>\n<|im_start|>user\n")
QWEN_SUFFIX = "<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"
QWEN_DEFAULT = "Given a web search query, retrieve relevant passages that answer the query"
ST_TEMPLATE = (
    QWEN_PREFIX + "<Instruct>: {% set sys = messages | selectattr('role', 'eq', 'system') "
    "| map(attribute='content') | first %}{{ sys if sys else '" + QWEN_DEFAULT + "' }}\n"
    "<Query>: {{ messages | selectattr('role', 'eq', 'query') | map(attribute='content') | first }}\n"
    "<Document>: {{ messages | selectattr('role', 'eq', 'document') | map(attribute='content') | first }}"
    "<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>{{ '\\n\\n' }}"
)


# ---- tiny models in the hub layout -----------------------------------------------------

def build_tokenizer(folder: Path):
    """Qwen2Tokenizer's pipeline (NFC, Qwen's split regex, byte-level BPE) trained on a
    few sentences, with Qwen's special and added tokens; tokenizer.json +
    tokenizer_config.json as the hub has them."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
    from transformers import Qwen2Tokenizer
    from transformers.models.qwen2.tokenization_qwen2 import PRETOKENIZE_REGEX

    tok = Tokenizer(models.BPE())
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(PRETOKENIZE_REGEX), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=["<|endoftext|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(CORPUS * 8, trainer)
    model = json.loads(tok.to_str())["model"]
    merges = [tuple(m) if isinstance(m, list) else tuple(m.split(" ")) for m in model["merges"]]
    qwen = Qwen2Tokenizer(vocab=model["vocab"], merges=merges, eos_token="<|im_end|>", pad_token="<|endoftext|>",
                          additional_special_tokens=["<|im_start|>", "<|im_end|>"])
    qwen.add_tokens([AddedToken(t, special=False, normalized=False) for t in ("<think>", "</think>")])
    qwen.save_pretrained(folder)
    return qwen


def build_reranker(folder: Path, arch: str, answers: tuple[str, str], seed: int) -> Path:
    """A tiny causal LM (`arch`: "qwen3" or "qwen2") whose (true, false) answer rows
    are set so their logit difference over the test's pairs has mean ~0 and std ~2."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM, Qwen3Config, Qwen3ForCausalLM

    folder.mkdir(parents=True, exist_ok=True)
    tok = build_tokenizer(folder)
    torch.manual_seed(seed)
    common = dict(vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=MAX_TOKENS,
                  initializer_range=0.3, tie_word_embeddings=False, pad_token_id=tok.pad_token_id,
                  eos_token_id=tok.eos_token_id)
    model = (Qwen3ForCausalLM(Qwen3Config(head_dim=16, **common)) if arch == "qwen3"
             else Qwen2ForCausalLM(Qwen2Config(**common))).eval()
    true_id, false_id = tok.convert_tokens_to_ids(list(answers))
    texts = [f"{QWEN_PREFIX}<Query>: {q}\n<Document>: {d}{QWEN_SUFFIX}" for q in QUERIES for d in DOCS]
    with torch.no_grad():
        last = model.model(**tok(texts, padding=True, padding_side="left", return_tensors="pt")).last_hidden_state
        mean = last[:, -1].mean(dim=0)
        head = model.lm_head.weight
        delta = head[true_id] - head[false_id]
        delta -= (delta @ mean) / (mean @ mean) * mean
        head[true_id] = head[false_id] + 2.0 / float((last[:, -1] @ delta).std()) * delta
    model.save_pretrained(folder)
    return folder


# ---- the references, in-process ----------------------------------------------------------

class QwenReadme:
    """QwenLM/Qwen3-Embedding@f4ad0c43 README.md, "Reranker Model / Transformers Usage",
    as written there (max_length is the README's variable)."""

    def __init__(self, folder: Path, max_length: int = MAX_TOKENS) -> None:
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer

        self.torch = torch
        self.tokenizer = AutoTokenizer.from_pretrained(folder, padding_side="left")
        self.model = AutoModelForCausalLM.from_pretrained(folder).eval()
        self.token_false_id = self.tokenizer.convert_tokens_to_ids("no")
        self.token_true_id = self.tokenizer.convert_tokens_to_ids("yes")
        self.max_length = max_length
        self.prefix_tokens = self.tokenizer.encode(QWEN_PREFIX, add_special_tokens=False)
        self.suffix_tokens = self.tokenizer.encode(QWEN_SUFFIX, add_special_tokens=False)

    @staticmethod
    def format_instruction(instruction, query, doc):
        if instruction is None:
            instruction = QWEN_DEFAULT
        output = "<Instruct>: {instruction}\n<Query>: {query}\n<Document>: {doc}".format(
            instruction=instruction, query=query, doc=doc)
        return output

    def process_inputs(self, pairs):
        tokenizer, max_length = self.tokenizer, self.max_length
        inputs = tokenizer(
            pairs, padding=False, truncation='longest_first',
            return_attention_mask=False, max_length=max_length - len(self.prefix_tokens) - len(self.suffix_tokens)
        )
        for i, ele in enumerate(inputs['input_ids']):
            inputs['input_ids'][i] = self.prefix_tokens + ele + self.suffix_tokens
        inputs = tokenizer.pad(inputs, padding=True, return_tensors="pt", max_length=max_length)
        return inputs

    def compute_logits(self, inputs):
        with self.torch.no_grad():
            batch_scores = self.model(**inputs).logits[:, -1, :]
            true_vector = batch_scores[:, self.token_true_id]
            false_vector = batch_scores[:, self.token_false_id]
            batch_scores = self.torch.stack([false_vector, true_vector], dim=1)
            batch_scores = self.torch.nn.functional.log_softmax(batch_scores, dim=1)
            scores = batch_scores[:, 1].exp().tolist()
        return scores, (true_vector - false_vector).tolist()

    def scores(self, query: str, docs: list[str], instruction: str | None = None) -> tuple[np.ndarray, np.ndarray]:
        """(P(yes), log-odds) per document, all pairs in one batch as the README runs them."""
        pairs = [self.format_instruction(instruction, query, doc) for doc in docs]
        probs, logodds = self.compute_logits(self.process_inputs(pairs))
        return np.array(probs), np.array(logodds)


def ensure_multiple_of_8(x: int, max_value: int | None = None) -> int:
    """mixedbread-ai/mxbai-rerank@8e709dca mxbai_rerank/utils.py."""
    if max_value is not None:
        max_value -= max_value % 8
    remainder = x % 8
    if remainder == 0:
        return x
    next_multiple = x + (8 - remainder)
    if max_value is not None and next_multiple > max_value:
        return max_value
    return next_multiple


def prepare_for_model(ids: list[int], pair_ids: list[int], *, max_length: int) -> dict[str, list[int]]:
    """transformers 4.x `tokenizer.prepare_for_model(ids, pair_ids, truncation="only_second",
    max_length=..., padding=False, add_special_tokens=False, ...)` as MxbaiRerankV2 calls it
    (gone from transformers 5's tokenizers): `truncate_sequences` cuts the second sequence's
    last tokens past `max_length`, when it has more tokens than that excess."""
    remove = len(ids) + len(pair_ids) - max_length
    if remove > 0 and len(pair_ids) > remove:
        pair_ids = pair_ids[:-remove]
    return {"input_ids": ids + pair_ids}


class MxbaiV2:
    """mixedbread-ai/mxbai-rerank@8e709dca mxbai_rerank/mxbai_rerank_v2.py, `MxbaiRerankV2`:
    `__init__` (tokenizer and lengths), `prepare_predefined_inputs`, `concat_input_ids`,
    `prepare_inputs` and `forward`, as written there (with `ensure_multiple_of_8` and
    `prepare_for_model` above)."""

    sep = "\n"
    instruction_prompt = "instruction: {instruction}"
    query_prompt = "query: {query}"
    doc_prompt = "document: {document}"
    task_prompt = "You are a search relevance expert who evaluates how well documents match search queries. For each query-document pair, carefully analyze the semantic relationship between them, then provide your binary relevance judgment (0 for not relevant, 1 for relevant).\nRelevance:"  # noqa: E501
    chat_template = {
        "prefix": "<|im_start|>system\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>\n<|im_start|>user\n",  # noqa: E501
        "suffix": "<|im_end|>\n<|im_start|>assistant\n",
    }

    def __init__(self, folder: Path, max_length: int = 8192) -> None:
        import torch
        from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

        self.torch = torch
        self.model = AutoModelForCausalLM.from_pretrained(folder).eval()
        self.tokenizer = AutoTokenizer.from_pretrained(folder, padding_side="left")
        self.tokenizer.padding_side = "left"
        self.cfg = AutoConfig.from_pretrained(folder)
        self.max_length = max_length or self.cfg.max_position_embeddings
        self.model_max_length = self.cfg.max_position_embeddings
        self.prepare_predefined_inputs()

    def prepare_predefined_inputs(self):
        def get_input_ids(x):
            return self.tokenizer(x, return_tensors=None, add_special_tokens=False)["input_ids"]

        self.yes_loc = get_input_ids("1")[0]
        self.no_loc = get_input_ids("0")[0]
        self.task_prompt_inputs = get_input_ids(self.task_prompt)
        self.sep_inputs = get_input_ids(self.sep)
        self.chat_template_prefix_inputs = get_input_ids(self.chat_template["prefix"])
        self.chat_template_suffix_inputs = get_input_ids(self.chat_template["suffix"])
        self.predefined_length = (
            len(self.chat_template_prefix_inputs)
            + len(self.task_prompt_inputs)
            + len(self.chat_template_suffix_inputs)
            + len(self.sep_inputs)
        )
        if self.max_length + self.predefined_length > self.model_max_length:
            self.max_length = self.model_max_length - self.predefined_length
        self.max_length_padding = ensure_multiple_of_8(
            max(self.model_max_length, self.max_length + self.predefined_length),
            max_value=self.model_max_length,
        )

    def concat_input_ids(self, input_ids):
        return (
            self.chat_template_prefix_inputs
            + input_ids
            + self.sep_inputs
            + self.task_prompt_inputs
            + self.chat_template_suffix_inputs
        )

    def prepare_inputs(self, queries, documents, *, instruction=None):
        inputs = []
        instruction_prompt = self.instruction_prompt.format(instruction=instruction) if instruction else None
        for query, document in zip(queries, documents):
            query_prompt = self.query_prompt.format(query=query)
            if instruction_prompt:
                query_prompt = "".join([instruction_prompt, self.sep, query_prompt])
            query_inputs = self.tokenizer(
                query_prompt, return_tensors=None, add_special_tokens=False,
                max_length=self.max_length * 3 // 4, truncation=True,
            )
            available_tokens = self.model_max_length - len(query_inputs["input_ids"]) - self.predefined_length
            doc_maxlen = min(available_tokens, self.max_length)
            document_inputs = self.tokenizer(
                self.doc_prompt.format(document=document), return_tensors=None, add_special_tokens=False,
                max_length=doc_maxlen, truncation=True,
            )
            item = prepare_for_model(
                query_inputs["input_ids"], self.sep_inputs + document_inputs["input_ids"],
                max_length=self.max_length,
            )
            item["input_ids"] = self.concat_input_ids(item["input_ids"])
            item["attention_mask"] = [1] * len(item["input_ids"])
            inputs.append(item)
        return self.tokenizer.pad(
            inputs, padding="longest", max_length=self.max_length_padding, pad_to_multiple_of=8, return_tensors="pt",
        )

    def forward(self, input_ids, attention_mask):
        outputs = self.model(input_ids=input_ids, attention_mask=attention_mask)
        yes_logits = outputs.logits[:, -1, self.yes_loc]
        no_logits = outputs.logits[:, -1, self.no_loc]
        return yes_logits - no_logits

    def predict(self, queries, documents, *, instruction=None) -> np.ndarray:
        with self.torch.inference_mode():
            inputs = self.prepare_inputs(queries=queries, documents=documents, instruction=instruction)
            return self.forward(**inputs).cpu().float().numpy()


# ---- fixtures ----------------------------------------------------------------------------

@pytest.fixture(scope="module")
def folders(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("llm-rerank")
    qwen = build_reranker(root / "qwen3-reranker", "qwen3", ("yes", "no"), seed=0)
    (qwen / "chat_template.jinja").write_text(ST_TEMPLATE)
    return {"qwen": qwen, "mxbai": build_reranker(root / "mxbai-v2", "qwen2", ("1", "0"), seed=1), "root": root}


@pytest.fixture(scope="module")
def fleet(folders: dict[str, Path]):
    import torch
    from transformers import AutoTokenizer, BertConfig, BertForSequenceClassification

    home = folders["root"] / "home"
    home.mkdir()
    # The mxbai model as a catalog entry names it: its prompt format and a default instruction.
    (home / "models.toml").write_text(
        f'[models."{MXBAI}"]\nsource = "path:{folders["mxbai"].resolve()}"\ntask = "rerank"\n'
        f'runtime = "llm-rerank"\nprompt_format = "mxbai-v2"\ndefault_instruction = "{INSTRUCTION}"\n')
    pull(home, folders["qwen"], QWEN, "--task", "rerank", "--runtime", "llm-rerank")
    done = subprocess.run([sys.executable, "-m", "fleetctl", "pull", MXBAI],
                          env={**os.environ, "FLEET_HOME": str(home)}, capture_output=True, text=True, timeout=120,
                          stdin=subprocess.DEVNULL)
    assert done.returncode == 0, done.stderr
    tok = AutoTokenizer.from_pretrained(default_model_dir())
    torch.manual_seed(0)
    cross = folders["root"] / "cross"
    BertForSequenceClassification(BertConfig(vocab_size=tok.vocab_size, hidden_size=32, num_hidden_layers=2,
                                             num_attention_heads=2, intermediate_size=64, num_labels=1,
                                             max_position_embeddings=128)).save_pretrained(cross)
    tok.save_pretrained(cross)
    pull(home, cross, CROSS)
    d = start_daemon(home)
    yield d
    d.stop()


@pytest.fixture(scope="module")
def readme(folders: dict[str, Path]) -> QwenReadme:
    return QwenReadme(folders["qwen"])


def load_adapter(folder: Path, name: str, **spec: Any):
    """The runtime as a worker loads it (the worker's call, no daemon)."""
    from fleet.runtimes.base import ModelSpec
    from fleet.runtimes.registry import adapter_class

    adapter = adapter_class("rerank", "llm-rerank")(
        ModelSpec(name=name, path=folder, task="rerank", runtime="llm-rerank", **spec), "cpu")
    adapter.load()
    return adapter


@pytest.fixture(scope="module")
def mxbai(folders: dict[str, Path]):
    return load_adapter(folders["mxbai"], MXBAI, extra={"prompt_format": "mxbai-v2"})


def run(adapter, **request: Any) -> np.ndarray:
    """One request through `run_batch`: its scores in document order."""
    from fleet.messages import RerankResult
    from fleet.protocol import RerankRequest

    (result,) = adapter.run_batch([RerankRequest(adapter.spec.name, **request)])
    assert isinstance(result, RerankResult), result
    scores = np.empty(len(request["documents"]))
    scores[np.frombuffer(result.index, "<i4")] = np.frombuffer(result.scores, "<f4")
    return scores


def rerank(d, body: dict, *, msgpack: bool = False) -> dict:
    if msgpack:
        resp = httpx.post(d.url + "/v1/rerank", content=msgspec.msgpack.encode(body),
                          headers={"Content-Type": "application/msgpack"}, timeout=120)
        assert resp.status_code == 200, resp.content
        return msgspec.msgpack.decode(resp.content)
    resp = httpx.post(d.url + "/v1/rerank", json=body, timeout=120)
    assert resp.status_code == 200, resp.text
    return resp.json()


def by_index(reply: dict) -> np.ndarray:
    """Scores in document order from a reply's results (best first)."""
    results = reply["results"]
    scores = np.empty(len(results))
    for r in results:
        scores[r["index"]] = r["score"]
    assert [r["score"] for r in results] == sorted(scores, reverse=True)
    return scores


# ---- Qwen3-Reranker ----------------------------------------------------------------------

def test_qwen3_scores_equal_the_readme(fleet, readme):
    worst = 0.0
    for query in QUERIES:
        want, want_logodds = readme.scores(query, DOCS)
        got = by_index(rerank(fleet, {"model": QWEN, "query": query, "documents": DOCS}, msgpack=True))
        raw = by_index(rerank(fleet, {"model": QWEN, "query": query, "documents": DOCS, "raw_scores": True}))
        np.testing.assert_allclose(got, want, atol=1e-5)
        np.testing.assert_allclose(raw, want_logodds, atol=1e-4)
        worst = max(worst, float(np.abs(got - want).max()))
    assert np.ptp(want) > 0.2  # the scores spread: a swapped answer token could not hide
    print(f"qwen3: max |fleet - README| = {worst:.2e}")


def test_qwen3_scores_equal_sentence_transformers_logit_score(fleet, folders):
    from sentence_transformers import CrossEncoder

    model = CrossEncoder(str(folders["qwen"]), device="cpu", local_files_only=True)
    assert type(model[1]).__name__ == "LogitScore"
    for query in QUERIES:
        want = model.predict([(query, d) for d in DOCS])
        got = by_index(rerank(fleet, {"model": QWEN, "query": query, "documents": DOCS}))
        np.testing.assert_allclose(got, want, atol=1e-5)


def test_qwen3_instruction_is_the_requests_own(fleet, readme):
    want, _ = readme.scores(QUERIES[0], DOCS, INSTRUCTION)
    default, _ = readme.scores(QUERIES[0], DOCS)
    got = by_index(rerank(fleet, {"model": QWEN, "query": QUERIES[0], "documents": DOCS,
                                  "instruction": INSTRUCTION}))
    np.testing.assert_allclose(got, want, atol=1e-5)
    assert np.abs(want - default).max() > 1e-3  # the instruction changes the answer
    from fleetctl import Client

    with Client(fleet.url) as client:
        hits = client.rerank(QWEN, QUERIES[0], DOCS, instruction=INSTRUCTION)
    np.testing.assert_allclose([h.score for h in sorted(hits, key=lambda h: h.index)], want, atol=1e-5)


def test_qwen3_long_document_is_cut_as_the_readme_cuts_it(fleet, readme):
    docs = [LONG_DOC, DOCS[0]]
    want, _ = readme.scores(QUERIES[1], docs)
    reply = rerank(fleet, {"model": QWEN, "query": QUERIES[1], "documents": docs})
    np.testing.assert_allclose(by_index(reply), want, atol=1e-5)
    short = len(readme.process_inputs([readme.format_instruction(None, QUERIES[1], DOCS[0])])["input_ids"][0])
    assert reply["usage"]["input_tokens"] == MAX_TOKENS + short


def test_qwen3_truncate_false_refuses_a_pair_over_the_limit(fleet):
    resp = httpx.post(fleet.url + "/v1/rerank", json={"model": QWEN, "query": QUERIES[1],
                                                      "documents": [DOCS[0], LONG_DOC], "truncate": False},
                      timeout=60)
    assert resp.status_code == 422, resp.text
    err = resp.json()["error"]
    assert err["code"] == "input_too_long" and "document 1" in err["message"] and str(MAX_TOKENS) in err["message"]


def test_a_cross_encoder_refuses_an_instruction(fleet):
    resp = httpx.post(fleet.url + "/v1/rerank", json={"model": CROSS, "query": "q", "documents": ["d"],
                                                      "instruction": INSTRUCTION}, timeout=60)
    assert resp.status_code == 400, resp.text
    err = resp.json()["error"]
    assert err["code"] == "bad_request" and "instruction" in err["message"] and CROSS in err["message"]


# ---- mxbai-rerank-v2 ---------------------------------------------------------------------

@pytest.mark.parametrize("instruction", [None, INSTRUCTION])
def test_mxbai_scores_equal_the_library(mxbai, folders, instruction):
    ref = MxbaiV2(folders["mxbai"])
    worst = 0.0
    for query in QUERIES:
        want = ref.predict([query] * len(DOCS), DOCS, instruction=instruction)
        body = {"query": query, "documents": DOCS, "instruction": instruction}
        raw = run(mxbai, **body, raw_scores=True)
        np.testing.assert_allclose(raw, want, atol=1e-4)
        np.testing.assert_allclose(run(mxbai, **body), 1 / (1 + np.exp(-want)), atol=1e-5)
        worst = max(worst, float(np.abs(raw - want).max()))
    assert np.ptp(want) > 1.0
    print(f"mxbai-v2 ({instruction=}): max |fleet raw - library| = {worst:.2e}")


def test_mxbai_long_document_is_cut_as_the_library_cuts_it(mxbai, folders):
    ref = MxbaiV2(folders["mxbai"])
    docs = [LONG_DOC, DOCS[1]]
    want = ref.predict([QUERIES[0]] * 2, docs)
    np.testing.assert_allclose(run(mxbai, query=QUERIES[0], documents=docs, raw_scores=True), want, atol=1e-4)


def test_mxbai_over_http_takes_its_catalog_entrys_format_and_instruction(fleet, folders):
    ref = MxbaiV2(folders["mxbai"])
    want = ref.predict([QUERIES[0]] * len(DOCS), DOCS, instruction=INSTRUCTION)
    got = by_index(rerank(fleet, {"model": MXBAI, "query": QUERIES[0], "documents": DOCS, "raw_scores": True},
                          msgpack=True))
    np.testing.assert_allclose(got, want, atol=1e-4)
    # An empty instruction is none (the library's `if instruction`), not the entry's.
    plain = ref.predict([QUERIES[0]] * len(DOCS), DOCS)
    got = by_index(rerank(fleet, {"model": MXBAI, "query": QUERIES[0], "documents": DOCS, "instruction": ""}))
    np.testing.assert_allclose(got, 1 / (1 + np.exp(-plain)), atol=1e-5)


def test_the_catalog_knows_every_prompt_format():
    from typing import get_args

    from fleet.catalog import RerankPrompt
    from fleet.runtimes.adapters.llm_rerank import FORMATS

    assert set(get_args(RerankPrompt)) == set(FORMATS)


# ---- the worker's call, and the pull -----------------------------------------------------

@pytest.mark.parametrize("which, extra", [("qwen", {}), ("mxbai", {"prompt_format": "mxbai-v2"})])
def test_one_batch_of_mixed_requests_equals_each_alone(folders, which, extra):
    """Requests with other instructions, raw scores, top_n, a query too long for the
    Rust template (mxbai cuts queries first) and one refused request in one
    run_batch, micro-batches of 2: each answer equals the request run alone, and
    the Python framing (no Rust template) gives the same ids and scores."""
    from fleet.messages import RerankResult, WorkError
    from fleet.protocol import RerankRequest
    from fleet.runtimes.base import Profile

    a = load_adapter(folders[which], which, profile=Profile(micro_batch_items=2), max_seq_len=MAX_TOKENS,
                     extra=extra)
    assert a.fast is not None  # the Rust template path is checked and on for this tokenizer
    batch = [
        RerankRequest(which, QUERIES[0], DOCS),
        RerankRequest(which, QUERIES[1], DOCS[:3], instruction=INSTRUCTION, raw_scores=True),
        RerankRequest(which, QUERIES[2], [LONG_DOC], truncate=False),
        RerankRequest(which, QUERIES[2], [*DOCS, LONG_DOC], top_n=2, instruction=""),
        RerankRequest(which, LONG_DOC, DOCS[:2]),
    ]
    together = a.run_batch(batch)
    assert isinstance(together[2], WorkError) and together[2].code == "input_too_long"
    fast = a.fast
    for req, got in zip(batch, together):
        if isinstance(got, WorkError):
            continue
        (alone,) = a.run_batch([req])
        a.fast = None
        (python,) = a.run_batch([req])
        a.fast = fast
        for other in (alone, python):
            assert isinstance(got, RerankResult) and got.index == other.index
            assert got.input_tokens == other.input_tokens
            # Other batch shapes move the left padding (positions shift): float noise only.
            np.testing.assert_allclose(np.frombuffer(got.scores, "<f4"), np.frombuffer(other.scores, "<f4"),
                                       atol=1e-4)
    assert len(np.frombuffer(together[3].index, "<i4")) == 2


def test_pull_as_reranker_picks_the_llm_runtime(tmp_path, folders):
    """A causal LM folder pulled with --task rerank is served by llm-rerank (nothing in
    the folder says "reranker": without --task it is a generator)."""
    from fleet.store import Store

    home = tmp_path / "home"
    pull(home, folders["mxbai"], "as-reranker", "--task", "rerank")
    pull(home, folders["mxbai"], "as-generator")
    store = Store(home / "models")
    assert (store.get("as-reranker").task, store.get("as-reranker").runtime) == ("rerank", "llm-rerank")
    assert store.get("as-generator").task == "generate"
