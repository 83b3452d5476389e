"""Tiny causal LMs and LoRA adapters for the generation tests, built offline.

The tokenizer is a byte-level BPE trained here on a few sentences (so any text
encodes), wrapped in PreTrainedTokenizerFast with a chat template; the model
is a 2-layer Llama with random weights. `initializer_range` is large so the
next-token distribution is peaked: greedy choices are then far from ties and
do not flip on float rounding differences between batch shapes.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

CORPUS = [
    "the quick brown fox jumps over the lazy dog",
    "hello world, this is fleet serving small models from one box",
    "invoices must be paid within thirty days of receipt",
    "user: what is the capital of france? assistant: paris",
    "a b c d e f g h i j k l m n o p q r s t u v w x y z 0 1 2 3 4 5 6 7 8 9 . , ! ?",
]
CHAT_TEMPLATE = (
    "{% for m in messages %}<s>{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<s>assistant:{% endif %}"
)
LORA_TARGETS = ["q_proj", "v_proj"]


def build_tokenizer(folder: Path):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=320, special_tokens=["<s>", "</s>", "<pad>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(CORPUS * 4, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>")
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(folder)
    return fast


def build_llama(folder: Path, *, seed: int = 0, hidden: int = 64, layers: int = 2, max_positions: int = 256) -> Path:
    """A tiny Llama causal LM with its tokenizer in `folder` (safetensors)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    folder.mkdir(parents=True, exist_ok=True)
    tok = build_tokenizer(folder)
    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=len(tok), hidden_size=hidden, intermediate_size=2 * hidden,
                      num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
                      max_position_embeddings=max_positions, bos_token_id=0, eos_token_id=1, pad_token_id=2,
                      initializer_range=0.3, tie_word_embeddings=False)
    LlamaForCausalLM(cfg).save_pretrained(folder)
    return folder


def never_ending(folder: Path) -> Path:
    """The model in `folder` with its EOS row of the LM head zeroed: the EOS logit is
    then 0 while the best token's is far above it, so greedy decoding runs to max_tokens
    (or, with none, to the end of the context)."""
    from safetensors.torch import load_file, save_file

    path = folder / "model.safetensors"
    weights = load_file(path)
    weights["lm_head.weight"][1] = 0.0  # eos_token_id 1 (build_llama)
    save_file(weights, path, metadata={"format": "pt"})
    return folder


