"""Writes a tiny Llama-architecture model that real vLLM can serve, without any model hub.

    <venv>/bin/python hack/real-vllm/make-model.py OUT_DIR

Deterministic: the training text, the tokenizer and the random weights come from fixed seeds, so two runs
write the same files (config.json carries the transformers version). Run by hack/real-vllm/build with the
real-vLLM venv's python (it needs torch, transformers, tokenizers, safetensors). Exits non-zero with a
message on any failure.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import sys
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("RAYON_NUM_THREADS", "1")  # tokenizers' trainer: one thread, one merge order
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

SEED = 20261201
VOCAB_SIZE = 2048
BOS, EOS, PAD = "<|begin_of_text|>", "<|end_of_text|>", "<|pad|>"
START, END = "<|start|>", "<|end|>"
SPECIAL = [BOS, EOS, PAD, START, END]
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "<|start|>{{ message['role'] }}\n{{ message['content'] }}<|end|>\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|start|>assistant\n{% endif %}"
)
MODEL = {
    "hidden_size": 256,
    "intermediate_size": 512,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "max_position_embeddings": 4096,
}


def corpus(seed: int = SEED, lines: int = 40000) -> list[str]:
    """Pseudo-English, numbers, code and JSON-ish lines from a seeded generator."""
    rng = random.Random(seed)
    onsets = ["", "b", "c", "d", "f", "g", "h", "j", "k", "l", "m", "n", "p", "r", "s", "t", "v", "w",
              "br", "ch", "cl", "dr", "fl", "gr", "pl", "pr", "sh", "sl", "st", "th", "tr", "wh"]  # fmt: skip
    vowels = ["a", "e", "i", "o", "u", "ai", "ea", "ee", "oo", "ou", "y"]
    codas = ["", "", "n", "r", "s", "t", "l", "m", "nd", "ng", "st", "ck", "ll", "ss", "rt"]
    words = sorted({"".join(rng.choice(x) for x in (onsets, vowels, codas, vowels, codas)[: rng.randint(2, 5)])
                    for _ in range(3000)} - {""})  # fmt: skip
    common = ["the", "a", "of", "and", "to", "in", "is", "that", "for", "it", "with", "as", "on", "be",
              "batch", "token", "request", "latency", "throughput", "model", "server", "cache", "queue"]  # fmt: skip
    out = []
    for _ in range(lines):
        kind = rng.random()
        if kind < 0.7:
            n = rng.randint(4, 20)
            ws = [rng.choice(common) if rng.random() < 0.35 else rng.choice(words) for _ in range(n)]
            ws[0] = ws[0].capitalize()
            out.append(" ".join(ws) + rng.choice([".", ".", ".", "?", "!", ","]))
        elif kind < 0.8:
            out.append(" ".join(str(rng.randint(0, 10 ** rng.randint(1, 6))) for _ in range(rng.randint(2, 8))))
        elif kind < 0.9:
            name = rng.choice(words)
            out.append(f"def {name}(x, y={rng.randint(0, 99)}):\n    return x * {rng.random():.3f} + y  # {rng.choice(words)}")
        else:
            obj = {rng.choice(words): rng.choice([rng.randint(0, 1000), rng.choice(words), True, None])
                   for _ in range(rng.randint(1, 4))}  # fmt: skip
            out.append(json.dumps(obj))
    # Every printable ASCII character at least once, and some non-ASCII text (byte-level covers the rest).
    out.append("".join(chr(c) for c in range(32, 127)))
    out.append("Grüße, naïve café — 東京 😀 ✓")
    return out


def build_tokenizer(out: Path):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(vocab_size=VOCAB_SIZE, special_tokens=SPECIAL, min_frequency=2,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)  # fmt: skip
    tok.train_from_iterator(corpus(), trainer=trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=BOS, eos_token=EOS, pad_token=PAD,
                                   model_max_length=MODEL["max_position_embeddings"])  # fmt: skip
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(str(out))
    return fast


def build_model(out: Path, tok) -> None:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(SEED)
    config = LlamaConfig(
        vocab_size=len(tok),
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
        tie_word_embeddings=False,
        initializer_range=0.02,
        **MODEL,
    )
    model = LlamaForCausalLM(config).to(torch.bfloat16).eval()
    model.config.dtype = torch.bfloat16  # config.json "dtype": vLLM serves the model in bf16
    model.save_pretrained(str(out), safe_serialization=True)


def check(out: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(out))
    text = tok.apply_chat_template([{"role": "user", "content": "Hello, batch!"}], tokenize=False,
                                   add_generation_prompt=True)  # fmt: skip
    assert text.endswith("<|start|>assistant\n"), text
    ids = tok("The batch token latency is 42.")["input_ids"]
    assert tok.decode(ids, skip_special_tokens=True) == "The batch token latency is 42.", tok.decode(ids)
    model = AutoModelForCausalLM.from_pretrained(str(out))
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits
    assert logits.shape[-1] == len(tok) and torch.isfinite(logits).all()


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        print("usage: make-model.py OUT_DIR", file=sys.stderr)
        return 2
    out = Path(argv[1])
    try:
        out.mkdir(parents=True, exist_ok=True)
        tok = build_tokenizer(out)
        build_model(out, tok)
        check(out)
    except Exception as exc:  # noqa: BLE001 - one clear message for the build script
        import traceback

        traceback.print_exc()
        print(f"make-model.py: FAILED writing {out}: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 1
    for f in sorted(p for p in out.iterdir() if p.is_file()):
        digest = hashlib.sha256(f.read_bytes()).hexdigest()[:16]
        print(f"[real-vllm]   {f.name:28s} {f.stat().st_size:>10d} B  sha256 {digest}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
