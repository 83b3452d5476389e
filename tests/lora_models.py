"""Tiny encoders and peft LoRA adapters of them, built offline, and the merged
references fleet must match.

The bases are 2-layer BERTs with the all-MiniLM tokenizer, saved as the hub
saves them: a sentence-transformers embedder (mean pooling, normalized), a
CrossEncoder folder, a transformers reranker, a 3-label classifier and a
5-label tagger. Each LoRA is made with peft `get_peft_model(...)` with random
A and B (`init_lora_weights=False`: it really changes the answers) and saved
with `save_pretrained`. A LoRA of task type SEQ_CLS / TOKEN_CLS saves the head
(peft `modules_to_save`), which is perturbed here so it differs from the base's;
one classifier LoRA is trained for another label set (5 labels) and carries
its own `config.json` (`id2label`), as a fine-tune for a new task does.

`merged(...)`: peft `PeftModel.from_pretrained(base, dir).merge_and_unload()`,
the in-process reference each served row must equal.
"""

from __future__ import annotations

import json
from pathlib import Path

from tests.conftest import default_model_dir

CLASSIFY_LABELS = ["negative", "neutral", "positive"]
#: The classifier LoRA with its own label set (another width than the base's).
TOPIC_LABELS = ["sports", "politics", "science", "arts", "business"]
NER_LABELS = ["O", "B-PER", "I-PER", "B-LOC", "I-LOC"]
#: The tagger LoRA with its own head names its labels its own way.
NER_OWN_LABELS = ["O", "B-DRUG", "I-DRUG", "B-DOSE", "I-DOSE"]
TARGETS = ["query", "value", "dense"]


def tokenizer():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(default_model_dir())


def bert_config(tok, **kw):
    from transformers import BertConfig

    # initializer_range 0.3: scores spread out, so rankings, labels and spans mean something.
    return BertConfig(vocab_size=tok.vocab_size, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                      intermediate_size=64, max_position_embeddings=128, initializer_range=0.3, **kw)


def build_bases(root: Path) -> dict[str, Path]:
    """name -> folder of each tiny base."""
    import torch
    from sentence_transformers import CrossEncoder, SentenceTransformer
    from sentence_transformers.sentence_transformer.modules import Normalize, Pooling, Transformer
    from transformers import BertForSequenceClassification, BertForTokenClassification, BertModel

    tok = tokenizer()
    out: dict[str, Path] = {}

    def save(model, name: str) -> Path:
        folder = root / name
        model.eval().save_pretrained(folder)
        tok.save_pretrained(folder)
        out[name] = folder
        return folder

    torch.manual_seed(0)
    bert = save(BertModel(bert_config(tok)), "bert")
    st = SentenceTransformer(modules=[Transformer(str(bert)), Pooling(32, "mean"), Normalize()], device="cpu")
    st.save(str(root / "embedder"))
    out["embedder"] = root / "embedder"
    save(BertForSequenceClassification(bert_config(tok, num_labels=1)), "reranker")
    CrossEncoder(str(out["reranker"]), device="cpu").save_pretrained(str(root / "cross-encoder"))
    out["cross-encoder"] = root / "cross-encoder"
    labels = dict(enumerate(CLASSIFY_LABELS))
    save(BertForSequenceClassification(bert_config(tok, num_labels=3, id2label=labels,
                                                   label2id={v: k for k, v in labels.items()})), "classifier")
    tags = dict(enumerate(NER_LABELS))
    save(BertForTokenClassification(bert_config(tok, num_labels=len(NER_LABELS), id2label=tags,
                                                label2id={v: k for k, v in tags.items()})), "tagger")
    return out


def load_base(folder: Path, auto_class: str, **kw):
    import transformers

    return getattr(transformers, auto_class).from_pretrained(str(folder), **kw).eval()


