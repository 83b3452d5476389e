"""The reference side of tests/test_decide_heads.py. It runs in the isolated venv
scripts/setup_decide_ref.sh builds (the `laya` and `bev-decider` packages), never in
fleet's venv, and imports nothing of fleet. One process (torch is imported once):

  python decide_reference.py OUT --tokenizer DIR --corpus FILE < [{"state": ..., "questions": {...}}, ...]

builds OUT/laya, a tiny random Laya checkpoint in the package's own layout, written
by its own `laya.train.save_checkpoint` (rl_agent_config.json, model.safetensors in
fp16, encoder/ with a tiny ModernBERT config, tokenizer/ with the WordPiece one in
DIR), and OUT/bev, a tiny random bev-decider checkpoint in the layout
`bev_decider.load` reads (config.json with the head's sizes, the token limits and
`backbone_config`; backbone_config.json, a tiny Qwen3; model.safetensors with
backbone.* and head.* in bf16; a byte-level BPE Qwen2 tokenizer trained on FILE);
then prints {"laya": [answers per job], "bev": [...]}: each package's own answers.
Laya rounds what it reports to 4 decimals; its module's `round` is made the identity
here so the comparison sees the probabilities its own path computes (nothing else
changes).
"""
import argparse
import json
import sys
from pathlib import Path


def widen(module, std: float) -> None:
    """Norms at one and zero, every other weight drawn from N(0, std), buffers that hold
    a value at one: a random model whatever the library left uninitialised (Laya's
    `build_model(pretrained=False)` initialises nothing, as a checkpoint is to fill it),
    and wider than the libraries' default init, at which every option gets about the same
    score and near-ties would test nothing."""
    import torch

    with torch.no_grad():
        for sub in module.modules():
            norm = "Norm" in type(sub).__name__
            for name, p in sub.named_parameters(recurse=False):
                if norm:
                    p.fill_(1.0 if name == "weight" else 0.0)
                else:
                    p.normal_(0.0, std)
        if hasattr(module, "temperature"):
            module.temperature.fill_(1.0)


def build_laya(out: Path, tokenizer: Path) -> None:
    import torch
    from laya.common import build_model
    from laya.train import save_checkpoint
    from transformers import AutoTokenizer, ModernBertConfig

    tok = AutoTokenizer.from_pretrained(tokenizer)
    enc = out.parent / (out.name + "-encoder")
    # local_attention 8: ModernBERT's sliding-window layers see a part of a row only.
    ModernBertConfig(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=3,
                     num_attention_heads=2, global_attn_every_n_layers=2, local_attention=8,
                     max_position_embeddings=512, pad_token_id=tok.pad_token_id, cls_token_id=tok.cls_token_id,
                     sep_token_id=tok.sep_token_id, bos_token_id=tok.cls_token_id,
                     eos_token_id=tok.sep_token_id).save_pretrained(enc)
    # Shipped temperatures per type (choice, score, noul) and per option bucket; 0.1 is
    # below the package's floor (0.5), which it applies instead.
    cfg = {"encoder": "tiny-modernbert", "head_layers": 1, "act_costs": {"defer": 0.1}, "max_len": 96,
           "head_max_len": 48, "temperature": [1.3, 0.8, 2.0],
           "temperature_by_options": {"choice:3-5": 1.7, "score:6-10": 0.1}}
    torch.manual_seed(0)
    model = build_model(cfg, encoder_dir=str(enc), pretrained=False)
    widen(model, 0.3)
    save_checkpoint(model, tok, cfg, str(out))


def bpe_qwen_tokenizer(corpus: Path):
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import Qwen2Tokenizer

    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=["<|endoftext|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    bpe.train_from_iterator(corpus.read_text().splitlines(), trainer)
    model = json.loads(bpe.to_str())["model"]
    merges = [tuple(m.split(" ")) if isinstance(m, str) else tuple(m) for m in model["merges"]]
    return Qwen2Tokenizer(vocab=model["vocab"], merges=merges)


def build_bev(out: Path, corpus: Path) -> None:
    import torch
    from bev_decider.model import ChoiceHead, DeciderNetwork
    from safetensors.torch import save_file
    from transformers import Qwen3Config, Qwen3Model

    out.mkdir(parents=True, exist_ok=True)
    tok = bpe_qwen_tokenizer(corpus)
    tok.save_pretrained(out)
    backbone_cfg = Qwen3Config(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                               num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=512,
                               pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id)
    backbone_cfg.to_json_file(out / "backbone_config.json")
    head = {"new_dim": 16, "num_layers": 1, "num_task_types": 3}
    (out / "config.json").write_text(json.dumps({"backbone_config": "backbone_config.json", "head": head,
                                                 "max_state_tokens": 160, "max_choice_tokens": 48}, indent=2))
    torch.manual_seed(0)
    network = DeciderNetwork(Qwen3Model(backbone_cfg), ChoiceHead(hidden_dim=32, **head))
    widen(network, 0.2)
    save_file({k: v.to(torch.bfloat16).contiguous() for k, v in network.state_dict().items()},
              str(out / "model.safetensors"))


def predict(folder: Path, family: str, jobs: list[dict]) -> list[dict]:
    """The package's answers to `jobs` on the checkpoint in `folder`."""
    if family == "laya":
        import laya.agent
        from laya.agent import Agent

        laya.agent.round = lambda x, ndigits=None: x  # report what the path computes, unrounded
        agent = Agent(str(folder), device="cpu")
        return [agent.system_one(job["state"], job["questions"])["answers"] for job in jobs]
    from bev_decider import load

    decider = load(str(folder), device="cpu", precision="fp32")
    return [decider.decide(job["state"], job["questions"]) for job in jobs]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("out", type=Path)
    ap.add_argument("--tokenizer", type=Path, required=True)
    ap.add_argument("--corpus", type=Path, required=True)
    args = ap.parse_args()
    jobs = json.load(sys.stdin)
    build_laya(args.out / "laya", args.tokenizer)
    build_bev(args.out / "bev", args.corpus)
    print(json.dumps({family: predict(args.out / family, family, jobs) for family in ("laya", "bev")}))


if __name__ == "__main__":
    main()
