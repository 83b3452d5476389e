"""Hugging Face's own clients, unchanged, against a model's URL (issue 38, item 6).

huggingface_hub's InferenceClient (and @huggingface/inference where node has it)
configured with `http://host:7744/models/NAME`: text classification gets a list of
labels per input (the client reads the first input's), zero-shot classification is
answered by an NLI model as transformers' zero-shot pipeline answers it and refused
for any other classifier, and an error reaches the client as its message.

One daemon serves a tiny NLI classifier (labels contradiction, neutral, entailment)
and a tiny sentiment classifier, BERTs with the MiniLM tokenizer, in float32 (the
overlay's profile), so answers agree with the references to float rounding.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import httpx
import numpy as np
import pytest

from tests.conftest import DaemonProc, default_model_dir, start_daemon

NLI = "tiny-nli"
SENTIMENT = "tiny-sentiment"
TEXT = "the match ended with a late goal from the home team"
LABELS = ["sports", "politics", "cooking"]
#: Where `node` finds @huggingface/inference (a folder holding node_modules/): the JS
#: client's case runs only when it is set and node is on PATH.
HF_JS_DIR = os.environ.get("FLEET_HF_JS_DIR")


def build_bert(folder: Path, labels: list[str]) -> Path:
    import torch
    from transformers import AutoTokenizer, BertConfig, BertForSequenceClassification

    tok = AutoTokenizer.from_pretrained(default_model_dir())
    torch.manual_seed(len(labels))
    cfg = BertConfig(vocab_size=tok.vocab_size, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                     intermediate_size=64, max_position_embeddings=128, initializer_range=0.3,
                     id2label=dict(enumerate(labels)), label2id={n: i for i, n in enumerate(labels)})
    BertForSequenceClassification(cfg).eval().save_pretrained(folder)
    tok.save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def folders(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("hf-clients")
    return {NLI: build_bert(root / NLI, ["contradiction", "neutral", "entailment"]),
            SENTIMENT: build_bert(root / SENTIMENT, ["negative", "positive"])}


@pytest.fixture(scope="module")
def d(tmp_path_factory: pytest.TempPathFactory, folders: dict[str, Path]):
    home = tmp_path_factory.mktemp("fleet-hf-clients")
    lines = []
    for name, folder in folders.items():
        lines += [f'[models."{name}"]', f'source = "path:{folder}"', 'task = "classify"', 'runtime = "transformers"',
                  f'[models."{name}".profile]', 'dtype = "float32"', ""]
    (home / "models.toml").write_text("\n".join(lines))
    daemon = start_daemon(home, extra_env={"FLEET_PRELOAD": f"{NLI},{SENTIMENT}", "FLEET_CPU_THREADS": "1"})
    yield daemon
    daemon.stop()


@pytest.fixture()
def hf(monkeypatch: pytest.MonkeyPatch):
    from huggingface_hub import InferenceClient, constants

    # CI exports HF_HUB_OFFLINE=1; the library then refuses every URL, loopback too.
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    return InferenceClient


@pytest.fixture(scope="module")
def pipeline(folders: dict[str, Path]):
    """transformers' zero-shot classification pipeline on the NLI model: the reference."""
    from transformers import pipeline as make

    return make("zero-shot-classification", model=str(folders[NLI]), device="cpu")


def native(d: DaemonProc, model: str, texts: list[str]) -> list[list[dict]]:
    resp = httpx.post(d.url + "/v1/classify", json={"model": model, "inputs": texts}, timeout=60)
    assert resp.status_code == 200, resp.text
    return resp.json()["results"]


def test_text_classification_gets_every_label_of_its_input(d: DaemonProc, hf) -> None:
    client = hf(model=f"{d.url}/models/{SENTIMENT}")
    got = client.text_classification(TEXT)
    want = native(d, SENTIMENT, [TEXT])[0]
    assert [(x.label, round(x.score, 6)) for x in got] == [(x["label"], round(x["score"], 6)) for x in want]
    assert len(got) == 2  # both labels, not only the top one
    assert [x.label for x in client.text_classification(TEXT, top_k=1)] == [want[0]["label"]]
    raw = client.text_classification(TEXT, function_to_apply="none")  # the logits
    assert not np.isclose(sum(x.score for x in raw), 1.0)
    # The wire: a list per input at the model's URL; /predict by name keeps TEI's flat list.
    at_url = httpx.post(f"{d.url}/models/{SENTIMENT}", json={"inputs": TEXT}, timeout=60).json()
    by_name = httpx.post(f"{d.url}/predict", json={"model": SENTIMENT, "inputs": TEXT}, timeout=60).json()
    assert isinstance(at_url[0], list) and at_url[0] == by_name


