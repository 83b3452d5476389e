"""The reference side of tests/test_gliner.py. It runs in the isolated venv
scripts/setup_gliner_ref.sh builds (the `gliner` package with the transformers it
pins), never in fleet's venv, and imports nothing of fleet.

  python gliner_reference.py build OUT --backbone deberta --corpus FILE
  python gliner_reference.py build OUT --backbone bert --tokenizer DIR
      a tiny random GLiNER in the library's own layout: a tiny backbone folder
      (config + tokenizer) beside OUT, GLiNER's config over it, random init,
      GLiNER.save_pretrained (gliner_config.json with encoder_config,
      pytorch_model.bin, the tokenizer with <<ENT>>/<<SEP>> added).
  python gliner_reference.py predict FOLDER < {"texts": [...], "labels": [...], "threshold": t}
      GLiNER.from_pretrained(FOLDER).predict_entities per text: one JSON list per line.
"""
import argparse
import io
import json
import sys
from pathlib import Path


def deberta_backbone(folder: Path, corpus: Path) -> None:
    """A DeBERTa-v3-style backbone: a sentencepiece unigram vocabulary (ids as
    deberta-v3: [PAD] 0, [CLS] 1, [SEP] 2, [UNK] 3, [MASK] last) and a tiny DebertaV2Config."""
    import sentencepiece as spm
    from transformers import DebertaV2Config, DebertaV2Tokenizer

    buf = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(corpus.read_text().splitlines()), model_writer=buf, vocab_size=400,
        model_type="unigram", pad_id=0, bos_id=1, eos_id=2, unk_id=3, pad_piece="[PAD]", bos_piece="[CLS]",
        eos_piece="[SEP]", unk_piece="[UNK]", num_threads=1, minloglevel=2)
    sp = spm.SentencePieceProcessor(model_proto=buf.getvalue())
    vocab = [(sp.id_to_piece(i), 0.0 if sp.is_control(i) or sp.is_unknown(i) else sp.get_score(i))
             for i in range(sp.get_piece_size())] + [("[MASK]", 0.0)]
    tok = DebertaV2Tokenizer(vocab=vocab, unk_id=3)
    tok.save_pretrained(folder)
    DebertaV2Config(vocab_size=len(tok), hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                    intermediate_size=64, max_position_embeddings=512, relative_attention=True, initializer_range=0.5,
                    position_buckets=32, pos_att_type=["p2c", "c2p"], position_biased_input=False,
                    pad_token_id=0).save_pretrained(folder)


def bert_backbone(folder: Path, tokenizer: Path) -> None:
    """A BERT backbone (AutoModel path) with a WordPiece tokenizer copied from `tokenizer`."""
    from transformers import AutoTokenizer, BertConfig

    tok = AutoTokenizer.from_pretrained(tokenizer)
    tok.save_pretrained(folder)
    BertConfig(vocab_size=len(tok), hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
               intermediate_size=64, max_position_embeddings=128, initializer_range=0.5).save_pretrained(folder)


def build(out: Path, backbone: str, tokenizer: Path | None, corpus: Path | None, hidden: int) -> None:
    import torch
    from gliner import GLiNER, GLiNERConfig

    base = out.parent / (out.name + "-backbone")
    base.mkdir(parents=True, exist_ok=True)
    if backbone == "deberta":
        deberta_backbone(base, corpus)
    else:
        bert_backbone(base, tokenizer)
    torch.manual_seed(0)
    config = GLiNERConfig(model_name=str(base), hidden_size=hidden, max_width=4, max_len=24, dropout=0.4)
    model = GLiNER.from_config(config, backbone_from_pretrained=False, local_files_only=True)
    # Heads initialised wider than the library's default and a backbone with wide
    # init (initializer_range): at the defaults every label gets the same score
    # (the <<ENT>> states barely differ), and ties would test nothing.
    with torch.no_grad():
        for name, p in model.model.named_parameters():
            if not name.startswith("token_rep_layer.bert_layer"):
                p.normal_(0.0, 0.2)
    model.save_pretrained(out)


def predict(folder: Path) -> None:
    from gliner import GLiNER

    job = json.load(sys.stdin)
    model = GLiNER.from_pretrained(str(folder), local_files_only=True)
    for text in job["texts"]:
        found = model.predict_entities(text, job["labels"], threshold=job["threshold"])
        print(json.dumps([{k: d[k] for k in ("start", "end", "text", "label", "score")} for d in found]))


def main() -> None:
    ap = argparse.ArgumentParser()
    sub = ap.add_subparsers(dest="cmd", required=True)
    b = sub.add_parser("build")
    b.add_argument("out", type=Path)
    b.add_argument("--backbone", choices=["deberta", "bert"], required=True)
    b.add_argument("--tokenizer", type=Path)
    b.add_argument("--corpus", type=Path)
    b.add_argument("--hidden", type=int, default=24)
    p = sub.add_parser("predict")
    p.add_argument("folder", type=Path)
    args = ap.parse_args()
    if args.cmd == "build":
        build(args.out, args.backbone, args.tokenizer, args.corpus, args.hidden)
    else:
        predict(args.folder)


if __name__ == "__main__":
    main()