def build_lora(base_folder: Path, folder: Path, *, seed: int, r: int = 4) -> Path:
    """A peft LoRA adapter of the model in `base_folder` with random, non-zero A and B
    (so it really changes the outputs), saved in peft format."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    base = AutoModelForCausalLM.from_pretrained(base_folder)
    config = LoraConfig(r=r, lora_alpha=2 * r, target_modules=LORA_TARGETS, task_type="CAUSAL_LM",
                        init_lora_weights=False)
    get_peft_model(base, config).save_pretrained(folder)
    return folder


def pull(home: Path, source: Path, name: str, *extra: str) -> None:
    env = {**os.environ, "FLEET_HOME": str(home)}
    out = subprocess.run([sys.executable, "-m", "fleetctl", "pull", f"path:{source}", "--name", name, *extra],
                         env=env, capture_output=True, text=True, timeout=120, stdin=subprocess.DEVNULL)
    assert out.returncode == 0, out.stderr


class Reference:
    """The same models run directly through transformers / peft: what fleet must match."""

    def __init__(self, base_folder: Path) -> None:
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer

        self.torch = torch
        self.base_folder = base_folder
        self.tokenizer = AutoTokenizer.from_pretrained(base_folder)
        self.model = AutoModelForCausalLM.from_pretrained(base_folder).eval()
        self._loras: dict[Path, object] = {}

    def with_lora(self, folder: Path | None):
        if folder is None:
            return self.model
        if folder not in self._loras:
            from peft import PeftModel
            from transformers import AutoModelForCausalLM

            base = AutoModelForCausalLM.from_pretrained(self.base_folder).eval()
            self._loras[folder] = PeftModel.from_pretrained(base, folder).eval()
        return self._loras[folder]

    def chat_prompt(self, messages: list[dict]) -> list[int]:
        text = self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        return self.tokenizer(text, add_special_tokens=False)["input_ids"]

    def greedy(self, prompt: str | list[int], max_new: int, lora: Path | None = None) -> tuple[str, int]:
        """(text, generated tokens) of `model.generate(do_sample=False)` on the prompt alone."""
        torch = self.torch
        ids = self.tokenizer(prompt)["input_ids"] if isinstance(prompt, str) else prompt
        x = torch.tensor([ids])
        with torch.inference_mode():
            out = self.with_lora(lora).generate(input_ids=x, attention_mask=torch.ones_like(x),
                                                max_new_tokens=max_new, do_sample=False)
        new = out[0, len(ids):].tolist()
        if new and new[-1] == self.tokenizer.eos_token_id:
            new = new[:-1]
        return self.tokenizer.decode(new, skip_special_tokens=True), len(new)

    def logits(self, prompt: str, lora: Path | None = None):
        torch = self.torch
        x = torch.tensor([self.tokenizer(prompt)["input_ids"]])
        with torch.inference_mode():
            return self.with_lora(lora)(input_ids=x).logits[0, -1].float()


#: Qwen2.5-Instruct's chat template as the model ships it (tokenizer_config.json): it
#: renders `tools` and history calls in the Hermes format (`<tool_call>` blocks).
QWEN25_TEMPLATE = Path(__file__).parent / "data" / "qwen2.5-instruct.jinja"
#: Gemma 3's chat template as its instruct models ship it (tokenizer_config.json): it has
#: no place for tools; calls are ```tool_code blocks of Python calls (fleet.tools).
GEMMA3_TEMPLATE = Path(__file__).parent / "data" / "gemma-3-it.jinja"
#: SmolLM3-3B's chat template as the model first shipped it (tokenizer_config.json, July
#: 2025; provenance in tests/test_tool_formats.py): the tools under `xml_tools`, calls in
#: Hermes `<tool_call>` blocks, `/think` and `/no_think` flags; no place for history calls.
SMOLLM3_TEMPLATE = Path(__file__).parent / "data" / "smollm3-3b.jinja"
#: Where a scripted model's greedy choice goes, given the token it just read (module doc
#: of build_tool_caller): (read, next, strength); the strongest one the grammar allows wins.
TOOL_SCRIPT = [
    ("\n", "<tool_call>", 3.0),  # the prompt ends "assistant\n": open a call at once
    ("</tool_call>", "<|im_end|>", 3.0),  # then end the turn
    ("{", '"', 2.0), (" ", '"', 1.0),  # keys and string values open
    ('"', '"', 2.0), ('"', "}", 1.5),  # strings close empty, objects close
    *((d, "}", 2.0) for d in "0123456789"), *((d, ",", 1.0) for d in "0123456789"),  # numbers stay short
]


#: The config and model classes of build_tool_caller's architectures.
CALLER_CLASSES = {"qwen2": ("Qwen2Config", "Qwen2ForCausalLM"), "smollm3": ("SmolLM3Config", "SmolLM3ForCausalLM")}


def build_tool_caller(folder: Path, *, hidden: int = 256, seed: int = 0, template: Path = QWEN25_TEMPLATE,
                      model_type: str = "qwen2") -> Path:
    """A tiny Qwen2 that calls tools, with Qwen2.5-Instruct's real chat template (or
    `template`) and its added `<tool_call>` / `</tool_call>` tokens (not special, as in Qwen's).
    `model_type` "smollm3" makes it a SmolLM3 (its config and model classes, so its folder
    is in SmolLM3's hub layout: config.json, tokenizer files, chat_template.jinja).

    Its one layer adds nothing (o_proj and down_proj are zero), so the logits are a
    function of the last token read: each TOOL_SCRIPT entry adds that token's unit
    embedding to the next token's LM-head row (256 dimensions keep the entries apart:
    random unit vectors overlap by ~1/16). Greedy decoding then opens a call right after
    the prompt, keeps strings and numbers short, and ends the turn after the call; the
    grammar of the request (fleet's tool calls) chooses everything else. Unconstrained,
    it writes nothing useful: it exists to show what grammar-held calls look like to
    clients, deterministically, through the real loading path.
    """
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    import transformers
    from transformers import PreTrainedTokenizerFast

    folder.mkdir(parents=True, exist_ok=True)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=320, special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(CORPUS * 4, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>")
    fast.add_tokens(["<tool_call>", "</tool_call>"])  # plain added tokens, as Qwen2.5's
    fast.chat_template = template.read_text()
    fast.save_pretrained(folder)
    eos = fast.convert_tokens_to_ids("<|im_end|>")
    torch.manual_seed(seed)
    config_class, model_class = CALLER_CLASSES[model_type]
    cfg = getattr(transformers, config_class)(
        vocab_size=len(fast), hidden_size=hidden, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=8192, bos_token_id=None, eos_token_id=eos,
        pad_token_id=fast.pad_token_id, tie_word_embeddings=False)
    model = getattr(transformers, model_class)(cfg)
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
        emb = model.model.embed_tokens.weight
        emb.normal_(0.0, 1.0)
        head = model.lm_head.weight
        head.normal_(0.0, 0.01)
        for read, nxt, strength in TOOL_SCRIPT:
            (r,), (n,) = fast(read, add_special_tokens=False)["input_ids"], [fast.convert_tokens_to_ids(nxt)] \
                if nxt.startswith("<") else fast(nxt, add_special_tokens=False)["input_ids"]
            head[n] += strength * emb[r] / emb[r].norm()
    model.generation_config.eos_token_id = eos
    model.save_pretrained(folder)
    return folder