@pytest.mark.parametrize("multi_label", [False, True])
def test_zero_shot_matches_the_pipeline(d: DaemonProc, hf, pipeline, multi_label: bool) -> None:
    client = hf(model=f"{d.url}/models/{NLI}")
    template = "The topic of this text is {}."
    got = client.zero_shot_classification(TEXT, LABELS, multi_label=multi_label, hypothesis_template=template)
    ref = pipeline(TEXT, candidate_labels=LABELS, multi_label=multi_label, hypothesis_template=template)
    assert [x.label for x in got] == ref["labels"]
    np.testing.assert_allclose([x.score for x in got], ref["scores"], atol=1e-5)
    if not multi_label:
        assert abs(sum(x.score for x in got) - 1.0) < 1e-5
    # The default template, a batch of inputs and the native route agree with the pipeline too.
    texts = [TEXT, "add the onions to the pan and stir"]
    batch = httpx.post(f"{d.url}/models/{NLI}", timeout=60, json={
        "inputs": [[t] for t in texts], "parameters": {"candidate_labels": ",".join(LABELS),
                                                       "multi_label": multi_label}}).json()
    body = {"model": NLI, "inputs": texts, "candidate_labels": LABELS, "multi_label": multi_label}
    resp = httpx.post(d.url + "/v1/classify", json=body, timeout=60)
    assert resp.status_code == 200, resp.text
    for text, row, nat in zip(texts, batch, resp.json()["results"], strict=True):
        ref = pipeline(text, candidate_labels=LABELS, multi_label=multi_label)
        assert [x["label"] for x in row] == [x["label"] for x in nat] == ref["labels"]
        np.testing.assert_allclose([x["score"] for x in row], ref["scores"], atol=1e-5)


def test_zero_shot_on_a_classifier_that_is_no_nli_model_is_refused(d: DaemonProc, hf) -> None:
    from huggingface_hub.errors import HfHubHTTPError

    with pytest.raises(HfHubHTTPError) as caught:
        hf(model=f"{d.url}/models/{SENTIMENT}").zero_shot_classification(TEXT, LABELS)
    said = str(caught.value)
    assert caught.value.response.status_code == 400
    assert "needs an NLI model" in said and f"stored NLI classifiers: {NLI}" in said
    assert "{'code'" not in said  # the message itself, not the error object printed as a dict
    # The wire: TEI's error shape, the message as the string `error`.
    resp = httpx.post(f"{d.url}/models/{SENTIMENT}", json={"inputs": TEXT, "parameters": {"candidate_labels": LABELS}},
                      timeout=60)
    assert resp.status_code == 400 and resp.json()["error_type"] == "bad_request"
    assert "negative, positive" in resp.json()["error"]
    for params, why in (({"candidate_labels": []}, "candidate_labels"),
                        ({"candidate_labels": LABELS, "hypothesis_template": "no slot"}, "{}")):
        resp = httpx.post(f"{d.url}/models/{NLI}", json={"inputs": TEXT, "parameters": params}, timeout=60)
        assert resp.status_code == 400 and why in resp.json()["error"], resp.text
    # Nothing else changed: the NLI model still answers.
    assert native(d, NLI, [TEXT])[0][0]["label"] in ("contradiction", "neutral", "entailment")


JS = """
const { InferenceClient } = require("@huggingface/inference");
const base = process.argv[1];  // node -e SCRIPT URL
(async () => {
  const out = {};
  const c = new InferenceClient();
  out.classified = await c.textClassification({ endpointUrl: `${base}/models/%(sentiment)s`, inputs: "%(text)s" });
  out.zeroShot = await c.zeroShotClassification({ endpointUrl: `${base}/models/%(nli)s`, inputs: "%(text)s",
                                                  parameters: { candidate_labels: %(labels)s } });
  try {
    await c.zeroShotClassification({ endpointUrl: `${base}/models/%(sentiment)s`, inputs: "%(text)s",
                                     parameters: { candidate_labels: %(labels)s } });
  } catch (e) { out.error = e.message; }
  console.log(JSON.stringify(out));
})().catch((e) => { console.log(JSON.stringify({ failed: String(e) })); });
"""


@pytest.mark.skipif(not HF_JS_DIR or shutil.which("node") is None,
                    reason="@huggingface/inference runs where FLEET_HF_JS_DIR names a folder with it installed "
                           "(npm install @huggingface/inference) and node is on PATH")
def test_the_js_client(d: DaemonProc, pipeline) -> None:
    script = JS % {"sentiment": SENTIMENT, "nli": NLI, "text": TEXT, "labels": json.dumps(LABELS)}
    run = subprocess.run(["node", "-e", script, d.url], cwd=HF_JS_DIR, capture_output=True, text=True, timeout=120)
    out = json.loads(run.stdout.strip().splitlines()[-1])
    assert "failed" not in out, out
    assert [x["label"] for x in out["classified"]] == [x["label"] for x in native(d, SENTIMENT, [TEXT])[0]]
    assert [x["label"] for x in out["zeroShot"]] == pipeline(TEXT, candidate_labels=LABELS)["labels"]
    assert "needs an NLI model" in out["error"] and "an HTTP error occurred" not in out["error"]