def build_lora(base, folder: Path, *, seed: int, task_type: str | None, r: int = 4, labels: list[str] | None = None,
               targets: list[str] = TARGETS) -> Path:
    """A peft LoRA of the transformers model `base` with random A and B; a head it
    saves (SEQ_CLS / TOKEN_CLS) is perturbed so it differs from the base's. With
    `labels`, a config.json in the adapter folder names the head's labels."""
    import torch
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(seed)
    config = LoraConfig(r=r, lora_alpha=2 * r, target_modules=targets, task_type=task_type, init_lora_weights=False)
    model = get_peft_model(base, config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if ".modules_to_save." in name:
                p.add_(torch.randn_like(p) * 0.5)
    model.save_pretrained(folder)
    if labels is not None:
        (folder / "config.json").write_text(json.dumps({
            "model_type": base.config.model_type, "id2label": {str(i): lab for i, lab in enumerate(labels)},
            "label2id": {lab: i for i, lab in enumerate(labels)}}))
    return folder


def build_loras(root: Path, bases: dict[str, Path]) -> dict[str, Path]:
    """name -> folder of each LoRA: two per base (one with its own head where the task has one)."""
    out: dict[str, Path] = {}
    out["emb-a"] = build_lora(load_base(bases["bert"], "AutoModel"), root / "emb-a", seed=1,
                              task_type="FEATURE_EXTRACTION")
    out["emb-b"] = build_lora(load_base(bases["bert"], "AutoModel"), root / "emb-b", seed=2,
                              task_type="FEATURE_EXTRACTION", r=8, targets=["query", "key"])
    seq = "AutoModelForSequenceClassification"
    out["rr-head"] = build_lora(load_base(bases["reranker"], seq), root / "rr-head", seed=3, task_type="SEQ_CLS")
    out["rr-body"] = build_lora(load_base(bases["reranker"], seq), root / "rr-body", seed=4,
                                task_type="FEATURE_EXTRACTION")
    out["ce-head"] = build_lora(load_base(bases["cross-encoder"], seq), root / "ce-head", seed=5, task_type="SEQ_CLS")
    out["ce-body"] = build_lora(load_base(bases["cross-encoder"], seq), root / "ce-body", seed=6, task_type=None)
    out["cls-head"] = build_lora(load_base(bases["classifier"], seq), root / "cls-head", seed=7, task_type="SEQ_CLS")
    topic = load_base(bases["classifier"], seq, num_labels=len(TOPIC_LABELS), ignore_mismatched_sizes=True)
    out["cls-topics"] = build_lora(topic, root / "cls-topics", seed=8, task_type="SEQ_CLS", labels=TOPIC_LABELS)
    tok = "AutoModelForTokenClassification"
    out["ner-own"] = build_lora(load_base(bases["tagger"], tok), root / "ner-own", seed=9, task_type="TOKEN_CLS",
                                labels=NER_OWN_LABELS)
    out["ner-body"] = build_lora(load_base(bases["tagger"], tok), root / "ner-body", seed=10,
                                 task_type="FEATURE_EXTRACTION")
    return out


def merged(base_folder: Path, auto_class: str, lora: Path | None, **kw):
    """The base with `lora` merged into its weights (peft merge_and_unload); the base alone for None."""
    base = load_base(base_folder, auto_class, **kw)
    if lora is None:
        return base
    from peft import PeftModel

    return PeftModel.from_pretrained(base, str(lora)).merge_and_unload().eval()


class References:
    """Each task's reference library run on the merged models, in-process."""

    def __init__(self, bases: dict[str, Path], loras: dict[str, Path]) -> None:
        self.bases, self.loras = bases, loras
        self.tok = tokenizer()

    def embed(self, lora: str | None, texts: list[str]):
        """sentence-transformers `encode` with the merged transformer."""
        from sentence_transformers import SentenceTransformer

        st = SentenceTransformer(str(self.bases["embedder"]), device="cpu")
        if lora is not None:
            from peft import PeftModel

            st[0].auto_model = PeftModel.from_pretrained(st[0].auto_model, str(self.loras[lora])).merge_and_unload()
        return st.encode(texts, convert_to_numpy=True)

    def cross_encoder(self, lora: str | None, pairs: list[tuple[str, str]]):
        """CrossEncoder.predict with the merged model (its saved activation applied)."""
        from sentence_transformers import CrossEncoder

        ce = CrossEncoder(str(self.bases["cross-encoder"]), device="cpu")
        if lora is not None:
            from peft import PeftModel

            ce[0].auto_model = PeftModel.from_pretrained(ce[0].auto_model, str(self.loras[lora])).merge_and_unload()
        return ce.predict(pairs, convert_to_numpy=True)

    def rerank_logits(self, lora: str | None, pairs: list[tuple[str, str]]):
        """The merged transformers reranker's logit per pair."""
        import torch

        model = merged(self.bases["reranker"], "AutoModelForSequenceClassification", self.loras.get(lora))
        enc = self.tok([q for q, _ in pairs], [d for _, d in pairs], padding=True, truncation=True,
                       return_tensors="pt")
        with torch.inference_mode():
            return model(**enc).logits[:, 0].numpy()

    def classify(self, lora: str | None, texts: list[str]):
        """Softmax over the merged classifier's labels: (labels, probabilities (n, labels))."""
        import torch

        extra = {"num_labels": len(TOPIC_LABELS), "ignore_mismatched_sizes": True} if lora == "cls-topics" else {}
        model = merged(self.bases["classifier"], "AutoModelForSequenceClassification", self.loras.get(lora), **extra)
        labels = TOPIC_LABELS if lora == "cls-topics" else CLASSIFY_LABELS
        enc = self.tok(texts, padding=True, truncation=True, return_tensors="pt")
        with torch.inference_mode():
            return labels, torch.softmax(model(**enc).logits, dim=-1).numpy()

    def extract(self, lora: str | None, texts: list[str]) -> list[list[tuple[str, int, int, float]]]:
        """The token-classification pipeline (aggregation "simple") on the merged tagger."""
        from transformers import pipeline

        model = merged(self.bases["tagger"], "AutoModelForTokenClassification", self.loras.get(lora))
        if lora == "ner-own":
            model.config.id2label = dict(enumerate(NER_OWN_LABELS))
            model.config.label2id = {v: k for k, v in model.config.id2label.items()}
        pipe = pipeline("token-classification", model=model, tokenizer=self.tok, aggregation_strategy="simple",
                        device="cpu")
        return [[(r["entity_group"], r["start"], r["end"], float(r["score"])) for r in pipe(t)] if t else []
                for t in texts]
